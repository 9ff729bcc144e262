"""`fedbus replay` and `fedbus log` on real federations (broker, server and
node processes on loopback, real training on scikit-learn's digits).

Each federation runs once per module and serves several tests; the damaged
logs are copies."""
from __future__ import annotations

import json
import re
import shutil
import signal
import struct
import time
import zlib

import msgpack
import pytest
from helpers import (SMALL, Processes, fedbus, free_port, merged, metrics, run_federation,
                     wait_until, write_config)

from fedbus.broker.wire import decode
from fedbus.record.msglog import read_log

IDENTICAL = re.compile(r"replay identical: (\d+) messages, (\d+) rounds")

# FedProto, sync, 4 clients in 2 nodes, 3 rounds.
SYNC = merged(SMALL, federation={"clients": 4, "rounds": 3},
              algorithm={"name": "fedproto"})

# FedAvg, async: 3 of 4 clients busy, aggregate every 2 updates. Client 2 is a
# 20x slower device with a 0.6 s budget: it misses its 0.4 s task deadline (a
# tick marks it late and it gets a new task), and its late updates come back
# and are rejected, so arrival order, ticks and rejections all matter.
ASYNC_STRAGGLER = merged(SMALL, federation={"clients": 4, "rounds": 12, "eval_every": 6,
                                            "mode": "async", "concurrency": 3, "buffer": 2,
                                            "deadline_s": 0.4},
                         train={"epochs": 2, "budget_s": 0.6},
                         system={"slow_clients": [2], "slow_factor": 20.0})

# Every client on a simulated device 40x slower: rounds last seconds, long
# enough to kill a process in the middle of a run.
SLOW = merged(SMALL, federation={"clients": 4, "rounds": 4},
              algorithm={"name": "fedproto"}, train={"epochs": 2},
              system={"slow_clients": [0, 1, 2, 3], "slow_factor": 40.0})


def replay(*args: str):
    return fedbus("replay", *map(str, args), check=False, timeout=300)


def assert_identical(run, *, rounds: int | None = None) -> tuple[int, int]:
    proc = replay(run)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    m = IDENTICAL.search(proc.stdout)
    assert m, proc.stdout
    n, r = int(m.group(1)), int(m.group(2))
    if rounds is not None:
        assert r == rounds
    return n, r


def index(run) -> list[dict]:
    return [json.loads(line) for line in (run / "messages.jsonl").read_text().splitlines()]


def copy_run(run, dst):
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns("logs", "*.sock"))
    return dst


# --- the federations, one each per module ---

@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("sync"), SYNC)
    return run


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("async"), ASYNC_STRAGGLER)
    return run


def _manual(tmp, sections):
    broker = f"tcp://127.0.0.1:{free_port()}"
    cfg = write_config(tmp / "cfg.toml", sections)
    procs = Processes(tmp)
    procs.start("broker", "broker", "--bind", broker, "--heartbeat-s", "0.3", "--liveness", "4")
    node = ("--heartbeat-s", "0.3", "--liveness", "4")
    run = tmp / "run"
    procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
    procs.start("node-0", "node", "--broker", broker, "--clients", "0-1", "--name", "n0", *node)
    procs.start("node-1", "node", "--broker", broker, "--clients", "2-3", "--name", "n1", *node)
    return run, procs


def _rounds_done(run) -> int:
    return len(metrics(run)) if (run / "metrics.jsonl").exists() else 0


@pytest.fixture(scope="module")
def killed_node_run(tmp_path_factory):
    """A whole run in which client node n1 (clients 2 and 3) was SIGKILLed after round 1."""
    tmp = tmp_path_factory.mktemp("killed-node")
    run, procs = _manual(tmp, SLOW)
    try:
        wait_until(lambda: _rounds_done(run) >= 1, 180, "the first round")
        procs.kill("node-1")
        wait_until(lambda: procs.procs["server"].poll() is not None, 240, "the run to finish")
        assert procs.procs["server"].returncode == 0, procs.log("server")
    finally:
        procs.close()
    return run


@pytest.fixture(scope="module")
def killed_server_run(tmp_path_factory):
    """A run whose server was SIGKILLed in the middle of its second round."""
    tmp = tmp_path_factory.mktemp("killed-server")
    run, procs = _manual(tmp, merged(SLOW, federation={"rounds": 6}))
    try:
        wait_until(lambda: _rounds_done(run) >= 1, 180, "the first round")
        time.sleep(0.5)  # the second round's tasks are out, its updates are coming
        procs.kill("server")
        assert procs.procs["server"].returncode == -signal.SIGKILL
    finally:
        procs.close()
    return run


# --- (a) sync ---

def test_sync_run_replays_identically(sync_run):
    n, _ = assert_identical(sync_run, rounds=3)
    assert n == len(index(sync_run))  # every record, inputs and outputs
    assert n > 3 * 4 * 4  # tasks, updates, evals and results of 4 clients in 3 rounds


# --- (b) async with a straggler ---

def test_async_run_with_a_straggler_replays_identically(async_run):
    assert_identical(async_run, rounds=12)
    entries = index(async_run)
    # the straggler was sent work; the run's own shape (ticks, rejections) depends
    # on timing, which is the point: replay follows whatever the log says happened
    assert any(e["kind"] == "task" and e["dst"] == "c2" for e in entries)
    assert [r["version"] for r in metrics(async_run)][-1] == 12


# --- (c) a killed client node ---

def test_run_with_a_killed_client_node_replays_identically(killed_node_run):
    run = killed_node_run
    recs = metrics(run)
    assert any("dead" in r["failures"].values() for r in recs), recs
    assert any(e["kind"] == "leave" for e in index(run))
    assert_identical(run, rounds=4)


# --- (d) corruption ---

def _body_span(run, i: int) -> tuple[int, int]:
    """Offset and length of record i's body frame in messages.bin."""
    rec = next(r for r in read_log(run) if r.index == i)
    data = (run / "messages.bin").read_bytes()
    body = rec.frames[1]
    at = data.find(body, rec.offset)
    assert at > rec.offset
    return at, len(body)


def _a_task_with_payload(run, round_: int) -> dict:
    return next(e for e in index(run) if e["dir"] == "out" and e["kind"] == "task"
                and e["round"] == round_)


def test_a_corrupted_record_is_detected_and_named(sync_run, tmp_path):
    run = copy_run(sync_run, tmp_path / "run")
    entry = _a_task_with_payload(run, 1)
    at, size = _body_span(run, entry["i"])
    data = bytearray((run / "messages.bin").read_bytes())
    data[at + size - 1] ^= 0x01  # the last byte of the body: array data
    (run / "messages.bin").write_bytes(bytes(data))
    proc = replay(run)
    assert proc.returncode != 0
    assert "replay identical" not in proc.stdout
    assert f"record {entry['i']} at offset {entry['off']}" in proc.stderr, proc.stderr
    assert "checksum" in proc.stderr


def test_a_well_formed_but_altered_record_is_a_divergence_named_by_record_round_field(
        sync_run, tmp_path):
    run = copy_run(sync_run, tmp_path / "run")
    entry = _a_task_with_payload(run, 1)
    rec = next(r for r in read_log(run) if r.index == entry["i"])
    body = bytearray(rec.frames[1])
    body[-1] ^= 0x01  # one value of the task's last array
    payload = msgpack.packb([rec.direction, rec.time, rec.frames[0], bytes(body)],
                            use_bin_type=True)
    data = bytearray((run / "messages.bin").read_bytes())
    old_len = struct.unpack_from("<I", data, rec.offset)[0]
    assert len(payload) == old_len
    data[rec.offset:rec.offset + 8 + old_len] = \
        struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    (run / "messages.bin").write_bytes(bytes(data))
    altered = decode([rec.frames[0], bytes(body)])  # still a well-formed message
    assert altered.kind == "task"

    proc = replay(run)
    assert proc.returncode == 1, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "replay identical" not in proc.stdout
    m = re.search(r"replay diverged at record (\d+) \(round (-?\d+)\): (\S+):", proc.stderr)
    assert m, proc.stderr
    assert int(m.group(1)) == entry["i"] and int(m.group(2)) == 1
    assert m.group(3).startswith("body.payload."), proc.stderr


# --- (e) the server SIGKILLed: torn final record ---

def test_a_log_cut_by_sigkill_replays(killed_server_run):
    n, r = assert_identical(killed_server_run)
    assert r >= 1
    assert n == len(list(read_log(killed_server_run)))


def _truncate_record(run, i: int) -> int:
    """Cut record i in the middle (a torn write) and drop everything after it,
    index lines included; return how many whole records remain."""
    recs = list(read_log(run))
    rec = recs[i]
    path = run / "messages.bin"
    length = struct.unpack_from("<I", path.read_bytes(), rec.offset)[0]
    with open(path, "r+b") as f:
        f.truncate(rec.offset + (8 + length) // 2)
    lines = (run / "messages.jsonl").read_text().splitlines(keepends=True)
    kept = [ln for ln in lines if json.loads(ln)["off"] < rec.offset]
    (run / "messages.jsonl").write_text("".join(kept))
    return i


def test_a_torn_final_record_after_sigkill_is_ignored_and_the_rest_replays(
        killed_server_run, tmp_path):
    run = copy_run(killed_server_run, tmp_path / "torn-last")
    whole = _truncate_record(run, len(list(read_log(run))) - 1)
    assert len(list(read_log(run))) == whole
    n, _ = assert_identical(run)
    assert n == whole


def test_a_log_torn_in_the_middle_of_a_burst_of_tasks_replays(killed_server_run, tmp_path):
    """The server died having sent (and logged) only some of a round's tasks:
    the outputs it never logged are not a divergence."""
    run = copy_run(killed_server_run, tmp_path / "torn-burst")
    tasks = [e for e in index(killed_server_run) if e["kind"] == "task" and e["round"] == 1]
    if len(tasks) < 2:  # the index was not flushed that far: use the records themselves
        tasks = [{"i": r.index} for r in read_log(run) if r.direction == "out"
                 and decode(r.frames).kind == "task" and decode(r.frames).round == 1]
    assert len(tasks) >= 2
    whole = _truncate_record(run, tasks[1]["i"])
    n, r = assert_identical(run)
    assert n == whole and r == 1


# --- (f) one client ---

def _client_replay(run, client: int, round_: int):
    proc = replay(run, "--client", client, "--round", round_)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert re.search(rf"client {client} round {round_} \(task \d+\): update identical",
                     proc.stdout), proc.stdout
    return proc


def test_one_fedproto_client_update_replays_identically(sync_run):
    # FedProto's client keeps its model between rounds: tasks 0 and 1 are replayed too
    proc = _client_replay(sync_run, 2, 2)
    assert "payload.protos: max abs diff 0" in proc.stdout


def test_one_fedavg_client_update_replays_identically_even_a_budget_cut_straggler(async_run):
    updates = {}
    for rec in read_log(async_run):
        if rec.direction == "in":
            m = decode(rec.frames)
            if m.kind == "update":
                updates.setdefault((int(m.src[1:]), m.round), m.body["work"]["stopped"])
    fast = next((c, r) for (c, r), stopped in sorted(updates.items())
                if c != 2 and r >= 2)
    _client_replay(async_run, *fast)
    # the straggler's updates stopped where its (virtual) clock ran out: the replay
    # runs the logged steps, the earlier cut tasks included
    cut = [(c, r) for (c, r), stopped in sorted(updates.items()) if stopped == "budget"]
    if cut:  # (unless none came back before the run ended)
        _client_replay(async_run, *cut[-1])


# --- (g) stop early and dump the state ---

def test_until_round_stops_early_and_dumps_the_server_state(sync_run, tmp_path):
    dump = tmp_path / "state.json"
    proc = replay(sync_run, "--until-round", 2, "--dump-state", dump)
    assert proc.returncode == 0, proc.stderr
    m = IDENTICAL.search(proc.stdout)
    assert m and int(m.group(2)) == 2
    assert int(m.group(1)) < len(index(sync_run))
    state = json.loads(dump.read_text())
    assert state["version"] == 2
    assert state["handler"]  # the algorithm's own state (FedProto's prototypes)


# --- (h) the timeline ---

def test_log_filters_by_round_client_and_kind(sync_run):
    proc = fedbus("log", str(sync_run), "--round", "1", "--client", "2", "--kind", "update")
    lines = proc.stdout.splitlines()
    timeline = [ln for ln in lines if not ln.startswith("round ")]
    want = [e for e in index(sync_run)
            if e["round"] == 1 and e["kind"] == "update" and "c2" in (e["src"], e["dst"])]
    assert len(want) == 1 and len(timeline) == 1, proc.stdout
    fields = timeline[0].split()
    assert fields[1:5] == ["<-", "update", "c2", "r1"], timeline[0]
    assert f"{want[0]['bytes']:,}" in fields and fields[-1] == str(want[0]["seq"])
    assert [ln for ln in lines if ln.startswith("round ")] == ["round 1: c2 answered"]


def test_log_kinds_and_round_outcomes(sync_run, killed_node_run):
    proc = fedbus("log", str(sync_run), "--round", "0", "--kind", "task", "--kind", "eval")
    timeline = [ln for ln in proc.stdout.splitlines() if not ln.startswith("round ")]
    assert len(timeline) == 8  # 4 tasks and 4 evals
    assert all(ln.split()[1] == "->" and ln.split()[2] in ("task", "eval") and
               ln.split()[4] == "r0" for ln in timeline), proc.stdout
    assert "round 0: sampled 0,1,2,3  answered 0,1,2,3" in proc.stdout.splitlines()

    # who was dead: the killed node's clients, in the round it died
    proc = fedbus("log", str(killed_node_run), "--kind", "leave")
    outcomes = [ln for ln in proc.stdout.splitlines() if ln.startswith("round ")]
    assert len(outcomes) == 4
    assert outcomes[0] == "round 0: sampled 0,1,2,3  answered 0,1,2,3"
    dead = [ln for ln in outcomes if "dead:" in ln]
    assert dead and all(re.search(r"dead: 2,3$|dead: 3$|dead: 2$", ln) for ln in dead), outcomes
    assert outcomes[-1] == "round 3: sampled 0,1  answered 0,1"  # node n1's clients are gone
    assert any("leave" in ln for ln in proc.stdout.splitlines() if not ln.startswith("round "))
    proc = fedbus("log", str(killed_node_run), "--client", "3", "--kind", "none")
    states = [ln.split(": c3 ")[1] for ln in proc.stdout.splitlines()]
    assert states[0] == "answered" and "dead" in states and states[-1] == "not sampled"


def test_log_json_lines_are_the_index(sync_run):
    proc = fedbus("log", str(sync_run), "--json", "--kind", "shutdown")
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines == [e for e in index(sync_run) if e["kind"] == "shutdown"]
