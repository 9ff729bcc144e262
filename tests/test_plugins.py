"""A third-party algorithm joins through the `fedbus.algorithms` entry-point group,
without forking fedbus, and runs in a real federation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import REPO, SMALL, free_port, merged, write_config

PLUGIN = '''
from fedbus.algorithms import Algorithm
from fedbus.algorithms.fedavg import FedAvgServer, FedAvgClient


class HalfStepServer(FedAvgServer):
    """FedAvg taking half the averaged step: enough to prove a plugin's maths runs."""
    PARAMS = {"step": 0.5}

    def aggregate(self, updates, failures, info):
        for u in updates:
            u.payload = {"delta": {k: v * self.params["step"]
                                   for k, v in u.payload["delta"].items()}}
        return super().aggregate(updates, failures, info)


ALGORITHM = Algorithm("halfstep", HalfStepServer, FedAvgClient, "FedAvg with a damped step")
'''


def _install_plugin(root):
    (root / "halfstep_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = root / "halfstep_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halfstep-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedbus.algorithms]\nhalfstep = halfstep_plugin:ALGORITHM\n")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_an_entry_point_algorithm_is_found_validated_and_runs(tmp_path):
    env = _install_plugin(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "from fedbus.algorithms import available, get_algorithm;"
         "from fedbus.node.config import build_config;"
         "print('halfstep' in available(), get_algorithm('halfstep').server.__name__,"
         " build_config({'algorithm': {'name': 'halfstep', 'step': 0.25}}).algorithm.step)"],
        env=env, capture_output=True, text=True, cwd=REPO, check=True)
    assert probe.stdout.split() == ["True", "HalfStepServer", "0.25"]

    cfg = write_config(tmp_path / "cfg.toml",
                       merged(SMALL, algorithm={"name": "halfstep"}, federation={"rounds": 2}))
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out", str(run),
                    "--quiet"], env=env, cwd=REPO, check=True, timeout=300)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["algorithm"] == "halfstep" and summary["rounds_completed"] == 2


# --- a plugin that does not load: one line naming the entry point, its module and what
# was found, exit code 2, from every command that resolves the algorithm ---

BROKEN = '''
from fedbus.algorithms import Algorithm
from fedbus.algorithms.fedavg import FedAvgServer, FedAvgClient

ALGORITHM = Algorithm("some-other-name", FedAvgServer, FedAvgClient, "misnamed")
NOT_AN_ALGORITHM = {"server": FedAvgServer}
'''


def _install_broken_plugins(root):
    """One package with three bad entry points: an Algorithm under another name, a value
    that is no Algorithm, and a module that fails to import."""
    (root / "broken_plugin.py").write_text(textwrap.dedent(BROKEN))
    (root / "failing_plugin.py").write_text("import a_module_that_is_not_installed\n")
    info = root / "broken_plugin-0.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.2\n")
    (info / "entry_points.txt").write_text(
        "[fedbus.algorithms]\n"
        "misnamed = broken_plugin:ALGORITHM\n"
        "not-algo = broken_plugin:NOT_AN_ALGORITHM\n"
        "fails-import = failing_plugin:ALGORITHM\n")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


PLUGIN_ERRORS = {
    "misnamed": ("(misnamed = broken_plugin:ALGORITHM, package broken-plugin 0.2): "
                 "broken_plugin.ALGORITHM is an Algorithm named 'some-other-name'; the entry "
                 "point's name and Algorithm.name must be the same"),
    "not-algo": ("(not-algo = broken_plugin:NOT_AN_ALGORITHM, package broken-plugin 0.2): "
                 "broken_plugin.NOT_AN_ALGORITHM is dict {'server': "),
    "fails-import": ("(fails-import = failing_plugin:ALGORITHM, package broken-plugin 0.2): "
                     "module failing_plugin does not import: ModuleNotFoundError: No module "
                     "named 'a_module_that_is_not_installed'"),
}


def _one_line_error(proc, prefix: str, name: str) -> str:
    assert proc.returncode == 2, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert line.startswith(f"{prefix}algorithm.name = {name!r}: plugin entry point {name!r} "), \
        line
    assert PLUGIN_ERRORS[name] in line, line
    return line


def test_each_plugin_error_is_one_line_naming_entry_point_module_and_what_was_found(tmp_path):
    env = _install_broken_plugins(tmp_path)
    for name in PLUGIN_ERRORS:
        run = subprocess.run(
            [sys.executable, "-m", "fedbus.launch", "run", "--set", f"algorithm.name={name}",
             "--out", str(tmp_path / f"run-{name}"), "--quiet"],
            env=env, capture_output=True, text=True, cwd=REPO, timeout=120)
        _one_line_error(run, "fedbus: config error: ", name)
        assert not (tmp_path / f"run-{name}").exists()  # refused before anything started
    line = _one_line_error(subprocess.run(
        [sys.executable, "-m", "fedbus.launch", "server", "--broker", "tcp://127.0.0.1:9",
         "--set", "algorithm.name=not-algo", "--out", str(tmp_path / "server-run")],
        env=env, capture_output=True, text=True, cwd=REPO, timeout=120),
        "fedbus server: ", "not-algo")
    assert "not a fedbus.algorithms.Algorithm" in line


def test_broken_plugins_do_not_hide_the_others_in_the_listing(tmp_path):
    env = _install_broken_plugins(tmp_path)
    listing = subprocess.run([sys.executable, "-m", "fedbus.launch", "algorithms", "--json"],
                             env=env, capture_output=True, text=True, cwd=REPO, check=True,
                             timeout=300)
    records = {r["name"]: r for r in json.loads(listing.stdout)}
    assert "fedavg" in records and "error" not in records["fedavg"]
    for name, detail in PLUGIN_ERRORS.items():
        assert records[name]["error"].startswith(f"PluginError: plugin entry point {name!r}")
        assert detail in records[name]["error"]
    one = subprocess.run([sys.executable, "-m", "fedbus.launch", "algorithms", "misnamed"],
                         env=env, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert one.returncode == 2 and len(one.stderr.strip().splitlines()) == 1, one.stderr
    assert PLUGIN_ERRORS["misnamed"] in one.stderr


def test_a_node_whose_plugin_does_not_load_says_so_in_one_line(tmp_path):
    """The server has the plugin; the node's machine has a broken install of it: the node
    gets the server's config, cannot build the algorithm, and exits 2 with one line."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir()
    bad.mkdir()
    server_env = _install_plugin(good)
    (bad / "halfstep_plugin.py").write_text("import a_dependency_missing_on_this_node\n")
    info = bad / "halfstep_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: halfstep-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedbus.algorithms]\nhalfstep = halfstep_plugin:ALGORITHM\n")
    node_env = {**os.environ,
                "PYTHONPATH": f"{bad}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    broker = f"tcp://127.0.0.1:{free_port()}"
    fedbus = [sys.executable, "-m", "fedbus.launch"]
    started = []
    try:
        for args, env in ((["broker", "--bind", broker], None),
                          (["server", "--broker", broker, "--set", "algorithm.name=halfstep",
                            "--set", "federation.clients=2", "--out", str(tmp_path / "run")],
                           server_env)):
            started.append(subprocess.Popen(fedbus + args, env=env, cwd=REPO,
                                            stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))
        node = subprocess.run(fedbus + ["node", "--broker", broker, "--clients", "0-1"],
                              env=node_env, cwd=REPO, capture_output=True, text=True,
                              timeout=120)
    finally:
        for proc in started:
            proc.kill()
            proc.wait(timeout=30)
    assert node.returncode == 2, node.stderr[-3000:]
    assert "Traceback" not in node.stderr
    last = node.stderr.strip().splitlines()[-1]
    assert last == ("fedbus node: the server's config cannot be used here: algorithm.name = "
                    "'halfstep': plugin entry point 'halfstep' (halfstep = "
                    "halfstep_plugin:ALGORITHM, package halfstep-plugin 0.1): module "
                    "halfstep_plugin does not import: ModuleNotFoundError: No module named "
                    "'a_dependency_missing_on_this_node'"), last
