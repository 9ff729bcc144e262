"""A regional relay: one participant upstream, a server to the nodes of its site.

Upstream the relay is a client node of the server's broker hosting the client addresses
of every node below it that is configured for the run (it registers again as nodes join
and leave: Peer.set_addresses, and the server's engine takes a node's new list as the
whole of what it hosts). Downstream it is the "server" of its own broker, which it starts
(`fedbus relay --bind`) or finds (`--downstream`); the site's nodes are ordinary `fedbus
node` processes that know nothing of the tree.

What goes down: the run's config (to each node, as it joins), tasks, evaluations,
errors and the shutdown, unchanged. What comes up: evaluation results, handler failures,
and, per sync round, ONE merged update standing for the round's updates of every client
below (kind "merged", PROTOCOL.md §4) when the algorithm declares how its updates merge
(ServerHandler.MERGE, fedbus.algorithms.core.merge); otherwise each update unchanged.

A round's group at the relay closes when every task the server sent this node for the
round (the task's "node_tasks") has been answered or has failed, or at the relay's own
deadline: `deadline_fraction` of the server's round deadline (federation.deadline_s, or
hard_deadline_s without one) after the round's first task, so the merged update can
still reach the server in time. An update that arrives after its group closed goes up
unmerged, and the server's rules for late updates (drop, or fold with 1/sqrt(1 +
staleness)) apply to it as to any. Async runs are forwarded unmerged.

Reliability is per hop: each Peer resends what its broker or receiver has not
acknowledged (PROTOCOL.md §6). A relay that dies loses the updates it held; the server
sees its clients leave and fails their tasks by its rules.
"""
from __future__ import annotations

import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import Work
from fedbus.algorithms.core.merge import form_nbytes
from fedbus.algorithms.core.params import resolved_params
from fedbus.broker.log import get_logger
from fedbus.broker.peer import Peer
from fedbus.broker.wire import BROADCAST, BROKER, SERVER, Message
from fedbus.node.config import build_config
from fedbus.node.engine import client_index
from fedbus.node.privacy.secure_round import MaskedSums
from fedbus.node.validate import Rejected, check_update, run_norms

log = get_logger("fedbus.relay")


# members of one merged update: each is ~15 msgpack values, the wire takes 2**20 a body
MAX_MERGED_MEMBERS = 50_000


@dataclass
class Group:
    """One sync round's tasks at this relay and the updates merged so far."""

    round: int
    version: int
    expected: int  # the round's tasks the server sent this relay ("node_tasks")
    deadline: float  # monotonic
    tasks: dict[str, int] = field(default_factory=dict)  # client address -> task id
    bounds: dict[str, Any] = field(default_factory=dict)  # client address -> task's "bound"
    done: set[str] = field(default_factory=set)  # answered (merged or forwarded) or failed
    members: list[list[Any]] = field(default_factory=list)  # [address, task, n, work]
    total: dict[str, Any] | None = None  # the rule's sum form
    total_bytes: int = 0  # its arrays' bytes
    closed: bool = False

    def complete(self) -> bool:
        # done holds only this group's own tasks' clients (on_update checks the task id;
        # _failed reaches a group through the client's own task), so counting is enough
        return len(self.tasks) >= self.expected and len(self.done) >= len(self.tasks)


class Relay:
    """See the module docstring. `upstream`: the server's broker; `downstream`: this site's
    broker (started by the relay when `bind` is given)."""

    def __init__(self, upstream: str, downstream: str, name: str, *,
                 curve_up=None, curve_down=None, down_name: str = SERVER,
                 heartbeat_s: float = 1.0, liveness: int = 3, max_frame_mb: int = 64,
                 deadline_fraction: float = 0.9, merge: bool = True):
        if not 0.0 < deadline_fraction <= 1.0:
            raise ValueError("deadline_fraction must lie in (0, 1]")
        self.upstream, self.downstream, self.name = upstream, downstream, name
        self.curve_up, self.curve_down, self.down_name = curve_up, curve_down, down_name
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.max_frame = int(max_frame_mb) << 20
        self.deadline_fraction = deadline_fraction
        self.merge_enabled = merge
        self.run_id = ""
        self.config: dict[str, Any] | None = None
        self.rule = None  # the algorithm's MergeRule, once the config is known
        self.params: dict[str, Any] = {}
        self.round_wait_s = 0.0
        self.nodes: dict[str, list[str]] = {}  # downstream node -> its client addresses
        self.configured: set[str] = set()  # downstream nodes configured for run_id
        self.groups: dict[int, Group] = {}
        self.group_of: dict[str, int] = {}  # client address -> round of its open task
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.up: Peer | None = None
        self.down: Peer | None = None
        self.stats = {"merged_sent": 0, "merged_clients": 0, "forwarded_updates": 0,
                      "late_forwarded": 0, "tasks": 0, "refused_members": 0,
                      "failed_messages": 0}
        self.security: dict[str, Any] = {}
        self.privacy: dict[str, Any] = {}
        self._running = False
        self._too_large_noted = False
        self.ended = False  # the server's shutdown came (and went down to the site)
        # the server's flushes not answered yet: (body, round, site nodes yet to answer)
        self.flushes: list[tuple[dict, int, set[str]]] = []

    # --- the loop -----------------------------------------------------------------

    def serve(self) -> int:
        self.down = Peer(self.downstream, self.down_name, role="server", curve=self.curve_down,
                         heartbeat_s=self.heartbeat_s, liveness=self.liveness,
                         max_frame=self.max_frame)
        self.down.start()
        self.up = Peer(self.upstream, self.name, role="client", addresses=(),
                       curve=self.curve_up, heartbeat_s=self.heartbeat_s,
                       liveness=self.liveness, max_frame=self.max_frame)
        self.up.start()
        self._running = True
        pumps = [threading.Thread(target=self._pump, args=(tag, peer), daemon=True,
                                  name=f"fedbus-relay-{tag}")
                 for tag, peer in (("up", self.up), ("down", self.down))]
        for t in pumps:
            t.start()
        log.info("relay ready", name=self.name, upstream=self.upstream,
                 downstream=self.downstream)
        try:
            while True:
                wait = self._next_timeout()
                try:
                    tag, msg = self.inbox.get(timeout=wait)
                except queue.Empty:
                    tag, msg = None, None
                if msg is not None:
                    try:
                        if tag == "up":
                            if self.from_server(msg):
                                return 0
                        else:
                            self.from_site(msg)
                    except Exception as err:  # one message must not take the site down
                        self.stats["failed_messages"] += 1
                        log.error("message handling failed", kind=msg.kind, src=msg.src,
                                  side=tag, error=f"{type(err).__name__}: {err}",
                                  exc_info=True)
                self.close_expired(time.monotonic())
        except KeyboardInterrupt:
            return 130
        finally:
            self._running = False
            log.info("relay stopped", **self.stats)
            self.await_shutdown_down()
            self.up.close()
            self.down.close()

    def _pump(self, tag: str, peer: Peer) -> None:
        while self._running:
            msg = peer.recv(timeout=0.5)
            if msg is not None:
                self.inbox.put((tag, msg))

    def _next_timeout(self) -> float:
        open_ = [g.deadline for g in self.groups.values() if not g.closed]
        if not open_:
            return 0.5
        return max(0.0, min(0.5, min(open_) - time.monotonic()))

    # --- from the server ------------------------------------------------------------

    def from_server(self, msg: Message) -> bool:
        """One message from upstream; True when the run is over."""
        kind, body = msg.kind, msg.body
        if kind == "config" and isinstance(body, dict):
            self.on_config(str(body.get("run", "")), body)
        elif kind == "task" and isinstance(body, dict):
            self.on_task(msg)
        elif kind == "flush" and isinstance(body, dict):
            self.on_flush(body, msg.round)
        elif kind in ("eval", "error", "secagg") and msg.dst != self.name:
            self.down.send(kind, msg.dst, body, round=msg.round, encoded=msg.frames[1])
        elif kind == "shutdown":
            self.ended = True
            self.down.send("shutdown", BROADCAST, body, round=msg.round)
            log.info("shutdown", reason=(body or {}).get("reason") if isinstance(body, dict)
                     else None)
            return True
        elif kind == "error":
            log.warning("server error", **{k: v for k, v in (body or {}).items()
                                           if k != "payload"})
        return False

    def await_shutdown_down(self) -> None:
        """As the server does (ServerNode._await_shutdown): the site's broker, away as the
        run ended, would lose the shutdown, and the site's nodes would wait for ever."""
        if self.ended and self.down.undelivered(BROADCAST) and \
                not self.down.wait_delivered(BROADCAST, self.down.delivery_wait_s):
            log.warning("the shutdown was not delivered to the site: a node that missed it "
                        "waits until it is stopped", waited_s=self.down.delivery_wait_s)

    def on_config(self, run: str, body: dict[str, Any]) -> None:
        if run != self.run_id:  # a new run (or the first): every node configures again
            self.run_id, self.config = run, body
            self.up.run = self.down.run = run
            self.configured.clear()
            self.groups.clear()
            self.group_of.clear()
            self._choose_rule(body["config"])
            for node in self.nodes:
                self.down.send("config", node, body)
            self._advertise()
        # the clients registered upstream are configured ones: they are ready now
        self.up.send("config", SERVER, {"node": self.name, "run": run}, src=self.name)

    def _choose_rule(self, raw: dict[str, Any]) -> None:
        cfg = build_config(raw)
        fed = cfg.federation
        self.round_wait_s = fed.deadline_s if fed.deadline_s > 0 else fed.hard_deadline_s
        server_cls = get_algorithm(cfg.algorithm.name).server
        self.params = resolved_params(server_cls, dict(cfg.algorithm))
        self.security, self.privacy = dict(cfg.security), dict(cfg.privacy)
        # the run's rule: none under an aggregation that is no sum (algorithm.robust)
        rule = server_cls.merge_rule(self.params) \
            if self.merge_enabled and fed.mode == "sync" else None
        if rule is not None and cfg.privacy.secure_aggregation:
            rule = MaskedSums()  # the members' inputs are masked: added in the ring
        self.rule = rule
        log.info("configured", run=self.run_id, algorithm=cfg.algorithm.name,
                 merge=rule.name if rule is not None else "none (forwarding updates)")

    def on_task(self, msg: Message) -> None:
        body = msg.body
        address = msg.dst
        self.stats["tasks"] += 1
        if self.rule is not None:
            g = self.groups.get(msg.round)
            if g is None:
                g = self.groups[msg.round] = Group(
                    msg.round, int(body.get("version", msg.round)),
                    int(body.get("node_tasks", 0)) or 1 << 30,
                    time.monotonic() + self.deadline_fraction * self.round_wait_s)
                for r in [r for r in self.groups if r < msg.round - 1]:
                    del self.groups[r]  # rounds long gone
            g.tasks[address] = int(body["task"])
            g.bounds[address] = body.get("bound")
            self.group_of[address] = msg.round
        # the body as it came: re-encoding a task (the global weights) costs 80x a copy
        self.down.send("task", address, body, round=msg.round, encoded=msg.frames[1])

    # --- from the site's nodes ------------------------------------------------------

    def from_site(self, msg: Message) -> None:
        kind, body = msg.kind, msg.body
        if kind == "join" and isinstance(body, dict):
            self.on_join(str(body.get("node")), [c for c in body.get("clients", [])
                                                 if isinstance(c, str)])
            if not self.run_id and msg.run and msg.run != self.up.run:
                self._site_run(msg.run)
        elif kind == "leave" and isinstance(body, dict):
            self.on_leave(str(body.get("node")))
        elif kind == "config" and isinstance(body, dict):
            node = str(body.get("node", ""))
            if body.get("run") == self.run_id and node in self.nodes:
                self.configured.add(node)
                self._advertise()
        elif kind == "update" and isinstance(body, dict):
            self.on_update(msg)
        elif kind == "flushed" and isinstance(body, dict) and msg.src != BROKER:
            for fbody, _, waiting in self.flushes:
                if fbody.get("mark") == body.get("mark"):
                    waiting.discard(msg.src)
            self._answer_flushes()
        elif kind in ("eval_result", "error", "secagg") and msg.src != BROKER:
            if kind == "error" and isinstance(body, dict):
                self._failed(msg.src)
            self._up_send(kind, body, src=msg.src, round=msg.round)
        elif kind == "error" and isinstance(body, dict):
            # the site's broker could not deliver (a node gone): that client fails here
            dst = body.get("dst")
            if body.get("kind") == "task" and isinstance(dst, str):
                self._failed(dst)

    def _site_run(self, run: str) -> None:
        """Not configured yet (restarted), it hears a node of its site is in `run` (the
        join's header): it registers upstream for that run, so the broker tells it if the
        run ended while it was down, and its shutdown goes down under that run (the site's
        broker keeps it for the site's nodes away); a live run's server configures it."""
        log.info("the site's nodes are in a run: registering for it", run=run)
        self.down.run = run
        self.up.set_run(run)

    def on_flush(self, body: dict, round_: int) -> None:
        """The server's flush (PROTOCOL.md §4.2): sent on to each of the site's nodes, and
        answered once each has answered or left."""
        self.flushes.append((body, round_, set(self.nodes)))
        for node in self.nodes:
            self.down.send("flush", node, body, round=round_)
        self._answer_flushes()

    def _answer_flushes(self) -> None:
        while self.flushes and not self.flushes[0][2]:
            body, round_, _ = self.flushes.pop(0)
            self._up_send("flushed", {"round": body.get("round"), "mark": body.get("mark")},
                          src=self.name, round=round_)

    def on_join(self, node: str, clients: list[str]) -> None:
        self.nodes[node] = clients
        self.configured.discard(node)
        for body, round_, waiting in self.flushes:  # (one it may have lost with a restart)
            if node in waiting:
                self.down.send("flush", node, body, round=round_)
        if self.config is not None:
            self.down.send("config", node, self.config)
        log.info("node joined", node=node, clients=len(clients))

    def on_leave(self, node: str) -> None:
        clients = self.nodes.pop(node, [])
        self.configured.discard(node)
        for _, _, waiting in self.flushes:
            waiting.discard(node)
        self._answer_flushes()
        for address in clients:
            self._failed(address)
        self._advertise()
        log.info("node left", node=node, clients=len(clients))

    def _advertise(self) -> None:
        """Register upstream the clients of the configured nodes (the server then marks
        them live once this relay answers its config)."""
        addresses = sorted((a for n in self.configured for a in self.nodes.get(n, ())),
                           key=_client_order)
        if tuple(addresses) != self.up.addresses:
            self.up.set_addresses(addresses)

    def on_update(self, msg: Message) -> None:
        body, address = msg.body, msg.src
        g = self.groups.get(self.group_of.get(address, -2))
        if g is None or g.closed or g.tasks.get(address) != body.get("task"):
            if any(old.closed and old.tasks.get(address) == body.get("task")
                   for old in self.groups.values()):
                self.stats["late_forwarded"] += 1
            self.stats["forwarded_updates"] += 1
            self._up_send("update", body, src=address, round=msg.round)
            return
        g.done.add(address)
        self.group_of.pop(address, None)
        form = None
        try:
            # one client's bad update must not sink its site's merged update: sent alone,
            # only that client's update is refused by the server
            problem = self.member_problem(body, g.bounds.get(address))
            if problem is not None:
                self.stats["refused_members"] += 1
                log.warning("update not merged: refused", client=address, reason=problem)
            elif body.get("version") == g.version:
                work = Work.from_dict(body["work"])
                # (client-level DP sums clipped deltas with weight 1 each:
                # fedbus.node.privacy.budget)
                n = 1 if self.privacy.get("dp") == "client" else int(body["num_samples"])
                form = self.rule.lift(body["payload"], n, work, self.params,
                                      client_index(address))
        except (KeyError, TypeError, ValueError) as err:
            log.warning("update not merged: malformed", client=address, error=str(err))
        size = 0 if form is None else form_nbytes(form)
        if form is not None and self._frame_room(size, 1) < 0:
            # a float64 sum of a large model (ResNet-18's 45 MB of float32 is 89 MB) would
            # exceed the bus's frame limit, which the broker drops: such updates go up alone
            if not self._too_large_noted:
                self._too_large_noted = True
                log.warning("updates not merged: their sum form exceeds the frame limit",
                            sum_bytes=size, max_frame=self.max_frame)
            form = None
        if form is None:  # the rule keeps it apart, or the server is to judge it
            self.stats["forwarded_updates"] += 1
            self._up_send("update", body, src=address, round=msg.round)
        else:
            if g.total is not None and (self._frame_room(
                    g.total_bytes + self.rule.grows_by(form), len(g.members) + 1) < 0
                    or len(g.members) >= MAX_MERGED_MEMBERS):
                # a growing sum form (MP-FedCL's pool) is full, or the member list would
                # pass the wire's values a body (about 15 a member): send what it holds
                self._send_merged(g)
            try:
                g.total = self.rule.add(g.total, form)
            except (KeyError, ValueError) as err:  # a wrong shape: the server judges it
                log.warning("update not merged: shape", client=address, error=str(err))
                self.stats["forwarded_updates"] += 1
                self._up_send("update", body, src=address, round=msg.round)
            else:
                g.total_bytes = size if not g.members else \
                    g.total_bytes + self.rule.grows_by(form)
                g.members.append([address, int(body["task"]), int(body["num_samples"]),
                                  work.to_dict()])
        if g.complete():
            self.flush(g)

    def member_problem(self, body: dict[str, Any], bound: Any) -> str | None:
        """Why a member's update must not be merged (the server's own checks, with the
        bounds its task carried: fedbus.node.validate), or None."""
        if not isinstance(bound, dict) or not isinstance(body.get("payload"), dict):
            return "no bound from the server for this task, or no payload"
        if isinstance(self.rule, MaskedSums):  # nothing to check in a masked vector but its
            n = body.get("num_samples")      # shape (MaskedSums.lift) and the header
            ok = isinstance(n, int) and not isinstance(n, bool) and \
                0 <= n <= int(bound.get("samples", 0))
            return None if ok else f"num_samples {n!r} is out of range"
        classes = bound.get("classes")
        counts = body["payload"].get("counts")
        num_classes = len(classes) if isinstance(classes, list) else \
            (len(counts) if isinstance(counts, np.ndarray) and counts.ndim == 1 else 1 << 30)
        protos = body["payload"].get("protos")
        dim = protos.shape[-1] if isinstance(protos, np.ndarray) and protos.ndim else 0
        norms = run_norms(self.security, self.privacy, dim)
        try:
            check_update(body, None, num_classes=num_classes,
                         max_samples=int(bound.get("samples", 0)), class_samples=classes,
                         label_pixels=int(bound.get("units", 1)), max_bytes=self.max_frame,
                         norms=norms, count_epochs=int(bound.get("epochs", 1)))
        except Rejected as err:
            return str(err)
        return None

    def _frame_room(self, form_bytes: int, members: int) -> int:
        """Bytes left under the frame limit for a merged update of this size (its member
        list ~ 128 B a member, and 64 KiB for the rest of the message); < 0: too big."""
        return self.max_frame - form_bytes - 128 * members - (64 << 10)

    def _failed(self, address: str) -> None:
        g = self.groups.get(self.group_of.pop(address, -2))
        if g is not None and not g.closed:
            g.done.add(address)
            if g.complete():
                self.flush(g)

    def close_expired(self, now: float) -> None:
        for g in list(self.groups.values()):
            if not g.closed and now >= g.deadline:
                log.info("round closed at the relay deadline", round=g.round,
                         answered=len(g.members), tasks=len(g.tasks))
                self.flush(g)

    def flush(self, g: Group) -> None:
        """Send the group's merged update (if any client's is in it) and close it."""
        g.closed = True
        if g.members:
            self._send_merged(g)

    def _send_merged(self, g: Group) -> None:
        """One merged update of what the group holds; the group starts a new sum."""
        body = {"version": g.version, "rule": self.rule.name, "members": g.members,
                "payload": g.total}
        self._up_send("merged", body, src=self.name, round=g.round)
        self.stats["merged_sent"] += 1
        self.stats["merged_clients"] += len(g.members)
        log.info("merged update sent", round=g.round, clients=len(g.members),
                 tasks=len(g.tasks))
        g.members, g.total, g.total_bytes = [], None, 0

    def _up_send(self, kind: str, body: Any, *, src: str, round: int) -> None:
        try:
            self.up.send(kind, SERVER, body, src=src, round=round)
        except ValueError as err:  # its client is no longer registered upstream
            log.warning("not forwarded", kind=kind, src=src, error=str(err))


def _client_order(address: str) -> tuple[int, str]:
    try:
        return client_index(address), address
    except ValueError:
        return 1 << 62, address


def spawn_site_broker(bind: str, *, heartbeat_s: float, liveness: int, max_frame_mb: int,
                      keys_dir: str | None, insecure: bool, log_file: str | None
                      ) -> subprocess.Popen:
    """The site's broker as a child process (`fedbus broker`), which dies with the relay."""
    from fedbus.node.lifetime import die_with_parent, fedbus_command

    cmd = fedbus_command("broker", "--bind", bind, "--heartbeat-s", str(heartbeat_s),
                         "--liveness", str(liveness), "--max-frame-mb", str(max_frame_mb))
    if keys_dir:
        cmd += ["--curve", "--keys-dir", keys_dir]
    elif insecure:
        cmd += ["--insecure"]
    if log_file:
        cmd += ["--log-file", log_file]
    # no thread runs yet when the relay starts its broker, so preexec_fn is safe here
    return subprocess.Popen(cmd, preexec_fn=die_with_parent)  # noqa: PLW1509
