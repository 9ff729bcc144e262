"""A deterministic simulation of a whole federation in one process (`fedbus bench sim`).

FoundationDB's simulation testing and TigerBeetle's VOPR, for fedbus: one seed draws a
federation's network (latency, jitter, drops, duplicates, reordering), its faults (node,
server and broker kills with restarts, node stops, link cuts) and its stragglers, and the
production code runs under it on a simulated clock, one event at a time. The same seed
replays bit for bit: every frame delivered, every fault, in the same order, at the same
simulated instant (`World.trace`, a SHA-256 over them).

What runs is production code, driven:
  server   fedbus.node.server.ServerNode (its RunDir, metrics, checkpoint, resume from the
           checkpoint file with `_restore`, `_emit`'s send/record/checkpoint/shutdown order,
           `_finish`'s summary), the engine through `judge`/`take`/`on_tick`
  nodes    fedbus.node.client_host.ClientNode.handle (configure, the pool, the real client
           handlers, client states saved and restored through ClientStateStore)
  peers    fedbus.broker.peer.Peer: `send` (sequencing, encoding), `_drain_socket`
           (header checks, duplicate detection), `_timers` (heartbeats, acks, silence,
           reconnection with backoff, re-registration, stale resends), `_connect`,
           `_register`, `_on_ready`'s resend of everything unacknowledged
  broker   fedbus.broker.broker.Broker.dispatch (registration, routing, parking, refusals,
           join/leave to the server, the shutdown kept for late nodes), `purge_dead`,
           `send_heartbeats`, `expire_parked`
and every message crosses the simulated network as the two real msgpack frames.

What stands in (see docs/RELIABILITY.md, "Simulation"):
  - the sockets: SimSocket replaces the Peer's DEALER and the Broker's ROUTER send (its
    zmq socket is bound to an unused inproc address); the event loop here replaces
    ServerNode.serve's and ClientNode.serve's loops (their bodies are mirrored: judge,
    take or on_refused, _emit; handle, shutdown), Peer._io_step's poll and Broker.run's
    poll and timer loop;
  - time: the modules' `time` (server, client_host, peer, broker) is this world's clock
    while a simulation runs, and a LocalRun's clock is too (a task's compute time is drawn
    from the seed instead of measured);
  - a node's outputs leave when its simulated compute time has passed (HeldSends).
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
import shutil
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

EPOCH = 1_700_000_000.0  # the simulated wall clock's zero
HEARTBEAT_S, LIVENESS = 1.0, 3
SNDMORE = zmq.SNDMORE
# kinds a lossy link may drop or a resending peer duplicate (the rest ride on connection
# state: a lost join or shutdown is a lost connection, which the link cut models)
# (`tasks`, `evals` and `updates`, bus.batch's batches, ride the same reliability as their
# members)
LOSSY = frozenset({"task", "update", "tasks", "updates", "eval", "evals", "eval_result",
                   "config", "ack", "heartbeat", "flush", "flushed"})
DUPLICABLE = frozenset({"task", "update", "tasks", "updates", "eval", "evals", "eval_result",
                        "config", "flush", "flushed"})
FAULT_KINDS = ("node_kill", "node_stop", "link_cut", "server_kill", "server_kill_at_checkpoint",
               "broker_kill")


class SimClock:
    """The simulated clock, standing in for the `time` module of the driven modules."""

    def __init__(self) -> None:
        self.t = 0.0

    def time(self) -> float:
        return EPOCH + self.t

    def monotonic(self) -> float:
        return self.t

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:  # only reachable from a loop the world replaces
        raise RuntimeError("nothing sleeps in a simulation")


_AGAIN = zmq.Again()


class SimFrame(bytes):
    """A received frame as the Peer reads one from zmq (`.more`, `.bytes`)."""

    more = False

    @property
    def bytes(self) -> bytes:
        return bytes(self)


class SimSocket:
    """A Peer's DEALER socket: what it sends goes to the world's network; what the network
    delivers waits in `inbox` for the Peer's `_drain_socket`."""

    def __init__(self, world: World, owner: str):
        self.world, self.owner = world, owner
        self.key = ("", owner)  # (broker, party): set on connect
        self.inbox: list[SimFrame] = []
        self.open = True
        self._out: list[bytes] = []

    def setsockopt(self, *a: Any) -> None:
        pass

    def getsockopt(self, *a: Any) -> int:
        return 0

    def connect(self, endpoint: str) -> None:
        self.key = (endpoint.split("://", 1)[1], self.owner)
        self.world.conns[self.key] = self

    def send(self, frame: Any, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        self._out.append(bytes(frame))
        if not flags & SNDMORE:
            frames, self._out = self._out, []
            self.world.transmit(self.key, True, frames, self)

    def recv(self, flags: int = 0, copy: bool = True) -> SimFrame:
        if not self.inbox:
            raise _AGAIN.with_traceback(None)  # (one instance: zmq's costs a stack format)
        return self.inbox.pop(0)

    def close(self, linger: int | None = None) -> None:
        self.open = False
        if self.world.conns.get(self.key) is self:
            del self.world.conns[self.key]


class SimContext:
    def __init__(self, world: World, owner: str):
        self.world, self.owner = world, owner

    def socket(self, kind: int) -> SimSocket:
        return SimSocket(self.world, self.owner)

    def term(self) -> None:
        pass


class BrokerTap:
    """The Broker's raw send: [routing id, header, body] to the network."""

    def __init__(self, world: World, name: str, broker: Any):
        self.world, self.name, self.broker = world, name, broker
        self._out: list[bytes] = []

    def send(self, frame: Any, flags: int = 0, copy: bool = True, track: bool = False) -> None:
        self._out.append(bytes(frame))
        if not flags & SNDMORE:
            (rid, *frames), self._out = self._out, []
            self.world.transmit((self.name, rid.decode()), False, frames, self.broker)


class HeldSends:
    """A node's Peer as its ClientNode sees it: sends wait until the node's simulated
    compute time for the message it handles has passed, then go to the real Peer."""

    def __init__(self, peer: Any):
        self.peer = peer
        self.held: list[tuple] = []

    @property
    def run(self) -> str:
        return self.peer.run

    @run.setter
    def run(self, value: str) -> None:
        self.peer.run = value

    def send(self, kind: str, dst: str, body: Any, **kw: Any) -> Any:
        from fedbus.broker.wire import Message

        self.held.append((kind, dst, body, kw))
        return Message(kind, kw.get("src") or "", dst, body)

    def release(self) -> None:
        held, self.held = self.held, []
        for kind, dst, body, kw in held:
            self.peer.send(kind, dst, body, **kw)
        self.peer._take_outgoing()


@dataclass
class Fault:
    kind: str
    target: str
    at_version: int  # armed once the server has this many aggregations
    delay_s: float  # then fires this much later
    hold_s: float  # down, stopped or cut this long
    fired_at: float = -1.0
    armed: bool = False
    note: str = ""  # why it did not fire


@dataclass
class SimResult:
    seed: int
    trace: str
    violations: list = field(default_factory=list)
    faults: list = field(default_factory=list)
    events: int = 0
    frames: int = 0
    dropped: int = 0
    duplicated: int = 0
    rounds_done: int = 0
    sim_s: float = 0.0

    @property
    def faults_fired(self) -> int:
        return sum(1 for f in self.faults if f.fired_at >= 0)


class SimKilled(Exception):
    """The party died inside a step (a kill aimed between metrics and checkpoint)."""


@contextmanager
def simulated_time(clock: SimClock):
    """The driven modules read `clock` for `time` while the simulation runs; a LocalRun's
    compute-time clock is frozen at the simulated instant (compute time is drawn instead)."""
    from fedbus.broker import broker as broker_mod
    from fedbus.broker import peer as peer_mod
    from fedbus.node import client_host
    from fedbus.node import server as server_mod

    mods = (broker_mod, peer_mod, client_host, server_mod)
    saved = [m.time for m in mods]
    real_make_run = client_host.make_run

    def make_run(handler: Any, body: dict) -> Any:
        run = real_make_run(handler, body)
        run.clock = clock.monotonic
        run._start = run.clock()
        return run

    for m in mods:
        m.time = clock
    client_host.make_run = make_run
    try:
        yield
    finally:
        for m, t in zip(mods, saved):
            m.time = t
        client_host.make_run = real_make_run


def sim_config(seed: int, *, clients: int, rounds: int, algorithm: str = "noop",
               mode: str = "sync") -> dict:
    """The simulated federation's config: small, stragglers folded (sync), or FedBuff with a
    buffer of half the clients (async)."""
    fed = {"clients": clients, "rounds": rounds, "fraction": 1.0, "seed": seed,
           "deadline_s": 1.5, "hard_deadline_s": 8.0, "min_updates": 1, "min_clients": 1,
           "late": "fold", "eval_every": 1, "start_timeout_s": 4.0, "mode": mode}
    if mode == "async":
        fed.update(concurrency=clients, buffer=max(1, clients // 2), eval_every=2)
    return {
        "federation": fed,
        "data": {"dataset": "digits", "partition": "iid", "test_fraction": 0.25},
        "model": {"arch": "mlp"},
        "algorithm": {"name": algorithm},
        "train": {"epochs": 1, "cohort": "off"},
        "launch": {"nodes": 2, "threads": 1},
        "bus": {"heartbeat_s": HEARTBEAT_S, "liveness": LIVENESS},
        "log": {"messages": False, "level": "error"},
    }


class World:
    """One seed's federation: a broker, a server, client nodes, a network, a clock."""

    def __init__(self, seed: int, *, faults: int = 3, rounds: int = 6, clients: int = 4,
                 nodes: int = 2, relays: int = 0, algorithm: str = "noop",
                 mode: str = "sync", batch: str | None = None,
                 workdir: Path | None = None,
                 horizon_s: float = 900.0, record: Callable[[str], None] | None = None):
        from fedbus.node.config import build_config

        self.seed = seed
        self.rng = np.random.default_rng(np.random.SeedSequence([seed, 0x51A]))
        self.clock = SimClock()
        self.rounds, self.horizon_s = rounds, horizon_s
        self.mode = mode
        self.raw_cfg = sim_config(seed, clients=clients, rounds=rounds, algorithm=algorithm,
                                  mode=mode)
        if batch is not None:  # else bus.batch's default, as a user's run gets it
            self.raw_cfg["bus"]["batch"] = batch
        self.cfg = build_config(self.raw_cfg)
        self.run_id = f"sim{seed:08x}"
        if workdir is None and Path("/dev/shm").is_dir():
            workdir = Path("/dev/shm")  # in memory: the run's fsyncs cost nothing
        self.tmp = Path(tempfile.mkdtemp(prefix=f"fedbus-sim-{seed}-", dir=workdir))
        self.run_dir = self.tmp / "run"
        self.state_dir = self.tmp / "states"
        self.say = record
        self._events: list = []
        self._order = itertools.count()
        self._incs = itertools.count(1)
        self.sha = hashlib.sha256()
        self.conns: dict[tuple[str, str], SimSocket] = {}  # (broker, party) -> connection
        self.parties: dict[tuple[str, str], tuple] = {}  # (broker, party) -> (owner, peer, tag)
        self.procs: dict[tuple[str, str], str] = {}  # (broker, party) -> its process's name
        self.brokers: dict[str, Any] = {}  # name -> Broker ("broker"; relays' "site<j>")
        self.cut: dict[str, float] = {}  # process -> when its links are up again
        self.stopped: dict[str, float] = {}  # process -> when a stopped process resumes
        self.held_links: list[tuple] = []  # frames waiting for a cut link to heal
        self._link_last: dict[tuple[int, int], float] = {}  # connection -> its last arrival
        # the network, drawn per seed
        self.latency_s = float(self.rng.uniform(0.0005, 0.005))
        self.jitter_s = float(self.rng.uniform(0.0, 0.02))
        self.p_drop = float(self.rng.choice([0.0, 0.01, 0.05]))
        self.p_dup = float(self.rng.choice([0.0, 0.02, 0.1]))
        self.task_s = float(self.rng.uniform(0.1, 0.6))
        self.slow = {int(c) for c in self.rng.choice(clients, size=int(self.rng.integers(0, 2)),
                                                      replace=False)}
        self.node_clients = {f"n{i}": [c for c in range(clients) if c % nodes == i]
                             for i in range(nodes)}
        # with relays, node i sits below relay i % relays, on that relay's site broker
        self.relay_names = [f"r{j}" for j in range(relays)]
        self.node_broker = {f"n{i}": f"site{i % relays}" if relays else "broker"
                            for i in range(nodes)}
        self.relays: dict[str, SimRelay] = {}
        self.faults = self._schedule(faults, nodes)
        # the history the chaos invariants read (fedbus.bench.chaos.read_history's format)
        self.history: list[dict] = []
        self.kills: list[dict] = []
        self.problems: list[str] = []
        self.n_frames = self.n_dropped = self.n_dup = 0
        self.server: SimServer | None = None
        self.nodes: dict[str, SimNode] = {}
        self.exited: dict[str, int] = {}  # party -> exit code
        self.exits: list[str] = []  # parties in the order they exited
        self.broker_down_at_end = False  # the server's shutdown left with no broker to take it
        self.server_rc: int | None = None
        self.shutdown_unsent = False

    # ------------------------------------------------------------------ schedule

    def _schedule(self, n: int, nodes: int) -> list[Fault]:
        out = []
        kinds = FAULT_KINDS + (("relay_kill",) if self.relay_names else ())
        for _ in range(n):
            kind = str(self.rng.choice(kinds))
            target = {"server_kill": "server", "server_kill_at_checkpoint": "server",
                      "broker_kill": "broker"}.get(kind) or f"n{int(self.rng.integers(nodes))}"
            if kind == "relay_kill" or (kind == "link_cut" and self.relay_names and
                                        self.rng.random() < 0.5):
                target = str(self.rng.choice(self.relay_names))
            out.append(Fault(kind, target, int(self.rng.integers(0, max(1, self.rounds - 1))),
                             float(self.rng.uniform(0.0, 2.0)),
                             float(self.rng.uniform(0.5, 3 * HEARTBEAT_S * LIVENESS))))
        return sorted(out, key=lambda f: (f.at_version, f.delay_s))

    # ------------------------------------------------------------------ events

    def at(self, t: float, fn: Callable, *args: Any) -> None:
        heapq.heappush(self._events, (t, next(self._order), fn, args))

    def note(self, *parts: Any) -> None:
        self.sha.update(repr((round(self.clock.t, 9), *parts)).encode())

    def new_inc(self) -> int:
        return (self.seed << 20 | next(self._incs)) & ((1 << 63) - 1) or 1

    def transmit(self, key: tuple[str, str], up: bool, frames: list[bytes], via: Any) -> None:
        """A frame pair between party key[1] and broker key[0], up (to the broker) or down."""
        from fedbus.broker.wire import header_fields

        try:
            kind = header_fields(frames[0])[0]
        except ValueError:
            kind = "?"
        target = self.brokers.get(key[0]) if up else self.conns.get(key)
        if target is None:
            return  # no connection: zmq would refuse or drop it
        copies = 1
        if kind in LOSSY and self.rng.random() < self.p_drop:
            self.n_dropped += 1
            return
        if kind in DUPLICABLE and self.rng.random() < self.p_dup:
            copies = 2
            self.n_dup += 1
        for i in range(copies):
            delay = self.latency_s + float(self.rng.exponential(self.jitter_s or 1e-6))
            if i:
                delay += float(self.rng.uniform(0.0, 0.3))  # a resend, later
            self.at(self._fifo(via, target, self.clock.t + delay), self._deliver, key, up,
                    frames, target, via, bool(i), False)

    def _fifo(self, via: Any, target: Any, t: float) -> float:
        """A connection is a TCP stream: what one end sends arrives in order (messages
        reorder across connections, and a resend arrives after what was sent before it)."""
        key = (id(via), id(target))
        t = max(t, self._link_last.get(key, 0.0))
        self._link_last[key] = t
        return t

    def _live(self, via: Any) -> bool:
        return via.open if isinstance(via, SimSocket) else \
            any(via is b for b in self.brokers.values())

    def _deliver(self, key: tuple[str, str], up: bool, frames: list[bytes], target: Any,
                 via: Any, copy: bool, held: bool) -> None:
        proc = self.procs.get(key, key[1])
        if self.cut.get(proc, -1.0) > self.clock.t:
            self.held_links.append((key, up, frames, target, via, copy, True))
            return
        if (copy or held) and not self._live(via):
            # a resend comes from a live connection only; what a cut link held dies with
            # the connection that sent it (a socket closed with linger 0 resets it)
            return
        bname, party = key
        if up:
            if target is not self.brokers.get(bname):
                return  # that broker is gone
            self.n_frames += 1
            self.note("deliver", party, bname, frames[0], hashlib.sha256(frames[1]).digest())
            target.now = self.clock.monotonic()
            target.dispatch(party.encode(), frames[0], frames[1])
            return
        if self.conns.get(key) is not target or not target.open:
            return  # that connection was closed: what was in flight is lost
        if self.stopped.get(proc, -1.0) > self.clock.t:
            self.at(self.stopped[proc], self._deliver, key, up, frames, target, via, copy, held)
            return
        self.n_frames += 1
        self.note("deliver", bname, party, frames[0], hashlib.sha256(frames[1]).digest())
        hdr = SimFrame(frames[0])
        hdr.more = True
        target.inbox += [hdr, SimFrame(frames[1])]
        owner = self.parties.get(key)
        if owner is not None and owner[1]._sock is target:
            owner[1]._drain_socket()
            owner[0].wake(owner[2])

    def heal(self, proc: str) -> None:
        self.note("heal", proc)
        held, self.held_links = self.held_links, []
        for item in held:
            if self.procs.get(item[0], item[0][1]) == proc:
                self.at(self._fifo(item[4], item[3], self.clock.t + self.latency_s),
                        self._deliver, *item)
            else:
                self.held_links.append(item)

    # ------------------------------------------------------------------ parties

    def start_broker(self, name: str = "broker") -> None:
        from fedbus.broker.broker import Broker

        if self.brokers.get(name) is not None:
            self.brokers[name].close()
        # a restarted broker reads the ended runs its predecessor kept (as `fedbus broker
        # --ended-runs FILE` restarted on the same file)
        b = Broker(f"inproc://fedbus-sim-{id(self)}-{name}-{self.clock.t}",
                   heartbeat_s=HEARTBEAT_S, liveness=LIVENESS,
                   grace_s=4 * HEARTBEAT_S * LIVENESS,
                   ended_file=self.tmp / f"ended-runs-{name}.bin")
        b.inc = self.new_inc()
        b._send = BrokerTap(self, name, b).send
        b._croute = None
        b.started = b.now = self.clock.monotonic()
        self.brokers[name] = b
        self.note("broker_up", name, b.inc)
        self.at(self.clock.t + HEARTBEAT_S, self._broker_timers, name, b)

    def _broker_timers(self, name: str, b: Any) -> None:
        """Broker.run's timer part, on the simulated clock."""
        if b is not self.brokers.get(name):
            return
        b.now = self.clock.monotonic()
        if b.backlogged:
            b.flush_pending()
        if b._reg_held and b.now >= b._next_reg_flush:
            b.flush_held_registrations()
        b.send_heartbeats()
        if b.now >= b.no_purge_until:
            b.purge_dead()
        b.expire_parked()
        self.at(self.clock.t + HEARTBEAT_S, self._broker_timers, name, b)

    def make_peer(self, owner: Any, name: str, broker: str = "broker", tag: str = "",
                  **kw: Any) -> Any:
        """A real Peer of process `owner`, connected through the simulated network, its I/O
        driven by io_step (owner.wake(tag) is told when application messages wait)."""
        from fedbus.broker.peer import Peer

        peer = Peer(f"sim://{broker}", name, heartbeat_s=HEARTBEAT_S, liveness=LIVENESS, **kw)
        peer.inc = self.new_inc()
        peer._ctx = SimContext(self, name)
        self.parties[(broker, name)] = (owner, peer, tag)
        self.procs[(broker, name)] = owner.name
        peer._connect()
        self.at(self.clock.t, self.io_step, owner, peer, tag)
        return peer

    def io_step(self, owner: Any, peer: Any, tag: str = "") -> None:
        """Peer._io_step without its poll, on the simulated clock (again at its deadline)."""
        from fedbus.broker.peer import _READY

        if not owner.alive or peer._closed:
            return
        now = self.clock.monotonic()
        if self.stopped.get(owner.name, -1.0) > self.clock.t:
            self.at(self.stopped[owner.name], self.io_step, owner, peer, tag)
            return
        if peer._reregister and peer._state == _READY:
            peer._reregister = False
            peer._register()
        peer._take_outgoing()
        peer._timers(now)
        if peer._sock is not None and peer._sock.inbox:
            peer._drain_socket()
            owner.wake(tag)
        self.at(max(peer._next_deadline(now), now + 0.01), self.io_step, owner, peer, tag)

    # ------------------------------------------------------------------ faults

    def arm_faults(self, version: int) -> None:
        for f in self.faults:
            if not f.armed and f.at_version <= version:
                f.armed = True
                self.at(self.clock.t + f.delay_s, self._fire, f)

    def _why_not(self, f: Fault) -> str:
        """Why fault f cannot fire now ("" when it can)."""
        if self.server is None and self.server_rc is not None:
            return "the run ended first"
        if f.kind == "node_kill" and not getattr(self.nodes.get(f.target), "alive", False):
            return "target already down"
        if f.kind.startswith("server_kill") and self.server is None:
            return "target already down"
        if f.kind == "server_kill_at_checkpoint" and self.server.die_at_checkpoint is not None:
            return "a kill at the checkpoint was armed already"
        if f.kind == "broker_kill" and self.brokers.get("broker") is None:
            return "target already down"
        if f.kind == "relay_kill" and not getattr(self.relays.get(f.target), "alive", False):
            return "target already down"
        return ""

    def _fire(self, f: Fault) -> None:
        f.note = self._why_not(f)
        if f.note:
            return
        f.fired_at = self.clock.t
        self.note("fault", f.kind, f.target)
        if self.say:
            self.say(f"  t={self.clock.t:8.3f}  {f.kind} {f.target} (hold {f.hold_s:.2f} s)")
        if f.kind == "node_kill":
            self.nodes[f.target].kill()
            self.at(self.clock.t + f.hold_s, self.start_node, f.target)
        elif f.kind == "node_stop":
            self.stopped[f.target] = self.clock.t + f.hold_s
        elif f.kind == "link_cut":
            self.cut[f.target] = self.clock.t + f.hold_s
            self.at(self.clock.t + f.hold_s, self.heal, f.target)
        elif f.kind == "server_kill":
            self.kill_server(f)
        elif f.kind == "server_kill_at_checkpoint":
            self.server.die_at_checkpoint = f  # fires inside the next _record
        elif f.kind == "broker_kill":
            self.brokers.pop("broker").close()
            self.at(self.clock.t + f.hold_s, self.start_broker)
        elif f.kind == "relay_kill":
            self.relays[f.target].kill()
            self.at(self.clock.t + f.hold_s, self.start_relay, f.target)

    def kill_server(self, f: Fault) -> None:
        from fedbus.bench.chaos import _checkpoint_version, read_metrics

        srv = self.server
        srv.kill()
        self.server = None
        self.kills.append({"fault": self.faults.index(f), "metrics_version":
                           max([int(r.get("version", 0)) for r in read_metrics(self.run_dir)],
                               default=0),
                           "metrics_versions": [int(r.get("version", 0))
                                                for r in read_metrics(self.run_dir)],
                           "checkpoint_version": _checkpoint_version(self.run_dir),
                           # the newest checkpoint still waiting for its flushes, if any
                           "pending_version": max([p[0] for p in srv.srv._pending],
                                                  default=None)})
        self.at(self.clock.t + f.hold_s, self.start_server, True)

    # ------------------------------------------------------------------ lifecycle

    def start_server(self, resume: bool) -> None:
        self.server = SimServer(self, resume)

    def start_relay(self, name: str) -> None:
        self.relays[name] = SimRelay(self, name)

    def start_node(self, name: str) -> None:
        self.nodes[name] = SimNode(self, name, self.node_clients[name])

    def run(self) -> SimResult:
        from fedbus.node import server as server_mod

        with simulated_time(self.clock):
            self.start_broker()
            self.start_server(False)
            for j, name in enumerate(self.relay_names):
                self.start_broker(f"site{j}")
                self.start_relay(name)
            for name in self.node_clients:
                self.start_node(name)
            n = 0
            while self._events and not self.finished():
                t, _, fn, args = heapq.heappop(self._events)
                if t > self.horizon_s:
                    self.problems.append(f"the run did not end within {self.horizon_s:.0f} "
                                         "simulated seconds")
                    break
                self.clock.t = max(self.clock.t, t)
                fn(*args)
                n += 1
            waiting = {r for r, relay in self.relays.items() if relay.alive}
            for what, parties in (("relay", self.relays), ("node", self.nodes)):
                for node in parties.values():
                    if node.alive:
                        run = node.relay.run_id if what == "relay" else node.node.run_id
                        site = self.node_broker.get(node.name, "broker")
                        above = site != "broker" and f"r{site[4:]}" in waiting
                        forgot = site != "broker" and site in self.brokers and \
                            not self.brokers[site]._ended and f"r{site[4:]}" in self.exited
                        why = " (the server's shutdown was not delivered within its " \
                            "wait)" if self.shutdown_unsent else " (its relay missed the " \
                            "shutdown)" if above else " (its site broker kept no ended run)" \
                            if forgot else "" if run else " (not configured since its " \
                            "start, and registered for no run: a new process with nothing " \
                            "of the run on disk)"
                        self.problems.append(f"{what} {node.name} never took the "
                                             f"shutdown{why}")
                        node.kill()
            if self.server is not None:
                self.server.kill()
            for b in self.brokers.values():
                b.close()
        del server_mod  # (imported for its patched clock's lifetime only)
        res = SimResult(self.seed, self.sha.hexdigest(), faults=self.faults, events=n,
                        frames=self.n_frames, dropped=self.n_dropped, duplicated=self.n_dup,
                        sim_s=self.clock.t)
        from fedbus.bench.simcheck import check_world

        res.violations = check_world(self)
        res.rounds_done = self.rounds_done
        return res

    def finished(self) -> bool:
        return self.server is None and self.server_rc is not None and \
            all(not n.alive for n in [*self.nodes.values(), *self.relays.values()])

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class SimServer:
    """ServerNode under the simulation: its serve loop's body, mirrored."""

    def __init__(self, world: World, resume: bool):
        from fedbus.bench.chaos import state_digest
        from fedbus.node.server import CheckpointError, ServerNode, read_checkpoint

        self.world, self.name, self.alive = world, "server", True
        self.die_at_checkpoint: Fault | None = None
        self.exiting: float | None = None  # done: the peer lingers until then
        srv = self.srv = ServerNode(world.cfg, world.run_dir, "sim://broker", resume=resume,
                                    run_id=world.run_id)
        if not resume:
            srv.run.write_config(world.cfg.to_dict())
        real_checkpoint = srv._checkpoint

        def checkpoint() -> None:
            f = self.die_at_checkpoint
            if f is not None:  # killed after the record, before the checkpoint
                self.die_at_checkpoint = None
                world.kill_server(f)
                raise SimKilled()
            real_checkpoint()
            e = srv.engine
            buffered = [[m.client, m.version] for u in e.buffer for m in (u.members or (u,))]
            world.history.append({"op": "checkpoint", "i": len(world.history),
                                  "version": e.version, "digest": state_digest(e.state_dict()),
                                  "buffered": buffered})

        srv._checkpoint = checkpoint
        outs = []
        if resume:
            try:
                srv._restore()
            except CheckpointError as err:
                world.problems.append(f"the server cannot resume: {err}")
                world.server_rc = 2
                self.alive = False
                return
            ckpt = world.run_dir / "checkpoint.fbk"
            state = read_checkpoint(ckpt)[1] if ckpt.exists() else None
            # (no checkpoint yet: a restart from round 0, digest "", which check_once rolls
            # back to nothing taken and check_resumes is not shown)
            world.history.append({"op": "resume", "i": len(world.history),
                                  "version": 0 if state is None else int(state["version"]),
                                  "digest": "" if state is None else state_digest(state)})
            outs = srv.engine.on_resumed(world.clock.time())
        world.note("server_up", resume)
        self.peer = world.make_peer(self, "server", role="server", run=world.run_id,
                                    max_frame=world.cfg.bus.max_frame_mb << 20)
        self._tick_at: float | None = None
        self._step(lambda: outs)

    def _await_shutdown(self, until: float) -> None:
        """ServerNode._await_shutdown: the Peer lives on (reconnecting, resending) until
        the shutdown is delivered, or the wait is over."""
        from fedbus.broker.wire import BROADCAST

        p, world = self.peer, self.world
        if not self.alive:
            return
        if p.undelivered(BROADCAST) and world.clock.t < until:
            world.at(world.clock.t + 0.02, self._await_shutdown, until)
            return
        world.shutdown_unsent = p.undelivered(BROADCAST) > 0
        self.exiting = world.clock.t + 1.0
        self._linger()

    def _linger(self) -> None:
        """Peer.close: up to its linger, while registered, for what is not acknowledged."""
        from fedbus.broker.peer import _READY

        p, world = self.peer, self.world
        if not self.alive:
            return
        if world.clock.t < self.exiting and p._state == _READY and (p._outq or p._unacked):
            world.at(world.clock.t + 0.01, self._linger)
            return
        self.alive = False
        p._goodbye()
        p.close(0)
        if p._sock is not None:
            p._sock.close()
        world.server, world.server_rc = None, 0
        world.exits.append("server")
        world.note("server_exit")

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.world.note("server_killed")
        if self.peer._sock is not None:
            self.peer._sock.close()
        self.peer.close(0)
        self.srv.run.close()

    def wake(self, tag: str = "") -> None:
        while self.alive and self.exiting is None:
            msg = self.peer.recv(timeout=0)
            if msg is None:
                return
            self._step(lambda m=msg: self._take(m))

    def _take(self, msg: Any) -> list:
        from fedbus.bench.chaos import taken_entries
        from fedbus.node.server import judge, take

        e, world = self.srv.engine, self.world
        now = world.clock.time()
        if self.srv.flush_input(msg):  # (ServerNode's loop: the flush exchange is the shell's)
            return []
        refusal = judge(e, msg)
        if refusal is not None:
            return e.on_refused(refusal, now)
        world.history += taken_entries(e, msg, len(world.history))
        return take(e, msg, now)

    def _tick(self, at: float) -> None:
        if self.alive and self._tick_at == at:
            self._tick_at = None
            self._step(lambda: self.srv.engine.on_tick(self.world.clock.time()))

    def _step(self, make_outs: Callable[[], list]) -> None:
        world, e = self.world, self.srv.engine
        version = e.version
        try:
            outs = make_outs()
            self.srv._emit(self.peer, outs, version)
        except SimKilled:
            return
        self.peer._take_outgoing()
        world.arm_faults(e.version)
        if e.done:  # serve's finally: _finish, _await_shutdown, peer.close() (linger 1 s)
            from fedbus.broker.peer import _READY

            world.broker_down_at_end = world.brokers.get("broker") is None or \
                self.peer._state != _READY
            self.srv._finish()
            self.exiting = float("inf")  # (takes no more messages)
            self._await_shutdown(world.clock.t + self.peer.delivery_wait_s)
            return
        d = e.next_deadline()
        if d is not None:
            at = max(d, world.clock.time()) - EPOCH
            if d <= world.clock.time():
                at = world.clock.t + 0.5  # a passed deadline that changed nothing: later
            if self._tick_at is None or at < self._tick_at:
                self._tick_at = at
                world.at(at, self._tick, at)


class SimNode:
    """ClientNode under the simulation: its serve loop's body, mirrored; each message takes
    simulated compute time (drawn), during which the node handles nothing else."""

    def __init__(self, world: World, name: str, clients: list[int]):
        from fedbus.node.client_host import ClientNode
        from fedbus.node.client_state import last_run
        from fedbus.node.engine import client_address

        self.world, self.name, self.alive = world, name, True
        self.node = ClientNode("sim://broker", clients, name=name, state_dir=world.state_dir,
                               heartbeat_s=HEARTBEAT_S, liveness=LIVENESS)
        self.node.threaded_writer = False  # states written as each flush is handled
        # (ClientNode.serve's Peer: registered for the run of its clients' states on disk)
        self.peer = world.make_peer(self, name, world.node_broker[name], role="client",
                                    addresses=[client_address(c) for c in clients],
                                    run=last_run(self.node.state_dir, clients, name))
        self.node.peer = self.held = HeldSends(self.peer)
        self.busy = False
        world.note("node_up", name, self.peer.inc)

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.world.note("node_killed", self.name)
        if self.peer._sock is not None:
            self.peer._sock.close()
        self.peer.close(0)

    def wake(self, tag: str = "") -> None:
        if not self.alive or self.busy:
            return
        if self.world.stopped.get(self.name, -1.0) > self.world.clock.t:
            self.world.at(self.world.stopped[self.name], self.wake)
            return
        msg = self.peer.recv(timeout=0)
        if msg is None:
            return
        from fedbus.node.engine import client_index

        world = self.world
        if msg.kind == "shutdown":  # ClientNode.serve's shutdown
            from fedbus.node.client_state import ClientStateStore

            reason = (msg.body or {}).get("reason")
            self.node._close_writer(drain=reason == "run complete")
            if self.node.states is None and self.node.state_dir is not None and msg.run and \
                    msg.run == self.peer.run:
                self.node.states = ClientStateStore(self.node.state_dir, msg.run,
                                                    node=self.name)
            if self.node.states is not None and reason == "run complete":
                self.node.states.discard(self.node.clients)
            self.alive = False
            self.peer._goodbye()
            self.peer.close(0)
            if self.peer._sock is not None:
                self.peer._sock.close()
            world.exited[self.name] = 0
            world.exits.append(self.name)
            world.note("node_exit", self.name)
            return
        cost = 0.001
        if msg.kind == "task":
            client = client_index(msg.dst)
            cost = world.task_s * float(world.rng.uniform(0.5, 1.5)) * \
                (8.0 if client in world.slow else 1.0)
        elif msg.kind in ("eval", "evals"):
            cost = 0.05
        elif msg.kind == "config":
            cost = 0.2
        self.node.handle(msg)
        self.busy = True
        world.at(world.clock.t + cost, self._done)

    def _done(self) -> None:
        if not self.alive:
            return
        if self.world.stopped.get(self.name, -1.0) > self.world.clock.t:
            self.world.at(self.world.stopped[self.name], self._done)
            return
        self.busy = False
        self.held.release()
        self.wake()


class SimRelay:
    """Relay under the simulation: its serve loop's body, mirrored (from_server for the
    upstream Peer's messages, from_site for the site's, close_expired at group deadlines).
    Its site broker lives on across a relay kill."""

    def __init__(self, world: World, name: str):
        from fedbus.node.relay import Relay

        self.world, self.name, self.alive = world, name, True
        site = f"site{world.relay_names.index(name)}"
        r = self.relay = Relay("sim://broker", f"sim://{site}", name, heartbeat_s=HEARTBEAT_S,
                               liveness=LIVENESS, max_frame_mb=world.cfg.bus.max_frame_mb)
        r.down = world.make_peer(self, "server", site, "down", role="server",
                                 max_frame=r.max_frame)
        r.up = world.make_peer(self, name, "broker", "up", role="client", addresses=(),
                               max_frame=r.max_frame)
        r._running = True
        self._expiry: float | None = None
        world.note("relay_up", name, r.up.inc)

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.world.note("relay_killed", self.name)
        for p in (self.relay.up, self.relay.down):
            if p._sock is not None:
                p._sock.close()
            p.close(0)

    def wake(self, tag: str) -> None:
        r, world = self.relay, self.world
        peer = r.up if tag == "up" else r.down
        while self.alive and not r.ended:
            msg = peer.recv(timeout=0)
            if msg is None:
                break
            try:
                if tag == "up":
                    if r.from_server(msg):
                        self._exit(world.clock.t + r.down.delivery_wait_s)
                        return
                else:
                    r.from_site(msg)
            except Exception as err:  # noqa: BLE001 (as Relay.serve: one message, not the site)
                r.stats["failed_messages"] += 1
                world.problems.append(f"relay {self.name} failed on a {msg.kind}: "
                                      f"{type(err).__name__}: {err}")
            self._expire()
        self._schedule()

    def _expire(self, at: float | None = None) -> None:
        if not self.alive or self.relay.ended or (at is not None and at != self._expiry):
            return
        if at is not None:
            self._expiry = None
        self.relay.close_expired(self.world.clock.monotonic())
        self.relay.up._take_outgoing()
        self.relay.down._take_outgoing()
        if at is not None:
            self._schedule()

    def _schedule(self) -> None:
        open_ = [g.deadline for g in self.relay.groups.values() if not g.closed]
        if open_ and (self._expiry is None or min(open_) < self._expiry):
            self._expiry = min(open_)
            self.world.at(max(self._expiry, self.world.clock.t), self._expire, self._expiry)

    def _exit(self, until: float) -> None:
        """serve's finally: await_shutdown_down (the down Peer lives on, reconnecting and
        resending, until the site's broker has the shutdown or the wait is over), then both
        peers closed."""
        from fedbus.broker.wire import BROADCAST

        if not self.alive:
            return
        self.relay.down._take_outgoing()
        if self.relay.down.undelivered(BROADCAST) and self.world.clock.t < until:
            self.world.at(self.world.clock.t + 0.02, self._exit, until)
            return
        self.alive = False
        for p in (self.relay.down, self.relay.up):
            p._take_outgoing()
            p._goodbye()
            p.close(0)
            if p._sock is not None:
                p._sock.close()
        self.world.exited[self.name] = 0
        self.world.exits.append(self.name)
        self.world.note("relay_exit", self.name)
