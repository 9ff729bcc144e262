"""Helpers for tests that run real fedbus processes on loopback."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from fedbus.bench.common import write_toml as write_config

REPO = Path(__file__).resolve().parents[1]
MNIST_NPZ = Path(os.environ.get("FEDBUS_MNIST_NPZ", REPO.parent / "shared/data/mnist-10k.npz"))
needs_mnist = pytest.mark.skipif(not MNIST_NPZ.is_file(),
                                 reason=f"real MNIST subset not found at {MNIST_NPZ} "
                                        f"(set FEDBUS_MNIST_NPZ)")

# A small, fast federation on real data (scikit-learn's digits).
SMALL = {
    "federation": {"clients": 6, "rounds": 3, "seed": 1, "start_timeout_s": 30.0},
    "data": {"dataset": "digits", "partition": "nway-kshot", "ways": 3, "ways_std": 1.0,
             "shots": 30, "shots_std": 3.0},
    "model": {"arch": "cnn"},
    "algorithm": {"name": "fedavg"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "bus": {"heartbeat_s": 0.3, "liveness": 4},
    "launch": {"nodes": 2},
}


def merged(base: dict, **changes: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for section, table in changes.items():
        out.setdefault(section, {}).update(table)
    return out


def fedbus(*args: str, timeout: float = 300, check: bool = True,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "fedbus.launch", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd or REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"fedbus {' '.join(args)} exited {proc.returncode}\n"
                             f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


def run_federation(tmp_path: Path, sections: dict, *extra: str, name: str = "run",
                   timeout: float = 300) -> tuple[Path, dict]:
    cfg = write_config(tmp_path / f"{name}.toml", sections)
    run_dir = tmp_path / name
    fedbus("run", str(cfg), "--out", str(run_dir), "--quiet", *extra, timeout=timeout)
    return run_dir, json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Callable[[], bool], timeout: float, what: str = "",
               interval: float = 0.1) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(interval)
    if not predicate():
        raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")


class Processes:
    """fedbus processes started by hand (as on separate machines); all killed at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", *args], cwd=REPO,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(timeout=30)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
