"""The node runtime: one DEALER socket to the broker, owned by a background I/O thread.

The application thread calls ``send`` (thread-safe, non-blocking: it assigns the sequence
number and encodes in the calling thread) and ``recv`` (a queue). The I/O thread registers,
heartbeats, acknowledges, drops duplicates, and -- when the broker goes silent for
heartbeat_s x liveness -- closes the socket, reconnects with exponential backoff (1 s doubling
to 32 s), re-registers and resends every message not acknowledged yet. See PROTOCOL.md §6.

What the I/O thread remembers is bounded whatever the other side sends or fails to send:
the duplicate-detection state (per source address at most dedup_incs_per_src incarnations,
at most dedup_max_keys (src, inc) pairs and dedup_max_seqs sequence numbers in all, least
recently used dropped first, pairs silent for dedup_ttl_s forgotten) and the resend buffer
(max_unacked messages / max_unacked_bytes in all, and on a server at most
max_unacked_per_dst to one destination address: one that never acknowledges loses its
oldest).

Silent means no bytes, not no whole message: a message takes as long as its size over the
link's rate to arrive (a 750 kB model over 1 Mbit/s: 6 s), and messages queued behind it
wait, heartbeats included. So while the kernel says data still arrives on the connection
(``receive_idle_s``, Linux's TCP_INFO), a long silence between whole messages is a message
in transit, not a lost broker; the broker purges nodes by the same rule.
"""
from __future__ import annotations

import itertools
import os
import queue
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import zmq

from . import wire
from .log import get_logger
from .wire import BROADCAST, BROKER, DEFAULT_MAX_FRAME, SERVER, Message, WireError

__all__ = ["Peer", "PeerError", "connection_peer", "receive_idle_s"]

# kinds the runtime handles itself; the application never sends or receives them
_INTERNAL_KINDS = frozenset({"register", "ready", "heartbeat", "ack"})
# kinds only the broker sends (delivered to the application, never sent by it)
_BROKER_KINDS = frozenset({"join", "leave"})
_NB = zmq.NOBLOCK
_MORE_NB = zmq.SNDMORE | zmq.NOBLOCK
_CLOSED = object()

# connection states
_IDLE, _REGISTERING, _READY, _DISCONNECTED, _CLOSED_STATE = (
    "idle", "registering", "ready", "disconnected", "closed")


class PeerError(RuntimeError):
    """The broker refused this node, or did not answer in time."""


# Linux's struct tcp_info: tcpi_last_data_recv, milliseconds since data last arrived (pure
# acks do not count), is the u32 at byte 52 (after 8 one-byte fields and rto, ato, snd_mss,
# rcv_mss, unacked, sacked, lost, retrans, fackets, last_data_sent, last_ack_sent).
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_TCP_INFO_LEN = 104
_LAST_DATA_RECV = 52


@contextmanager
def _borrowed_socket(fd: int):
    """libzmq's socket fd as a Python socket, for reading its state; raises OSError."""
    sock = socket.socket(fileno=fd)
    try:
        yield sock
    finally:
        sock.detach()  # the descriptor is libzmq's: never close it


def connection_peer(fd: int | None):
    """The far end (address, port) of the socket with file descriptor fd, or None."""
    if fd is None or fd < 0:
        return None
    try:
        with _borrowed_socket(fd) as sock:
            return sock.getpeername()
    except OSError:
        return None


def noted_connection(frame, fd: int | None, peer) -> tuple[int | None, Any]:
    """(fd, far end) of the connection a received frame came in on (its SRCFD); the known
    (fd, peer) when it is that one or cannot be told."""
    try:
        new = frame.get(zmq.SRCFD)
    except (zmq.ZMQError, AttributeError, OSError):  # OSError: fastroute.c's frames
        return fd, peer
    return (fd, peer) if new == fd else (new, connection_peer(new))


def receive_idle_s(fd: int | None, peer) -> float | None:
    """Seconds since the TCP connection on file descriptor fd (libzmq's, from a received
    frame's SRCFD) last received data, as the kernel counts them; None when that cannot be
    told: no fd, no TCP_INFO (not Linux), not a TCP socket, or fd no longer the connection
    to `peer` (libzmq closed it, and the number may name another file since)."""
    if _TCP_INFO is None or fd is None or fd < 0 or peer is None:
        return None
    try:
        with _borrowed_socket(fd) as sock:
            if sock.getpeername() != peer:
                return None
            info = sock.getsockopt(socket.IPPROTO_TCP, _TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _LAST_DATA_RECV + 4:
        return None
    return struct.unpack_from("=I", info, _LAST_DATA_RECV)[0] / 1000.0


# a (src, inc) pair's received sequence numbers above its watermark: at most this many, then
# the watermark moves past the oldest half (PROTOCOL.md §6)
_ABOVE_MAX = 65536


class _Out:
    """A sent message awaiting its acknowledgement."""

    __slots__ = ("dst", "frames", "msg", "nbytes", "sent_at", "waiting")

    def __init__(self, msg: Message, waiting: set | None):
        self.msg = msg
        self.dst = msg.dst
        self.frames = msg.frames
        self.nbytes = msg.nbytes
        self.sent_at = 0.0  # 0: not transmitted on the current connection yet
        self.waiting = waiting  # broadcast: node names still to acknowledge; else None


class _In:
    """A received application message whose body is decoded lazily, in recv()."""

    __slots__ = ("body", "dst", "hdr", "inc", "kind", "round", "run", "seq", "src", "ts")

    def __init__(self, kind, src, dst, run, rnd, seq, inc, ts, hdr, body):
        self.kind, self.src, self.dst, self.run = kind, src, dst, run
        self.round, self.seq, self.inc, self.ts = rnd, seq, inc, ts
        self.hdr, self.body = hdr, body


class Peer:
    """A node's connection to the broker (see the module docstring).

    endpoint: the broker ("tcp://host:5555", "ipc:///path").
    name: this node's name, also its zmq routing id (unique among live nodes).
    role: "server" or "client".
    addresses: the client ids this node hosts (role "client"); the server's address is
        always "server". The node name is an address too.
    curve: an auth.PeerCurve (this node's keypair and the broker's public key) to encrypt and
        authenticate with CurveZMQ; None = plaintext. Under CURVE the name must be the key's.
    max_unacked, max_unacked_bytes: the resend buffer's size in all (oldest dropped).
    max_unacked_per_dst: at most this many unacknowledged messages to one destination
        address (oldest dropped, logged once per destination); None: 1024 on a server,
        whose destinations are clients that might never acknowledge, no more than
        max_unacked on a client node, whose only destination is the server.
    dedup_incs_per_src, dedup_max_keys, dedup_max_seqs, dedup_ttl_s: the bounds of the
        duplicate-detection state (PROTOCOL.md §6).
    """

    def __init__(
        self,
        endpoint: str,
        name: str,
        *,
        role: str,
        addresses: Sequence[str] = (),
        run: str = "",
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        max_frame: int = DEFAULT_MAX_FRAME,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 32.0,
        curve=None,
        ack_interval_s: float = 0.2,
        resend_s: float = 10.0,
        max_unacked: int = 100_000,
        max_unacked_bytes: int = 1 << 30,
        max_unacked_per_dst: int | None = None,
        dedup_incs_per_src: int = 8,
        dedup_max_keys: int = 65_536,
        dedup_max_seqs: int = 1 << 20,
        dedup_ttl_s: float = 3600.0,
    ):
        if role not in ("server", "client"):
            raise ValueError(f"role must be 'server' or 'client', got {role!r}")
        if not isinstance(name, str) or not name or len(name.encode()) > wire.MAX_STR_BYTES:
            raise ValueError("name must be a non-empty str of at most 255 bytes")
        if role == "client" and name in wire.RESERVED_ADDRESSES:
            raise ValueError(f"a client node cannot be named {name!r}")
        addrs = tuple(addresses)
        if role == "server":
            addrs = (SERVER,) + tuple(a for a in addrs if a != SERVER)
        self.endpoint = endpoint
        self.name = name
        self.role = role
        self.addresses: tuple[str, ...] = addrs
        self.run = run
        self.heartbeat_s = float(heartbeat_s)
        self.liveness = int(liveness)
        self.max_frame = int(max_frame)
        self.backoff_initial_s = float(backoff_initial_s)
        self.backoff_max_s = float(backoff_max_s)
        self.ack_interval_s = float(ack_interval_s)
        self.resend_s = float(resend_s)
        self.max_unacked = int(max_unacked)
        self.max_unacked_bytes = int(max_unacked_bytes)
        if max_unacked_per_dst is None:
            max_unacked_per_dst = 1024 if role == "server" else self.max_unacked
        self.max_unacked_per_dst = max(1, int(max_unacked_per_dst))
        self.dedup_incs_per_src = max(1, int(dedup_incs_per_src))
        self.dedup_max_keys = max(1, int(dedup_max_keys))
        self.dedup_max_seqs = max(1, int(dedup_max_seqs))
        self.dedup_ttl_s = float(dedup_ttl_s)
        self.inc = random.getrandbits(63) or 1
        # CURVE (auth.PeerCurve): encrypt, authenticate with this node's key; the routing id
        # gets a random part the broker binds to the key (see auth.peer_routing_id)
        self.curve = curve
        if curve is not None:
            from .auth import peer_routing_id

            self._rid = peer_routing_id(name)
        else:
            self._rid = name.encode()
        self.log = get_logger("peer").bind(node=name)
        self._sources = frozenset(addrs) | {name}
        self._default_src = SERVER if role == "server" else (addrs[0] if len(addrs) == 1 else name)
        self._ack_src = SERVER if role == "server" else name

        # application side
        self._lock = threading.Lock()
        self._seqs: dict[str, itertools.count] = {}
        self._outq: deque = deque()
        self._inq: queue.SimpleQueue = queue.SimpleQueue()  # C: put/get without a Condition
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._wake_pending = False
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._start_error: str | None = None
        self._closing = False
        self._closed = False
        self._reregister = False  # set_addresses: register again with the new list

        # I/O thread state (touched only by the I/O thread after start)
        self._state = _IDLE
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._unacked: dict[tuple[str, int], _Out] = {}
        self._unacked_bytes = 0
        # destination address -> its keys in _unacked, oldest first
        self._by_dst: dict[str, dict[tuple[str, int], None]] = {}
        self._dst_drops: dict[str, int] = {}  # destination -> messages dropped (logged once)
        self._backlog: deque = deque()  # frame pairs waiting for the socket (HWM)
        # (src, inc) -> [watermark, set of seqs above it, last use]; least recently used first
        self._seen: dict[tuple[str, int], list] = {}
        self._seen_incs: dict[str, dict[int, None]] = {}  # src -> its incs in _seen
        self._seen_seqs = 0  # seqs held in all the sets above watermarks
        self._next_seen_sweep = 0.0
        self._dedup_logged = 0.0
        self._acks: dict[str, list[tuple[int, int]]] = {}  # src address -> [(inc, seq)]
        self._client_nodes: set[str] = set()  # server: live client nodes (join/leave)
        # server: client address -> the node hosting it (join/leave), so that one ack per
        # node covers all its clients instead of one per client
        self._host: dict[str, str] = {}
        self._last_rx = 0.0
        # the connection the broker's messages arrive on (fd, far end), to tell a long
        # message in transit from a lost broker; and when the silence is looked at next
        self._rx_fd: int | None = None
        self._rx_peer = None
        self._next_silence_check = 0.0
        self._transit_noted = 0.0
        self._last_tx = 0.0
        self._register_sent = 0.0
        self._reconnect_at = 0.0
        self._backoff = self.backoff_initial_s
        self._broker_hb = self.heartbeat_s
        self._next_ack = 0.0
        self._next_resend = 0.0
        self._bad_logged = 0.0
        self._trim_logged = -1e9
        self._trim_dropped = 0
        self._poller: zmq.Poller | None = None
        self._poll_key: tuple = ()
        # counters
        self.n_sent = 0
        self.n_received = 0
        self.n_duplicates = 0
        self.n_resent = 0
        self.n_bad = 0
        self.n_reconnects = 0
        self.n_unacked_dropped = 0  # dropped from the resend buffer unacknowledged
        self.n_dedup_evicted = 0  # (src, inc) pairs forgotten to stay within the bounds

    # ------------------------------------------------------------------ public API
    def start(self, timeout: float = 30.0) -> None:
        """Connect and register; block until the broker says "ready".

        Raises PeerError if the broker refuses the registration or does not answer within
        timeout seconds (the peer is closed then).
        """
        if self._thread is not None:
            raise PeerError("Peer.start() called twice")
        self._thread = threading.Thread(target=self._io_main, name=f"fedbus-peer-{self.name}",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.close(0)
            hint = (" (CURVE: is this node's public key in the broker's allow-list, and is the "
                    "broker key the broker's?)" if self.curve is not None else
                    " (a broker that requires CURVE answers nothing to a node without keys)")
            raise PeerError(f"no answer from the broker at {self.endpoint} within {timeout} s"
                            + hint)
        if self._start_error is not None:
            self.close(0)
            raise PeerError(self._start_error)

    def send(self, kind: str, dst: str, body: Any, *, src: str | None = None,
             round: int = -1, encoded: Any = None) -> Message:
        """Queue a message for dst; returns it with seq/inc/ts/run and .frames set.

        Thread-safe and non-blocking: the body is encoded here, in the calling thread; the I/O
        thread transmits it, and keeps it until dst acknowledges it (resending it after a
        reconnection). Raises ValueError for a kind/src/dst this node may not use and
        WireError for a body that cannot be encoded.
        """
        if self._closing:
            raise PeerError("the peer is closed")
        if kind not in wire.KINDS or kind in _INTERNAL_KINDS or kind in _BROKER_KINDS:
            raise ValueError(f"cannot send kind {kind!r}")
        if src is None:
            src = self._default_src
        elif src not in self._sources:
            raise ValueError(f"node {self.name!r} does not host src {src!r}")
        if not isinstance(dst, str) or not dst or dst == BROKER:
            raise ValueError(f"bad dst {dst!r}")
        if self.role == "client" and dst != SERVER:
            raise ValueError(f"a client node may address only 'server', not {dst!r}")
        msg = Message(kind, src, dst, body, run=self.run, round=round, inc=self.inc)
        # the expensive part, outside the lock; a relay forwarding a body unchanged passes
        # the body frame it received (`encoded`, the encoding of `body`): a copy, no encoding
        body_bytes = wire.encode_body(body) if encoded is None else \
            wire.frame_view(encoded).tobytes()
        with self._lock:
            counter = self._seqs.get(src)
            if counter is None:
                counter = self._seqs[src] = itertools.count(1)
            msg.seq = next(counter)
            msg.ts = time.time()
            hdr = wire.encode_header(kind, src, dst, run=self.run, round=round, seq=msg.seq,
                                     inc=self.inc, ts=msg.ts)
            msg.frames = [hdr, body_bytes]
            self._outq.append(msg)
        self._wake()
        return msg

    def set_addresses(self, addresses: Sequence[str]) -> None:
        """Host a new set of client addresses (role "client"): the node registers again with
        the new list, and the broker tells the server (a `join` listing them; PROTOCOL.md §5).
        A relay (fedbus.node.relay) calls this as nodes join and leave below it. The name
        stays an address."""
        if self.role != "client":
            raise ValueError("only a client node hosts client addresses")
        addrs = tuple(dict.fromkeys(addresses))
        for a in addrs:
            if not isinstance(a, str) or not a or a in wire.RESERVED_ADDRESSES:
                raise ValueError(f"bad client address {a!r}")
        with self._lock:
            self.addresses = addrs
            self._sources = frozenset(addrs) | {self.name}
            self._default_src = addrs[0] if len(addrs) == 1 else self.name
            self._reregister = True
        self._wake()

    @property
    def delivery_wait_s(self) -> float:
        """How long a node that ended its run waits for its shutdown to be delivered
        (wait_delivered): through a broker restart and a reconnection's backoff."""
        return max(30.0, 4 * self.heartbeat_s * self.liveness)

    def wait_delivered(self, dst: str, timeout: float, stop=None) -> bool:
        """Block until nothing sent to dst is undelivered (the connection lives on,
        reconnecting and resending), at most timeout seconds or until stop() is true;
        True once delivered."""
        limit = time.monotonic() + timeout
        while self.undelivered(dst):
            if time.monotonic() >= limit or (stop is not None and stop()):
                return False
            time.sleep(0.02)
        return True

    def set_run(self, run: str) -> None:
        """Register again for this run: a relay restarted unconfigured learns its run from
        its site's nodes, and registered for it upstream it is told if that run ended."""
        with self._lock:
            self.run = run
            self._reregister = True
        self._wake()

    def recv(self, timeout: float | None = None) -> Message | None:
        """The next application message (task, update, eval, eval_result, error, shutdown,
        join, leave), duplicates already dropped; None on timeout or once closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if deadline is None:
                    item = self._inq.get()
                else:
                    remaining = deadline - time.monotonic()
                    item = self._inq.get(timeout=remaining) if remaining > 0 else \
                        self._inq.get_nowait()
            except queue.Empty:
                return None
            if item is _CLOSED:
                self._inq.put(_CLOSED)  # keep answering None
                return None
            if isinstance(item, Message):
                return item
            try:
                body = wire.decode_body(item.body, max_frame=self.max_frame)
            except WireError as e:
                self.n_bad += 1
                self.log.warning("bad body dropped", kind=item.kind, src=item.src,
                                 seq=item.seq, reason=str(e))
                continue
            return Message(item.kind, item.src, item.dst, body, item.run, item.round, item.seq,
                           item.inc, item.ts, [item.hdr, item.body])

    def close(self, linger_s: float = 1.0) -> None:
        """Stop: wait up to linger_s for unacknowledged messages, tell the broker we leave,
        close the socket. Idempotent."""
        if self._closed:
            return
        t = self._thread
        if t is not None and t.is_alive() and linger_s > 0:
            deadline = time.monotonic() + linger_s
            while time.monotonic() < deadline and (self._outq or self._unacked) \
                    and self._state == _READY:
                time.sleep(0.01)
        self._closing = True
        self._wake()
        if t is not None:
            t.join(max(linger_s, 0) + 5.0)
        self._closed = True
        self._inq.put(_CLOSED)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    @property
    def connected(self) -> bool:
        """Registered with the broker right now."""
        return self._state == _READY

    @property
    def unacked_count(self) -> int:
        """Messages sent (or queued) and not acknowledged yet."""
        return len(self._unacked) + len(self._outq)

    def unacked_for(self, dst: str) -> int:
        """Messages to dst in the resend buffer (sent, not acknowledged yet)."""
        return len(self._by_dst.get(dst, ()))

    def undelivered(self, dst: str) -> int:
        """Messages to dst queued by send() or in the resend buffer: not delivered yet (a
        broadcast is delivered once every client node live at its sending acknowledged it
        or left, or the broker refused it)."""
        # the queue first: _take_outgoing files a message in the buffer before it leaves
        # the queue, so one on its way between the two is counted in one or the other
        queued = sum(1 for m in list(self._outq) if m.dst == dst)
        return queued + len(self._by_dst.get(dst, ()))

    @property
    def dedup_keys(self) -> int:
        """(src, inc) pairs the duplicate detection remembers now."""
        return len(self._seen)

    def __enter__(self):
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ I/O thread
    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass

    def _io_main(self) -> None:
        self._ctx = zmq.Context()
        try:
            try:
                self._connect()
            except Exception as e:  # e.g. a malformed endpoint
                self._start_error = f"cannot connect to {self.endpoint!r}: {e}"
                self.log.error("cannot connect", endpoint=self.endpoint, error=str(e))
                return
            while not self._closing:
                try:
                    self._io_step()
                except Exception:  # the I/O thread must survive anything
                    self.log.exception("peer I/O error")
                    time.sleep(0.05)
            self._goodbye()
        finally:
            if not self._started.is_set() and self._start_error is None:
                self._start_error = "the peer was closed before the broker answered"
            if self._sock is not None:
                self._sock.close()  # LINGER: 0, or 500 ms after _goodbye()
                self._sock = None
            self._ctx.term()
            self._state = _CLOSED_STATE
            self._started.set()

    def _io_step(self) -> None:
        now = time.monotonic()
        timeout = self._next_deadline(now) - now
        want = (self._sock, bool(self._backlog))
        if want != self._poll_key:
            self._poller = zmq.Poller()
            self._poller.register(self._wake_r, zmq.POLLIN)
            if self._sock is not None:
                self._poller.register(self._sock, zmq.POLLIN | (zmq.POLLOUT if want[1] else 0))
            self._poll_key = want
        events = dict(self._poller.poll(max(0, int(timeout * 1000) + 1)))
        if self._wake_r in events:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except (BlockingIOError, OSError):
                pass
        self._wake_pending = False
        if self._reregister and self._state == _READY:
            self._reregister = False
            self._register()
        self._take_outgoing()
        sock = self._sock
        if sock is not None and sock in events:
            ev = events[sock]
            if ev & zmq.POLLOUT and self._backlog:
                self._flush_backlog()
            if ev & zmq.POLLIN:
                self._drain_socket()
        self._timers(time.monotonic())

    def _next_deadline(self, now: float) -> float:
        t = now + 0.1  # closing/wake-ups are also signalled, this is only a safety net
        if self._state == _DISCONNECTED:
            return min(t, self._reconnect_at)
        t = min(t, max(self._last_rx + self._silence_limit(), self._next_silence_check))
        if self._state == _READY:  # heartbeats and acks go out only when registered
            t = min(t, self._last_tx + min(self.heartbeat_s, self._broker_hb))
            if self._acks:
                t = min(t, self._next_ack)
        return max(t, now)

    def _silence_limit(self) -> float:
        return max(self.heartbeat_s, self._broker_hb) * self.liveness

    # -- connection
    def _connect(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self._rid)
        if self.curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.broker_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.secret)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame + 4096)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(self.endpoint)
        self._sock = sock
        self._backlog.clear()
        now = time.monotonic()
        self._last_rx = now
        self._rx_fd = self._rx_peer = None
        self._next_silence_check = 0.0
        self._register()

    def _register(self) -> None:
        self._reregister = False
        self._state = _REGISTERING
        self._register_sent = time.monotonic()
        self._send_control("register", BROKER, {
            "role": self.role, "node": self.name,
            "clients": list(self.addresses) if self.role == "client" else [],
            "run": self.run,
        }, src=self.name)

    def _lost(self, why: str) -> None:
        """The broker is gone: drop the socket, retry after the backoff."""
        self.log.warning("broker lost", reason=why, endpoint=self.endpoint,
                         retry_in_s=round(self._backoff, 3), unacked=len(self._unacked))
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._backlog.clear()
        self._state = _DISCONNECTED
        self._reconnect_at = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.backoff_max_s)

    def _goodbye(self) -> None:
        if self._state != _READY or self._sock is None:
            return
        self._take_outgoing()
        self._flush_acks()
        self._send_control("leave", BROKER, None, src=self.name)
        deadline = time.monotonic() + 0.5
        while self._backlog and time.monotonic() < deadline:
            self._flush_backlog()
            time.sleep(0.005)
        self._sock.setsockopt(zmq.LINGER, 500)

    # -- sending
    def _transmit(self, frames) -> bool:
        """Hand two frames to the socket (or to the backlog if it is full)."""
        if self._sock is None:
            return False
        if self._backlog:
            self._backlog.append(frames)
            return True
        try:
            self._sock.send(frames[0], _MORE_NB)
            self._sock.send(frames[1], _NB, copy=len(frames[1]) < 65536)
        except zmq.Again:
            self._backlog.append(frames)
        self._last_tx = time.monotonic()
        return True

    def _flush_backlog(self) -> None:
        sock = self._sock
        while self._backlog and sock is not None:
            frames = self._backlog[0]
            try:
                sock.send(frames[0], _MORE_NB)
                sock.send(frames[1], _NB, copy=len(frames[1]) < 65536)
            except zmq.Again:
                return
            self._backlog.popleft()
            self._last_tx = time.monotonic()

    def _send_control(self, kind: str, dst: str, body, *, src: str) -> None:
        msg = Message(kind, src, dst, body, run=self.run, seq=0, inc=self.inc, ts=time.time())
        self._transmit(wire.encode(msg))

    def _take_outgoing(self) -> None:
        """Move messages queued by send() into the resend buffer; transmit when ready."""
        q = self._outq
        ready = self._state == _READY and self._sock is not None
        now = time.monotonic()
        while q:
            msg = q[0]
            waiting = None
            if msg.dst == BROADCAST and self._client_nodes:
                waiting = set(self._client_nodes)
            out = _Out(msg, waiting)
            key = (msg.src, msg.seq)
            self._unacked[key] = out
            self._unacked_bytes += out.nbytes
            per_dst = self._by_dst.get(out.dst)
            if per_dst is None:
                per_dst = self._by_dst[out.dst] = {}
            per_dst[key] = None
            self.n_sent += 1
            q.popleft()  # (only now: undelivered() counts it in one place or the other)
            if ready:
                self._transmit(out.frames)
                out.sent_at = now
            if len(per_dst) > self.max_unacked_per_dst:
                self._trim_dst(out.dst, per_dst)
        if len(self._unacked) > self.max_unacked or self._unacked_bytes > self.max_unacked_bytes:
            self._trim_unacked()

    def _trim_dst(self, dst: str, per_dst: dict) -> None:
        """A destination holds more than max_unacked_per_dst unacknowledged messages (it
        does not acknowledge: a hostile or broken node): drop its oldest, so that it cannot
        grow the resend buffer, nor the work of resending it, without bound."""
        dropped = 0
        while len(per_dst) > self.max_unacked_per_dst:
            self._forget(next(iter(per_dst)))
            dropped += 1
        self.n_unacked_dropped += dropped
        drops = self._dst_drops
        before = drops.get(dst)
        if before is not None:
            drops[dst] = before + dropped
        elif len(drops) < 65_536:
            drops[dst] = dropped
            self.log.warning("destination does not acknowledge: its oldest unacknowledged "
                             "messages are dropped from the resend buffer (logged once per "
                             "destination)", dst=dst, max_per_dst=self.max_unacked_per_dst,
                             dropped_total=self.n_unacked_dropped)

    def _trim_unacked(self) -> None:
        dropped = 0
        while self._unacked and (len(self._unacked) > self.max_unacked
                                 or self._unacked_bytes > self.max_unacked_bytes):
            self._forget(next(iter(self._unacked)))
            dropped += 1
        self.n_unacked_dropped += dropped
        self._trim_dropped += dropped
        now = time.monotonic()
        if dropped and now - self._trim_logged > 10.0:  # once the buffer is full, every
            self._trim_logged = now                      # send trims: log a sum, not each
            self.log.warning("resend buffer full: oldest unacknowledged messages dropped",
                             dropped=self._trim_dropped, max_messages=self.max_unacked,
                             max_bytes=self.max_unacked_bytes)
            self._trim_dropped = 0

    def _resend_all(self) -> None:
        """After "ready": transmit every unacknowledged message again, in order."""
        now = time.monotonic()
        n = 0
        for out in list(self._unacked.values()):
            self._transmit(out.frames)
            if out.sent_at:
                n += 1
            out.sent_at = now
        if n:
            self.n_resent += n
            self.log.info("resent unacknowledged messages", count=n)

    def _forget(self, key: tuple[str, int]) -> None:
        out = self._unacked.pop(key, None)
        if out is not None:
            self._unacked_bytes -= out.nbytes
            per_dst = self._by_dst.get(out.dst)
            if per_dst is not None:
                per_dst.pop(key, None)
                if not per_dst:
                    del self._by_dst[out.dst]

    # -- receiving
    def _drain_socket(self, max_msgs: int = 4096) -> None:
        sock = self._sock
        recv = sock.recv
        for _ in range(max_msgs):
            try:
                hf = recv(_NB, copy=False)
            except zmq.Again:
                return
            if not hf.more:
                self._bad("message has 1 frame, expected 2")
                continue
            body = recv(_NB, copy=False)
            if body.more:
                while sock.getsockopt(zmq.RCVMORE):
                    recv(_NB, copy=False)
                self._bad("message has more than 2 frames")
                continue
            self._last_rx = time.monotonic()
            hdr = hf.bytes
            try:
                kind, src, dst, run, rnd, seq, inc, ts = wire.header_fields(
                    hdr, max_frame=self.max_frame)
            except WireError as e:
                self._bad(str(e))
                continue
            if len(body) > self.max_frame:
                self._bad(f"body frame of {len(body)} bytes exceeds max_frame={self.max_frame}")
                continue
            if src == BROKER:
                self._note_connection(hf)
                self._from_broker(kind, dst, run, rnd, inc, ts, hdr, body)
                if self._sock is not sock:  # that message dropped the connection (_lost)
                    return
            elif kind == "ack":
                self._on_ack(src, body)
            elif kind in _INTERNAL_KINDS or kind in _BROKER_KINDS:
                self._bad(f"kind {kind!r} from {src!r} is not for the application")
            else:
                if seq > 0:
                    acks = self._acks.get(src)
                    if acks is None:
                        acks = self._acks[src] = []
                        if len(self._acks) == 1:
                            self._next_ack = time.monotonic() + self.ack_interval_s
                    acks.append((inc, seq))
                    if self._is_duplicate(src, inc, seq, self._last_rx):
                        self.n_duplicates += 1
                        continue
                self.n_received += 1
                self._inq.put(_In(kind, src, dst, run, rnd, seq, inc, ts, hdr, body))

    def _bad(self, reason: str) -> None:
        self.n_bad += 1
        now = time.monotonic()
        if now - self._bad_logged > 1.0:
            self._bad_logged = now
            self.log.warning("bad frame dropped", reason=reason, bad_total=self.n_bad)

    def _is_duplicate(self, src: str, inc: int, seq: int, now: float) -> bool:
        """Record (src, inc, seq); True if it was seen before."""
        key = (src, inc)
        seen = self._seen
        st = seen.pop(key, None)  # re-inserted below: the dict is in least-recent-use order
        if st is None:
            st = self._seen_new(src, inc)
        seen[key] = st
        st[2] = now
        wm, above = st[0], st[1]
        if seq <= wm or seq in above:
            return True
        if seq == wm + 1:
            wm += 1
            while wm + 1 in above:
                wm += 1
                above.discard(wm)
                self._seen_seqs -= 1
            st[0] = wm
        else:
            above.add(seq)
            self._seen_seqs += 1
            if len(above) > _ABOVE_MAX or self._seen_seqs > self.dedup_max_seqs:
                self._seen_trim(st, src)
        return False

    def _seen_trim(self, st: list, src: str) -> None:
        """Move a pair's watermark past the oldest half of the seqs it holds above it (a
        sender's seqs are shared by all its destinations, so gaps can be permanent, and
        duplicates only come from resends of recent, unacknowledged messages) -- or past
        more, so that all pairs together hold at most dedup_max_seqs: the sender whose
        gaps fill the allowance pays for them, not the senders around it."""
        keep = sorted(st[1])
        over = self._seen_seqs - self.dedup_max_seqs
        cut = min(len(keep), max(len(keep) // 2 + 1, over))
        st[0] = keep[cut - 1]
        st[1] = set(keep[cut:])
        self._seen_seqs -= cut
        if over > 0:
            self._dedup_full("dedup_max_seqs", src)

    def _seen_new(self, src: str, inc: int) -> list:
        """State for a new (src, inc), making room for it: the source's least recently used
        incarnation beyond dedup_incs_per_src, the least recently used pair beyond
        dedup_max_keys. (One sender that makes up a new inc per message -- a restarted
        process has a new one -- can so hold no more than a few entries.)"""
        seen = self._seen
        incs = self._seen_incs.get(src)
        if incs is None:
            incs = self._seen_incs[src] = {}
        elif len(incs) >= self.dedup_incs_per_src:
            oldest = min(incs, key=lambda i: seen[(src, i)][2])
            self._seen_drop((src, oldest))
            self._dedup_full("dedup_incs_per_src", src)
            if src not in self._seen_incs:
                incs = self._seen_incs[src] = {}
        incs[inc] = None
        if len(seen) >= self.dedup_max_keys:
            while seen and len(seen) >= self.dedup_max_keys:
                self._seen_drop(next(iter(seen)))
            self._dedup_full("dedup_max_keys", src)
        return [0, set(), 0.0]

    def _seen_drop(self, key: tuple[str, int], evicted: bool = True) -> None:
        st = self._seen.pop(key)
        self._seen_seqs -= len(st[1])
        incs = self._seen_incs.get(key[0])
        if incs is not None:
            incs.pop(key[1], None)
            if not incs:
                del self._seen_incs[key[0]]
        if evicted:
            self.n_dedup_evicted += 1

    def _dedup_full(self, bound: str, src: str) -> None:
        now = time.monotonic()
        if now - self._dedup_logged > 10.0:
            self._dedup_logged = now
            self.log.warning("duplicate-detection state at its bound: older entries "
                             "forgotten", bound=bound, src=src, keys=len(self._seen),
                             seqs=self._seen_seqs, evicted_total=self.n_dedup_evicted)

    def _seen_sweep(self, now: float) -> None:
        """Forget (src, inc) pairs silent for dedup_ttl_s (the oldest come first)."""
        limit = now - self.dedup_ttl_s
        expired = []
        for key, st in self._seen.items():
            if st[2] >= limit:
                break
            expired.append(key)
        for key in expired:
            self._seen_drop(key, evicted=False)  # aged out, not pushed out

    def _note_connection(self, frame) -> None:
        """Remember the connection the broker's messages come in on, for the silence check
        in _timers."""
        self._rx_fd, self._rx_peer = noted_connection(frame, self._rx_fd, self._rx_peer)

    def _from_broker(self, kind, dst, run, rnd, inc, ts, hdr, body_frame) -> None:
        if kind == "heartbeat":
            return
        try:
            body = wire.decode_body(body_frame, max_frame=self.max_frame)
        except WireError as e:
            self._bad(f"broker {kind} body: {e}")
            return
        if kind == "ready":
            self._on_ready(body)
            return
        msg = Message(kind, BROKER, dst, body, run, rnd, 0, inc, ts, [hdr, body_frame])
        if kind == "error":
            if not self._on_error(msg):
                return
        elif kind == "join" and isinstance(body, dict):
            self._on_join(body)
        elif kind == "leave" and isinstance(body, dict):
            self._on_leave(body)
        self._inq.put(msg)

    def _on_ready(self, body) -> None:
        if isinstance(body, dict):
            hb = body.get("heartbeat_s")
            if isinstance(hb, (int, float)) and hb > 0:
                self._broker_hb = float(hb)
        if self._state == _READY:
            return  # a duplicate answer to a repeated register
        first = not self._started.is_set()
        self._state = _READY
        self._backoff = self.backoff_initial_s
        self.log.info("registered", endpoint=self.endpoint, role=self.role,
                      addresses=len(self.addresses), again=not first)
        self._backlog.clear()
        self._resend_all()
        self._take_outgoing()
        self._started.set()

    def _on_error(self, msg: Message) -> bool:
        """Handle an error from the broker; True if the application should see it."""
        body = msg.body if isinstance(msg.body, dict) else {}
        code = body.get("code")
        kind = body.get("kind")
        if code == "not_registered":
            if self._state == _READY or time.monotonic() - self._register_sent > \
                    self._broker_hb:
                self.log.info("broker does not know us (restarted?): registering again")
                self._register()
            return False
        if kind == "register":
            reason = f"registration refused ({code}): {body.get('reason')}"
            if not self._started.is_set():
                self._start_error = reason
                self._closing = True
                self._started.set()
            else:
                self.log.error("registration refused", code=code, reason=body.get("reason"))
                self._lost(reason)
            return False
        src, seq = body.get("src"), body.get("seq")
        if kind in _INTERNAL_KINDS or not isinstance(seq, int) or seq <= 0:
            self.log.debug("broker refused a control message", code=code, kind=kind,
                           reason=body.get("reason"))
            return kind not in _INTERNAL_KINDS
        key = (src, seq)
        out = self._unacked.get(key)
        if out is not None:
            node = body.get("node")
            if out.waiting is not None and node:
                out.waiting.discard(node)
                if not out.waiting:
                    self._forget(key)
            else:
                self._forget(key)
        self.log.warning("message refused by the broker", code=code, kind=kind, src=src,
                         dst=body.get("dst"), seq=seq, reason=body.get("reason"))
        return True

    def _on_join(self, body: dict) -> None:
        node = body.get("node")
        if self.role != "server" or not isinstance(node, str):
            return
        self._client_nodes.add(node)
        clients = body.get("clients")
        if isinstance(clients, list):
            for address in clients:
                if isinstance(address, str):
                    self._host[address] = node
        # broadcasts this node may have missed (e.g. it re-registered after a broker restart)
        if self._state == _READY:
            for out in self._unacked.values():
                if out.waiting is not None and node in out.waiting:
                    self._transmit(out.frames)
                    out.sent_at = time.monotonic()

    def _on_leave(self, body: dict) -> None:
        node = body.get("node")
        if self.role != "server" or not isinstance(node, str):
            return
        self._client_nodes.discard(node)
        clients = body.get("clients")
        if isinstance(clients, list):
            for address in clients:
                if self._host.get(address) == node:
                    del self._host[address]
        for key, out in list(self._unacked.items()):
            if out.waiting is not None and node in out.waiting:
                out.waiting.discard(node)
                if not out.waiting:
                    self._forget(key)

    def _on_ack(self, acker: str, body_frame) -> None:
        try:
            body = wire.decode_body(body_frame, max_frame=self.max_frame)
            entries = body["acks"]
            if not isinstance(entries, list):
                raise TypeError("acks must be a list")
        except (WireError, KeyError, TypeError) as e:
            self._bad(f"ack from {acker!r}: {e}")
            return
        unacked = self._unacked
        for e in entries:
            if not isinstance(e, list) or len(e) not in (3, 4) or e[1] != self.inc:
                continue
            src = e[0]
            first = e[2]
            last = e[3] if len(e) == 4 else first
            if not isinstance(first, int) or not isinstance(last, int) or last < first:
                continue
            if last - first < 64:
                keys = [(src, s) for s in range(first, last + 1)]
            else:  # a wide range: look at what we hold instead of every number in it
                keys = [k for k in list(unacked) if k[0] == src and first <= k[1] <= last]
            for key in keys:
                out = unacked.get(key)
                if out is None:
                    continue
                if out.waiting is not None:
                    out.waiting.discard(acker)
                    if out.waiting:
                        continue
                self._forget(key)

    def _flush_acks(self) -> None:
        """Send what arrived since the last flush: one "ack" per source address, or, on a
        server, one per client node covering every address it hosts (the entries name
        their src, so the receiving node's runtime needs no more than that)."""
        pending, self._acks = self._acks, {}
        by_dst: dict[str, list[list]] = {}
        for src, items in pending.items():
            entries = by_dst.setdefault(self._host.get(src, src), [])
            by_inc: dict[int, list[int]] = {}
            for inc, seq in items:
                by_inc.setdefault(inc, []).append(seq)
            for inc, seqs in by_inc.items():
                seqs.sort()
                first = prev = seqs[0]
                for s in seqs[1:]:
                    if s == prev + 1 or s == prev:
                        prev = s
                        continue
                    entries.append([src, inc, first, prev])
                    first = prev = s
                entries.append([src, inc, first, prev])
        for dst, entries in by_dst.items():
            self._send_control("ack", dst, {"acks": entries}, src=self._ack_src)

    # -- timers
    def _timers(self, now: float) -> None:
        st = self._state
        if st == _DISCONNECTED:
            if now >= self._reconnect_at and not self._closing:
                self.n_reconnects += 1
                self.log.info("reconnecting", endpoint=self.endpoint)
                self._connect()
            return
        limit = self._silence_limit()
        if now - self._last_rx > limit and now >= self._next_silence_check:
            idle = receive_idle_s(self._rx_fd, self._rx_peer)
            if idle is None or idle >= limit:
                self._lost(f"no traffic for {now - self._last_rx:.1f} s")
                return
            # bytes still arrive: a message longer than the limit is on its way
            if self._transit_noted != self._last_rx:
                self._transit_noted = self._last_rx
                self.log.info("no whole message from the broker, but data still arriving: "
                              "a long message in transit", silent_s=round(now - self._last_rx, 1),
                              data_idle_s=idle)
            self._next_silence_check = now + min(self.heartbeat_s, limit - idle)
        if self._seen and now >= self._next_seen_sweep:
            self._next_seen_sweep = now + min(60.0, max(self.dedup_ttl_s / 4, 0.05))
            self._seen_sweep(now)
        if st == _READY:
            if self._acks and now >= self._next_ack:
                self._flush_acks()
                self._next_ack = now + self.ack_interval_s
            if now - self._last_tx >= min(self.heartbeat_s, self._broker_hb):
                self._send_control("heartbeat", BROKER, None, src=self.name)
            if now >= self._next_resend:
                self._next_resend = now + max(self.resend_s / 4, 0.05)
                self._resend_stale(now)

    def _resend_stale(self, now: float) -> None:
        """Messages unacknowledged for resend_s are transmitted again (lost on the way?)."""
        limit = now - self.resend_s
        n = 0
        for out in self._unacked.values():
            if out.sent_at and out.sent_at < limit:
                self._transmit(out.frames)
                out.sent_at = now
                n += 1
        if n:
            self.n_resent += n
            self.log.info("resent stale unacknowledged messages", count=n)

