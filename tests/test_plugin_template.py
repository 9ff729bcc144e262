"""The plugin template, examples/plugin/, is a real package: pip builds and installs it
(from a copy, into a folder of its own), `fedbus algorithms` then lists its algorithm,
and real federations on digits run it: it learns, replays identically, keeps its client
state through eviction (the state a resume restores), and sums under secure
aggregation as its merge declaration says."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO, SMALL, merged, metrics, write_config

NAME = "example-proto"

# 4 clients holding every class (chance: 10 %), 3 rounds of 2 local epochs
LEARNS = merged(SMALL, federation={"clients": 4, "rounds": 3},
                data={"partition": "iid"}, train={"epochs": 2}, algorithm={"name": NAME})


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """The template pip-installed (built from a copy: the build leaves nothing in the
    repository) into a folder on PYTHONPATH, as a user's environment would hold it."""
    root = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(REPO / "examples" / "plugin", root / "source",
                             ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                           "__pycache__"))
    site = root / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(site),
                          str(source)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    entry_points = next(site.glob("fedbus_example_plugin-*.dist-info")) / "entry_points.txt"
    assert f"{NAME} = fedbus_example_plugin:ALGORITHM" in entry_points.read_text()
    return {**os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(site),
                                                        os.environ.get("PYTHONPATH")]))}


def cli(env, *args: str, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fedbus.launch", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"fedbus {' '.join(args)}\n{proc.stdout}\n{proc.stderr}"
    return proc


def federation(env, tmp_path, sections, name="run", *extra: str):
    cfg = write_config(tmp_path / f"{name}.toml", sections)
    run = tmp_path / name
    cli(env, "run", str(cfg), "--out", str(run), "--quiet", *extra)
    return run, json.loads((run / "summary.json").read_text())


@pytest.fixture(scope="module")
def learned(plugin_env, tmp_path_factory):
    return federation(plugin_env, tmp_path_factory.mktemp("learns"), LEARNS)


def test_fedbus_algorithms_lists_the_installed_plugin(plugin_env):
    records = {r["name"]: r for r in json.loads(cli(plugin_env, "algorithms", "--json").stdout)}
    rec = records[NAME]
    assert "error" not in rec, rec
    assert rec["module"] == "fedbus_example_plugin" and rec["options"] == 3
    assert rec["merge"] == "prototype-sums"
    assert rec["uploads"]["text"] == "protos float32[10x50], counts int64[10]"
    assert "fedavg" in records and "fedproto" in records  # the built-ins are all still there
    one = cli(plugin_env, "algorithms", NAME).stdout
    assert "momentum = 0.5  # weight of a client's last uploaded prototype" in one


def test_a_federation_with_the_plugin_learns_and_replays(plugin_env, learned):
    run, summary = learned
    assert summary["algorithm"] == NAME and summary["rounds_completed"] == 3
    final = summary["final"]
    # chance is 0.1 (every client holds all ten classes); both classifiers learned
    assert final["acc_mean"] > 0.3 and final["proto_acc_mean"] > 0.3, final
    curve = [r["proto_acc_mean"] for r in metrics(run)]
    assert curve[-1] > curve[0], curve
    assert "replay identical: " in cli(plugin_env, "replay", str(run)).stdout
    client = cli(plugin_env, "replay", str(run), "--client", "1", "--round", "2").stdout
    assert "update identical" in client, client  # its smoothing over rounds 0-2 included


def test_the_plugins_client_state_survives_eviction(plugin_env, learned, tmp_path):
    """With one resident client per node, every task evicts the other client (its
    state_dict packed away) and restores it: the run equals the resident one only if
    extra_state carries the smoothed prototypes, as a resume needs it to."""
    _, resident = learned
    _, evicted = federation(plugin_env, tmp_path,
                            merged(LEARNS, launch={"max_resident": 1}), "evicted")
    assert evicted["final"] == resident["final"]


def test_the_plugins_merge_declaration_serves_secure_aggregation(plugin_env, tmp_path):
    run, summary = federation(plugin_env, tmp_path,
                              merged(LEARNS, federation={"rounds": 2},
                                     privacy={"secure_aggregation": True}), "secure")
    assert summary["rounds_completed"] == 2
    records = metrics(run)
    assert all(r["secagg"]["survivors"] == 4 and "failed" not in r["secagg"] for r in records)
    assert all(r["participants"] == [0, 1, 2, 3] for r in records)
