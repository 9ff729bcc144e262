"""The fedbus broker: one ROUTER socket that routes messages between registered nodes.

Built from small verbs in the style of the zguide's Majordomo broker:

    run -> process_batch -> dispatch -> (process_node | route | broadcast | refuse)
        -> send_heartbeats / purge_dead / expire_parked / flush_pending / log_stats

Nodes register the addresses (client ids) they host and their role; the broker keeps the
routing table address -> node, tells the server about joins/leaves, enforces the role rules
(only the server addresses clients or broadcasts; a client node addresses only the server,
with a src it hosts) and purges nodes that fall silent. The body frame is never decoded: it
is forwarded as the zmq.Frame it arrived in (no copy). See PROTOCOL.md for the rules.

Hot path (process_batch): one poll, then recv with NOBLOCK until EAGAIN (at most 2048 per
batch). A message costs 3 recv + 3 send calls into pyzmq; the header and body are received as
zmq.Frame objects only because Frame.more is the cheapest way pyzmq offers to read RCVMORE
(``getsockopt`` converts the option to an enum on every call), and both checks are needed to
reject one-frame and three-frame messages without ever misreading the next message. A
canonical header whose (kind, src, dst, run) prefix this node has sent and we have routed
before costs one dict lookup plus a 53-byte struct check (the per-node route cache, cleared
whenever the routing table changes); everything else goes through dispatch(). Per-message
debug lines (with sha256) are produced only when debug logging is on.

That loop runs in C where the optional extension was built (fastroute, _fastroute.c): the
same checks, no pyzmq calls, ~2.5x the messages a second at 200 B (docs/PERFORMANCE.md);
every message it does not route comes back to dispatch() as the Python loop would pass it.
The Python loop runs under debug logging, with FEDBUS_BROKER_FASTPATH=0, or without the
extension; the "broker listening" line says which.

Limits (PROTOCOL.md §11): what each registered node sends into the broker is metered by two
token buckets (messages/s and bytes/s, with bursts; the server has its own, by default
unlimited). Both loops spend a per-node credit (Node.credit) and hand a message back to
dispatch() when it is used up; dispatch() refills the credit from the buckets or drops the
message as `rate_limited`. Registrations are limited per key (a small burst, then about one a
second): one over the limit is held, the newest per key, until the key's bucket allows it, so
a key's flood reaches the server as a few `join`s. A register body is at most
MAX_REGISTER_BYTES and is decoded with hooks that stop at a second map or list.
"""
from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path

import msgpack
import zmq

from . import wire
from .fastroute import credit_type, fast_route, why_not
from .log import get_logger
from .peer import noted_connection, receive_idle_s
from .wire import BROADCAST, BROKER, DEFAULT_MAX_FRAME, SERVER, WireError

__all__ = ["MAX_REGISTER_BYTES", "Broker", "Limits", "Node"]

# A register body's cap. A relay hosting 100,000 clients "c0".."c99999" registers a body of
# 688,973 bytes (msgpack: 7 bytes per address), 100,000 addresses of 19 characters take 2.1
# MB; 2 MiB is ~3x the first. Decoding a hostile 2 MiB body costs at most ~50 MB for a moment
# (700,000 two-character strings; containers beyond the body's one map and one list stop the
# decoder at once).
MAX_REGISTER_BYTES = 2 * 1024 * 1024
_UNLIMITED = 1 << 62

ENDED_RUNS = 64  # runs whose shutdown a late-registering node is sent (Broker._ended)
MEMBERS_PER_RUN = 100_000  # node incarnations remembered per run (Broker._members)
# kinds a node may send to the broker itself (dst "broker")
_CONTROL_KINDS = frozenset({"register", "heartbeat", "leave", "shutdown"})
# kinds a node never sends to another node: only the broker sends ready/join/leave notices,
# and register/heartbeat/leave requests go to "broker"
_NOT_FORWARDED = frozenset({"ready", "join", "leave", "register", "heartbeat"})
# what a node sends the broker outside its message budget (registrations have their own)
_UNMETERED_KINDS = frozenset({"register", "heartbeat", "leave"})
_NB = zmq.NOBLOCK
_MORE_NB = zmq.SNDMORE | zmq.NOBLOCK
_FULL, _UNREACHABLE = "full", "unreachable"  # why Broker._send_now did not send


class Node:
    """A registered node (one DEALER socket): its routing id, role and hosted addresses."""

    __slots__ = (
        "blocked_at",
        "budget",
        "clients",
        "credit",
        "fd",
        "inc",
        "is_server",
        "last_seen",
        "name",
        "peer",
        "pending",
        "pending_bytes",
        "rcache",
        "rid",
        "role",
        "run",
        "since",
        "sources",
        "transit_noted",
    )

    def __init__(self, name: str, rid: bytes, role: str, clients: tuple[str, ...], run: str,
                 now: float, inc: int = 0):
        self.name = name
        self.inc = inc  # its Peer's incarnation: the same process across re-registrations
        self.rid = rid
        self.role = role
        self.is_server = role == "server"
        self.clients = clients
        # the src values this node may use
        self.sources = frozenset(clients) | {name} | ({SERVER} if self.is_server else set())
        self.run = run
        self.last_seen = now
        self.since = now
        self.pending: deque = deque()  # (sender rid, hdr, body, kind, src, dst, seq, nbytes)
        self.pending_bytes = 0
        self.blocked_at: float | None = None  # its pipe was full (HWM) since then
        # header prefix (kind, src, dst, run) -> the node it routes to; only for messages this
        # node may send, cleared whenever the routing table changes
        self.rcache: dict[bytes, Node] = {}
        # its connection (libzmq's fd, the far end), refreshed by its heartbeats: a node
        # silent for the limit while data still arrives on it is sending a long message
        self.fd: int | None = None
        self.peer = None
        self.transit_noted = 0.0  # last_seen when that was last logged
        # what it may still send (rate limits): the credit both routing loops spend, refilled
        # from its identity's _Budget (kept across its registrations) by Broker._spend
        self.budget: _Budget | None = None
        self.credit = None

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.role}, {len(self.clients)} clients)"


class _RateLimit:
    """At most `per_s` events per second pass; the rest are counted for a summary."""

    def __init__(self, per_s: int):
        self.per_s = per_s
        self.window = 0.0
        self.n = 0
        self.suppressed = 0

    def allow(self, now: float) -> bool:
        if now - self.window >= 1.0:
            self.window = now
            self.n = 0
        self.n += 1
        if self.n <= self.per_s:
            return True
        self.suppressed += 1
        return False


class Limits:
    """The broker's rate limits (PROTOCOL.md §11); every rate 0 = unlimited.

    peer_msg_rate, peer_byte_rate: what one client node may send into the broker, messages
        and bytes a second, sustained; burst_s seconds of each may come at once. Sized for a
        node hosting 1,000 clients answering 1,000 tasks at once (2,000 messages with their
        evaluations, 40,000 fit a burst) and for a 10 GbE link (1 GiB/s, bursts of 2 GiB:
        45 of a ResNet-18's 45 MB updates), while one flooding node can no longer fill the
        server's pipe at the broker's full speed (300,000 msg/s at 200 B).
    server_msg_rate, server_byte_rate: the same for the server node; unlimited by default (it
        sends every task and broadcast: 1,000 tasks of 45 MB are 45 GB in a round).
    register_rate, register_burst: registrations per key (under CURVE; per node name in
        plaintext) a second, and how many may come at once: restarts and a relay's
        re-registrations as its nodes join (a Peer has one registration in flight at a time,
        and a held one is replaced by its newer list) pass; 20,000 from one key make at most
        register_burst + register_rate x seconds `join`s at the server.
    """

    __slots__ = ("burst_s", "peer_byte_rate", "peer_msg_rate", "register_burst",
                 "register_rate", "server_byte_rate", "server_msg_rate")

    def __init__(self, *, peer_msg_rate: float = 20_000, peer_byte_rate: float = 1 << 30,
                 server_msg_rate: float = 0, server_byte_rate: float = 0,
                 burst_s: float = 2.0, register_rate: float = 1.0, register_burst: int = 10):
        for k, v in (("peer_msg_rate", peer_msg_rate), ("peer_byte_rate", peer_byte_rate),
                     ("server_msg_rate", server_msg_rate),
                     ("server_byte_rate", server_byte_rate), ("register_rate", register_rate)):
            if v < 0:
                raise ValueError(f"{k} must be >= 0 (0 = unlimited), got {v}")
        if burst_s <= 0 or register_burst < 1:
            raise ValueError("burst_s must be > 0 and register_burst >= 1")
        self.peer_msg_rate = float(peer_msg_rate)
        self.peer_byte_rate = float(peer_byte_rate)
        self.server_msg_rate = float(server_msg_rate)
        self.server_byte_rate = float(server_byte_rate)
        self.burst_s = float(burst_s)
        self.register_rate = float(register_rate)
        self.register_burst = int(register_burst)

    def for_role(self, role: str) -> tuple[float, float]:
        """(messages/s, bytes/s) for a node of this role."""
        if role == "server":
            return self.server_msg_rate, self.server_byte_rate
        return self.peer_msg_rate, self.peer_byte_rate

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__slots__}


class _PyCredit:
    """The Python twin of _fastroute.Credit (used when the extension is not)."""

    __slots__ = ("msgs", "nbytes")

    def __init__(self, msgs: int = 0, nbytes: int = 0):
        self.msgs = msgs
        self.nbytes = nbytes


class _Budget:
    """One identity's token buckets (messages, bytes), lazily refilled into its credit."""

    __slots__ = ("byte_burst", "byte_rate", "carry_b", "carry_m", "credit", "dropped",
                 "logged_at", "msg_burst", "msg_rate", "role", "t", "told_at")

    def __init__(self, role: str, limits: Limits, credit_cls, now: float):
        self.role = role
        self.msg_rate, self.byte_rate = limits.for_role(role)
        # a burst never below one message (bytes may be overdrawn by the last message)
        self.msg_burst = max(1, int(self.msg_rate * limits.burst_s))
        self.byte_burst = max(1, int(self.byte_rate * limits.burst_s))
        self.credit = credit_cls(self.msg_burst if self.msg_rate else _UNLIMITED,
                                 self.byte_burst if self.byte_rate else _UNLIMITED)
        self.t = now
        self.carry_m = self.carry_b = 0.0
        self.dropped = 0  # over the limit since the last log line
        self.logged_at = self.told_at = -1e9

    def refill(self, now: float) -> None:
        dt = now - self.t
        if dt <= 0:
            return
        self.t = now
        cr = self.credit
        if self.msg_rate:
            add = dt * self.msg_rate + self.carry_m
            whole = int(add)
            if cr.msgs + whole >= self.msg_burst:
                cr.msgs, self.carry_m = self.msg_burst, 0.0
            else:
                cr.msgs += whole
                self.carry_m = add - whole
        if self.byte_rate:
            add = dt * self.byte_rate + self.carry_b
            whole = int(add)
            if cr.nbytes + whole >= self.byte_burst:
                cr.nbytes, self.carry_b = self.byte_burst, 0.0
            else:
                cr.nbytes += whole
                self.carry_b = add - whole

    def retry_after_s(self) -> float:
        """Seconds until a message (and a byte) will be allowed again."""
        cr, t = self.credit, 0.0
        if self.msg_rate and cr.msgs < 1:
            t = max(t, (1 - cr.msgs - self.carry_m) / self.msg_rate)
        if self.byte_rate and cr.nbytes < 1:
            t = max(t, (1 - cr.nbytes - self.carry_b) / self.byte_rate)
        return round(max(t, 0.001), 3)


class _RegisterStop(Exception):
    """A register body holds a container other than its one map and one list."""


class EndedRuns:
    """The file a broker keeps its ended runs' shutdowns in (Broker._ended), written
    whole on each run's end (a temporary file, fsync, rename) and read when a broker
    starts: a broker killed after a run ended, and restarted on the same file, still sends
    a node that was away at the end (stopped, cut off) the shutdown it missed, where it
    would otherwise wait for a finished run for ever. msgpack: {"v": 1, "ended":
    [[run, header, body], ...]}, oldest first. A file that cannot be read is moved aside
    (FILE.damaged), said, and the broker starts with none."""

    VERSION = 1

    def __init__(self, path: str | Path, log):
        self.path = Path(path)
        self.log = log

    def load(self) -> dict[str, tuple[bytes, bytes]]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            doc = msgpack.unpackb(raw, raw=False)
            if not isinstance(doc, dict) or doc.get("v") != self.VERSION:
                raise ValueError(f"not a version-{self.VERSION} ended-runs file")
            ended = {}
            for item in doc["ended"][-ENDED_RUNS:]:
                run, hdr, body = item
                if not (isinstance(run, str) and isinstance(hdr, bytes) and
                        isinstance(body, bytes)):
                    raise ValueError("an entry is not [run, header, body]")
                ended[run] = (hdr, body)
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as err:
            aside = self.path.with_name(self.path.name + ".damaged")
            os.replace(self.path, aside)
            self.log.error("ended-runs file damaged: moved aside, starting with none",
                           path=str(self.path), moved_to=str(aside), error=str(err))
            return {}
        self.log.info("ended runs read", path=str(self.path), runs=len(ended))
        return ended

    def save(self, ended: dict[str, tuple[bytes, bytes]]) -> None:
        data = msgpack.packb({"v": self.VERSION,
                              "ended": [[run, h, b] for run, (h, b) in ended.items()]},
                             use_bin_type=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as err:  # a full disk: the run's shutdown still goes out
            self.log.error("ended-runs file not written: a node away now and a broker "
                           "restarted before it is back would miss its shutdown",
                           path=str(self.path), error=str(err))


class Broker:
    """The message broker. ``Broker(bind).run()`` blocks until ``stop()`` / stop_event.

    bind: one endpoint or a list ("tcp://0.0.0.0:5555", "ipc:///tmp/fedbus.sock", ...).
    heartbeat_s, liveness: a node silent for heartbeat_s * liveness is purged.
    max_frame: the largest frame accepted (bytes); larger ones are dropped and logged.
    grace_s: after the broker starts, messages to addresses not registered yet are held this
        long (nodes re-register after a broker restart) before they are refused as
        unroutable. Default max(10 s, 4 * heartbeat_s * liveness).
    curve: an auth.BrokerCurve (keypair + allow-list) to require CurveZMQ on every endpoint;
        None = plaintext. See PROTOCOL.md §10.
    limits: a Limits (rate limits per node and registrations per key, PROTOCOL.md §11);
        None = the defaults.
    ended_file: where the shutdowns of ended runs are kept (EndedRuns), so that a broker
        restarted on the same file still sends a node coming back after its run ended the
        shutdown it missed; None = in memory only (lost with the process).
    """

    def __init__(
        self,
        bind: str | Iterable[str],
        *,
        heartbeat_s: float = 1.0,
        liveness: int = 3,
        max_frame: int = DEFAULT_MAX_FRAME,
        curve=None,
        grace_s: float | None = None,
        max_pending: int = 10_000,
        max_pending_bytes: int = 256 * 1024 * 1024,
        limits: Limits | None = None,
        ended_file: str | Path | None = None,
    ):
        if heartbeat_s <= 0 or liveness < 1:
            raise ValueError("heartbeat_s must be > 0 and liveness >= 1")
        self.heartbeat_s = float(heartbeat_s)
        self.liveness = int(liveness)
        self.max_frame = int(max_frame)
        self.grace_s = (
            float(grace_s) if grace_s is not None else max(10.0, 4 * heartbeat_s * liveness)
        )
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.inc = random.getrandbits(63)
        self.log = get_logger("broker")
        self.debug = self.log.isEnabledFor(logging.DEBUG)

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.sock.setsockopt(zmq.LINGER, 0)
        # frames up to 2 x max_frame reach the codec (and are logged as oversized);
        # anything larger makes libzmq drop the connection before allocating it
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_frame + 4096)
        self._send = _raw_send(self.sock)
        self._croute = fast_route(self.sock)  # (C route, socket address), or None
        self.limits = limits if limits is not None else Limits()
        self.max_register = min(MAX_REGISTER_BYTES, self.max_frame)
        self._credit_cls = credit_type() or _PyCredit
        self.endpoints: list[str] = []
        binds = [bind] if isinstance(bind, str) else list(bind)
        if not binds:
            raise ValueError("Broker needs at least one endpoint to bind")
        # CURVE (auth.BrokerCurve): every endpoint of the socket encrypts, and the ZAP handler
        # admits only allow-listed keys; register() takes identities from their names
        self.curve = curve
        self.zap = None
        try:
            if curve is not None:
                from .auth import ZAP_DOMAIN, ZapHandler

                self.zap = ZapHandler(self.ctx, curve.allow, watch=self.sock)
                self.sock.setsockopt(zmq.CURVE_SERVER, 1)
                self.sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret)
                self.sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public)
                self.sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            for ep in binds:
                self.sock.bind(ep)
                self.endpoints.append(self.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        except zmq.ZMQError:
            self.sock.close(0)
            if self.zap is not None:
                self.zap.close()
            self.ctx.term()
            raise

        self.nodes: dict[bytes, Node] = {}  # routing id -> node
        self.routes: dict[str, Node] = {}  # address (client id, node name, "server") -> node
        self.client_nodes: dict[bytes, Node] = {}
        self.server: Node | None = None
        self.parked: dict[str, deque] = {}  # unknown address -> messages held during grace
        self.parked_count = 0
        # addresses registered at some point in this broker's life: a message for one that is
        # gone now is refused at once, even during the start-up grace
        self.seen_addresses: set[str] = set()
        self.backlogged: set[Node] = set()  # nodes with held messages
        self.blocked: set[Node] = set()  # nodes whose pipe was full at the last try
        self.stall_limit_s = self.heartbeat_s
        self._stalled_since = 0.0
        self.no_purge_until = 0.0
        self.started = time.monotonic()
        self.now = self.started
        self._stop = False
        self._closed = False
        self._last_not_reg: dict[bytes, float] = {}
        # run -> (header, body) of its server's shutdown broadcast: a client node of that run
        # that registers afterwards (stopped or cut off past the end) is sent it then, or it
        # would wait for a finished run forever. The newest ENDED_RUNS runs are kept.
        self._ended_file = EndedRuns(ended_file, self.log) if ended_file is not None else None
        self._ended: dict[str, tuple[bytes, bytes]] = \
            self._ended_file.load() if self._ended_file is not None else {}
        # run -> (name, inc) of the client nodes registered while its server was: one of
        # them registering again with no run (never configured: its config was lost, say)
        # after the run ended is the same process, and is sent the shutdown too; a new
        # process of that name is not (it may be waiting for the next run)
        self._members: dict[str, set[tuple[str, int]]] = {}
        # (name, inc) of the client nodes registered while the current server is: its run's
        # members once that is known (a relay, the server of its site, learns it upstream)
        self._with_server: set[tuple[str, int]] = set()
        # counters (totals) and the per-second snapshot
        self.n_routed = 0
        self.n_bytes = 0
        self.n_refused = 0
        self.n_bad = 0
        self.n_unroutable = 0
        self.bad_reasons: dict[str, int] = {}
        self.n_rate_limited = 0  # messages dropped over a node's rate limit
        self.n_register_held = 0  # registrations held by the per-key limit
        self.n_ended_sent = 0  # shutdowns sent to nodes registering after their run ended
        # rate limits: token buckets per identity (kept across registrations), per-key
        # registration buckets [tokens, time], and the newest held registration per key
        self._budgets: dict[str, _Budget] = {}
        self._reg_buckets: dict[object, list] = {}
        self._reg_held: dict[object, tuple] = {}
        self._next_reg_flush = 0.0
        self._snap = (0, 0, 0, 0, 0)
        self._rl_bad = _RateLimit(5)
        self._rl_refuse = _RateLimit(20)
        self.log.info(
            "broker listening", endpoints=self.endpoints, heartbeat_s=self.heartbeat_s,
            liveness=self.liveness, max_frame=self.max_frame, grace_s=self.grace_s,
            curve=curve is not None, fast_path="C" if self._croute else f"Python ({why_not()})",
            limits=self.limits.as_dict(), max_register_bytes=self.max_register,
        )

    # ------------------------------------------------------------------ main loop
    def run(self, stop_event=None) -> None:
        """Serve until stop() is called or stop_event (anything with is_set()) is set."""
        sock = self.sock
        hb = self.heartbeat_s
        now = time.monotonic()
        next_hb = now + hb
        next_stats = now + 1.0
        busy = False
        while not self._stop and not (stop_event is not None and stop_event.is_set()):
            if self.backlogged:
                self.flush_pending()
            if self.blocked and self.stalled():
                # back-pressure: a node's pipe is full, so stop reading until it drains
                # (the senders' own pipes fill up and block them), as zmq.proxy does
                time.sleep(0.0002)
            else:
                if not busy:
                    now = time.monotonic()
                    wait = min(next_hb, next_stats) - now
                    if self.backlogged:
                        wait = min(wait, 0.002)
                    if self._reg_held:
                        wait = min(wait, self._next_reg_flush - now)
                    wait = min(max(wait, 0.0), 0.1)
                    busy = sock.poll(int(wait * 1000) + (1 if wait > 0 else 0), zmq.POLLIN) != 0
                if busy:
                    busy = self.process_batch()
            now = self.now = time.monotonic()
            if self._reg_held and now >= self._next_reg_flush:
                self.flush_held_registrations()
            if now >= next_hb:
                self.send_heartbeats()
                if now >= self.no_purge_until:
                    self.purge_dead()
                self.expire_parked()
                next_hb = now + hb
            if now >= next_stats:
                self.log_stats()
                next_stats = now + 1.0

    def stalled(self) -> bool:
        """True while some node's pipe is full and it has been so for less than the stall
        limit (a node that takes nothing for that long no longer holds everyone up: further
        messages for it are queued, up to max_pending, then refused)."""
        now = time.monotonic()
        limit = self.stall_limit_s
        stalled = False
        for node in self.blocked:
            if now - node.blocked_at < limit:
                stalled = True
        if stalled:
            self._stalled_since = self._stalled_since or now
        elif self._stalled_since:
            # we read nothing while stalled: give every node a heartbeat interval of credit
            self.no_purge_until = now + self.heartbeat_s
            self._stalled_since = 0.0
        return stalled

    def serve_forever(self) -> None:
        """run() until stop() is called (e.g. from a signal handler)."""
        self.run()

    def stop(self) -> None:
        self._stop = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self.log_stats(force=True)
        if self.zap is not None:
            self.sock.disable_monitor()
            self.zap.close()
        self.sock.close(0)
        self.ctx.term()
        self.log.info("broker closed")

    # ------------------------------------------------------------------ receive
    def process_batch(self, max_msgs: int = 2048) -> bool:
        """Drain up to max_msgs messages without blocking; True if more may be waiting.

        The fast path handles the common case inline: a registered node with rate-limit
        credit left sends a canonical header whose (kind, src, dst, run) prefix was validated
        and routed before (the route cache) to a node that is taking messages. Everything else
        goes through dispatch().
        """
        if self._croute is not None and not self.debug:
            return self._process_batch_c(max_msgs)
        recv = self.sock.recv
        send = self._send
        dispatch = self.dispatch
        nodes = self.nodes
        unpack_tail = wire._TAIL_KEYS_ONLY.unpack_from
        TAIL = wire._TAIL_LEN
        HMAX = wire.MAX_HEADER_BYTES
        K1, K2, K3, K4 = wire._TAIL_KEYS
        max_frame = self.max_frame
        fast = not self.debug
        now = self.now = time.monotonic()
        routed = nbytes = 0
        try:
            for _ in range(max_msgs):
                try:
                    rid = recv(_NB)
                except zmq.Again:
                    return False
                hf = recv(_NB, copy=False)  # a ROUTER message always has a part after the id
                if not hf.more:
                    self.bad_frame(rid, "message has 1 frame, expected 2 (header, body)")
                    continue
                body = recv(_NB, copy=False)
                if body.more:
                    extra = self._discard_rest()
                    self.bad_frame(rid, f"message has {2 + extra} frames, expected 2")
                    continue
                hdr = hf.bytes
                if fast:
                    n = len(hdr)
                    node = nodes.get(rid)
                    if node is not None and TAIL < n <= HMAX:
                        prefix = hdr[:-TAIL]
                        # route cache: canonical prefixes this node sent and we routed before
                        target = node.rcache.get(prefix)
                        credit = node.credit
                        if (target is not None and not target.pending and credit.msgs > 0
                                and credit.nbytes > 0):
                            k1, rnd, k2, k3, k4 = unpack_tail(hdr, n - TAIL)
                            blen = len(body)
                            if (k1 == K1 and k2 == K2 and k3 == K3 and k4 == K4 and rnd >= -1
                                    and blen <= max_frame):
                                try:
                                    send(target.rid, _MORE_NB)
                                    send(hdr, _MORE_NB)
                                    send(body, _NB, copy=False)
                                except zmq.ZMQError:
                                    pass  # full or gone: dispatch() holds it and says why
                                else:
                                    node.last_seen = now
                                    credit.msgs -= 1
                                    credit.nbytes -= n + blen
                                    routed += 1
                                    nbytes += n + blen
                                    continue
                dispatch(rid, hdr, body)
                if self.blocked:
                    return True
            return True
        finally:
            self.n_routed += routed
            self.n_bytes += nbytes

    def _process_batch_c(self, max_msgs: int) -> bool:
        """process_batch with its fast path in C (fastroute): the same decisions; each message
        it does not route comes back here, exactly as the Python loop would see it."""
        route, sock = self._croute
        nodes, max_frame = self.nodes, self.max_frame
        left = max_msgs
        while left > 0:
            self.now = now = time.monotonic()
            more, routed, nbytes, used, held = route(sock, nodes, left, max_frame, now)
            self.n_routed += routed
            self.n_bytes += nbytes
            left -= used
            if held is None:
                return more
            if len(held) == 2:
                self.bad_frame(*held)
            else:
                self.dispatch(*held)
                if self.blocked:
                    return True
        return True

    def _discard_rest(self) -> int:
        n = 0
        while self.sock.getsockopt(zmq.RCVMORE):
            self.sock.recv(_NB, copy=False)
            n += 1
        return n

    def dispatch(self, rid: bytes, hdr: bytes, body) -> None:
        """Validate one message's header and route it, refuse it or handle it here."""
        try:
            kind, src, dst, run, _rnd, seq, inc, _ts = wire.header_fields(
                hdr, max_frame=self.max_frame)
        except WireError as e:
            self.bad_frame(rid, str(e))
            return
        blen = len(body)
        if blen > self.max_frame:
            self.bad_frame(rid, f"body frame of {blen} bytes exceeds max_frame={self.max_frame}")
            return
        node = self.nodes.get(rid)
        if node is None:
            self.from_unregistered(rid, kind, src, dst, seq, body, inc)
            return
        node.last_seen = self.now
        if run and run != node.run:  # configured since it registered (not re-registered)
            self._run_learned(node, run)
        if dst == BROKER and kind in _UNMETERED_KINDS:
            self.process_node(node, kind, src, seq, body, inc)
            return
        credit = node.credit
        if credit.msgs <= 0 or credit.nbytes <= 0:
            node.budget.refill(self.now)
            if credit.msgs <= 0 or credit.nbytes <= 0:
                self.rate_limited(node, kind, src, dst, seq, len(hdr) + blen)
                return
        credit.msgs -= 1
        credit.nbytes -= len(hdr) + blen
        if dst == BROKER:
            self.process_node(node, kind, src, seq, body, inc)
            return
        if kind in _NOT_FORWARDED:
            self.refuse(node, kind, src, dst, seq, "forbidden",
                        f"kind {kind!r} is not sent to {dst!r} (only the broker sends "
                        f"ready/join/leave; register/heartbeat/leave go to 'broker')")
            return
        if src not in node.sources:
            self.refuse(node, kind, src, dst, seq, "forbidden",
                        f"node {node.name!r} does not host src {src!r}")
            return
        if node.is_server:
            if dst == BROADCAST:
                self.broadcast(node, hdr, body, kind, src, seq, run)
                return
            target = self.routes.get(dst)
        elif dst == SERVER:
            target = self.server
        else:
            self.refuse(node, kind, src, dst, seq, "forbidden",
                        f"a client node may address only 'server', not {dst!r}")
            return
        if target is None:
            self.unknown_destination(node, hdr, body, kind, src, dst, seq)
            return
        if self.route(node.rid, target, hdr, body, kind, src, dst, seq, blen):
            # same (kind, src, dst, run) from this node: same decision while routes are stable.
            # Only canonical headers (their prefix is in the codec's validated-prefix cache):
            # then "cached prefix + a tail with the canonical layout" is exactly a valid header.
            prefix = hdr[:-wire._TAIL_LEN]
            if len(node.rcache) < 4096 and prefix in wire._PREFIX_CACHE:
                node.rcache[prefix] = target

    # ------------------------------------------------------------------ send
    def _send_now(self, target: Node, hdr: bytes, body) -> str:
        """Send [target id, header, body] without waiting: "" when sent; _FULL when the node's
        pipe is full (HWM: the node is marked blocked, so reading stops until it catches up);
        _UNREACHABLE when it is not connected right now (EHOSTUNREACH: reconnecting?). Any
        other ZMQ error is raised."""
        send = self._send
        try:
            send(target.rid, _MORE_NB)
            send(hdr, _MORE_NB)
            send(body, _NB, copy=False)
        except zmq.Again:
            if target.blocked_at is None:
                target.blocked_at = time.monotonic()
            self.blocked.add(target)
            return _FULL
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise
            return _UNREACHABLE
        return ""

    def route(self, sender: bytes, target: Node, hdr: bytes, body, kind: str, src: str, dst: str,
              seq: int, blen: int) -> bool:
        """Forward [target id, header, body] to a node; hold it if the node cannot take it.
        True if it was sent now."""
        if target.pending or self._send_now(target, hdr, body):
            # queued behind held messages, its pipe is full, or it is not connected right now:
            # hold it until the node catches up, is back, or is purged
            self._hold(target, (sender, hdr, body, kind, src, dst, seq, blen))
            return False
        self.n_routed += 1
        self.n_bytes += len(hdr) + blen
        if self.debug:
            self.log.debug(
                "routed", src=src, dst=dst, node=target.name, kind=kind, seq=seq,
                bytes=len(hdr) + blen, sha256=hashlib.sha256(_buf(body)).hexdigest(),
            )
        return True

    def broadcast(self, node: Node, hdr: bytes, body, kind: str, src: str, seq: int,
                  run: str = "") -> None:
        """Server -> "*": one copy to every client node. A shutdown is kept under the run
        its header names: a relay registers at its site's broker before it knows its run."""
        run = run or node.run
        if kind == "shutdown" and run:
            self._ended.pop(run, None)
            if len(self._ended) >= ENDED_RUNS:
                del self._ended[next(iter(self._ended))]
            self._ended[run] = (bytes(hdr), bytes(_buf(body)))
            if self._ended_file is not None:
                self._ended_file.save(self._ended)
        if not self.client_nodes:
            self.refuse(node, kind, src, BROADCAST, seq, "unroutable",
                        "broadcast with no client node registered")
            return
        blen = len(body)
        for target in list(self.client_nodes.values()):
            self.route(node.rid, target, hdr, body, kind, src, BROADCAST, seq, blen)

    def _hold(self, target: Node, item: tuple) -> None:
        if len(target.pending) >= self.max_pending or (
            target.pending_bytes + item[7] > self.max_pending_bytes
        ):
            if not item[0]:  # the broker's own notice
                self.log.warning("broker message not delivered", kind=item[3], dst=item[5],
                                 node=target.name, reason="queue full")
                return
            sender, _h, _b, kind, src, dst, seq, _n = item
            self._refuse_rid(sender, kind, src, dst, seq, "unroutable",
                             f"node {target.name!r} is not taking messages and its queue is "
                             f"full ({len(target.pending)} messages)", node=target.name)
            return
        target.pending.append(item)
        target.pending_bytes += item[7]
        self.backlogged.add(target)

    def flush_pending(self) -> None:
        """Retry held messages, oldest first, for every backlogged node."""
        for target in list(self.backlogged):
            q = target.pending
            while q:
                _sender, hdr, body, kind, src, dst, seq, blen = q[0]
                unsent = self._send_now(target, hdr, body)
                if unsent:
                    if unsent == _UNREACHABLE:  # not a full pipe: not blocked, just away
                        target.blocked_at = None
                        self.blocked.discard(target)
                    break
                q.popleft()
                target.pending_bytes -= blen
                self.n_routed += 1
                self.n_bytes += len(hdr) + blen
                if self.debug:
                    self.log.debug(
                        "routed", src=src, dst=dst, node=target.name, kind=kind, seq=seq,
                        bytes=len(hdr) + blen, sha256=hashlib.sha256(_buf(body)).hexdigest(),
                        held=True,
                    )
            if not q:
                self.backlogged.discard(target)
                target.blocked_at = None
                self.blocked.discard(target)

    def send_to(self, rid: bytes, msg: wire.Message) -> bool:
        """Send a broker-originated message. If the node cannot take it now, hold it like a
        routed message (heartbeats excepted: they are simply skipped); never raise."""
        frames = wire.encode(msg)
        node = self.nodes.get(rid)
        if node is not None and node.pending and msg.kind != "heartbeat":
            self._hold(node, (b"", frames[0], frames[1], msg.kind, BROKER, msg.dst, 0,
                              len(frames[1])))
            return False
        try:
            self._send(rid, _MORE_NB)
            self._send(frames[0], _MORE_NB)
            self._send(frames[1], _NB)
        except zmq.ZMQError as e:
            if msg.kind == "heartbeat":  # a node with a full pipe has traffic anyway
                if self.debug:
                    self.log.debug("heartbeat skipped", node=rid.decode("utf-8", "replace"),
                                   reason=e.strerror)
                return False
            if node is not None and e.errno in (zmq.EAGAIN, errno.EHOSTUNREACH):
                if e.errno == zmq.EAGAIN:
                    if node.blocked_at is None:
                        node.blocked_at = time.monotonic()
                    self.blocked.add(node)
                self._hold(node, (b"", frames[0], frames[1], msg.kind, BROKER, msg.dst, 0,
                                  len(frames[1])))
                return False
            self.log.warning("broker message not delivered", kind=msg.kind, dst=msg.dst,
                             node=rid.decode("utf-8", "replace"), reason=e.strerror)
            return False
        return True

    def _msg(self, kind: str, dst: str, body, *, run: str = "", round: int = -1) -> wire.Message:
        return wire.Message(kind, BROKER, dst or "?", body, run=run, round=round, seq=0,
                            inc=self.inc, ts=time.time())

    # ------------------------------------------------------------------ control
    def process_node(self, node: Node, kind: str, src: str, seq: int, body,
                     inc: int = 0) -> None:
        """A message from a registered node to the broker itself."""
        if kind == "heartbeat":
            self._note_connection(node, body)
            return
        if kind == "register":
            self.register(node.rid, src, body, inc)
            return
        if kind == "leave":
            self.unregister(node, "unregistered")
            return
        if kind == "shutdown" and node.is_server:
            self.log.info("shutdown requested by the server", node=node.name)
            self._stop = True
            return
        self.refuse(node, kind, src, BROKER, seq, "forbidden",
                    f"the broker does not accept {kind!r} from a {node.role} node")

    def from_unregistered(self, rid: bytes, kind: str, src: str, dst: str, seq: int, body,
                          inc: int = 0) -> None:
        if kind == "register" and dst == BROKER:
            self.register(rid, src, body, inc)
            return
        if kind == "leave" and dst == BROKER:
            return
        # tell it once in a while (not once per message) so that it re-registers
        last = self._last_not_reg.get(rid, -1e9)
        if self.now - last < 0.1:
            return
        if len(self._last_not_reg) > 100_000:
            self._last_not_reg.clear()
        self._last_not_reg[rid] = self.now
        self.log.info("message from an unregistered node", node=rid.decode("utf-8", "replace"),
                      kind=kind, src=src, dst=dst, seq=seq)
        self._refuse_rid(rid, kind, src, dst, seq, "not_registered",
                         "this node is not registered (broker restarted?): register again",
                         log=False)

    def register(self, rid: bytes, src: str, body_frame, inc: int = 0) -> None:
        """A registration arrived: refuse an oversized body or an unknown key; register now,
        or hold it while its key is over the registration limit (the newest per key)."""
        blen = len(body_frame)
        if blen > self.max_register:
            self._register_error(
                rid, rid.decode("utf-8", "replace"), "bad_register",
                f"register body of {blen} bytes exceeds the limit of {self.max_register} bytes "
                "for a registration (about 300,000 client addresses like 'c12345')")
            return
        ident = self._identity(rid, body_frame)
        if ident is None:
            return
        name, entry = ident
        key = entry.public if entry is not None else name
        if key in self._reg_held:  # after the one held (it replaces it): never out of order
            self._hold_registration(key, (rid, src, body_frame, name, inc),
                                    max(self._next_reg_flush - self.now, 0.001))
            return
        wait = self._register_token(key)
        if wait:
            self._hold_registration(key, (rid, src, body_frame, name, inc), wait)
            return
        self._register(rid, src, body_frame, name, entry, inc)

    def _identity(self, rid: bytes, body_frame) -> tuple[str, object] | None:
        """(node name, allow-list entry or None) of a registration's connection; None after
        refusing it (CURVE: its key is not in the allow-list)."""
        name = rid.decode("utf-8", "replace")
        if self.curve is None:
            return name, None
        # the identity is the authenticated key's (its ZAP User-Id is the key), not what the
        # node says: the allow-list entry of that key names it
        user = _user_id(body_frame)
        entry = self.curve.allow.entry_for_key(user)
        if entry is None:
            self._register_error(rid, name, "forbidden",
                                 f"no allow-list entry for this connection's key ({user!r})")
            return None
        return entry.name, entry

    def _register_token(self, key) -> float:
        """Take a registration token of this key: 0.0, or the seconds until one is free."""
        rate, burst = self.limits.register_rate, float(self.limits.register_burst)
        if not rate:
            return 0.0
        now = self.now
        b = self._reg_buckets.get(key)
        if b is None:
            if len(self._reg_buckets) >= 100_000:  # plaintext: names are anyone's choice
                full = [k for k, (t0, t1) in self._reg_buckets.items()
                        if t0 + (now - t1) * rate >= burst and k not in self._reg_held]
                for k in full or [k for k in self._reg_buckets if k not in self._reg_held]:
                    del self._reg_buckets[k]
            b = self._reg_buckets[key] = [burst, now]
        tokens = min(burst, b[0] + (now - b[1]) * rate)
        b[1] = now
        if tokens >= 1.0:
            b[0] = tokens - 1.0
            return 0.0
        b[0] = tokens
        return max((1.0 - tokens) / rate, 0.001)

    def _hold_registration(self, key, item: tuple, wait: float) -> None:
        """Hold a registration over its key's limit until a token is free; it replaces the
        one held for the key (a Peer's newer register carries its whole, newest list). A held
        one from another connection is answered `rate_limited`."""
        rid, _src, _frame, name, _inc = item
        prev = self._reg_held.get(key)
        retry = round(wait, 3)
        if prev is None and len(self._reg_held) >= 10_000:
            self._register_error(rid, name, "rate_limited",
                                 "too many registrations are waiting at the broker: try later",
                                 retry_after_s=retry)
            return
        if prev is not None and prev[0] != rid:
            self._register_error(prev[0], prev[3], "rate_limited",
                                 "a newer registration with this key, from another "
                                 "connection, replaced this one", retry_after_s=retry)
        if not self._reg_held:
            self._next_reg_flush = self.now + wait
        else:
            self._next_reg_flush = min(self._next_reg_flush, self.now + wait)
        self._reg_held[key] = item
        self.n_register_held += 1
        if self.debug or self._rl_refuse.allow(self.now):
            self.log.warning("registration held: its key registers more often than the limit",
                             node=name, register_rate=self.limits.register_rate,
                             register_burst=self.limits.register_burst, wait_s=retry,
                             held_total=self.n_register_held)

    def flush_held_registrations(self) -> None:
        """Register what was held, for each key whose bucket has a token again."""
        now = self.now
        nxt = now + 1.0
        for key, item in list(self._reg_held.items()):
            wait = self._register_token(key)
            if wait:
                nxt = min(nxt, now + wait)
                continue
            del self._reg_held[key]
            rid, src, frame, _name, inc = item
            ident = self._identity(rid, frame)  # the allow-list may have changed meanwhile
            if ident is not None:
                self._register(rid, src, frame, *ident, inc)
        self._next_reg_flush = nxt

    def _register(self, rid: bytes, src: str, body_frame, name: str, entry,
                  inc: int = 0) -> None:
        """Register (or re-register) a node; reply "ready" or "error"."""
        try:
            body = _decode_register(body_frame)
        except WireError as e:
            self._register_error(rid, name, "bad_register", f"register body: {e}")
            return
        problem = _check_register(body, name, src)
        if problem:
            self._register_error(rid, name, "forbidden" if entry else "bad_register", problem)
            return
        role = body["role"]
        clients = tuple(body.get("clients") or ())
        if role == "server":
            clients = tuple(c for c in clients if c != SERVER)
        if entry is not None:
            problem = entry.check(role, clients)
            if problem:
                self._register_error(rid, name, "forbidden", problem)
                return
        run = body.get("run") or ""
        old = self.nodes.get(rid)
        if old is None and entry is not None:
            # the same key from a new connection (a restarted node): it replaces the old one
            prev = self.routes.get(name)
            if prev is not None and prev.name == name:
                old = prev
        # conflicts with other live nodes
        if role == "server" and self.server is not None and self.server is not old:
            self._register_error(rid, name, "conflict",
                                 f"a server is already registered (node {self.server.name!r})")
            return
        taken = []
        for a in (name, *clients):
            owner = self.routes.get(a)
            if owner is not None and owner is not old and not (a == SERVER and role == "server"):
                taken.append(a)
        if taken:
            self._register_error(
                rid, name, "conflict",
                f"addresses already hosted by other live nodes: {taken[:10]}"
                + (f" (+{len(taken) - 10} more)" if len(taken) > 10 else ""),
            )
            return
        if old is not None:
            self._drop_routes(old)
            if old.rid != rid:
                del self.nodes[old.rid]
                self.log.warning("node replaced by a new connection with its key", node=name)
        node = Node(name, rid, role, clients, run, self.now, inc)
        # its budget is its identity's, kept across registrations (a re-register refills
        # nothing)
        budget = self._budgets.get(name)
        if budget is None or budget.role != role:
            if len(self._budgets) >= 100_000:  # plaintext: names are anyone's choice
                live = {n.name for n in self.nodes.values()}
                self._budgets = {k: v for k, v in self._budgets.items() if k in live}
            budget = self._budgets[name] = _Budget(role, self.limits, self._credit_cls,
                                                   self.now)
        node.budget, node.credit = budget, budget.credit
        if old is not None:
            node.pending, node.pending_bytes = old.pending, old.pending_bytes
            self.backlogged.discard(old)
            self.blocked.discard(old)
            if node.pending:
                self.backlogged.add(node)
        self.nodes[rid] = node
        self._note_connection(node, body_frame)
        self._routes_changed()
        self.routes[name] = node
        for c in clients:
            self.routes[c] = node
        if len(self.seen_addresses) < 1_000_000:
            self.seen_addresses.add(name)
            self.seen_addresses.update(clients)
        if role == "server":
            self.server = node
            self.routes[SERVER] = node
            self.seen_addresses.add(SERVER)
        else:
            self.client_nodes[rid] = node
        self._last_not_reg.pop(rid, None)
        self.log.info("node registered", node=name, role=role, clients=len(clients), run=run,
                      again=old is not None)
        self.send_to(rid, self._msg("ready", name, {
            "heartbeat_s": self.heartbeat_s, "liveness": self.liveness, "node": name,
            "clients": list(clients), "max_frame": self.max_frame,
        }, run=run))
        if role == "server":
            self._ended.pop(run, None)  # the run goes on (resumed)
            self._with_server = set()
            for cn in list(self.client_nodes.values()):
                self._member(run, cn)
                self.send_to(rid, self._msg("join", SERVER, {
                    "node": cn.name, "clients": list(cn.clients), "reason": "registered"},
                    run=cn.run))
        else:
            self.notify_server("join", node, "registered")
            # (a server whose shutdown went out is only waiting for it to be delivered)
            live = self.server.run if self.server is not None else ""
            live = "" if live in self._ended else live
            if self.server is not None:
                self._member(live, node)
            ended, run = self._ended_for(node, live)
            if ended is not None:  # its run ended while it was away: the shutdown it missed
                self.n_ended_sent += 1
                self.log.info("shutdown sent to a node registering after its run ended",
                              node=name, run=run)
                self.route(b"", node, ended[0], ended[1], "shutdown", SERVER, BROADCAST, 0,
                           len(ended[1]))
        self.unpark(node)

    def _run_learned(self, node: Node, run: str) -> None:
        """A node's messages name a run its registration did not: a node configured since
        (whose shutdown and joins then name it), or a relay's site server that learned its
        run upstream (the site's nodes are that run's members)."""
        node.run = run
        if node is self.server:
            members = self._run_members(run)
            for key in self._with_server:
                if len(members) < MEMBERS_PER_RUN:
                    members.add(key)

    def _member(self, run: str, node: Node) -> None:
        """Note a client node registered while the server (of `run`, if known) is."""
        key = (node.name, node.inc)
        if len(self._with_server) < MEMBERS_PER_RUN:
            self._with_server.add(key)
        if run:
            members = self._run_members(run)
            if len(members) < MEMBERS_PER_RUN:
                members.add(key)

    def _run_members(self, run: str) -> set[tuple[str, int]]:
        members = self._members.get(run)
        if members is None:
            while len(self._members) >= 2 * ENDED_RUNS:  # runs whose server never ended
                del self._members[next(iter(self._members))]
            members = self._members[run] = set()
        return members

    def _ended_for(self, node: Node, live: str) -> tuple[tuple[bytes, bytes] | None, str]:
        """(the shutdown of the ended run a registering client node missed, that run), or
        (None, ""): none, or another run's server is live (the node joins that run)."""
        run = node.run
        if run:
            ended = self._ended.get(run)
            return (ended, run) if ended is not None and live in ("", run) else (None, "")
        if live:
            return None, ""
        for run in reversed(self._ended):  # (newest first)
            if (node.name, node.inc) in self._members.get(run, ()):
                return self._ended[run], run
        return None, ""

    def _register_error(self, rid: bytes, name: str, code: str, reason: str, **extra) -> None:
        self.n_refused += 1
        if self.debug or self._rl_refuse.allow(self.now):
            self.log.warning("registration refused", node=name, code=code, reason=reason)
        self.send_to(rid, self._msg("error", name or "?", {
            "code": code, "reason": reason, "kind": "register", "src": name, "dst": BROKER,
            "seq": 0, **extra}))

    def unregister(self, node: Node, reason: str) -> None:
        """Remove a node (it left, or it was purged); tell the server; refuse what it held."""
        if self.nodes.get(node.rid) is not node:
            return
        del self.nodes[node.rid]
        self._drop_routes(node)
        self.backlogged.discard(node)
        self.blocked.discard(node)
        level = self.log.warning if reason == "purged" else self.log.info
        level("node " + reason, node=node.name, role=node.role, clients=len(node.clients),
              silent_s=round(self.now - node.last_seen, 3))
        if not node.is_server:
            self.notify_server("leave", node, reason)
        while node.pending:
            sender, _h, _b, kind, src, dst, seq, _n = node.pending.popleft()
            self._refuse_rid(sender, kind, src, dst, seq, "unroutable",
                             f"node {node.name!r} {reason} before the message could be "
                             "delivered", node=node.name)
        node.pending_bytes = 0

    def _routes_changed(self) -> None:
        for n in self.nodes.values():
            n.rcache.clear()

    def _drop_routes(self, node: Node) -> None:
        self._routes_changed()
        for a in (node.name, *node.clients):
            if self.routes.get(a) is node:
                del self.routes[a]
        if self.server is node:
            self.server = None
            if self.routes.get(SERVER) is node:
                del self.routes[SERVER]
        if self.client_nodes.get(node.rid) is node:
            del self.client_nodes[node.rid]

    def notify_server(self, kind: str, node: Node, reason: str) -> None:
        """Tell the server a client node joined or left."""
        if self.server is None:
            return
        self.send_to(self.server.rid, self._msg(kind, SERVER, {
            "node": node.name, "clients": list(node.clients), "reason": reason}, run=node.run))

    # ------------------------------------------------------------------ liveness
    def send_heartbeats(self) -> None:
        for node in list(self.nodes.values()):
            self.send_to(node.rid, self._msg("heartbeat", node.name, None))

    def purge_dead(self) -> None:
        """Purge every node silent for heartbeat_s * liveness: no whole message from it, and
        no data arriving on its connection either (a message that takes longer than that on
        the wire, a model over a slow link, is not silence)."""
        limit = self.heartbeat_s * self.liveness
        now = time.monotonic()
        for node in list(self.nodes.values()):
            if now - node.last_seen > limit:
                idle = receive_idle_s(node.fd, node.peer)
                if idle is not None and idle < limit:
                    if node.transit_noted != node.last_seen:
                        node.transit_noted = node.last_seen
                        self.log.info("node silent but its data still arriving: a long "
                                      "message in transit", node=node.name,
                                      silent_s=round(now - node.last_seen, 1), data_idle_s=idle)
                    continue
                self.now = now
                self.unregister(node, "purged")

    @staticmethod
    def _note_connection(node: Node, frame) -> None:
        """Remember the connection a node's messages come in on."""
        node.fd, node.peer = noted_connection(frame, node.fd, node.peer)

    # ------------------------------------------------------------------ refusals
    def unknown_destination(self, node: Node, hdr: bytes, body, kind: str, src: str, dst: str,
                            seq: int) -> None:
        """dst is not registered: hold it during the start-up grace, else refuse it."""
        if (self.now - self.started < self.grace_s and dst not in self.seen_addresses
                and self.parked_count < self.max_pending):
            self.parked.setdefault(dst, deque()).append(
                (node.rid, hdr, body, kind, src, dst, seq, len(body), self.now))
            self.parked_count += 1
            if self.debug:
                self.log.debug("held for an unregistered address", src=src, dst=dst, kind=kind,
                               seq=seq)
            return
        self.refuse(node, kind, src, dst, seq, "unroutable", f"no node hosts {dst!r}")

    def unpark(self, node: Node) -> None:
        """A node registered: route what was held for its addresses."""
        if not self.parked:
            return
        addrs = [node.name, *node.clients] + ([SERVER] if node.is_server else [])
        for a in addrs:
            q = self.parked.pop(a, None)
            if not q:
                continue
            for sender, hdr, body, kind, src, dst, seq, blen, _t in q:
                self.parked_count -= 1
                self.route(sender, node, hdr, body, kind, src, dst, seq, blen)

    def expire_parked(self) -> None:
        if not self.parked or self.now - self.started < self.grace_s:
            return
        for dst, q in list(self.parked.items()):
            for sender, _h, _b, kind, src, _d, seq, _n, _t in q:
                self._refuse_rid(sender, kind, src, dst, seq, "unroutable",
                                 f"no node registered {dst!r} within the start-up grace")
        self.parked.clear()
        self.parked_count = 0

    def refuse(self, node: Node, kind: str, src: str, dst: str, seq: int, code: str,
               reason: str, **extra) -> None:
        self._refuse_rid(node.rid, kind, src, dst, seq, code, reason, **extra)

    def _refuse_rid(self, rid: bytes, kind: str, src: str, dst: str, seq: int, code: str,
                    reason: str, *, log: bool = True, **extra) -> None:
        """Log why a message is not delivered and send an "error" back to its sender."""
        if not rid:  # the broker's own notice for a node that is gone: nobody to tell
            if self.debug:
                self.log.debug("broker message dropped", kind=kind, dst=dst, reason=reason)
            return
        self.n_refused += 1
        if code == "unroutable":
            self.n_unroutable += 1
        if log and (self.debug or self._rl_refuse.allow(self.now)):
            self.log.warning("message refused", code=code, reason=reason, kind=kind, src=src,
                             dst=dst, seq=seq, node=rid.decode("utf-8", "replace"))
        if kind in ("error", "heartbeat", "leave"):
            return  # never answer an error (or a heartbeat/leave) with an error
        sender = self.nodes.get(rid)
        self.send_to(rid, self._msg("error", src or "?", {
            "code": code, "reason": reason, "kind": kind, "src": src, "dst": dst, "seq": seq,
            **extra}, run=sender.run if sender else ""))

    def rate_limited(self, node: Node, kind: str, src: str, dst: str, seq: int,
                     nbytes: int) -> None:
        """Drop a message over its sender's rate limit: counted; the sender gets an error
        `rate_limited` (at most 10 a second, each with retry_after_s) and the log one line a
        second per node."""
        self.n_rate_limited += 1
        b = node.budget
        b.dropped += 1
        now = self.now
        if now - b.logged_at >= 1.0:
            self.log.warning(
                "node rate-limited: messages dropped", node=node.name, role=node.role,
                dropped=b.dropped, msg_rate=b.msg_rate, byte_rate=b.byte_rate,
                burst_s=self.limits.burst_s, rate_limited_total=self.n_rate_limited)
            b.logged_at, b.dropped = now, 0
        if kind in ("error", "heartbeat", "leave") or now - b.told_at < 0.1:
            return
        b.told_at = now
        limit = (f"{b.msg_rate:g} messages/s" if b.msg_rate else "") + \
            (" and " if b.msg_rate and b.byte_rate else "") + \
            (f"{b.byte_rate / 2**20:g} MiB/s" if b.byte_rate else "")
        self.send_to(node.rid, self._msg("error", src or "?", {
            "code": "rate_limited", "kind": kind, "src": src, "dst": dst, "seq": seq,
            "reason": f"node {node.name!r} sends more than its limit of {limit} (bursts of "
                      f"{self.limits.burst_s:g} s); {nbytes} bytes dropped",
            "retry_after_s": b.retry_after_s()}, run=node.run))

    def bad_frame(self, rid: bytes, reason: str) -> None:
        """Count, log (rate-limited; every one at debug level) and drop a malformed message."""
        self.n_bad += 1
        key = reason.split(":")[0][:60]
        self.bad_reasons[key] = self.bad_reasons.get(key, 0) + 1
        if self.debug:
            self.log.debug("bad frame dropped", node=rid.decode("utf-8", "replace"),
                           reason=reason)
        elif self._rl_bad.allow(self.now):
            self.log.warning("bad frame dropped", node=rid.decode("utf-8", "replace"),
                             reason=reason)

    # ------------------------------------------------------------------ stats
    def log_stats(self, force: bool = False) -> None:
        """One info line per second with counters, when something happened."""
        self.debug = self.log.isEnabledFor(logging.DEBUG)
        snap = (self.n_routed, self.n_bytes, self.n_refused, self.n_bad, self.n_rate_limited)
        if snap == self._snap and not force and not self._rl_bad.suppressed:
            return
        d = [a - b for a, b in zip(snap, self._snap)]
        self._snap = snap
        extra = {}
        for name, rl in (("bad_suppressed", self._rl_bad), ("refused_suppressed", self._rl_refuse)):
            if rl.suppressed:
                extra[name] = rl.suppressed
                rl.suppressed = 0
        if d[3] or extra.get("bad_suppressed"):
            extra["bad_reasons"] = dict(self.bad_reasons)
        if self.n_register_held:
            extra["register_held_total"] = self.n_register_held
        self.log.info(
            "counters", routed=d[0], bytes=d[1], refused=d[2], bad_frames=d[3],
            rate_limited=d[4], rate_limited_total=snap[4],
            nodes=len(self.nodes), clients=len(self.routes) - len(self.nodes),
            held=sum(len(n.pending) for n in self.backlogged) + self.parked_count,
            routed_total=snap[0], bytes_total=snap[1], refused_total=snap[2],
            bad_frames_total=snap[3], unroutable_total=self.n_unroutable, **extra,
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _raw_send(sock):
    """The socket's send without pyzmq's Python wrapper (routing_id/group handling we do not
    use): the Cython base class method, bound. Falls back to sock.send."""
    base = getattr(zmq.backend, "Socket", None)
    fn = getattr(base, "send", None) if base is not None and isinstance(sock, base) else None
    return fn.__get__(sock) if fn is not None else sock.send


def _buf(frame):
    b = getattr(frame, "buffer", None)
    return b if b is not None else frame


def _user_id(frame) -> str | None:
    """The ZAP User-Id of the connection a received zmq.Frame came from (None if none)."""
    try:
        return frame.get("User-Id") or None
    except (AttributeError, KeyError, OSError, zmq.ZMQError):  # zmq.Frame's, or fastroute's
        return None


def _decode_register(frame):
    """A register body: one map of strings and at most one list of strings (PROTOCOL.md §5).
    The decoder stops at a second map or list, so a body of millions of empty containers
    costs nothing (the frame is at most MAX_REGISTER_BYTES); WireError if it is not that."""
    seen = [0, 0]

    def on_map(pairs):
        seen[0] += 1
        if seen[0] > 1:
            raise _RegisterStop("a register body is one map, with no map inside")
        return dict(pairs)

    def on_list(items):
        seen[1] += 1
        if seen[1] > 1:
            raise _RegisterStop("a register body holds one list (its clients), of strings")
        return items

    view = wire.frame_view(frame)
    if view.nbytes == 0:
        raise WireError("empty body frame")
    try:
        return msgpack.unpackb(view, raw=False, object_pairs_hook=on_map, list_hook=on_list,
                               max_bin_len=0, max_ext_len=0, max_map_len=64)
    except _RegisterStop as e:
        raise WireError(str(e)) from None
    except msgpack.ExtraData:
        raise WireError("trailing bytes after the register body") from None
    except UnicodeDecodeError as e:
        raise WireError(f"a str that is not valid UTF-8: {e.reason}") from None
    except Exception as e:  # noqa: BLE001 -- msgpack's FormatError/ValueError/StackError...
        raise WireError(f"malformed register body: {type(e).__name__}: {e}") from None


def _check_register(body, name: str, src: str) -> str | None:
    """Why a register body is invalid, or None."""
    if type(body) is not dict:
        return "register body must be a map"
    role = body.get("role")
    if role not in ("server", "client"):
        return f"role must be 'server' or 'client', got {role!r}"
    if body.get("node") != name:
        return (f"body node {body.get('node')!r} differs from the node's identity {name!r} "
                "(its routing id; under CURVE its key's name)")
    if src != name:
        return f"register src {src!r} differs from the node's identity {name!r}"
    if not name or len(name.encode()) > wire.MAX_STR_BYTES:
        return "node name must be 1..255 bytes"
    if role == "client" and name in wire.RESERVED_ADDRESSES:
        return f"a client node cannot be named {name!r}"
    clients = body.get("clients", [])
    if clients is None:
        clients = []
    if type(clients) is not list or any(type(c) is not str for c in clients):
        return "clients must be a list of str"
    seen = set()
    for c in clients:
        if role == "server" and c == SERVER:
            continue
        if c in wire.RESERVED_ADDRESSES:
            return f"client id {c!r} is reserved"
        if len(c.encode()) > wire.MAX_STR_BYTES:
            return "client ids must be at most 255 bytes"
        if c == name:
            return f"client id {c!r} equals the node name"
        if c in seen:
            return f"client id {c!r} listed twice"
        seen.add(c)
    run = body.get("run", "")
    if run is not None and type(run) is not str:
        return "run must be a str"
    return None
