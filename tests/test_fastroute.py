"""The broker's C fast path (broker/_fastroute.c) against its Python loop: one stream of
messages, good and bad, through a real Broker on loopback each way must give the same
deliveries, in the same order, and the same counters. Raw DEALER sockets send exact frames."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq
from conftest import require_fast_path
from helpers import wait_until

from fedbus.broker import wire
from fedbus.broker.broker import Broker
from fedbus.broker.wire import Message

MAX_FRAME = 64 * 1024
N_FLOOD = 1600


@pytest.fixture(scope="module", autouse=True)
def built():
    require_fast_path()


def dealer(ctx, endpoint: str, name: str, rcvhwm: int | None = None) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, name.encode())
    s.setsockopt(zmq.LINGER, 0)
    if rcvhwm is not None:
        s.setsockopt(zmq.RCVHWM, rcvhwm)
        s.setsockopt(zmq.RCVBUF, 64 * 1024)
    s.connect(endpoint)
    return s


def recv_through(sock, last: bytes, timeout: float = 120.0) -> list[list[bytes]]:
    """Frame lists up to and including the message whose header is `last`: a marker sent
    after the rest on the same route, so everything before it has arrived (FIFO per
    connection) and nothing is left to wait for."""
    out = []
    deadline = time.monotonic() + timeout
    while not out or out[-1][0] != last:
        assert time.monotonic() < deadline, f"{len(out)} messages, not the marker"
        if sock.poll(200):
            out.append(sock.recv_multipart())
    return out


def recv_one(sock, timeout: float = 120.0) -> list[bytes]:
    assert sock.poll(int(timeout * 1000)), "nothing came"
    return sock.recv_multipart()


def register(sock, name: str, role: str, clients: list[str]) -> None:
    sock.send_multipart(wire.encode(Message(
        "register", name, "broker", {"role": role, "node": name, "clients": clients})))
    m = wire.decode(sock.recv_multipart())
    assert m.kind == "ready", m


def header(kind, src, dst, seq, round=0, run="r"):
    return wire.encode_header(kind, src, dst, run=run, round=round, seq=seq, inc=7, ts=1.5)


def forwarded_or_said(frames: list[bytes]):
    """A delivered message as comparable data: forwarded frames as they are; the broker's
    own messages (their seq, inc and ts differ from run to run) as kind, dst and body."""
    if wire.decode_header(frames[0])["src"] == "broker":
        m = wire.decode(frames)
        return ("broker", m.kind, m.dst, m.body)
    return tuple(frames)


def stream(fast: bool) -> dict:
    """Run the stream through a fresh broker with the C loop (fast) or the Python one."""
    b = Broker("tcp://127.0.0.1:*", max_frame=MAX_FRAME, grace_s=0.0)
    assert b._croute is not None
    if not fast:
        b._croute = None
    holds = []
    hold = b._hold
    b._hold = lambda target, item: (holds.append(item[6]), hold(target, item))  # seq held
    stop = threading.Event()
    t = threading.Thread(target=b.run, args=(stop,), daemon=True)
    t.start()
    ep = b.endpoints[0]
    ctx = zmq.Context()
    try:
        server = dealer(ctx, ep, "srv", rcvhwm=4)
        register(server, "srv", "server", [])
        node = dealer(ctx, ep, "n1")
        register(node, "n1", "client", ["c0", "c1"])
        while wire.decode_header(recv_one(server)[0])["kind"] != "join":
            pass  # (a heartbeat may come first)

        sent = []

        def send(frames):
            node.send_multipart(frames)
            sent.append(frames)

        body = wire.encode_body
        for i in range(40):  # one route: the first through dispatch, then cached
            send([header("update", "c0", "server", seq=i + 1), body({"i": i})])
        send([header("update", "c1", "server", seq=41), body({"i": "c1"})])  # a new route
        send([header("update", "c1", "server", seq=42), body({"i": "c1 again"})])
        send([msgpack.packb({"v": 1, "kind": "update", "src": "c0", "dst": "server",
                             "run": "r", "round": 0, "seq": 43, "inc": 7, "ts": 0}),
              body({"i": "not canonical"})])
        send([b"only one frame"])
        send([header("update", "c0", "server", seq=44), body({"i": 1}), b"a third"])
        send([header("update", "c0", "server", seq=45), b"\0" * (MAX_FRAME + 1)])  # too big
        h = bytearray(header("update", "c0", "server", seq=46))
        h[-46:-38] = (-2).to_bytes(8, "big", signed=True)  # the tail's round: -2 < -1
        send([bytes(h), body({})])
        h = bytearray(header("update", "c0", "server", seq=47))
        h[-12] ^= 0xFF  # the tail's "ts" key spoilt: not canonical, and not a valid header
        send([bytes(h), body({})])
        send([header("update", "c9", "server", seq=48), body({})])  # a src it does not host
        send([header("update", "c0", "c1", seq=49), body({})])  # a client addressing a client
        send([header("update", "c0", "server", seq=50), body({"i": "last"})])
        # back-pressure: the server reads nothing while 1,600 x 20 KiB arrive for it: more
        # than its pipe (SNDHWM 1,000) and the kernel's buffers hold, so the broker holds the
        # rest, and all arrive in order when it reads again
        for i in range(N_FLOOD):
            send([header("update", "c1", "server", seq=100 + i), bytes(20 * 1024)])
        # (the broker holds once the server's pipe and buffers are full: an event, not a
        # pause a slow machine might not fill)
        wait_until(lambda: holds, 120, "the broker to hold a message for the server",
                   interval=0.01)
        last_up = header("update", "c1", "server", seq=100 + N_FLOOD)
        send([last_up, body({"i": "end"})])
        at_server = recv_through(server, last_up)
        # the server's tasks down the same routes; the last one comes behind them, and
        # behind the broker's answers to the node's refused messages
        for i in range(31):
            server.send_multipart([header("task", "server", f"c{i % 2}", seq=i + 1),
                                   body({"t": i})])
        at_node = recv_through(node, header("task", "server", "c0", seq=31))
    finally:
        stop.set()
        t.join(10)
        b.close()
        ctx.destroy(0)
    # heartbeats come by the clock, not by the stream
    return {"server": [m for m in map(forwarded_or_said, at_server) if m[1] != "heartbeat"],
            "node": [m for m in map(forwarded_or_said, at_node) if m[1] != "heartbeat"],
            "counters": (b.n_routed, b.n_bytes, b.n_refused, b.n_bad, dict(b.bad_reasons)),
            "held": holds,
            "sent": sent}


def test_c_and_python_loops_route_the_same_stream_the_same_way():
    c, py = stream(True), stream(False)
    assert c["server"] == py["server"]
    assert c["node"] == py["node"]
    assert c["counters"] == py["counters"]
    # and what they agree on is right: every good update reached the server, in order
    want = [tuple(f) for f in c["sent"] if len(f) == 2 and len(f[1]) <= MAX_FRAME
            and _valid(f[0]) and wire.decode_header(f[0])["src"] in ("c0", "c1")
            and wire.decode_header(f[0])["dst"] == "server"]
    got = [m for m in c["server"] if m[0] != "broker"]
    assert got == want and len(got) == 40 + 3 + 1 + N_FLOOD + 1
    # the server's pipe filled: the broker held a message for it and stopped reading (each
    # way), and everything still arrived in order
    assert c["held"] and py["held"]
    routed, nbytes, refused, bad, reasons = c["counters"]
    tasks = [m for m in c["node"] if m[0] != "broker"]
    assert routed == len(got) + len(tasks) == len(got) + 31
    assert nbytes == sum(len(h) + len(b) for h, b in got + tasks)
    assert bad == 5 and refused == 2
    assert reasons["message has 1 frame, expected 2 (header, body)"] == 1
    assert reasons["message has 3 frames, expected 2"] == 1
    errors = [m for m in c["node"] if m[0] == "broker"]
    assert sorted(e[3]["code"] for e in errors) == ["forbidden", "forbidden"]
    assert [m[1] for m in tasks] == [wire.encode_body({"t": i}) for i in range(31)]


def _valid(hdr: bytes) -> bool:
    try:
        wire.decode_header(hdr)
        return True
    except wire.WireError:
        return False


def test_a_frame_handed_back_by_c_is_a_read_only_buffer_with_its_properties():
    """What fastroute hands dispatch() for a message it does not route: the body, no copy,
    with zmq.Frame's get(); here received on a real socket pair."""
    from fedbus.broker import _fastroute
    from fedbus.broker.fastroute import fast_route

    ctx = zmq.Context()
    r = ctx.socket(zmq.ROUTER)
    port = r.bind_to_random_port("tcp://127.0.0.1")
    d = dealer(ctx, f"tcp://127.0.0.1:{port}", "x")
    try:
        route, addr = fast_route(r)
        d.send_multipart([b"not a header", b"the body"])
        assert r.poll(5000)
        more, routed, nbytes, used, held = route(addr, {}, 10, MAX_FRAME, 0.0)
        assert (more, routed, nbytes, used) == (True, 0, 0, 1)
        rid, hdr, body = held
        assert (rid, hdr) == (b"x", b"not a header")
        assert isinstance(body, _fastroute.Held)
        assert len(body) == 8 and bytes(body) == body.bytes == b"the body"
        view = memoryview(body)
        assert view.readonly and view.tobytes() == b"the body"
        assert body.buffer.tobytes() == b"the body"
        fd = body.get(zmq.SRCFD)
        assert isinstance(fd, int) and fd >= 0
        with pytest.raises(KeyError):
            body.get("User-Id")  # no ZAP here
        assert r.poll(100) == 0
        assert route(addr, {}, 10, MAX_FRAME, 0.0) == (False, 0, 0, 0, None)
        del view, body, held
    finally:
        d.close(0)
        r.close(0)
        ctx.term()
