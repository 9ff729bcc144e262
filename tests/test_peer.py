"""The node runtime (Peer) against a real broker subprocess: duplicates, acks, resends after
reconnecting, heartbeats from the I/O thread while the application thread is busy."""
from __future__ import annotations

import time

import pytest
import zmq
from conftest import free_port, wait_for

from fedbus.broker import wire
from fedbus.broker.peer import Peer, PeerError
from fedbus.broker.wire import Message


def recv_kind(peer: Peer, kind: str, timeout: float = 30.0, others: list | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = peer.recv(max(0.0, deadline - time.monotonic()))
        if m is None:
            continue
        if m.kind == kind:
            return m
        if others is not None:
            others.append(m)
    raise AssertionError(f"no {kind!r} within {timeout} s")


def raw_client(ctx, endpoint: str, name: str, clients: list[str]) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, name.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    s.send_multipart(wire.encode(Message(
        "register", name, "broker", {"role": "client", "node": name, "clients": clients})))
    assert s.poll(30_000)
    assert wire.decode(s.recv_multipart()).kind == "ready"
    return s


def test_duplicates_are_dropped_by_src_inc_seq_and_acked(ipc_endpoint, broker_proc):
    broker_proc(ipc_endpoint)
    server = Peer(ipc_endpoint, "srv", role="server")
    server.start(60)
    ctx = zmq.Context()
    raw = raw_client(ctx, ipc_endpoint, "raw", ["c0", "c1"])
    A, B = 111, 222
    sends = [("c0", A, 1), ("c0", A, 2), ("c0", A, 1), ("c0", A, 2), ("c1", A, 1),
             ("c0", B, 1), ("c0", A, 3), ("c0", A, 3), ("c1", A, 1)]
    for src, inc, seq in sends:
        raw.send_multipart(wire.encode(Message("update", src, "server", {"k": [src, inc, seq]},
                                               seq=seq, inc=inc, ts=time.time())))
    got = []
    while len(got) < 5:
        m = recv_kind(server, "update")
        got.append((m.src, m.inc, m.seq))
        assert m.body["k"] == [m.src, m.inc, m.seq]
    assert got == [("c0", A, 1), ("c0", A, 2), ("c1", A, 1), ("c0", B, 1), ("c0", A, 3)]
    # nothing else comes through: a fresh update sent after them is the next one delivered
    raw.send_multipart(wire.encode(Message("update", "c1", "server", {"k": "end"}, seq=2,
                                           inc=A, ts=time.time())))
    assert recv_kind(server, "update").body == {"k": "end"}
    assert server.n_duplicates == 4

    # every copy is acknowledged (duplicates too): a server sends one ack per client node,
    # to the node's name, its entries naming each src address the node hosts
    acked: dict[tuple[str, int], set[int]] = {}
    deadline = time.monotonic() + 10
    want = {("c0", A): {1, 2, 3}, ("c0", B): {1}, ("c1", A): {1, 2}}
    while acked != want and time.monotonic() < deadline:
        if not raw.poll(200):
            continue
        m = wire.decode(raw.recv_multipart())
        if m.kind != "ack":
            continue
        assert m.src == "server" and m.seq == 0
        assert m.dst == "raw"
        for src, inc, first, last in m.body["acks"]:
            assert src in ("c0", "c1")
            acked.setdefault((src, inc), set()).update(range(first, last + 1))
    assert acked == want
    raw.close()
    ctx.term()
    server.close()


def test_messages_sent_before_start_and_acks_empty_the_resend_buffer(tcp_endpoint,
                                                                      broker_proc):
    broker_proc(tcp_endpoint)
    server = Peer(tcp_endpoint, "srv", role="server")
    server.start(60)
    node = Peer(tcp_endpoint, "n1", role="client", addresses=["c0"])
    early = [node.send("update", "server", {"i": i}) for i in range(5)]  # not started yet
    assert [m.seq for m in early] == [1, 2, 3, 4, 5] and all(m.frames for m in early)
    assert node.unacked_count == 5
    node.start(60)
    got = [recv_kind(server, "update").body["i"] for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    wait_for(lambda: node.unacked_count == 0, 60, message="acks for the early messages")
    assert node.connected
    node.close()
    server.close()


def test_resend_after_reconnect_exactly_once(broker_proc):
    ep = f"tcp://127.0.0.1:{free_port()}"
    hb = 0.2
    broker = broker_proc(ep, heartbeat_s=hb, liveness=3)
    kw = {"heartbeat_s": hb, "liveness": 3, "backoff_initial_s": 0.2, "backoff_max_s": 1.0}
    server = Peer(ep, "srv", role="server", **kw)
    server.start(60)
    node = Peer(ep, "n1", role="client", addresses=["c0", "c1"], **kw)
    node.start(60)
    recv_kind(server, "join")
    node.send("update", "server", {"i": -1}, src="c0")
    assert recv_kind(server, "update").body == {"i": -1}

    broker.kill()
    wait_for(lambda: not node.connected and not server.connected, 30,
             message="both peers notice the broker is gone")
    for i in range(20):
        node.send("update", "server", {"i": i}, src=f"c{i % 2}")
    for j in range(10):
        server.send("task", f"c{j % 2}", {"j": j})
    assert node.unacked_count >= 20 and server.unacked_count >= 10
    broker.start()

    ups, tasks = [], []
    deadline = time.monotonic() + 60
    while (len(ups) < 20 or len(tasks) < 10) and time.monotonic() < deadline:
        m = server.recv(0.1)
        if m is not None and m.kind == "update":
            ups.append(m.body["i"])
        m = node.recv(0.1)
        if m is not None and m.kind == "task":
            tasks.append(m.body["j"])
    assert sorted(ups) == list(range(20))
    assert sorted(tasks) == list(range(10))
    assert node.n_reconnects >= 1 and server.n_reconnects >= 1
    wait_for(lambda: node.unacked_count == 0 and server.unacked_count == 0, 30,
             message="all acknowledged")
    # nothing more arrives (no duplicates): once all is acknowledged nothing is resent, and
    # a message sent now comes through behind any resend still on its way
    node.send("update", "server", {"i": "end"}, src="c0")
    server.send("task", "c0", {"j": "end"})
    assert recv_kind(server, "update").body == {"i": "end"}
    assert recv_kind(node, "task").body == {"j": "end"}
    assert node.connected and server.connected
    node.close()
    server.close()


# A client node whose application thread waits (the GIL released), then spins in pure
# Python (holding it), each for as long as its I/O thread takes to send `beats` heartbeats:
# at least (beats - 1) x heartbeat_s apart, so each phase outlasts the broker's silence
# limit by the node's own heartbeats, not by a number of seconds that a slow machine would
# make too short. The node must stay registered because heartbeats come from the I/O thread.
BUSY_NODE = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
from fedbus.broker.log import configure_logging
from fedbus.broker.peer import Peer
configure_logging(level="info", console=False)
p = Peer(cfg["endpoint"], "busy", role="client", addresses=["c9"], heartbeat_s=cfg["hb"],
         liveness=cfg["liveness"])
beats = [0]
send_control = p._send_control
def counted(kind, *args, **kw):
    beats[0] += kind == "heartbeat"
    return send_control(kind, *args, **kw)
p._send_control = counted
p.start(60)
print(json.dumps({"event": "ready"}), flush=True)
until = beats[0] + cfg["beats"]
while beats[0] < until:             # e.g. waiting on a GPU
    time.sleep(0.01)
until, x = beats[0] + cfg["beats"], 0
while beats[0] < until:             # holding the GIL in Python code
    x += 1
p.send("update", "server", {"alive": True, "spins": x, "beats": beats[0]})
print(json.dumps({"event": "sent"}), flush=True)
m = p.recv(60)
p.close(2)
print(json.dumps({"event": "closed"}), flush=True)
"""


def test_heartbeats_continue_while_the_app_thread_is_busy(tcp_endpoint, broker_proc, spawn_py):
    # silence limit 2 s: no scheduler stall of a live process on a loaded machine reaches it;
    # each busy phase lasts liveness + 2 heartbeats, (liveness + 1) x 0.2 s at the least
    hb, liveness = 0.2, 10
    broker = broker_proc(tcp_endpoint, heartbeat_s=hb, liveness=liveness)
    server = Peer(tcp_endpoint, "srv", role="server", heartbeat_s=hb, liveness=liveness)
    server.start(60)
    proc = spawn_py(BUSY_NODE, {"endpoint": tcp_endpoint, "hb": hb, "liveness": liveness,
                                "beats": liveness + 2}, name="busy")
    proc.expect("ready", timeout=60)
    recv_kind(server, "join")
    others: list[Message] = []
    m = recv_kind(server, "update", timeout=120, others=others)
    assert m.src == "c9" and m.body["alive"] is True and m.body["spins"] > 0
    assert m.body["beats"] >= 2 * (liveness + 2)
    assert not [o for o in others if o.kind == "leave"], others
    assert broker.events("node purged") == []
    server.send("shutdown", "busy", None)
    proc.expect("closed", timeout=60)
    server.close()


def test_unroutable_error_is_delivered_and_clears_the_resend_buffer(tcp_endpoint, broker_proc):
    broker_proc(tcp_endpoint, grace_s=0)
    server = Peer(tcp_endpoint, "srv", role="server")
    server.start(60)
    sent = server.send("task", "nobody", {"x": 1}, round=4)
    e = recv_kind(server, "error")
    assert e.src == "broker" and e.dst == "server"
    assert e.body["code"] == "unroutable" and e.body["dst"] == "nobody"
    assert e.body["seq"] == sent.seq and e.body["kind"] == "task"
    wait_for(lambda: server.unacked_count == 0, 60, message="the refused message forgotten")
    server.close()


def test_start_fails_cleanly(tcp_endpoint, broker_proc):
    # nobody listening
    lonely = Peer(f"tcp://127.0.0.1:{free_port()}", "n", role="client", addresses=["c0"])
    with pytest.raises(PeerError, match="no answer"):
        lonely.start(timeout=1.0)
    with pytest.raises(PeerError, match="cannot connect"):
        Peer("bogus://nowhere", "n", role="client", addresses=["c0"]).start(30)
    # refused: a second server, a client id already taken
    broker_proc(tcp_endpoint)
    s1 = Peer(tcp_endpoint, "srv1", role="server")
    s1.start(60)
    with pytest.raises(PeerError, match="conflict"):
        Peer(tcp_endpoint, "srv2", role="server").start(30)
    n1 = Peer(tcp_endpoint, "n1", role="client", addresses=["c0"])
    n1.start(60)
    with pytest.raises(PeerError, match="conflict"):
        Peer(tcp_endpoint, "n2", role="client", addresses=["c0", "c1"]).start(30)
    # local misuse is caught before anything is sent
    with pytest.raises(ValueError):
        n1.send("update", "c5", {})  # a client node may address only the server
    with pytest.raises(ValueError):
        n1.send("update", "server", {}, src="c1")  # not hosted here
    with pytest.raises(ValueError):
        n1.send("heartbeat", "server", None)  # the runtime's own kind
    with pytest.raises(wire.WireError):
        n1.send("update", "server", {"x": object()})
    n1.close()
    s1.close()


# ---------------------------------------------------------------------------- bounded state
def _drain(sock: zmq.Socket) -> int:
    """Read and drop whatever arrived on a raw socket (acks); how many messages."""
    n = 0
    while sock.poll(0):
        sock.recv_multipart(copy=False)
        n += 1
    return n


def _heartbeat(sock: zmq.Socket, name: str) -> None:
    sock.send_multipart(wire.encode(Message("heartbeat", name, "broker", None)))


def test_duplicate_table_stays_bounded_under_fresh_incarnations(ipc_endpoint, broker_proc):
    """Issue 30, hole 10: an authenticated client sends tiny updates, each with a new `inc`
    (200k of them held +241 MB in the server before); the receiving Peer must not remember
    them all, and must still drop a true duplicate -- of a sender that keeps its
    incarnation through the flood, and of the flood's latest message. 50k updates (paced
    under the broker's per-node message rate) against at most 8 pairs a source show the
    bound; then the bound on all pairs together."""
    broker_proc(ipc_endpoint)
    server = Peer(ipc_endpoint, "srv", role="server", dedup_max_seqs=1000)
    assert (server.dedup_incs_per_src, server.dedup_max_keys, server.dedup_ttl_s) == \
        (8, 65_536, 3600)
    assert Peer(ipc_endpoint, "x", role="server").dedup_max_seqs == 1 << 20
    server.start(60)
    ctx = zmq.Context()
    srcs = [f"c{i}" for i in range(10)]
    raw = raw_client(ctx, ipc_endpoint, "raw", srcs + ["steady"])
    body = wire.encode_body({"x": 1})
    N, batch = 50_000, 1_000
    LIVE = 424242  # "steady" keeps one incarnation and counts its seqs up through the flood
    live_seq = sent = 0

    def delivered(n: int) -> None:
        deadline = time.monotonic() + 60
        while server.n_received < n and time.monotonic() < deadline:
            _drain(raw)
            while server.recv(0) is not None:
                pass
            time.sleep(0.005)
        assert server.n_received == n, (server.n_received, n)
        while server.recv(0) is not None:
            pass

    try:
        t0 = time.monotonic()
        while sent < N:
            t_batch = time.monotonic()
            for i in range(sent, sent + batch):
                raw.send(wire.encode_header("update", srcs[i % 10], "server", seq=1,
                                            inc=1_000_000 + i), zmq.SNDMORE)
                raw.send(body)
            live_seq += 1
            raw.send_multipart([wire.encode_header("update", "steady", "server", seq=live_seq,
                                                   inc=LIVE), body])
            _heartbeat(raw, "raw")
            sent += batch
            delivered(sent + live_seq)
            # the bound holds all along: 8 incarnations a source, the steady one among them
            assert server.dedup_keys <= 10 * 8 + 1
            assert all(len(incs) <= 8 for incs in server._seen_incs.values())
            assert LIVE in server._seen_incs["steady"]
            time.sleep(max(0.0, t_batch + batch / 10_000 - time.monotonic()))
        elapsed = time.monotonic() - t0
        assert server.n_duplicates == 0
        assert server.n_dedup_evicted >= N - 80
        assert server._seen_seqs == 0  # contiguous seqs leave nothing above the watermarks
        # true duplicates are still dropped: the steady sender's recent seqs, and the
        # flood's latest message (its pair is among the most recently used)
        for src, inc, seq in (("steady", LIVE, live_seq), ("steady", LIVE, live_seq - 5),
                              (srcs[(N - 1) % 10], 1_000_000 + N - 1, 1)):
            raw.send_multipart([wire.encode_header("update", src, "server", seq=seq, inc=inc),
                                body])
        wait_for(lambda: server.n_duplicates == 3, 30, message="three duplicates dropped")
        # and nothing else came through: a fresh update sent after them is the next one
        raw.send_multipart([wire.encode_header("update", srcs[1], "server", seq=1,
                                               inc=3_000_000), wire.encode_body({"end": 1})])
        end = recv_kind(server, "update")
        assert (end.src, end.inc, end.body) == (srcs[1], 3_000_000, {"end": 1})
        assert server.n_received == N + live_seq + 1

        # gaps (seqs that went elsewhere, or made up) are held above the watermark up to
        # dedup_max_seqs in all; the sender that makes them pays: its watermark moves on
        base = live_seq
        for k in range(1, 1501):
            raw.send_multipart([wire.encode_header("update", "steady", "server",
                                                   seq=base + 2 * k, inc=LIVE), body])
            if k % 500 == 0:
                _heartbeat(raw, "raw")
                delivered(N + live_seq + 1 + k)
                assert server._seen_seqs <= 1000
        raw.send_multipart([wire.encode_header("update", "steady", "server",
                                               seq=base + 3000, inc=LIVE), body])
        wait_for(lambda: server.n_duplicates == 4, 30, message="a gapped duplicate dropped")

        # many sources (a node may host many addresses): dedup_max_keys bounds them all,
        # least recently used first
        server.dedup_max_keys = 32
        got = server.n_received
        for i in range(3000):
            raw.send_multipart([wire.encode_header("update", srcs[i % 10], "server", seq=1,
                                                   inc=2_000_000 + i), body])
            if i % 500 == 499:
                _heartbeat(raw, "raw")
                delivered(got + i + 1)
                assert server.dedup_keys <= 32
        print(f"{N} fresh incarnations in {elapsed:.1f} s")
    finally:
        raw.close()
        ctx.term()
        server.close()


def test_duplicate_state_of_silent_sources_ages_out(ipc_endpoint, broker_proc):
    broker_proc(ipc_endpoint)
    # a TTL no machine outruns while the state is checked, then lowered (and a sweep made
    # due) to watch it age out: whether it is seen before it ages never rests on speed
    server = Peer(ipc_endpoint, "srv", role="server", dedup_ttl_s=3600)
    server.start(60)
    ctx = zmq.Context()
    raw = raw_client(ctx, ipc_endpoint, "raw", ["c0", "c1"])
    try:
        for src, inc, seq in (("c0", 5, 1), ("c0", 5, 2), ("c0", 5, 4), ("c1", 6, 1)):
            raw.send_multipart(wire.encode(Message("update", src, "server", {}, seq=seq,
                                                   inc=inc)))
        wait_for(lambda: server.n_received == 4, 30, message="four updates")
        assert server.dedup_keys == 2 and server._seen_seqs == 1  # c0's 4 waits above 2
        server.dedup_ttl_s, server._next_seen_sweep = 0.5, 0.0
        wait_for(lambda: server.dedup_keys == 0, 30, message="silent pairs forgotten")
        assert server._seen_seqs == 0 and server._seen_incs == {}
        assert server.n_dedup_evicted == 0  # aged out, not pushed out
    finally:
        raw.close()
        ctx.term()
        server.close()


def test_resend_buffer_to_a_destination_that_never_acks_is_capped(ipc_endpoint, broker_proc):
    """Issue 30, hole 11: a node that registers again and again and never acknowledges made
    the server keep (and resend every resend_s) every config sent to it: +177 MB for 20k,
    rounds/s 16 -> 9.5. Per destination the server now keeps the newest
    max_unacked_per_dst, drops the oldest, counts them and logs once per destination; a
    destination that acknowledges is unaffected."""
    from structlog.testing import capture_logs

    assert Peer(ipc_endpoint, "s", role="server").max_unacked_per_dst == 1024
    assert Peer(ipc_endpoint, "n", role="client", addresses=["c"]).max_unacked_per_dst == \
        100_000  # a client node's one destination, the server: bounded by max_unacked
    broker_proc(ipc_endpoint)
    ctx = zmq.Context()
    good = None
    with capture_logs() as logs:
        server = Peer(ipc_endpoint, "srv", role="server", max_unacked_per_dst=50, resend_s=0.4)
        try:
            server.start(60)
            mute = raw_client(ctx, ipc_endpoint, "mute", ["c0"])
            good = Peer(ipc_endpoint, "good", role="client", addresses=["c1"])
            good.start(60)
            joined = set()
            while joined != {"mute", "good"}:
                joined.add(recv_kind(server, "join").body["node"])
            to_c0 = [server.send("task", "c0", {"i": i}).seq for i in range(300)]
            to_mute = [server.send("config", "mute", {"i": i}).seq for i in range(120)]
            # (the cap counts what is unacknowledged: a burst to c1 stays under it)
            to_c1 = [server.send("task", "c1", {"i": i}).seq for i in range(40)]
            got = [recv_kind(good, "task").body["i"] for _ in range(40)]
            assert got == list(range(40))
            wait_for(lambda: server.unacked_for("c1") == 0, 30, message="c1's acks")
            assert server.unacked_for("c0") == 50 and server.unacked_for("mute") == 50
            assert server.unacked_count == 100
            assert server.n_unacked_dropped == 250 + 70
            # the mute node got everything once; resends (every 0.4 s) are of the newest 50
            # to each of its destinations only: read until all arrived and resends came
            # (the wait only a liveness guard)
            seen: dict[int, int] = {}
            deadline = time.monotonic() + 60

            def all_and_resends() -> bool:
                return set(to_c0 + to_mute) <= set(seen) and any(k > 1 for k in seen.values())

            while not all_and_resends() and time.monotonic() < deadline:
                if mute.poll(100):
                    m = wire.decode(mute.recv_multipart())
                    if m.kind in ("task", "config"):
                        seen[m.seq] = seen.get(m.seq, 0) + 1
                _heartbeat(mute, "mute")
            assert set(to_c0 + to_mute) <= set(seen)
            resent = {s for s, k in seen.items() if k > 1}
            assert resent and resent <= set(to_c0[-50:] + to_mute[-50:])
            assert not set(to_c1) & set(seen)
        finally:
            if good is not None:
                good.close()
            server.close()
            ctx.destroy(0)
    drops = [e for e in logs if e["event"].startswith("destination does not acknowledge")]
    assert sorted(e["dst"] for e in drops) == ["c0", "mute"], drops  # once per destination
    assert all(e["log_level"] == "warning" and e["max_per_dst"] == 50 for e in drops)
