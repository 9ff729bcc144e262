"""A third-party algorithm joins through the `fedbus.algorithms` entry-point group,
without forking fedbus, and runs in a real federation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from helpers import REPO, SMALL, merged, write_config

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
