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
import zlib

import msgpack
import numpy as np
import pytest
from helpers import (SMALL, Processes, fedbus, free_port, merged, metrics, run_federation,
                     wait_until, write_config)

from fedbus.broker.wire import decode
from fedbus.record.msglog import read_log

IDENTICAL = re.compile(r"replay identical: (\d+) messages, (\d+) rounds")

# The sync runs below send their tasks and updates one a client (bus.batch = "off"): these
# tests count, cut and alter single task and update records. A batched run's replay is
# tests/test_batch.py's and the async one's here.
ONE_A_CLIENT = {"batch": "off"}

# FedProto, sync, 4 clients in 2 nodes, 3 rounds.
SYNC = merged(SMALL, federation={"clients": 4, "rounds": 3},
              algorithm={"name": "fedproto"}, bus=ONE_A_CLIENT)

# FedAvg, async: 3 of 4 clients busy, aggregate every 2 updates. Client 2 is a
# straggler by events, not seconds: its node holds each of its updates until a
# message of a later version reaches it (system.hold_clients), so they arrive
# after others made from the same version, and stale; on a 20x slower simulated
# device with a 0.6 s budget its training is cut where its (virtual) clock ran
# out. Arrival order and staleness matter; no deadline decides who is late (the
# shape varies with the machine's speed, which is the point: replay follows the
# log, whatever happened).
ASYNC_STRAGGLER = merged(SMALL, federation={"clients": 4, "rounds": 12, "eval_every": 6,
                                            "mode": "async", "concurrency": 3, "buffer": 2},
                         train={"epochs": 2, "budget_s": 0.6},
                         system={"slow_clients": [2], "slow_factor": 20.0,
                                 "hold_clients": [2]})

# Rounds that wait for every sampled client (no deadline), with a process
# killed or stopped at an event in the middle of the run. Client 2's node holds
# its update until the next round's task (system.hold_clients), so round 0 stays
# open on that node until it dies.
KILLED = merged(SMALL, federation={"clients": 4, "rounds": 4},
                algorithm={"name": "fedproto"}, system={"hold_clients": [2]}, bus=ONE_A_CLIENT)
PLAIN = merged(SMALL, federation={"clients": 4, "rounds": 6}, algorithm={"name": "fedproto"},
               bus=ONE_A_CLIENT)


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


def _manual(tmp, sections, liveness: int = 10):
    """Broker, server and two nodes (clients 0-1, 2-3) started by hand. A process silent
    for `liveness` 0.3 s heartbeats is dead (10: no live one a loaded machine stalls)."""
    broker = f"tcp://127.0.0.1:{free_port()}"
    cfg = write_config(tmp / "cfg.toml", sections)
    procs = Processes(tmp)
    node = ("--heartbeat-s", "0.3", "--liveness", str(liveness))
    procs.start("broker", "broker", "--bind", broker, *node)
    run = tmp / "run"
    procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
    procs.start("node-0", "node", "--broker", broker, "--clients", "0-1", "--name", "n0", *node)
    procs.start("node-1", "node", "--broker", broker, "--clients", "2-3", "--name", "n1", *node)
    return run, procs


def _rounds_done(run) -> int:
    return len(metrics(run)) if (run / "metrics.jsonl").exists() else 0


def _logged(run, direction: str, kind: str, round_: int, src: str | None = None) -> int:
    """How many `kind` messages of round `round_` (from `src`) the live server's log holds
    so far."""
    if not (run / "messages.bin").exists():
        return 0
    n = 0
    for rec in read_log(run):
        if rec.direction == direction:
            m = decode(rec.frames)
            n += m.kind == kind and m.round == round_ and src in (None, m.src)
    return n


@pytest.fixture(scope="module")
def killed_node_run(tmp_path_factory):
    """A whole run in which client node n1 (clients 2 and 3) was SIGKILLed in round 0,
    holding client 2's update (never sent) once client 3's had reached the server: c2 is
    dead in round 0, c3 answered it, and neither is sampled again (events, on any
    machine)."""
    tmp = tmp_path_factory.mktemp("killed-node")
    run, procs = _manual(tmp, KILLED)
    try:
        wait_until(lambda: "event='update held'" in procs.log("node-1")
                   and _logged(run, "in", "update", 0, src="c3") == 1, 180,
                   "n1 holding c2's update of round 0, c3's at the server")
        assert _rounds_done(run) == 0, "round 0 ended without client 2"
        procs.kill("node-1")
        wait_until(lambda: procs.procs["server"].poll() is not None, 240, "the run to finish")
        assert procs.procs["server"].returncode == 0, procs.log("server")
    finally:
        procs.close()
    return run


@pytest.fixture(scope="module")
def killed_server_run(tmp_path_factory):
    """A run whose server was SIGKILLed in the middle of its second round: its four tasks
    logged and an update of it received (events in the server's own log, not a wait).
    Node n1 is stopped (SIGSTOP) once round 1's tasks are out, so the run cannot pass
    round 2 before the kill, on any machine; its broker waits 60 s before taking a
    stopped node for dead (a liveness guard)."""
    tmp = tmp_path_factory.mktemp("killed-server")
    run, procs = _manual(tmp, PLAIN, liveness=200)
    node_1 = procs.procs["node-1"]
    try:
        wait_until(lambda: _logged(run, "out", "task", 1) == 4, 180,
                   "the second round's tasks out", interval=0.01)
        node_1.send_signal(signal.SIGSTOP)
        wait_until(lambda: _logged(run, "in", "update", 1) >= 1, 120,
                   "an update of the second round in", interval=0.01)
        procs.kill("server")
        assert procs.procs["server"].returncode == -signal.SIGKILL
        assert _rounds_done(run) <= 2, "the run went on while n1 was stopped"
    finally:
        node_1.send_signal(signal.SIGCONT)
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
    assert [r["failures"] for r in recs] == [{"2": "dead"}, {}, {}, {}], recs
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
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "replay identical" not in proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedbus replay: "), proc.stderr
    assert f"record {entry['i']} at offset {entry['off']}" in proc.stderr, proc.stderr
    assert "checksum" in proc.stderr and "--until-round" in proc.stderr


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


# --- (f2) secure aggregation: the logged update is masked ---

SECURE = merged(SMALL, federation={"clients": 4, "rounds": 2}, algorithm={"name": "fedproto"},
                privacy={"secure_aggregation": True})


@pytest.fixture(scope="module")
def secure_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("secure"), SECURE)
    return run


def test_a_client_of_a_secure_aggregation_run_is_recomputed_but_not_compared(secure_run):
    assert_identical(secure_run, rounds=2)  # the server's side replays as any run's
    proc = replay(secure_run, "--client", 1, "--round", 1)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert re.match(r"client 1 round 1 \(task \d+\): update not compared: under secure "
                    r"aggregation \(privacy.secure_aggregation = true\) it travelled masked",
                    lines[0]), proc.stdout
    assert "inf" not in proc.stdout and "max abs diff" not in proc.stdout
    # what it can say: the work matches the logged record, and the recomputed update
    logged = next(decode(r.frames).body for r in read_log(secure_run) if r.direction == "in"
                  and decode(r.frames).kind == "update" and decode(r.frames).src == "c1"
                  and decode(r.frames).round == 1)
    assert "masked" in logged["payload"]
    work = logged["work"]
    assert lines[1] == (f"  work identical: {work['epochs_done']:g}/{work['epochs_asked']} "
                        f"epochs, {work['steps']} steps, {work['samples']} samples seen")
    assert re.match(r"  recomputed: task \d+: .* \| protos \d+/10 classes, mean \|v\| [\d.]+",
                    lines[2]), lines[2]


def test_the_log_shows_secure_aggregation_steps_and_masked_updates(secure_run):
    proc = fedbus("log", str(secure_run), "--round", "1", "--client", "1")
    timeline = _timeline(proc)
    steps = [re.search(r"step (\w+), task", ln).group(1) for ln in timeline
             if ln.split()[2] == "secagg"]
    assert steps == ["keys", "peers", "shares", "masking", "unmask", "reveal"], proc.stdout
    update = next(ln for ln in timeline if ln.split()[2] == "update")
    assert re.search(r"\| masked uint8\[\d+,\d+\]$", update), update
    assert "clipped" not in update  # a client's clipped count is never sent (issue 42)
    task = next(ln for ln in timeline if ln.split()[2] == "task")
    assert task.split("seq")[1].split(None, 1)[1].startswith("task ")
    assert "secure aggregation" in task


# --- (f3) what replay cannot do is one line ---

def test_a_run_without_a_message_log_says_the_log_is_off(tmp_path):
    run, _ = run_federation(tmp_path, merged(SMALL, federation={"clients": 3, "rounds": 1},
                                             log={"messages": False}))
    assert not (run / "messages.bin").exists()
    for args in ((), ("--client", "0", "--round", "0")):
        proc = replay(run, *args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr == (f"fedbus replay: {run} ran with log.messages = false: it kept "
                               "no message log, so there is nothing to replay "
                               "(log.messages = true, the default, keeps one)\n")
    proc = fedbus("log", str(run), check=False)
    assert proc.returncode == 2 and "ran with log.messages = false" in proc.stderr


def test_a_data_set_not_found_from_another_directory_is_one_line(tmp_path):
    """A relative npz path resolves against the working directory: the run found it, a
    replay started elsewhere does not."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    np.savez(tmp_path / "digits.npz", x=(digits.images * 16).astype(np.uint8), y=digits.target)
    cfg = write_config(tmp_path / "cfg.toml", merged(SMALL, federation={"clients": 3,
                                                                        "rounds": 1}))
    fedbus("run", str(cfg), "--out", str(tmp_path / "run"), "--quiet",
           "--set", "data.dataset=npz:digits.npz", cwd=tmp_path)
    for args in ((), ("--client", "0", "--round", "0")):
        proc = replay(tmp_path / "run", *args)  # from the repository, not tmp_path
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
        assert proc.stderr.startswith("fedbus replay: data.dataset = 'npz:digits.npz' cannot "
                                      "be loaded: npz dataset not found: digits.npz"), \
            proc.stderr
        assert "replay from the directory the run was started in" in proc.stderr
    from_there = fedbus("replay", str(tmp_path / "run"), cwd=tmp_path)
    assert IDENTICAL.search(from_there.stdout)


# --- (g) stop early and dump the state ---

def test_until_round_is_0_based_and_inclusive_and_dumps_the_server_state(sync_run, tmp_path):
    dump = tmp_path / "state.json"
    proc = replay(sync_run, "--until-round", 1, "--dump-state", dump)
    assert proc.returncode == 0, proc.stderr
    m = IDENTICAL.search(proc.stdout)
    assert m and int(m.group(2)) == 2, proc.stdout  # rounds 0 and 1
    assert "(rounds 0-1)" in proc.stdout
    assert int(m.group(1)) < len(index(sync_run))
    state = json.loads(dump.read_text())
    assert state["version"] == 2
    assert state["handler"]  # the algorithm's own state (FedProto's prototypes)
    first = replay(sync_run, "--until-round", 0)
    assert first.returncode == 0 and int(IDENTICAL.search(first.stdout).group(2)) == 1


# --- options: every one has help; combinations replay would ignore and rounds or clients
# the run does not have are one line, exit 2 ---

def test_every_replay_and_log_option_has_help():
    from fedbus.launch.cli import build_parser

    for command in ("replay", "log"):
        parser = build_parser(command)
        sub = next(a for a in parser._actions if a.dest == "command").choices[command]
        for action in sub._actions:
            if action.dest != "help":
                assert action.help and len(action.help) > 10, (command, action.dest)


@pytest.mark.parametrize("args, says", [
    (("--round", "1"), "--round needs --client"),
    (("--client", "1"), "--client needs --round"),
    (("--client", "1", "--round", "1", "--dump-state", "x.json"),
     "--dump-state is for server replay"),
    (("--client", "1", "--round", "1", "--until-round", "0"),
     "--until-round is for server replay"),
    (("--until-round", "3"), "--until-round 3: this run has rounds 0-2"),
    (("--client", "1", "--round", "7"), "--round 7: this run has rounds 0-2"),
    (("--client", "4", "--round", "0"), "--client 4: this run has clients 0-3"),
    (("--client", "-1", "--round", "0"), "--client -1: this run has clients 0-3"),
])
def test_refused_combinations_and_ranges_are_one_line(sync_run, args, says):
    proc = replay(sync_run, *args)
    assert proc.returncode == 2 and not proc.stdout, proc.stdout
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith(f"fedbus replay: {says}"), proc.stderr


# --- (h) the timeline ---

def _timeline(proc) -> list[str]:
    return [ln for ln in proc.stdout.splitlines() if not ln.startswith("round ")]


def test_log_filters_by_round_client_and_kind(sync_run):
    proc = fedbus("log", str(sync_run), "--round", "1", "--client", "2", "--kind", "update")
    lines = proc.stdout.splitlines()
    timeline = _timeline(proc)
    want = [e for e in index(sync_run)
            if e["round"] == 1 and e["kind"] == "update" and "c2" in (e["src"], e["dst"])]
    assert len(want) == 1 and len(timeline) == 1, proc.stdout
    fields = timeline[0].split()
    assert fields[1:5] == ["<-", "update", "c2", "r1"], timeline[0]
    seq = fields.index("seq")
    assert f"{want[0]['bytes']:,}" in fields and fields[seq + 1] == str(want[0]["seq"])
    assert fields[seq + 2:seq + 4] == ["task", f"{_task_of(sync_run, want[0])}:"]
    assert [ln for ln in lines if ln.startswith("round ")] == ["round 1: c2 answered"]


def _task_of(run, entry) -> int:
    rec = next(r for r in read_log(run) if r.index == entry["i"])
    return decode(rec.frames).body["task"]


def test_log_kinds_and_round_outcomes(sync_run, killed_node_run):
    proc = fedbus("log", str(sync_run), "--round", "0", "--kind", "task", "--kind", "eval")
    timeline = _timeline(proc)
    assert len(timeline) == 8  # 4 tasks and 4 evals
    assert all(ln.split()[1] == "->" and ln.split()[2] in ("task", "eval") and
               ln.split()[4] == "r0" for ln in timeline), proc.stdout
    assert "round 0: sampled 0,1,2,3  answered 0,1,2,3" in proc.stdout.splitlines()

    # who was dead: the killed node's client whose update it held, in the round it died;
    # the node's clients are not sampled after it
    proc = fedbus("log", str(killed_node_run), "--kind", "leave")
    outcomes = [ln for ln in proc.stdout.splitlines() if ln.startswith("round ")]
    assert outcomes == ["round 0: sampled 0,1,2,3  answered 0,1,3  dead: 2"] + \
        [f"round {r}: sampled 0,1  answered 0,1" for r in (1, 2, 3)], outcomes
    assert any("leave" in ln for ln in _timeline(proc))
    for client, first in ((2, "dead"), (3, "answered")):
        proc = fedbus("log", str(killed_node_run), "--client", str(client), "--outcomes-only")
        states = [ln.split(f": c{client} ")[1] for ln in proc.stdout.splitlines()]
        assert states == [first] + ["not sampled"] * 3, (client, proc.stdout)


def test_log_json_lines_are_the_index_with_a_summary(sync_run):
    proc = fedbus("log", str(sync_run), "--json", "--kind", "shutdown")
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]  # every line is JSON
    messages = [ln for ln in lines if "kind" in ln]
    assert [{k: v for k, v in m.items() if k != "summary"} for m in messages] == \
        [e for e in index(sync_run) if e["kind"] == "shutdown"]
    assert messages[0]["summary"] == {"reason": "run complete"}
    assert [ln["outcome"]["round"] for ln in lines if "outcome" in ln] == [0, 1, 2]


def test_a_run_recorded_before_a_config_key_existed_still_replays(sync_run, monkeypatch,
                                                                  tmp_path):
    """A key added to the schema after a run was recorded: the replayed server's config
    message carries it, the logged one does not. Replay compares the keys the run knew,
    so the run still replays identically, and a change to one of them is still caught."""
    from fedbus.algorithms.core.params import Opt
    from fedbus.analysis import replay as rp
    from fedbus.node import config as config_mod

    monkeypatch.setitem(config_mod.SCHEMA["train"], "added_since", Opt(3, "a key from later"))
    result = rp.replay_server(sync_run)
    assert result.divergence is None, result.divergence
    cfg, _ = rp.load_run(sync_run)
    assert cfg.train.added_since == 3  # the replayed server does have it
    altered = tmp_path / "altered"
    shutil.copytree(sync_run, altered)
    raw = json.loads((altered / "config.json").read_text())
    raw["train"]["lr"] = raw["train"]["lr"] * 2
    (altered / "config.json").write_text(json.dumps(raw))
    diverged = rp.replay_server(altered).divergence
    assert diverged is not None and diverged.field == "body.config.train.lr", diverged


def test_legacy_values_fill_only_keys_a_run_predates():
    from fedbus.analysis.replay import with_legacy_values

    old = {"train": {"lr": 0.1}, "algorithm": {"name": "fedavg-proto"}}
    filled = with_legacy_values(old)
    assert filled["train"]["optimizer_state"] == "persist"  # the behaviour it had
    assert filled["algorithm"]["proto_model"] == "local"
    assert filled["train"]["cohort"] == "off"  # one by one, as every client trained then
    assert "optimizer_state" not in old["train"]  # the input is not changed
    new = {"train": {"optimizer_state": "fresh"}, "algorithm": {"name": "fedproto"}}
    assert with_legacy_values(new)["train"]["optimizer_state"] == "fresh"
    assert "proto_model" not in with_legacy_values(new)["algorithm"]  # fedavg-proto's only
