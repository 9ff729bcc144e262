"""The engine end to end: real broker, server and node processes on loopback,
real training on scikit-learn's digits."""
from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
from helpers import (SMALL, Processes, fedbus, free_port, merged, metrics, run_federation,
                     straggler, wait_until, write_config)

from fedbus.node.server import read_checkpoint


def test_sync_federation_learns_and_writes_the_run_directory(tmp_path):
    run, summary = run_federation(tmp_path, SMALL)
    assert summary["algorithm"] == "fedavg"
    assert summary["rounds_completed"] == 3
    assert summary["final"]["acc_mean"] > 0.3  # chance is 0.1
    assert 0 <= summary["final"]["acc_std"] < 0.5
    assert summary["bytes_up"] > 0 and summary["bytes_down"] > summary["bytes_up"] / 10
    assert summary["params_up"] > 0
    recs = metrics(run)
    assert [r["round"] for r in recs] == [0, 1, 2]
    assert all(r["updates"] == 6 and r["failed"] == 0 for r in recs)
    assert all(len(r["per_client"]) == 6 for r in recs)
    for name in ("config.json", "metrics.csv", "messages.bin", "messages.jsonl",
                 "checkpoint.fbk", "logs/server.jsonl", "logs/broker.jsonl"):
        assert (run / name).exists(), name
    assert json.loads((run / "config.json").read_text())["federation"]["clients"] == 6
    first_log_line = (run / "logs/server.jsonl").read_text().splitlines()[0]
    assert "event" in json.loads(first_log_line)


def test_partial_participation_samples_a_fraction(tmp_path):
    cfg = merged(SMALL, federation={"fraction": 0.5, "rounds": 3})
    run, summary = run_federation(tmp_path, cfg)
    recs = metrics(run)
    assert summary["rounds_completed"] == 3
    assert all(r["sampled"] == 3 and r["updates"] == 3 for r in recs)
    # seeded sampling picks different clients over rounds
    assert len({tuple(r["participants"]) for r in recs}) > 1


def test_async_mode_aggregates_every_buffer(tmp_path):
    # Which updates fill which buffer depends on timing, and so does what five buffers of
    # two learn (0.12-0.32 over six runs with both nodes started at once); ten learn
    # 0.37-0.61, clear of chance whatever the interleaving.
    cfg = merged(SMALL, federation={"mode": "async", "concurrency": 4, "buffer": 2,
                                    "rounds": 10, "eval_every": 10}, train={"epochs": 3})
    run, summary = run_federation(tmp_path, cfg)
    recs = metrics(run)
    assert summary["rounds_completed"] == 10
    assert [r["version"] for r in recs] == list(range(1, 11))  # one line per aggregation
    assert ["acc_mean" in r for r in recs] == [False] * 9 + [True]  # evaluated every 10th
    assert all(r["updates"] == 2 for r in recs)
    assert summary["final"]["acc_mean"] > 0.2  # chance is 0.1


def test_straggler_misses_its_rounds_and_is_folded_with_staleness_weight(tmp_path):
    run, summary = run_federation(tmp_path, merged(straggler(SMALL), federation={"rounds": 4}))
    recs = metrics(run)
    assert summary["rounds_completed"] == 4
    assert [r["failures"] for r in recs] == [{"2": "late"}] * 4
    # client 2 takes part from round 1 on through its folded update only
    assert [r["participants"] for r in recs] == [[0, 1, 3, 4, 5]] + [[0, 1, 2, 3, 4, 5]] * 3
    # each round folds the straggler's update of the round before, with staleness 1
    assert [r["stale"] for r in recs] == [[]] + [[[2, v, 1, pytest.approx(1 / math.sqrt(2))]]
                                                 for v in range(3)]
    assert summary["late_folded"] == 3


def test_straggler_update_is_dropped_with_drop_policy(tmp_path):
    run, summary = run_federation(tmp_path, straggler(SMALL, late="drop"))
    recs = metrics(run)
    assert [r["failures"] for r in recs] == [{"2": "late"}] * 3
    assert all(r["folded"] == 0 for r in recs)
    # rounds 0 and 1's updates arrive late; round 2's is held past the end of the run
    assert summary["late_dropped"] == 2 and summary["late_folded"] == 0


def _global_weights(run) -> dict:
    _raw, state = read_checkpoint(run / "checkpoint.fbk")
    return state["handler"]


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}.{k}")
    elif isinstance(tree, np.ndarray):
        yield prefix, tree


def test_async_with_full_buffer_equals_sync_fedavg(tmp_path):
    sync_cfg = merged(SMALL, federation={"rounds": 2})
    async_cfg = merged(SMALL, federation={"rounds": 2, "mode": "async", "concurrency": 6,
                                          "buffer": 6})
    sync_run, _ = run_federation(tmp_path, sync_cfg, name="sync")
    async_run, _ = run_federation(tmp_path, async_cfg, name="async")
    a, b = dict(_flat(_global_weights(sync_run))), dict(_flat(_global_weights(async_run)))
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert np.allclose(a[key], b[key], atol=1e-5, rtol=0), key


def _manual_federation(tmp_path, sections, liveness: int = 4):
    port = free_port()
    broker = f"tcp://127.0.0.1:{port}"
    cfg = write_config(tmp_path / "cfg.toml", sections)
    run = tmp_path / "run"
    procs = Processes(tmp_path)
    procs.start("broker", "broker", "--bind", broker, "--heartbeat-s", "0.3",
                "--liveness", str(liveness))
    return broker, cfg, run, procs


def test_killed_client_node_is_dropped_and_a_restarted_node_rejoins(tmp_path):
    """Node-1 (clients 3-5) is SIGKILLed mid-run: its clients' tasks of the open round fail
    as dead and the round closes on node-0's clients alone; the run then waits for all six
    (min_clients), so the restarted node rejoins and takes part, on any machine."""
    # Events, not timing: client 3's node holds its update until the next round's task
    # (system.hold_clients), so at any moment of the run the open round has an unanswered
    # task on node-1 (a round ends once the other five have answered, federation.quorum,
    # c3 late: no deadline a loaded machine's honest clients could miss), and no
    # evaluation between rounds leaves a gap
    sections = merged(SMALL, federation={"rounds": 4, "min_clients": 6, "quorum": 5,
                                         "eval_every": 100},
                      system={"hold_clients": [3]}, bus={"liveness": 10})
    # 3 s of silence before a purge (not 1.2): a loaded machine can stall a live node that
    # long, and the test is about the killed one
    broker, cfg, run, procs = _manual_federation(tmp_path, sections, liveness=10)
    node_args = ("--heartbeat-s", "0.3", "--liveness", "10")
    try:
        procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
        procs.start("node-0", "node", "--broker", broker, "--clients", "0-2", "--name", "n0",
                    *node_args)
        procs.start("node-1", "node", "--broker", broker, "--clients", "3-5", "--name", "n1",
                    *node_args)
        wait_until(lambda: (run / "metrics.jsonl").exists() and len(metrics(run)) >= 1, 120,
                   "the first round", interval=0.002)
        # SIGKILL mid-federation, the server stopped meanwhile: n1 dies in round 1 (or in
        # round 2, should round 1 have had all the answers it waits for), on any machine
        server = procs.procs["server"]
        server.send_signal(signal.SIGSTOP)
        try:
            assert len(metrics(run)) == 1, "the server ran past round 1 before it was stopped"
            procs.kill("node-1")
        finally:
            server.send_signal(signal.SIGCONT)
        wait_until(lambda: any("dead" in r["failures"].values() for r in metrics(run)), 60,
                   "a round without node-1")
        procs.start("node-1b", "node", "--broker", broker, "--clients", "3-5", "--name", "n1",
                    *node_args)
        wait_until(lambda: procs.procs["server"].poll() is not None, 240, "the run to finish")
        assert procs.procs["server"].returncode == 0, procs.log("server")
        summary = json.loads((run / "summary.json").read_text())
        recs = metrics(run)
        assert summary["rounds_completed"] == 4
        dead = [r for r in recs if "dead" in r["failures"].values()]
        # closed on node-0's clients (and any of c4, c5 that had answered before the kill)
        assert len(dead) == 1 and dead[0]["round"] in (1, 2), recs
        assert {0, 1, 2} <= set(dead[0]["participants"]) <= {0, 1, 2, 4, 5}, dead[0]
        assert dead[0]["failures"]["3"] == "dead", dead[0]["failures"]
        assert set(dead[0]["failures"]) <= {"3", "4", "5"}, dead[0]["failures"]
        after = recs[recs.index(dead[0]) + 1:]
        assert after and all({4, 5} <= set(r["participants"]) for r in after), \
            "node-1's clients came back"
        server_log = (run / "logs/server.jsonl").read_text()
        assert "leave" in server_log
        assert sum('"node_ready"' in line and '"n1"' in line
                   for line in server_log.splitlines()) >= 2  # and again after the restart
    finally:
        procs.close()


def _checkpoint_version(run) -> int:
    try:
        return read_checkpoint(run / "checkpoint.fbk")[1]["version"]
    except (OSError, ValueError):  # not written yet
        return 0


def test_server_killed_and_resumed_finishes_every_round(tmp_path):
    """The server is SIGKILLed after round 1's record and the checkpoint after it exist:
    stopped first (SIGSTOP) and the two facts, and the rounds still to run, read again, so
    they hold at the kill whatever the machine's speed; `fedbus server --resume` then runs
    the rest, every round recorded."""
    rounds = 6
    sections = merged(SMALL, federation={"rounds": rounds})
    broker, cfg, run, procs = _manual_federation(tmp_path, sections)

    def two_rounds_kept() -> bool:
        return (run / "metrics.jsonl").exists() and len(metrics(run)) >= 2 \
            and _checkpoint_version(run) >= 2

    try:
        server = procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
        procs.start("node-0", "node", "--broker", broker, "--clients", "0-2", "--name", "n0")
        procs.start("node-1", "node", "--broker", broker, "--clients", "3-5", "--name", "n1")
        wait_until(two_rounds_kept, 120, "round 1's record and checkpoint", interval=0.002)
        server.send_signal(signal.SIGSTOP)
        assert two_rounds_kept()
        done_before = len(metrics(run))
        assert done_before < rounds, "the run ended before the server could be stopped"
        procs.kill("server")
        procs.start("server2", "server", "--broker", broker, "--resume", str(run))
        wait_until(lambda: procs.procs["server2"].poll() is not None, 240, "the resumed run")
        assert procs.procs["server2"].returncode == 0, procs.log("server2")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["rounds_completed"] == rounds
        recorded = [r["round"] for r in metrics(run)]
        assert recorded[-1] == rounds - 1 and set(range(rounds)) <= set(recorded)
        log = [json.loads(line) for line in (run / "logs/server.jsonl").read_text().splitlines()]
        resumed = [rec["version"] for rec in log if rec.get("event") == "resumed"]
        assert resumed and resumed[0] >= 2, resumed  # from the checkpoint, not from scratch
    finally:
        procs.close()


def test_a_server_killed_after_its_last_checkpoint_resumes_to_a_clean_end(tmp_path):
    """The chaos storm's hang (CI, 2026-11-27): a server killed after the final round's
    checkpoint but before it exited (no summary.json yet), resumed, waited forever for
    rounds there were none of. It now finishes at once, writing the summary, and sends the
    shutdown again: a node that missed the first (the broker was down) leaves; the message
    log, with the resume, replays identically."""
    sections = merged(SMALL, federation={"rounds": 2})
    broker, cfg, run, procs = _manual_federation(tmp_path, sections)
    try:
        procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
        procs.start("node-0", "node", "--broker", broker, "--clients", "0-5", "--name", "n0")
        wait_until(lambda: procs.procs["server"].poll() is not None, 240, "the run")
        assert procs.procs["server"].returncode == 0, procs.log("server")
        wait_until(lambda: procs.procs["node-0"].poll() is not None, 60, "node-0 leaving")
        first = json.loads((run / "summary.json").read_text())
        (run / "summary.json").unlink()  # what a kill before ServerNode._finish leaves

        procs.start("node-1", "node", "--broker", broker, "--clients", "0-5", "--name", "n1")
        wait_until(lambda: "registered" in procs.log("node-1"), 60, "node-1 registered")
        procs.start("server2", "server", "--broker", broker, "--resume", str(run))
        wait_until(lambda: procs.procs["server2"].poll() is not None, 60, "the resumed server")
        assert procs.procs["server2"].returncode == 0, procs.log("server2")
        again = json.loads((run / "summary.json").read_text())
        assert again["rounds_completed"] == first["rounds_completed"] == 2
        assert again["final"] == first["final"]
        assert [r["round"] for r in metrics(run)] == [0, 1]  # no round ran twice
        wait_until(lambda: procs.procs["node-1"].poll() is not None, 60,
                   "node-1 leaving on the resent shutdown")
        out = fedbus("replay", str(run))
        assert "replay identical" in out.stdout, out.stdout + out.stderr
    finally:
        procs.close()


def test_the_last_checkpoint_is_on_disk_before_the_shutdown_leaves(tmp_path, monkeypatch):
    """A server killed after its shutdown went out but before its last checkpoint would
    resume to rerun a round whose nodes had left. The server (in this process, on a real
    broker with a real node) sends the shutdown only once the final checkpoint is written:
    its Peer, watched, finds the checkpoint at the last version at that moment."""
    from fedbus.node import server as server_mod
    from fedbus.node.config import load_config

    sections = merged(SMALL, federation={"rounds": 2})
    broker, cfg, run, procs = _manual_federation(tmp_path, sections)
    versions_at_shutdown = []

    class WatchedPeer(server_mod.Peer):
        def send(self, kind, *args, **kw):
            if kind == "shutdown":
                versions_at_shutdown.append(
                    read_checkpoint(run / "checkpoint.fbk")[1]["version"])
            return super().send(kind, *args, **kw)

    monkeypatch.setattr(server_mod, "Peer", WatchedPeer)
    try:
        procs.start("node-0", "node", "--broker", broker, "--clients", "0-5", "--name", "n0")
        assert server_mod.ServerNode(load_config(cfg), run, broker).serve() == 0
        assert versions_at_shutdown == [2]
        wait_until(lambda: procs.procs["node-0"].poll() is not None, 60, "node-0 leaving")
    finally:
        procs.close()


def test_bad_config_fails_fast_with_the_key_named(tmp_path):
    from helpers import fedbus

    cfg = write_config(tmp_path / "bad.toml", {"federation": {"roundz": 3}})
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "r"), check=False)
    assert proc.returncode == 2
    assert "unknown key federation.roundz" in proc.stderr


def test_evicting_clients_to_disk_does_not_change_the_results(tmp_path):
    # FedProto clients keep local models between rounds: evicting them (a memory budget
    # that holds one client per node) and restoring must give bit-identical prototypes.
    base = merged(SMALL, algorithm={"name": "fedproto"}, federation={"rounds": 3})
    resident, _ = run_federation(tmp_path, base, name="resident")
    evicted, _ = run_federation(
        tmp_path, merged(base, launch={"node_memory_mb": 0.01, "evict_to": "disk"}), name="evicted")
    a, b = _global_weights(resident), _global_weights(evicted)
    assert np.array_equal(a["protos"], b["protos"]) and a["protos"].any()
    assert [r["per_client"] for r in metrics(resident)] == \
        [r["per_client"] for r in metrics(evicted)]


def test_size_sampling_draws_clients_in_proportion_to_their_data():
    """federation.sampling = "size" (FedProx's and Michieli & Ozay's Alg. 1 line 3): a
    client with more training data is sampled more often; the draws are seeded."""
    from fedbus.node.config import build_config
    from fedbus.node.server import build_engine

    def engine(sampling, seed=0):
        cfg = build_config(merged(SMALL, federation={"clients": 20, "seed": seed,
                                                     "sampling": sampling},
                                  data={"partition": "powerlaw", "powerlaw_sigma": 1.5}))
        return build_engine(cfg, "r")

    eng = engine("size")
    clients = list(range(20))
    sizes = np.array([eng.train_sizes[c] for c in clients], dtype=float)
    counts = {name: np.zeros(20) for name in ("size", "uniform")}
    for name, e in (("size", eng), ("uniform", engine("uniform"))):
        for _ in range(3000):
            picked = e._sample(clients, 2)
            assert len(set(picked)) == 2 and picked == sorted(picked)
            counts[name][picked] += 1
    big, small = np.argsort(sizes)[-3:], np.argsort(sizes)[:3]
    assert counts["size"][big].sum() > 3 * counts["size"][small].sum()
    assert np.corrcoef(sizes, counts["size"])[0, 1] > 0.8
    assert abs(np.corrcoef(sizes, counts["uniform"])[0, 1]) < 0.5
    assert counts["uniform"].min() > 0.5 * counts["uniform"].mean()
    a, b = engine("size", seed=3), engine("size", seed=3)
    assert [a._sample(clients, 5) for _ in range(20)] == [b._sample(clients, 5) for _ in range(20)]
