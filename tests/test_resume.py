"""A resumed run continues the same experiment: `fedbus run --resume RUN` after the
launcher was killed mid-round gives, on the CPU, the records and the final server state of
the uninterrupted run, because every client continues from the state it saved
(fedbus.node.client_state) and not from its initial model. Plus what --out and --resume
refuse, and the client-state store itself."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch
import zygote
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
    return [r for rounds in _saved_by_client(run_dir).values() for r in rounds]


def _saved_by_client(run_dir) -> dict[int, list[int]]:
    """client -> the rounds of its states on disk."""
    out: dict[int, list[int]] = {}
    for f in (run_dir / "clients").glob("*/client-*-r*.pt"):
        client, rnd = f.stem[len("client-"):].split("-r")
        out.setdefault(int(client), []).append(int(rnd))
    return out


def _records(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _server_pid(run_dir) -> int | None:
    return _pid(run_dir, "server")


def _pid(run_dir, process: str) -> int | None:
    """The pid of a process of a `fedbus run`, from its log (logs/PROCESS.jsonl)."""
    path = run_dir / f"logs/{process}.jsonl"
    if not path.exists():
        return None
    for line in path.read_text().splitlines():
        try:
            return int(json.loads(line)["pid"])
        except (ValueError, KeyError):
            continue
    return None


def _checkpoint_version(run_dir) -> int | None:
    path = run_dir / "checkpoint.fbk"
    return int(read_checkpoint(path)[1]["version"]) if path.exists() else None


def _kill_mid_round(cfg, run_dir, after_records: int) -> None:
    """Start `fedbus run`, and SIGKILL the launcher (its children die with it) inside a round
    whose work is partly done: once `after_records` rounds are recorded and a checkpoint is
    written, the server is stopped (SIGSTOP) and the facts are read again: the run must
    not have ended. The kill is aimed by events, never by a wait."""
    proc = zygote.start(["run", str(cfg), "--out", str(run_dir), "--quiet"],
                        stdout=run_dir.with_name(run_dir.name + ".out"), cwd=REPO)
    stopped = None
    try:
        def mid_round() -> bool:
            # (a checkpoint waits for the nodes' flushes, PROTOCOL.md §4.2: it can lag)
            return _records(run_dir) >= after_records and \
                (_checkpoint_version(run_dir) or 0) >= 1

        wait_until(mid_round, 240, "a round in progress", interval=0.002)
        stopped = _server_pid(run_dir)
        os.kill(stopped, signal.SIGSTOP)
        assert _records(run_dir) < ROUNDS, "no round left to stop inside"
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
    # (a state newer than the checkpoint's round, on disk and not restored: the next test)

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


@pytest.mark.slow
def test_a_node_killed_before_its_states_are_written_resumes_exactly(tmp_path):
    """The durability window of writing client states off the message path: a node sends
    its updates before their states are on disk, and is SIGKILLed while they are not
    (node-1's writer holds back every flush from round 2 on: FEDBUS_HOLD_STATE_WRITES, so
    the window is an event, not a race). The server recorded rounds 0-2 but kept checkpoint
    1 (the later ones wait for node-1); node-0 answered flush 2, so its clients' states of
    round 1 are on disk, newer than the checkpoint. The resumed run redoes rounds 1-2 from
    every client's state of round 0 and equals the uninterrupted run."""
    cfg = _config(tmp_path, "fedproto")
    whole = tmp_path / "whole"
    fedbus("run", str(cfg), "--out", str(whole), "--quiet")

    run_dir = tmp_path / "stopped"
    env = {**os.environ, "FEDBUS_HOLD_STATE_WRITES": "2:node-1"}
    proc = zygote.start(["run", str(cfg), "--out", str(run_dir), "--quiet"],
                        stdout=run_dir.with_name(run_dir.name + ".out"), cwd=REPO, env=env)
    server = None
    try:
        # checkpoint 1 is written once flush 1 is answered; later ones never are; node-0's
        # states of round 1 are written once it has flush 2, and stay (the checkpoint is 1)
        wait_until(lambda: _records(run_dir) >= 3 and (_checkpoint_version(run_dir) or 0) >= 1
                   and max(_saved_rounds(run_dir), default=0) >= 1, 240,
                   "round 2 recorded, a checkpoint and a state of round 1 written",
                   interval=0.002)
        server = _server_pid(run_dir)
        os.kill(server, signal.SIGSTOP)  # (client 3's 20x sleep leaves rounds to stop in)
        assert _records(run_dir) < ROUNDS, "the run ended before it could be stopped"
        os.kill(_pid(run_dir, "node-1"), signal.SIGKILL)
        assert _checkpoint_version(run_dir) == 1
        # node-1's clients' states of rounds 1 and 2 were taken and their updates sent, but
        # only round 0's is on disk; node-0's clients have newer ones the resume must not use
        newest = {c: max(rounds) for c, rounds in _saved_by_client(run_dir).items()}
        assert len(newest) == 4 and 0 in newest.values() and max(newest.values()) >= 1
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if server is not None:
            try:
                os.kill(server, signal.SIGCONT)
            except ProcessLookupError:
                pass
    assert not (run_dir / "summary.json").exists()

    out = fedbus("run", "--resume", str(run_dir), "--quiet")
    assert out.returncode == 0
    a, b = metrics(whole), metrics(run_dir)
    assert [r["round"] for r in b] == list(range(ROUNDS))
    assert _comparable(a) == _comparable(b)
    assert b[-1]["per_client"] == a[-1]["per_client"]
    _assert_trees_equal(read_checkpoint(whole / "checkpoint.fbk")[1]["handler"],
                        read_checkpoint(run_dir / "checkpoint.fbk")[1]["handler"])


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
    proc = zygote.start(["run", str(cfg), "--out", str(run_dir), "--quiet", "--no-client-state"],
                        stdout=run_dir.with_name(run_dir.name + ".out"), cwd=REPO)
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
    # the state each client would be restored from (its newest before the checkpoint's
    # round, which may be behind the records while flushes are answered): damage one
    done = _checkpoint_version(run_dir)
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


@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory):
    """A finished one-round FedAvg run, made once: tests read it and damage copies."""
    tmp = tmp_path_factory.mktemp("one-round")
    cfg = write_config(tmp / "fedavg.toml", merged(SMALL, federation={"rounds": 1, "clients": 4},
                                                   algorithm={"name": "fedavg"}))
    fedbus("run", str(cfg), "--out", str(tmp / "whole"), "--quiet")
    return tmp / "whole"


@pytest.mark.parametrize("damage", [b"", b"\x93garbage", b"\x81\xa3abc\x01", "flip", "cut"])
def test_a_damaged_checkpoint_is_one_line_naming_it(tmp_path, damage, one_round_run):
    """Empty, not msgpack, msgpack that is no checkpoint, one byte of a real checkpoint
    changed (it would still decode: its digest catches it) or a real one cut short:
    `fedbus run --resume` and `fedbus server --resume` each say so in one line and exit 2,
    before anything starts."""
    whole = one_round_run
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
