"""CurveZMQ transport security and identity (issue #7, item 1), and a 10,000-message fuzz.

* keys: `fedbus keygen` files, address sets, the broker CLI's policy (CURVE required off
  loopback, --insecure warns);
* identity: a node with an unknown key, a plaintext node, and a node whose key does not allow
  the role, the name or the client ids it claims get nothing routed; a restarted node takes
  its key's place over;
* confidentiality: bytes captured by a TCP relay between a node and the broker hold a known
  float32 pattern of the payload with CURVE off, and do not with CURVE on;
* fuzz: 10,000 malformed or hostile messages from an authenticated client socket during a
  real FedProto federation leave broker and server up; the run completes; the global state
  equals a replay of the run's log without the hostile client's messages.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq
import zmq.auth
from conftest import wait_for
from helpers import SMALL, Processes, fedbus, free_port, merged, metrics, write_config

from fedbus.broker import auth, wire
from fedbus.broker.peer import Peer, PeerError
from fedbus.broker.wire import Message
from fedbus.node.config import build_config

HB = {"heartbeat_s": 0.3, "liveness": 4}


@pytest.fixture
def keys(tmp_path):
    """broker, server, node-a (c0-2), node-b (c3-5) in keys/; an unlisted key in rogue/."""
    d = tmp_path / "keys"
    auth.write_keypair(d, "broker", "broker")
    auth.write_keypair(d, "server", "server")
    auth.write_keypair(d, "node-a", "client", clients="c0-2")
    auth.write_keypair(d, "node-b", "client", clients="c3-5")
    rogue = tmp_path / "rogue"
    auth.write_keypair(rogue, "node-a", "client", clients="c0-2")  # same name, other key
    shutil.copy(d / "broker.key", rogue / "broker.key")
    return d


def _curve_broker(broker_proc, keys, endpoint=None, **kw):
    b = broker_proc(endpoint or f"tcp://127.0.0.1:{free_port()}", start=False, **HB, **kw)
    b.args += ["--curve", "--keys-dir", str(keys)]
    return b.start()


def _peer(endpoint, name, keys_dir=None, key=None, **kw) -> Peer:
    curve = auth.load_peer_curve(keys_dir, key or name) if keys_dir else None
    return Peer(endpoint, name, curve=curve, **HB, **kw)


# --------------------------------------------------------------------------- keys and policy
def test_address_sets():
    s = auth.AddressSet("c0-99, c200,c300-c349,node-x")
    for a in ("c0", "c99", "c200", "c300", "c349", "node-x"):
        assert a in s
    for a in ("c100", "c007", "c-1", "c201", "c350", "server", "x", "", 5):
        assert a not in s
    assert len(s) == 100 + 1 + 50 + 1
    assert auth.format_addresses([f"c{i}" for i in (0, 1, 2, 5, 7, 8)] + ["x"]) == "c0-2,c5,c7-8,x"
    with pytest.raises(auth.AuthError):
        auth.AddressSet("c9-3")
    with pytest.raises(auth.AuthError):
        auth.AddressSet("c0,server")


def test_keygen_writes_a_keypair_and_its_allow_list_entry(tmp_path):
    d = tmp_path / "k"
    out = fedbus("keygen", "node-a", "--clients", "0-9,12", "--dir", str(d)).stdout
    assert "node-a.key_secret" in out
    pub, sec = d / "node-a.key", d / "node-a.key_secret"
    assert sec.stat().st_mode & 0o777 == 0o600
    cert = auth.read_certificate(pub)
    assert (cert.name, cert.role, cert.clients, cert.secret) == ("node-a", "client", "c0-9,c12",
                                                                  None)
    full = auth.read_certificate(sec)
    assert full.public == cert.public and len(full.secret) == 40
    assert zmq.auth.load_certificate(sec) == (full.public, full.secret)  # zmq's format
    fedbus("keygen", "broker", "--dir", str(d))
    fedbus("keygen", "server", "--dir", str(d))
    listing = fedbus("keygen", "--list", "--dir", str(d)).stdout
    assert "broker" in listing and "c0-9,c12" in listing
    again = fedbus("keygen", "node-a", "--clients", "1", "--dir", str(d), check=False)
    assert again.returncode == 2 and "--force" in again.stderr
    nocl = fedbus("keygen", "node-b", "--dir", str(d), check=False)
    assert nocl.returncode == 2 and "--clients" in nocl.stderr
    allow = auth.AllowList.load(d)
    assert set(allow.by_name) == {"node-a", "server"}  # the broker's own key is not a node
    assert allow.entry("node-a").check("client", ["c3", "c12"]) is None
    assert "may not host ['c10']" in allow.entry("node-a").check("client", ["c10"])
    assert "for role 'server', not 'client'" in allow.entry("server").check("client", [])


def test_broker_requires_curve_off_loopback(tmp_path, broker_proc, keys):
    port = free_port()
    empty = tmp_path / "nokeys"
    empty.mkdir()
    no = fedbus("broker", "--bind", f"tcp://0.0.0.0:{port}", "--keys-dir", str(empty),
                check=False, timeout=60)
    assert no.returncode == 2
    assert "fedbus keygen" in no.stderr and "--insecure" in no.stderr
    insecure = broker_proc(f"tcp://0.0.0.0:{free_port()}", start=False)
    insecure.args.append("--insecure")
    insecure.start()
    warn = wait_for(lambda: [r for r in insecure.events() if "INSECURE" in r.get("event", "")],
                    30, message="the insecure warning")
    assert warn[0]["level"] == "warning"
    assert insecure.events("broker listening")[0]["curve"] is False
    assert insecure.stop() == 0
    # with keys, a non-loopback bind gets CURVE without being asked
    secure = broker_proc(f"tcp://0.0.0.0:{free_port()}", start=False)
    secure.args += ["--keys-dir", str(keys)]
    secure.start()
    assert secure.events("broker listening")[0]["curve"] is True
    assert secure.events("allow-list loaded")[0]["nodes"] == 3
    assert secure.stop() == 0


# --------------------------------------------------------------------------- identity
def test_identity_comes_from_the_key(tmp_path, broker_proc, keys, spawn_py):
    b = _curve_broker(broker_proc, keys)
    ep = b.endpoint
    server = _peer(ep, "server", keys, role="server")
    server.start(30)
    good = _peer(ep, "node-a", keys, role="client", addresses=["c0", "c1"])
    good.start(30)
    join = server.recv(10)
    assert (join.kind, join.body["node"], join.body["clients"]) == ("join", "node-a",
                                                                    ["c0", "c1"])
    good.send("update", "server", {"ok": 1}, src="c0")
    assert server.recv(10).body == {"ok": 1}

    refused = [
        # (name, key folder, key, role, addresses, what the refusal says)
        ("node-a", keys, "node-a", "server", (), "allow-listed for role 'client', not 'server'"),
        ("node-a", keys, "node-a", "client", ("c2", "c3"), "may not host ['c3']"),
        ("node-b", keys, "node-a", "client", ("c2",), "identity 'node-a'"),
        ("server", keys, "node-b", "server", (), "identity 'node-b'"),
        ("node-b", keys, "server", "client", ("c3",), "identity 'server'"),
    ]
    for name, kdir, key, role, addrs, why in refused:
        p = _peer(ep, name, kdir, key=key, role=role, addresses=addrs)
        with pytest.raises(PeerError, match="registration refused") as err:
            p.start(30)
        assert why in str(err.value), (name, key, role, addrs, str(err.value))
    # an unknown key and a plaintext node never get past the handshake
    for kdir in (tmp_path / "rogue", None):
        p = _peer(ep, "node-a", kdir, role="client", addresses=["c2"])
        with pytest.raises(PeerError, match="no answer from the broker"):
            p.start(3)
    wait_for(lambda: b.events("connection refused"), 60, message="refusals in the broker log")
    reasons = " ".join(r["reason"] for r in b.events("connection refused"))
    assert "not in the allow-list" in reasons and "plaintext" in reasons
    # a raw socket with a good key that never registered gets "not_registered", no routing
    curve = auth.load_peer_curve(keys, "node-b")
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.curve_serverkey, raw.curve_publickey, raw.curve_secretkey = (
        curve.broker_public, curve.public, curve.secret)
    raw.connect(ep)
    raw.send_multipart(wire.encode(Message("update", "c3", "server", {"sneaky": 1}, seq=1,
                                           inc=5)))
    assert raw.poll(10_000)
    err = wire.decode(raw.recv_multipart())
    assert (err.kind, err.body["code"]) == ("error", "not_registered")
    raw.close()
    # nothing of any of that reached the server (no join, no update), and the good node
    # keeps working: the broker answered each of them before the good node's update, so
    # anything it had let through would reach the server first (FIFO)
    good.send("update", "server", {"ok": 2}, src="c1")
    m = server.recv(30)
    assert (m.kind, m.src, m.body) == ("update", "c1", {"ok": 2}), m

    good.close()
    server.close()


RESTART = r'''
import json, sys, time
from fedbus.broker import auth
from fedbus.broker.peer import Peer
cfg = json.loads(sys.argv[1])
p = Peer(cfg["ep"], "node-b", role="client", addresses=["c3"], heartbeat_s=0.3, liveness=4,
         curve=auth.load_peer_curve(cfg["keys"], "node-b"))
p.start(30)
p.send("update", "server", {"from": cfg["n"]}, src="c3")
print(json.dumps({"event": "up"}), flush=True)
time.sleep(120)
'''


def test_a_restarted_node_takes_its_keys_place(broker_proc, keys, spawn_py):
    """Killed without a goodbye, a node restarted with its key (a new connection, a new random
    routing id) replaces its old registration at once instead of being refused as a conflict
    until the broker purges the old one (here: after 20 s)."""
    b = broker_proc(f"tcp://127.0.0.1:{free_port()}", start=False, heartbeat_s=1.0,
                    liveness=20)
    b.args += ["--curve", "--keys-dir", str(keys)]
    b.start()
    server = _peer(b.endpoint, "server", keys, role="server")
    server.start(30)
    try:
        for n in (1, 2):
            proc = spawn_py(RESTART, {"ep": b.endpoint, "keys": str(keys), "n": n},
                            name=f"node-b-{n}")
            proc.expect("up", timeout=60)
            m = server.recv(10)
            while m is not None and m.kind != "update":
                assert m.kind == "join" and m.body["node"] == "node-b", m
                m = server.recv(10)
            assert m is not None and m.body == {"from": n}
            if n == 1:
                proc.kill(signal.SIGKILL)
        assert b.events("node replaced by a new connection with its key", node="node-b")
        assert not b.events("registration refused")
    finally:
        server.close()


# --------------------------------------------------------------------------- confidentiality
class Relay:
    """A TCP relay: listens on loopback, forwards each connection to target, records bytes."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.socks: list[socket.socket] = []
        self.stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stop:
            try:
                a, _ = self.lsock.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target)
            except OSError:
                a.close()
                continue
            self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            with self.lock:
                self.captured += data
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        self.stop = True
        self.lsock.close()
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


PATTERN = np.array([1.2345678, -9.8765432, 3.1415927, 2.7182817, -0.33333334, 42.4242],
                   np.float32)


@pytest.mark.parametrize("curve", [False, True], ids=["plaintext", "curve"])
def test_captured_traffic_hides_the_payload_only_with_curve(broker_proc, keys, curve):
    port = free_port()
    ep = f"tcp://127.0.0.1:{port}"
    b = _curve_broker(broker_proc, keys, ep) if curve else broker_proc(ep, **HB)
    relay = Relay(port)
    kdir = keys if curve else None
    server = _peer(b.endpoint, "server", kdir, role="server")
    node = _peer(f"tcp://127.0.0.1:{relay.port}", "node-a", kdir, role="client",
                 addresses=["c0"])
    try:
        server.start(30)
        node.start(30)
        protos = np.tile(PATTERN, (10, 20))  # 10 x 120 float32
        node.send("update", "server", {"protos": protos, "counts": np.arange(10)}, src="c0")
        m = server.recv(10)
        while m is not None and m.kind != "update":
            m = server.recv(10)
        assert m is not None and np.array_equal(m.body["protos"], protos)
        # the server's reply travels back through the relay too
        server.send("task", "c0", {"protos": protos})
        back = node.recv(10)
        assert back is not None and np.array_equal(back.body["protos"], protos)
    finally:
        node.close()
        server.close()
        relay.close()
    with relay.lock:
        captured = bytes(relay.captured)
    assert len(captured) > 2 * protos.nbytes  # both messages crossed the relay
    needle = PATTERN.tobytes()  # 24 bytes that occur 400 times in each payload
    if curve:
        assert needle not in captured and needle[:8] not in captured
        assert b"register" not in captured and b"node-a" not in captured
    else:
        assert captured.count(needle) >= 2 * 200
        assert b"register" in captured


# --------------------------------------------------------------------------- fuzz
FUZZ_N = 10_000


class Hostile:
    """An authenticated client node (key "evil", allowed c3) on a raw DEALER socket."""

    def __init__(self, endpoint: str, keys, *, max_frame: int):
        self.curve = auth.load_peer_curve(keys, "evil")
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDTIMEO, 60_000)
        self.sock.setsockopt(zmq.IDENTITY, b"evil#0123456789abcdef")
        self.sock.curve_serverkey = self.curve.broker_public
        self.sock.curve_publickey = self.curve.public
        self.sock.curve_secretkey = self.curve.secret
        self.sock.connect(endpoint)
        self.max_frame = max_frame
        self.inc = 4242
        self.seq = 0
        self.run = ""
        self.task = None  # (task id, version, round) of c3's first task
        self.received: dict[str, int] = {}
        self.errors: list[dict] = []
        self.spec_shape: tuple[int, int] | None = None  # FedProto's (classes, feature dim)
        self.ready = False
        self.last_tx = 0.0

    def send(self, frames) -> None:
        self.sock.send_multipart(frames, copy=True)
        self.last_tx = time.monotonic()

    def control(self, kind: str, body, dst: str = "broker") -> None:
        self.send(wire.encode(Message(kind, "evil", dst, body, run=self.run, inc=self.inc)))

    def register(self) -> None:
        self.control("register", {"role": "client", "node": "evil", "clients": ["c3"],
                                  "run": ""})

    def pump(self) -> None:
        """Handle what arrived; heartbeat when quiet."""
        while self.sock.poll(0):
            frames = self.sock.recv_multipart()
            try:
                m = wire.decode(frames, max_frame=self.max_frame)
            except wire.WireError:
                continue
            self.received[m.kind] = self.received.get(m.kind, 0) + 1
            if m.kind == "ready":
                self.ready = True
            elif m.kind == "config" and not self.run:
                self.run = m.body["run"]
                self.seq += 1
                self.send(wire.encode(Message("config", "c3", "server",
                                              {"node": "evil", "run": self.run}, run=self.run,
                                              seq=self.seq, inc=self.inc)))
            elif m.kind == "task" and self.task is None:
                self.task = (m.body["task"], m.body["version"], m.round)
            elif m.kind == "error":
                self.errors.append(m.body)
        if time.monotonic() - self.last_tx > 0.2:
            self.control("heartbeat", None)


def _fuzz_messages(h: Hostile, n: int, seed: int = 7):
    """Yield (frames, counts_as_update): n malformed or hostile messages. counts_as_update is
    True for a well-formed update c3 -> server with a fresh seq whose body decodes: the server
    must see it, and reject it."""
    rng = np.random.default_rng(seed)
    tid, version, rnd = h.task
    c, d = h.spec_shape
    delivered: list[int] = []  # seqs of updates the server's Peer has seen (from c3)

    def hdr(kind="update", src="c3", dst="server", run=None, round_=None, seq=None):
        if seq is None:
            h.seq += 1
            seq = h.seq
        hdr.seq = seq
        return wire.encode_header(kind, src, dst, run=h.run if run is None else run,
                                  round=rnd if round_ is None else round_, seq=seq,
                                  inc=h.inc, ts=time.time())

    def upd(**kw):
        payload = {"protos": np.zeros((c, d), np.float32), "counts": np.ones(c, np.int64)}
        payload.update(kw.pop("payload", {}))
        body = {"task": tid, "version": version, "num_samples": 5,
                "work": {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 5},
                "payload": payload}
        body.update(kw)
        return body

    nan = np.zeros((c, d), np.float32)
    nan[1, 2] = np.nan
    inf = np.full((c, d), np.inf, np.float32)
    bad_updates = [  # each has exactly one defect: none can pass validation
        lambda: upd(payload={"protos": nan}),
        lambda: upd(payload={"protos": inf}),
        lambda: upd(payload={"protos": np.zeros((c, d + 1), np.float32)}),
        lambda: upd(payload={"protos": np.zeros((c + 1, d), np.float32)}),
        lambda: upd(payload={"protos": np.zeros((c, d), np.float16)}),
        lambda: upd(payload={"counts": np.full(c, -1, np.int64)}),
        lambda: upd(payload={"counts": np.full(c, 1 << 40, np.int64)}),
        lambda: upd(payload={"classes": np.array([0, c + int(rng.integers(0, 99))])}),
        lambda: upd(task=int(rng.integers(tid + 1000, 1 << 62))),
        lambda: upd(task=str(tid)),
        lambda: upd(version=version + 1 + int(rng.integers(0, 5))),
        lambda: upd(num_samples=-1),
        lambda: upd(num_samples=float("nan")),
        lambda: upd(num_samples=1 << 50),
        lambda: {k: v for k, v in upd().items() if k != "work"},
        lambda: {k: v for k, v in upd().items() if k != "payload"},
        lambda: upd(work={"epochs_asked": 1, "epochs_done": -1.0, "steps": 1, "samples": 5}),
        lambda: [tid, version],
        lambda: "update",
        lambda: None,
    ]
    for i in range(n):
        k = int(rng.integers(0, 16))
        if k == 0:  # random bytes, one frame
            yield [rng.bytes(int(rng.integers(1, 300)))], False
        elif k == 1:  # three frames
            yield [hdr(), wire.encode_body(upd()), rng.bytes(8)], False
        elif k == 2:  # garbage header
            yield [rng.bytes(int(rng.integers(1, 200))), rng.bytes(20)], False
        elif k == 3:  # truncated header
            full = hdr()
            yield [full[:int(rng.integers(1, len(full)))], wire.encode_body(upd())], False
        elif k == 4:  # valid header, garbage body
            body = rng.bytes(int(rng.integers(1, 2000)))
            yield [hdr(), body], _decodes(body, h.max_frame)
        elif k == 5:  # an array claiming a huge shape (or data outside the frame)
            shape = [int(x) for x in rng.integers(1 << 20, 1 << 40, size=int(rng.integers(1, 4)))]
            ext = msgpack.ExtType(1, bytes([11, len(shape)]) + b"".join(
                s.to_bytes(8, "little") for s in shape) + (64).to_bytes(8, "little"))
            body = msgpack.packb({"task": tid, "payload": {"protos": ext}}) + bytes(64)
            yield [hdr(), body], _decodes(body, h.max_frame)
        elif k == 6:  # spoofed src
            src = ["c0", "c1", "server", "node-0", "broker", "*", "c99"][int(rng.integers(0, 7))]
            yield [hdr(src=src), wire.encode_body(upd())], False
        elif k == 7:  # forbidden or unknown destinations
            dst = ["c0", "c2", "node-0", "*", "c99", "evil", "c3"][int(rng.integers(0, 7))]
            yield [hdr(dst=dst), wire.encode_body(upd())], False
        elif k == 8:  # kinds only the broker sends, or that go to the broker
            kind = ["join", "leave", "ready", "register", "heartbeat"][int(rng.integers(0, 5))]
            yield [hdr(kind=kind), wire.encode_body({"node": "evil", "clients": ["c0"]})], False
        elif k == 9:  # registrations the key does not allow
            body = [{"role": "server", "node": "evil", "clients": []},
                    {"role": "client", "node": "evil", "clients": ["c3", "c0"]},
                    {"role": "client", "node": "node-0", "clients": ["c3"]},
                    {"role": "client", "node": "evil", "clients": "c3"},
                    "register"][int(rng.integers(0, 5))]
            yield [hdr(kind="register", src="evil", dst="broker", seq=0),
                   wire.encode_body(body)], False
        elif k == 10:  # other kinds at the server, with ids that match nothing
            kind = ["error", "eval_result", "config", "shutdown", "task", "ack"][
                int(rng.integers(0, 6))]
            body = {"code": "handler_failed", "task": int(rng.integers(tid + 1000, 1 << 40)),
                    "eval": -5, "metrics": {"acc": float("nan")}, "node": "node-0",
                    "run": "not-the-run", "acks": [["c0", 1, 1, 1 << 60]]}
            yield [hdr(kind=kind), wire.encode_body(body)], False
        elif k == 11 and i % 25 == 0:  # over the frame cap (but under libzmq's hard limit)
            yield [hdr(), bytes(h.max_frame + 1000)], False
        elif k == 12 and delivered:  # a replayed seq: the server's Peer drops the duplicate
            old = delivered[int(rng.integers(0, len(delivered)))]
            yield [hdr(seq=old), wire.encode_body(upd(payload={"protos": nan}))], False
        elif k == 13:  # wrong run id, or wrong round
            if rng.random() < 0.5:
                frames = [hdr(run="other-run"), wire.encode_body(upd())]
            else:
                frames = [hdr(round_=rnd + 1 + int(rng.integers(0, 9))), wire.encode_body(upd())]
            delivered.append(hdr.seq)
            yield frames, True
        else:  # a valid-looking update with one defect (sometimes unsequenced)
            body = wire.encode_body(bad_updates[int(rng.integers(0, len(bad_updates)))]())
            frames = [hdr(seq=0 if rng.random() < 0.1 else None), body]
            if hdr.seq:
                delivered.append(hdr.seq)
            yield frames, True


def _decodes(body: bytes, max_frame: int) -> bool:
    try:
        wire.decode_body(body, max_frame=max_frame)
        return True
    except wire.WireError:
        return False


def _replay_without(run_dir, src: str):
    """The server's engine after the run's logged inputs, minus those from src: but its first
    config acknowledgement (which made its client live and so shaped the sampling) and, for an
    update that answered its live task, the ending of that task (a rejected answer ends it)."""
    from fedbus.analysis.replay import load_run
    from fedbus.node.server import build_engine, dispatch
    from fedbus.record.msglog import read_log

    from fedbus.analysis.replay import take_refused

    cfg, run_id = load_run(run_dir)
    engine = build_engine(cfg, run_id)
    kept_config = False
    skipped = 0
    for rec in read_log(run_dir):
        if rec.direction == "in":
            m = wire.decode(rec.frames, max_frame=64 << 20)
            if m.src == src:
                if m.kind == "config" and not kept_config:
                    kept_config = True
                else:
                    skipped += 1
                    continue
            dispatch(engine, m, rec.time)
        elif rec.direction == "refused":  # the server logs refusals, not what it refused
            skipped += 1
            outs = take_refused(engine, rec)
            assert all(o.kind == "error" or o.dst != src for o in outs)
        elif rec.direction == "tick":
            engine.on_tick(rec.time)
    return engine, skipped


def test_fuzz_from_an_authenticated_client(tmp_path, keys):
    auth.write_keypair(keys, "node-0", "client", clients="c0-2")
    auth.write_keypair(keys, "evil", "client", clients="c3")
    ep = f"tcp://127.0.0.1:{free_port()}"
    # a round closes on the three honest clients' updates (federation.quorum), never on a
    # clock they could miss while the server works through the flood; the hostile c3's
    # evaluation ends when it leaves. The hard deadline is only a liveness guard
    sections = merged(SMALL, federation={"clients": 4, "rounds": 3, "seed": 5, "quorum": 3,
                                         "hard_deadline_s": 150.0},
                      algorithm={"name": "fedproto"}, bus={"max_frame_mb": 1})
    cfg_path = write_config(tmp_path / "fuzz.toml", sections)
    run_dir = tmp_path / "run"
    from fedbus.node.server import build_engine

    spec_shape = build_engine(build_config(sections), "x").handler.update_spec()["protos"][1]
    procs = Processes(tmp_path)
    hostile = None
    try:
        procs.start("broker", "broker", "--bind", ep, "--curve", "--keys-dir", str(keys),
                    "--heartbeat-s", "0.3", "--liveness", "10", "--max-frame-mb", "1",
                    "--log-file", str(tmp_path / "broker.jsonl"))
        hostile = Hostile(ep, keys, max_frame=1 << 20)
        hostile.spec_shape = spec_shape
        deadline = time.monotonic() + 60
        while not hostile.ready and time.monotonic() < deadline:
            if time.monotonic() - hostile.last_tx > 1.0:
                hostile.register()  # (again: the broker may not have been listening yet)
            hostile.sock.poll(100)
            hostile.pump()
        assert hostile.ready, "the hostile node could not register"
        procs.start("server", "server", "--broker", ep, str(cfg_path), "--out", str(run_dir),
                    "--keys-dir", str(keys))
        procs.start("node", "node", "--broker", ep, "--clients", "0-2", "--keys-dir", str(keys),
                    "--key", "node-0", "--heartbeat-s", "0.3", "--liveness", "10")
        deadline = time.monotonic() + 180
        while hostile.task is None and time.monotonic() < deadline:
            assert procs.procs["server"].poll() is None, procs.log("server")[-3000:]
            hostile.sock.poll(100)
            hostile.pump()
        assert hostile.task is not None, "the hostile client got no task"

        expected = sent = 0
        for frames, counts in _fuzz_messages(hostile, FUZZ_N):
            hostile.send(frames)
            sent += 1
            expected += counts
            if sent % 20 == 0:
                hostile.pump()
        assert sent == FUZZ_N
        # everyone is still up, and the server answers the flood
        wait_for(lambda: (hostile.pump(), len([e for e in hostile.errors
                                               if e.get("code") == "rejected"]))[1] >= expected,
                 180, interval=0.1, message="the server's rejections")
        assert procs.procs["broker"].poll() is None and procs.procs["server"].poll() is None
        assert procs.procs["node"].poll() is None
        codes = {e.get("code") for e in hostile.errors}
        assert {"rejected", "forbidden"} <= codes, codes
        hostile.control("leave", None)  # c3 goes; the run goes on with the honest clients
        wait_for(lambda: procs.procs["server"].poll() is not None, 180,
                 message="the server to finish the run")
        assert procs.procs["server"].returncode == 0, procs.log("server")[-3000:]
        assert procs.procs["broker"].poll() is None
    finally:
        if hostile is not None:
            hostile.sock.close(0)
        procs.close()

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 3
    from fedbus.record.msglog import read_log

    # refusals are logged as small records (one per task they ended, else counts), never
    # the refused bytes: nothing of c3's updates is in the log
    logged = 0
    for r in read_log(run_dir):
        if r.direction == "in":
            assert wire.decode(r.frames, max_frame=64 << 20).src != "c3" or \
                wire.decode(r.frames, max_frame=64 << 20).kind == "config"
        elif r.direction == "refused":
            b = wire.decode_body(r.frames[1], max_frame=len(r.frames[1]))
            logged += b["count"].get("rejected", 0) if "count" in b else \
                int(b["kind"] == "update" and b["src"] == "c3")
    assert logged == expected and summary["rejected"] == expected, (logged, expected, summary)
    assert expected > FUZZ_N // 6
    recs = [r for r in metrics(run_dir) if "participants" in r]
    assert len(recs) == 3 and all(3 not in r["participants"] for r in recs)
    assert all(r["participants"] == [0, 1, 2] for r in recs)
    # the global state is the one the honest messages alone produce
    from fedbus.node.server import read_checkpoint

    ckpt = read_checkpoint(run_dir / "checkpoint.fbk")[1]
    clean, skipped = _replay_without(run_dir, "c3")
    assert skipped > 0
    assert clean.version == ckpt["version"] == 3
    state = clean.handler.state_dict()
    assert set(state) == set(ckpt["handler"])
    for k, v in state.items():
        assert np.array_equal(np.asarray(v), np.asarray(ckpt["handler"][k])), k
    assert bool(np.asarray(state["has"]).any())  # real prototypes were aggregated
    assert clean.totals["rejected"] == expected  # (the refusals, taken from their records)
    broker_log = [json.loads(x) for x in (tmp_path / "broker.jsonl").read_text().splitlines()
                  if x.strip()]
    assert any(r.get("event") == "bad frame dropped" for r in broker_log)
    assert os.path.getsize(tmp_path / "broker.jsonl") > 0

