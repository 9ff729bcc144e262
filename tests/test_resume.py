"""A resumed run continues the same experiment: `fedbus run --resume RUN` after the
launcher was killed mid-round gives, on the CPU, the records and the final server state of
the uninterrupted run, because every client continues from the state it saved
(fedbus.node.client_state) and not from its initial model. Plus what --out and --resume
refuse, and the client-state store itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from helpers import REPO, SMALL, fedbus, merged, metrics, wait_until, write_config

from fedbus.node.server import read_checkpoint
from fedbus.node.client_state import ClientStateStore

ROUNDS = 5
# metrics that depend on the wall clock, not on the mathematics
TIMING = {"time", "round_s", "eval_s", "wall_s"}


def _config(tmp_path, algorithm: str):
    # client 3 is slowed 20x (a sleep: the mathematics is unchanged), so a round usually
    # stays open after the fast clients finish: _kill_mid_round's first try then succeeds
    # (it retries on a later round otherwise; its verdict never rests on this)
    sections = merged(SMALL, federation={"rounds": ROUNDS, "clients": 4},
                      algorithm={"name": algorithm},
                      system={"slow_clients": [3], "slow_factor": 20.0})
    return write_config(tmp_path / f"{algorithm}.toml", sections)


def _saved_rounds(run_dir) -> list[int]:
    files = list((run_dir / "clients").glob("*/client-*-r*.pt"))
    return [int(f.stem.rsplit("-r", 1)[1]) for f in files]


def _records(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _server_pid(run_dir) -> int | None:
    path = run_dir / "logs/server.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            return int(json.loads(line)["pid"])
        except (ValueError, KeyError):
            continue
    return None


def _kill_mid_round(cfg, run_dir, after_records: int) -> None:
    """Start `fedbus run`, and SIGKILL the launcher (its children die with it) inside a round
    whose work is partly done: once `after_records` rounds are recorded and a client has
    saved its state of an unrecorded round, the server is stopped (SIGSTOP) and the two
    facts are read again; they hold while it is stopped, so they hold at the kill. If the
    round closed before the stop, the server goes on and the next round is tried: the
    kill is aimed by events, never by a wait."""
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                             str(run_dir), "--quiet"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stopped = None
    try:
        def mid_round() -> bool:
            done = _records(run_dir)
            return done >= after_records and any(r >= done for r in _saved_rounds(run_dir))

        while stopped is None:
            wait_until(mid_round, 240, "a round in progress", interval=0.002)
            server = _server_pid(run_dir)
            os.kill(server, signal.SIGSTOP)
            if mid_round():
                stopped = server
            else:  # the round closed first
                os.kill(server, signal.SIGCONT)
                assert _records(run_dir) < ROUNDS - 1, "no round left to stop inside"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if stopped is not None:  # killed with the launcher; continued, should it linger
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _assert_trees_equal(a, b, path="") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            _assert_trees_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_trees_equal(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, float) and np.isnan(a):
        assert isinstance(b, float) and np.isnan(b), path
    else:
        assert a == b, (path, a, b)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedproto", "fedper"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, algorithm):
    cfg = _config(tmp_path, algorithm)
    whole = tmp_path / "whole"
    fedbus("run", str(cfg), "--out", str(whole), "--quiet")

    stopped = tmp_path / "stopped"
    _kill_mid_round(cfg, stopped, after_records=2)
    assert not (stopped / "summary.json").exists()
    before = len(metrics(stopped))
    assert before < ROUNDS
    # a state of the interrupted round exists and must not be the one restored
    assert max(_saved_rounds(stopped)) >= before

    out = fedbus("run", "--resume", str(stopped), "--quiet")
    assert out.returncode == 0

    a, b = metrics(whole), metrics(stopped)
    assert [r["round"] for r in b] == list(range(ROUNDS))  # one record per round
    assert _comparable(a) == _comparable(b)
    # the clients did continue: without their states FedProto's and FedPer's local
    # models would start again and the per-client accuracies could not all agree
    assert b[-1]["per_client"] == a[-1]["per_client"]
    ckpt_a = read_checkpoint(whole / "checkpoint.fbk")[1]
    ckpt_b = read_checkpoint(stopped / "checkpoint.fbk")[1]
    _assert_trees_equal(ckpt_a["handler"], ckpt_b["handler"])
    assert ckpt_a["version"] == ckpt_b["version"] == ROUNDS
    # a complete run leaves no client states behind
    assert _saved_rounds(stopped) == []


def test_out_that_holds_a_run_is_refused_without_resume_or_force(tmp_path):
    cfg = _config(tmp_path, "fedavg")
    run_dir = tmp_path / "run"
    fedbus("run", str(cfg), "--out", str(run_dir), "--quiet",
           "--set", "federation.rounds=1")
    first = (run_dir / "metrics.jsonl").read_text()

    again = fedbus("run", str(cfg), "--out", str(run_dir), "--quiet", check=False)
    assert again.returncode == 2
    assert f"--out {run_dir} already holds a run" in again.stderr
    assert f"fedbus run --resume {run_dir}" in again.stderr and "--force" in again.stderr
    assert (run_dir / "metrics.jsonl").read_text() == first  # nothing touched

    done = fedbus("run", "--resume", str(run_dir), check=False)
    assert done.returncode == 2 and "is complete (summary.json)" in done.stderr

    forced = fedbus("run", str(cfg), "--out", str(run_dir), "--quiet", "--force",
                    "--set", "federation.rounds=2")
    assert forced.returncode == 0
    assert [r["round"] for r in metrics(run_dir)] == [0, 1]

    stranger = tmp_path / "not-a-run"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    refused = fedbus("run", str(cfg), "--out", str(stranger), "--force", check=False)
    assert refused.returncode == 2 and "holds no run" in refused.stderr
    assert (stranger / "notes.txt").read_text() == "mine"


def test_resume_refuses_what_it_cannot_continue(tmp_path):
    cfg = _config(tmp_path, "fedavg")
    empty = tmp_path / "empty"
    empty.mkdir()
    out = fedbus("run", "--resume", str(empty), check=False)
    assert out.returncode == 2 and "holds no run (no config.json)" in out.stderr

    started = tmp_path / "started"
    started.mkdir()
    (started / "config.json").write_text("{}")
    out = fedbus("run", "--resume", str(started), check=False)
    assert out.returncode == 2 and "has no checkpoint" in out.stderr
    assert f"--out {started} --force" in out.stderr

    out = fedbus("run", "--resume", str(started), str(cfg), check=False)
    assert out.returncode == 2 and "drop CONFIG, --set, --out and --force" in out.stderr


def test_the_store_keeps_the_newest_states_and_finds_the_one_before_a_round(tmp_path):
    store = ClientStateStore(tmp_path, "run1", keep=2)
    for r in (0, 2, 5):
        store.save(3, r, {"w": torch.full((2,), float(r)), "step": r})
    assert store.saved[3] == [2, 5]  # round 0 deleted
    assert sorted(p.name for p in (tmp_path / "run1").iterdir()) == \
        ["client-3-r2.pt", "client-3-r5.pt"]
    assert store.newest_before(3, 5) == 2 and store.newest_before(3, 6) == 5
    assert store.newest_before(3, 2) is None and store.newest_before(4, 9) is None
    assert store.load(3, 2)["step"] == 2

    again = ClientStateStore(tmp_path, "run1")  # a restarted node reads what is there
    assert again.clients() == {3} and again.newest_before(3, 9) == 5

    (tmp_path / "run1" / "client-3-r5.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="client-3-r5.pt cannot be read"):
        again.load(3, 5)

    again.discard([3])
    assert not (tmp_path / "run1").exists()
    with pytest.raises(ValueError, match="cannot name a folder"):
        ClientStateStore(tmp_path, "../escape")


def test_without_client_state_a_resume_says_the_clients_start_again(tmp_path):
    cfg = _config(tmp_path, "fedproto")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                             str(run_dir), "--quiet", "--no-client-state"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        wait_until(lambda: _records(run_dir) >= 2, 240, "two rounds recorded", interval=0.002)
        # stopped, then read again: rounds are left to resume at the kill, on any machine
        server = _server_pid(run_dir)
        os.kill(server, signal.SIGSTOP)
        assert 2 <= _records(run_dir) < ROUNDS, "the run ended before it could be stopped"
        assert _saved_rounds(run_dir) == []  # the nodes saved nothing
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if server is not None:  # killed with the launcher; continued, should it linger
            try:
                os.kill(server, signal.SIGCONT)
            except ProcessLookupError:
                pass
    out = fedbus("run", "--resume", str(run_dir), "--quiet")
    assert "holds no client states" in out.stderr
    assert "every client starts again from its initial state" in out.stderr
    assert [r["round"] for r in metrics(run_dir)] == list(range(ROUNDS))


def test_a_damaged_client_state_is_named_and_its_client_starts_again(tmp_path):
    cfg = _config(tmp_path, "fedproto")
    run_dir = tmp_path / "run"
    _kill_mid_round(cfg, run_dir, after_records=2)
    done = len(metrics(run_dir))
    # the state each client would be restored from: damage one of them
    newest = {}
    for f in (run_dir / "clients").glob("*/client-*-r*.pt"):
        client, rnd = f.stem.split("-r")
        if int(rnd) < done and int(rnd) >= newest.get(client, (-1, None))[0]:
            newest[client] = (int(rnd), f)
    victim = sorted(newest.values())[0][1]
    victim.write_bytes(victim.read_bytes()[:40])  # truncated
    fedbus("run", "--resume", str(run_dir), "--quiet")
    assert [r["round"] for r in metrics(run_dir)] == list(range(ROUNDS))
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("node-*.jsonl"))
    assert "client state not restored" in logs and victim.name in logs


@pytest.mark.parametrize("damage", [b"", b"\x93garbage", b"\x81\xa3abc\x01", "flip", "cut"])
def test_a_damaged_checkpoint_is_one_line_naming_it(tmp_path, damage):
    """Empty, not msgpack, msgpack that is no checkpoint, one byte of a real checkpoint
    changed (it would still decode: its digest catches it) or a real one cut short:
    `fedbus run --resume` and `fedbus server --resume` each say so in one line and exit 2,
    before anything starts."""
    cfg = _config(tmp_path, "fedavg")
    whole = tmp_path / "whole"
    fedbus("run", str(cfg), "--out", str(whole), "--quiet", "--set", "federation.rounds=1")
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.json").write_text((whole / "config.json").read_text())
    if damage == "flip":  # a byte in the middle of the weights: still valid msgpack
        real = bytearray((whole / "checkpoint.fbk").read_bytes())
        real[len(real) // 2] ^= 0x10
        damage = bytes(real)
    elif damage == "cut":
        damage = (whole / "checkpoint.fbk").read_bytes()[:-30]
    (stopped / "checkpoint.fbk").write_bytes(damage)
    for argv in (["run", "--resume", str(stopped)],
                 ["server", "--broker", "tcp://127.0.0.1:1", "--resume", str(stopped)]):
        out = fedbus(*argv, check=False, timeout=120)
        assert out.returncode == 2, out.stderr
        lines = [ln for ln in out.stderr.splitlines() if ln.startswith("fedbus ")]
        assert len(lines) == 1 and str(stopped / "checkpoint.fbk") in lines[0], out.stderr
        assert "--force" in lines[0] and "Traceback" not in out.stderr


def test_a_damaged_metrics_file_is_one_line_naming_the_line(tmp_path):
    """A torn last line (a stop mid-write) is the normal case and is dropped; a damaged line
    before the end stops `fedbus run --resume` and `fedbus plot` with one line naming it,
    where the records used to be cut short there in silence."""
    from fedbus.record import DamagedFile
    from fedbus.record.rundir import read_metrics

    cfg = _config(tmp_path, "fedavg")
    run_dir = tmp_path / "run"
    fedbus("run", str(cfg), "--out", str(run_dir), "--quiet", "--set", "federation.rounds=3")
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines) + "\n" + lines[-1][:25])  # torn tail
    assert len(read_metrics(run_dir)) == 3
    path.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(DamagedFile, match=r"metrics.jsonl, line 2, is not a metrics record"):
        read_metrics(run_dir)
    (run_dir / "summary.json").unlink()  # as if it had stopped: a resume is asked for
    for argv in (["run", "--resume", str(run_dir)], ["plot", str(run_dir)]):
        out = fedbus(*argv, check=False, timeout=120)
        assert out.returncode == 2, (argv, out.stderr)
        assert "metrics.jsonl, line 2, is not a metrics record" in out.stderr
        assert "Traceback" not in out.stderr
