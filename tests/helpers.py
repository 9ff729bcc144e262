"""Helpers for tests that run real fedbus processes on loopback."""
from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zygote

from fedbus.bench.common import write_toml as write_config
from fedbus.broker.wire import Message

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


# The algorithm tests' federations: 4 clients in SMALL's 2 nodes. SMALL's bus declares a node
# dead after 4 missed 0.3 s heartbeats; on a loaded 2-core machine a node can stall that long,
# so these allow 10 (3 s)
TINY = merged(SMALL, federation={"clients": 4, "rounds": 3}, bus={"liveness": 10})
SLOW = 2  # the straggler, or the slow client of an async run


def fedbus(*args: str, timeout: float = 300, check: bool = True,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    proc = zygote.run(list(args), cwd=cwd or REPO, timeout=timeout)
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


def logged_messages(run_dir: Path, kind: str, direction: str) -> list[Message]:
    """The run's message log's `task`s or `eval`s (direction "out") or `update`s ("in"), a
    batch's members (PROTOCOL.md §4.3) each as the message it stands for, in log order: a
    batched run (bus.batch's default) and an unbatched one read alike."""
    from fedbus.broker.wire import decode
    from fedbus.node.engine import unbatch_tasks, unbatch_updates
    from fedbus.record.msglog import read_log

    def unbatch(body):
        return unbatch_updates(body) if kind == "update" else unbatch_tasks(body, kind + "s")
    out = []
    for rec in read_log(run_dir):
        if rec.direction != direction:
            continue
        m = decode(rec.frames)
        if m.kind == kind:
            out.append(m)
        elif m.kind == kind + "s":
            for address, body in unbatch(m.body):
                src, dst = (address, m.dst) if kind == "update" else (m.src, address)
                out.append(Message(kind, src, dst, body, m.run, m.round))
    return out


def staleness_weight_ok(staleness: int, weight: float) -> bool:
    """The engine's weight of an update made `staleness` versions ago: 1/sqrt(1 + staleness)."""
    return staleness >= 1 and weight == pytest.approx(1 / math.sqrt(1 + staleness))


def late_rounds(records: list[dict]) -> list[int]:
    """The rounds in which the straggler SLOW was marked late."""
    return [r["round"] for r in records if r["failures"].get(str(SLOW)) == "late"]


def _run_every_round(tmp_path: Path, cfg: dict,
                     timeout: float) -> tuple[Path, dict, list[dict]]:
    """Runs `cfg` and checks that its algorithm completed every round."""
    run, summary = run_federation(tmp_path, cfg, timeout=timeout)
    assert summary["algorithm"] == cfg["algorithm"]["name"]
    assert summary["rounds_completed"] == cfg["federation"]["rounds"]
    return run, summary, metrics(run)


def straggler(sections: dict, late: str = "fold") -> dict:
    """`sections` in sync rounds with client SLOW a straggler by events, not seconds: its node
    holds each of its updates until the next round's first message arrives
    (system.hold_clients), and each round closes once every other sampled client has
    answered (federation.quorum), so SLOW is late in every round it is sampled in, on any
    machine. Its held update leaves before its node's other clients answer the next round;
    where one of them is sampled, that round waits for it, so the held update reaches the
    server in that round: folded there with staleness 1 (late = fold) or dropped."""
    fed = {**SMALL["federation"], **sections.get("federation", {})}
    sampled = max(fed.get("min_clients", 1),
                  math.ceil(fed.get("fraction", 1.0) * fed["clients"]))
    return merged(sections, federation={"quorum": sampled - 1, "late": late},
                  system={"hold_clients": [SLOW]})


def run_with_folded_straggler(tmp_path: Path, sections: dict, *,
                              timeout: float = 240) -> tuple[Path, dict, list[dict]]:
    """Runs `sections` with client SLOW a straggler (`straggler`) whose late updates are
    folded into later aggregations with their staleness weight. Asserts what every such run
    shows; returns (run dir, summary, metrics records)."""
    cfg = straggler(sections)
    run, summary, records = _run_every_round(tmp_path, cfg, timeout)
    rounds = cfg["federation"]["rounds"]
    assert [r["round"] for r in records] == list(range(rounds))
    late = late_rounds(records)
    assert late, [r["failures"] for r in records]
    folded = [(r["round"], entry) for r in records for entry in r["stale"]]
    assert any(client == SLOW and rnd > late[0] for rnd, (client, *_) in folded), folded
    for rnd, (client, version, staleness, weight) in folded:
        assert staleness == rnd - version and staleness_weight_ok(staleness, weight), folded
    assert summary["late_folded"] >= 1
    return run, summary, records


def run_async_with_slow_client(tmp_path: Path, sections: dict, *, concurrency: int = 3,
                               timeout: float = 240, held: bool = False
                               ) -> tuple[Path, dict, list[dict]]:
    """Runs `sections` in async mode, `concurrency` clients busy at a time and an aggregation
    every 2 updates, with client SLOW on a device 20x slower, so updates arrive out of order
    and some were made from older versions. Asserts what every such run shows; returns
    (run dir, summary, metrics records). `held`: SLOW's node also holds each of its updates
    until a message of a later version reaches it (system.hold_clients), so that update is
    stale by the order of events, not by the machine's speed; with an evaluation every
    version (federation.eval_every = 1, which reaches SLOW's node through its other client)
    it arrives before the run ends."""
    cfg = merged(sections, federation={"mode": "async", "concurrency": concurrency, "buffer": 2},
                 system={"slow_clients": [SLOW], "slow_factor": 20.0,
                         **({"hold_clients": [SLOW]} if held else {})})
    run, summary, records = _run_every_round(tmp_path, cfg, timeout)
    rounds = cfg["federation"]["rounds"]
    assert [r["version"] for r in records] == list(range(1, rounds + 1))
    assert all(r["updates"] == 2 for r in records), [r["updates"] for r in records]
    stale = [entry for r in records for entry in r["stale"]]
    assert all(staleness_weight_ok(staleness, weight) for _, _, staleness, weight in stale), stale
    return run, summary, records


def assert_update_replays(run: Path, client: int, rnd: int) -> None:
    """`fedbus replay --client` retrains the client's update of round `rnd` bit for bit."""
    out = fedbus("replay", str(run), "--client", str(client), "--round", str(rnd)).stdout
    assert "update identical" in out, out


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
        proc = zygote.start(list(args), stdout=self.log_dir / f"{name}.log", cwd=REPO)
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
