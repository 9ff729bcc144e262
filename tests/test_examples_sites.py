"""The relay examples (docs/RELAYS.md): examples/two-sites/ and
examples/slurm-relays.sbatch load, parse, and run as documented, with CurveZMQ keys made
and exchanged the way docs/RELAYS.md says, through real brokers, relays and nodes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedbus.algorithms import get_algorithm
from fedbus.node.config import load_config
from tests.helpers import REPO, metrics

EXAMPLE = REPO / "examples" / "two-sites"
SLURM = REPO / "examples" / "slurm-relays.sbatch"


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user who installed fedbus: `fedbus` and `python` on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _run_script(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
                log: Path) -> int:
    """Run a bash example in its own session; whatever it started is killed at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{cmd[1]} ran past {timeout} s:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def test_the_two_site_server_config_loads_and_its_algorithm_merges():
    cfg = load_config(EXAMPLE / "server.toml")
    assert cfg.data.dataset == "digits"  # offline, as the walk-through runs anywhere
    assert cfg.federation.clients == 6 and cfg.federation.mode == "sync"
    # the walk-through promises one merged update per relay and round
    assert get_algorithm(cfg.algorithm.name).server.merge_rule() is not None


@pytest.mark.parametrize("script", [EXAMPLE / "rehearse.sh", SLURM], ids=lambda p: p.name)
def test_the_example_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_two_site_walk_through_runs_with_one_merged_update_per_relay(tmp_path):
    work = tmp_path / "sites"
    rc = _run_script(["bash", str(EXAMPLE / "rehearse.sh"), str(work)], cwd=REPO,
                     env=_env(), timeout=280, log=tmp_path / "rehearse.log")
    assert rc == 0, (tmp_path / "rehearse.log").read_text(errors="replace")[-3000:]
    records = metrics(work / "S" / "runs" / "two-sites")
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["merged"] == 2, r  # relay-a and relay-b, each for its whole site
        assert r["participants"] == list(range(6)) and not r["failures"], r
    for machine, clients in (("RA", 3), ("RB", 3)):
        log = (work / machine / "relay.log").read_text(errors="replace")
        assert log.count("merged update sent") == 3, machine
        assert f"clients={clients} tasks={clients}" in log, machine
    # docs/RELAYS.md's check: `fedbus log --kind merged` names both relays
    timeline = subprocess.run([sys.executable, "-m", "fedbus.launch", "log",
                               str(work / "S" / "runs" / "two-sites"), "--round", "1",
                               "--kind", "merged"], check=False, capture_output=True, text=True,
                              cwd=REPO)
    assert timeline.returncode == 0, timeline.stderr
    assert "relay-a" in timeline.stdout and "relay-b" in timeline.stdout, timeline.stdout
