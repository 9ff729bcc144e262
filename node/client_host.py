"""A client node: one process, one device, one or thousands of clients.

The node registers the client addresses it hosts, waits for the server's
config, and then answers tasks and eval requests one at a time, in arrival
order. Each client's handler (model, optimizer, extra state) is built on
first use over the node's shared data and stored networks, and kept while the
materialised clients fit `launch.node_memory_mb`; the rest are evicted, packed,
to memory or disk and restored when their next task comes (fedbus.node.pool),
so a 2-core machine can host ten thousand small clients.
"""
from __future__ import annotations

import collections
import copy
import heapq
import itertools
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedbus.algorithms.core.handlers import ClientHandler, LocalRun
from fedbus.broker.log import get_logger
from fedbus.broker.peer import Peer
from fedbus.broker.wire import Message
from fedbus.node.client_state import ClientStateStore, last_run
from fedbus.node.config import Config, build_config
from fedbus.node.engine import SENT_BATCHES, SERVER, client_address, client_index, unbatch_tasks
from fedbus.node.pool import ClientPool
from fedbus.node.privacy.prototypes import protect
from fedbus.node.state_writer import StateWriter
from fedbus.node.validate import non_finite
from fedbus.record.msglog import MessageLogWriter

__all__ = ["ClientNode", "ClientPool", "node_threads", "run_alone", "run_task", "run_tasks"]

log = get_logger("fedbus.node")


class ClientNode:
    def __init__(self, broker: str, clients: list[int], *, name: str, device: str = "cpu",
                 cfg: Config | None = None, max_resident: int | None = None,
                 memory_mb: float | None = None, threads: int | None = None,
                 evict_to: str | None = None, heartbeat_s: float = 1.0, liveness: int = 3,
                 spool_dir: str | Path | None = None, log_dir: str | Path | None = None,
                 state_dir: str | Path | None = None, curve=None, identity=None):
        self.broker = broker
        self.curve = curve  # fedbus.broker.auth.PeerCurve, or None for plaintext
        # fedbus.node.privacy.identity.Identity: signs its clients' secure-aggregation keys
        self.identity = identity
        self.clients = clients
        self.name = name
        self.device = torch.device(device)
        self.cfg = cfg
        self.run_id = ""
        self.max_resident = max_resident
        self.memory_mb = memory_mb
        self.threads = threads
        self.evict_to = evict_to
        self.heartbeat_s, self.liveness = heartbeat_s, liveness
        self.spool_dir = Path(spool_dir) if spool_dir else None
        self.log_dir = Path(log_dir) if log_dir else None
        # each client's state after each task (fedbus.node.client_state), for a resume
        self.state_dir = Path(state_dir) if state_dir else None
        self.states: ClientStateStore | None = None
        # writes the states off the message path, at the server's flushes (state_writer);
        # not threaded under `fedbus bench sim`, which must be deterministic
        self.writer: StateWriter | None = None
        self.threaded_writer = True
        self._unrestored: set[int] = set()  # saved clients not yet restored
        self._resume_cutoff: int | None = None  # the first round seen after the restart
        self.pool: ClientPool | None = None
        self.msglog: MessageLogWriter | None = None
        self.peer: Peer | None = None
        self.deferred: list = []  # heap of (due, order, task message, update body)
        self.held: list = []  # system.hold_clients: (round, task message, update body)
        self._order = itertools.count()
        self.secure = None  # fedbus.node.privacy.secure_round.SecureClient under secure aggregation
        # train.cohort: messages received while gathering a round's tasks, handled next; the
        # gathered tasks already answered (a failed cohort retries only the others); the
        # reasons for training one by one already logged
        self._pending: collections.deque = collections.deque()
        # PROTOCOL.md §4.3: (client address, task id) of the tasks that came in a `tasks`
        # batch, answered in an `updates` batch; the answers trained, not yet sent (round,
        # member), sent together as soon as the node has nothing more in hand
        self._batch_of: set[tuple[str, int]] = set()
        self._outbox: list[tuple[int, dict[str, Any]]] = []
        self._answered: set[str] = set()
        # the pool whose clients' cohort_reason is known, and those reasons (fixed for a run)
        self._cohort_known: tuple[ClientPool | None, dict[int, str | None]] = (None, {})
        self._cohort_logged: set[str] = set()

    def configure(self, run_id: str, raw: dict[str, Any]) -> None:
        if self.pool is None or run_id != self.run_id:  # else the server re-registered
            self._build(run_id, build_config(raw))
        self.peer.run = run_id  # updates carry the run id; the server checks it
        # (batch: this node takes `tasks` batches, PROTOCOL.md §4.3)
        self.peer.send("config", SERVER, {"node": self.name, "run": run_id,
                                          "batch": list(SENT_BATCHES)},
                       src=client_address(self.clients[0]))

    def _build(self, run_id: str, cfg: Config) -> None:
        self.cfg, self.run_id = cfg, run_id
        self._batch_of.clear()  # (task ids start again in a new run)
        threads = self.threads or node_threads(cfg)
        torch.set_num_threads(threads)
        spool = None
        evict_to = self.evict_to or cfg.launch.evict_to
        if evict_to == "disk":
            spool = self.spool_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"fedbus-{self.name}"
            spool.mkdir(parents=True, exist_ok=True)
        self.pool = ClientPool(cfg, self.device, clients=self.clients, memory_mb=self.memory_mb,
                               max_resident=self.max_resident, evict_to=evict_to, spool=spool)
        # Warm up before reporting ready: the first model and optimizer import and
        # initialise parts of torch, which takes seconds once per process; clients are
        # materialised while they fit, up to WARM_CLIENTS.
        for client in self.clients[:WARM_CLIENTS]:
            self.pool.get(client)
            if self.pool.evictions:
                break
        if cfg.privacy.secure_aggregation:
            from fedbus.algorithms import get_algorithm
            from fedbus.algorithms.core.params import resolved_params
            from fedbus.node.privacy.secure_round import SecureClient

            server_cls = get_algorithm(cfg.algorithm.name).server
            params = resolved_params(server_cls, dict(cfg.algorithm))
            self.secure = SecureClient(server_cls.merge_rule(params), params,
                                       unit_weight=cfg.privacy.dp == "client",
                                       identity=self.identity, privacy=cfg.privacy)
            if self.identity is None:
                log.warning("secure aggregation without a signing identity (no "
                            "NAME.sign_secret in the keys folder): keys and survivor sets "
                            "are unsigned, so it holds against an honest-but-curious server "
                            "only (SECURITY.md 3a)")
        if self.writer is not None:  # a new run: the last one's snapshots are not needed
            self.writer.close()
            self.writer = None
        if self.state_dir is not None:
            sync = cfg.federation.mode == "sync"
            # sync: every file is kept until the first flush says which checkpoint is on disk
            self.states = ClientStateStore(self.state_dir, run_id, node=self.name,
                                           durable=0 if sync else None)
            self.writer = StateWriter(self.states, threaded=self.threaded_writer,
                                      newest_wins=not sync, name=self.name,
                                      hold_from=held_flushes(self.name))
            self._unrestored = self.states.clients() & set(self.clients)
            if self._unrestored:
                log.info("client states found: restored as their clients are first sent "
                         "work", clients=len(self._unrestored), path=str(self.states.path))
        if cfg.log.client_messages and self.log_dir is not None:
            self.msglog = MessageLogWriter(self.log_dir / f"messages-{self.name}")
        log.info("configured", run=run_id, algorithm=cfg.algorithm.name, device=str(self.device),
                 clients=len(self.clients), threads=threads, **self.pool.stats())

    def serve(self) -> int:
        # registered for the run its states on disk are of: told if that run ended
        self.peer = peer = Peer(self.broker, self.name, role="client",
                                addresses=[client_address(c) for c in self.clients],
                                run=last_run(self.state_dir, self.clients, self.name),
                                heartbeat_s=self.heartbeat_s, liveness=self.liveness,
                                curve=self.curve)
        peer.start()
        log.info("node ready", node=self.name, clients=len(self.clients), device=str(self.device))
        try:
            while True:
                if self._pending:
                    msg = self._pending.popleft()  # logged when it was received
                else:
                    self._flush_updates()  # nothing more in hand: what trained leaves now
                    msg = self._recv(max(0.0, min(1.0, self.send_due())))
                if msg is None:
                    continue
                if msg.kind in SENT_BATCHES:  # a batch: its members, as if each had come alone
                    self._unbatch(msg)
                    continue
                if msg.kind == "task" and (self._secure_task(msg) or self._cohort_may(msg)):
                    self._safely_tasks(self._gather(msg))
                    continue
                if msg.kind == "shutdown":
                    reason = (msg.body or {}).get("reason")
                    log.info("shutdown", reason=reason, run=msg.run)
                    if self.states is None and self.state_dir is not None and msg.run and \
                            msg.run == peer.run:  # its run ended while it was down
                        self.states = ClientStateStore(self.state_dir, msg.run, node=self.name)
                    self._close_writer(drain=reason == "run complete")
                    if self.states is not None and reason == "run complete":
                        self.states.discard(self.clients)
                    return 0
                self.handle(msg)
        except KeyboardInterrupt:
            return 130
        finally:
            self._close_writer()
            if self.states is not None:  # what a resume had on disk, and what it was spared
                log.info("client states", path=str(self.states.path), **self.states.stats())
            if self.msglog is not None:
                self.msglog.close()
            peer.close()

    def _close_writer(self, drain: bool = False) -> None:
        if self.writer is not None:
            self.writer.close(drain)
            self.writer = None

    def _recv(self, timeout: float) -> Message | None:
        msg = self.peer.recv(timeout=timeout)
        if msg is not None and self.msglog is not None:
            self.msglog.write("in", time.time(), msg.frames)
        if msg is not None and self.held and msg.kind in ("task", "tasks", "eval", "evals"):
            self._release_held(msg.round)
        return msg

    def _release_held(self, round_: int) -> None:
        """system.hold_clients: a message of a later round has arrived, so the updates held
        from earlier rounds leave now, before that message is handled: late by the order of
        events, whatever the machine's speed."""
        due = [h for h in self.held if h[0] < round_]
        self.held = [h for h in self.held if h[0] >= round_]
        for rnd, msg, update in due:
            log.info("held update released", client=client_index(msg.dst), round=rnd,
                     by_round=round_)
            self._send_update(msg, update)

    def _secure_task(self, msg: Message) -> bool:
        """A task of a securely aggregated round: gathered with the round's other tasks so
        that all their keys leave before any of them trains (on_tasks)."""
        return self.secure is not None and isinstance(msg.body, dict) and "secagg" in msg.body

    def _cohort_may(self, msg: Message) -> bool:
        """Whether a task is worth gathering others with: train.cohort is not off and its
        client could join a cohort (cohort_reason). Otherwise it is trained and answered at
        once, as before cohorts (a node of unsupported clients sends each update as soon as
        it is trained)."""
        mode = self.cfg.train.get("cohort", "auto") if self.cfg is not None else "off"
        if self.pool is None or mode == "off":
            return False
        pool, known = self._cohort_known
        if pool is not self.pool:  # a new run: its own models and clients
            known = {}
            self._cohort_known = (self.pool, known)
        try:
            client = client_index(msg.dst)
            if client not in known:  # asked once a client: a round's every task asks
                known[client] = cohort_reason(self.pool.get(client), mode)
        except (KeyError, IndexError):
            return False  # not hosted here: on_task answers with the error
        return known[client] is None

    def _gather(self, first: Message) -> list[Message]:
        """train.cohort: the task `first` and the tasks that follow it within COHORT_GATHER_S
        of each other (a round's tasks leave the server in one burst); the first other
        message ends the gathering and is handled next."""
        tasks = [first]
        while self._pending and self._pending[0].kind == "task":  # a batch's other members
            tasks.append(self._pending.popleft())
        while True:
            msg = self._recv(COHORT_GATHER_S)
            if msg is None:
                return tasks
            if msg.kind != "task":
                self._pending.append(msg)
                return tasks
            tasks.append(msg)

    def _unbatch(self, msg: Message) -> None:
        """A `tasks` or `evals` batch (PROTOCOL.md §4.3): its members, in order, first in
        line, each a `task` (`eval`) message from the server to its client, as the
        unbatched server would have sent it; what follows is what a run of individual
        tasks or evaluations goes through (a cohort, an error for a client not hosted
        here). A task's answer joins the node's next `updates` batch; an evaluation's
        leaves alone."""
        kind = SENT_BATCHES[msg.kind]
        try:
            members = unbatch_tasks(msg.body, msg.kind)
        except ValueError as err:
            log.warning(f"malformed {msg.kind} batch: ignored", reason=str(err),
                        round=msg.round)
            return
        self._pending.extendleft(
            Message(kind, msg.src, to, body, run=msg.run, round=msg.round, seq=msg.seq,
                    inc=msg.inc, ts=msg.ts) for to, body in reversed(members))
        if kind == "task":
            self._batch_of.update((to, body.get("task")) for to, body in members)

    def _flush_updates(self) -> None:
        """The updates trained since the last flush, as `updates` batches (PROTOCOL.md §4.3):
        one a round, in the order they were trained, each within half the frame limit."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, []
        limit = (int(self.cfg.bus.max_frame_mb) << 20) // 2 if self.cfg is not None else 1 << 25
        chunk: list[dict[str, Any]] = []
        size, round_ = 0, outbox[0][0]
        for rnd, member in outbox:
            weight = _array_bytes(member) + 512
            if chunk and (rnd != round_ or size + weight > limit):
                self._send_batch(round_, chunk)
                chunk, size = [], 0
            chunk.append(member)
            size, round_ = size + weight, rnd
        self._send_batch(round_, chunk)

    def _send_batch(self, round_: int, members: list[dict[str, Any]]) -> None:
        out = self.peer.send("updates", SERVER, {"members": members}, src=self.name,
                             round=round_)
        if self.msglog is not None:
            self.msglog.write("out", time.time(), out.frames)

    def _safely_tasks(self, msgs: list[Message]) -> None:
        """Tasks gathered together: trained in cohorts where they may (run_tasks), each
        update sent as on_task sends it; any failure falls back to one task at a time."""
        try:
            self.on_tasks(msgs)
        except Exception:
            log.exception("cohort failed: its tasks run one by one", tasks=len(msgs))
            for msg in msgs:
                if msg.dst not in self._answered:
                    self._safely(msg, self.on_task)
        finally:
            self._answered = set()

    def _admit(self, msg: Message) -> bool:
        """A task's steps before training: a simulated drop (False: no answer), the secure
        aggregation's first message."""
        body = msg.body
        client = client_index(msg.dst)
        sim = body.get("sim", {})
        secure = self.secure is not None and "secagg" in body
        stage = sim.get("drop_stage", "task") if sim.get("drop") else None
        if stage is not None and (stage == "task" or not secure):
            log.info("simulated drop", client=client, task=body["task"])
            return False
        if secure:
            self._send("secagg", msg, self.secure.begin(msg.dst, body))  # before training
            self.secure.sessions[msg.dst]["drop"] = stage
        return True

    def on_tasks(self, msgs: list[Message]) -> None:
        """Several tasks: one by one where run alone (secure aggregation), the rest in
        chunks that stay resident together (pinned in the pool, at most what its budget
        holds: ClientPool.cohort_room), each chunk through run_tasks."""
        mode = self.cfg.train.get("cohort", "auto")
        alone = [m for m in msgs if self._secure_task(m)]
        self._train_secure(alone)
        rest = [m for m in msgs if m not in alone]
        while rest:
            room = self.pool.cohort_room(client_index(rest[0].dst))
            chunk, later, seen = [], [], set()
            for msg in rest:  # a client twice (async): its second task in a later chunk
                if len(chunk) < room and msg.dst not in seen:
                    chunk.append(msg)
                    seen.add(msg.dst)
                else:
                    later.append(msg)
            rest = later
            started = time.monotonic()
            admitted, handlers = [], []
            try:
                for msg in chunk:
                    if not self._admit(msg):
                        self._answered.add(msg.dst)
                        continue
                    handler = self._handler(msg)
                    self.pool.pinned.add(client_index(msg.dst))
                    admitted.append(msg)
                    handlers.append(handler)
                results = run_tasks(handlers, [m.body for m in admitted], mode,
                                    self._cohort_logged)
            finally:
                self.pool.release()
            for msg, handler, (update, took) in zip(admitted, handlers, results):
                self._answered.add(msg.dst)
                self._finish(msg, handler, update, started + took)

    def _train_secure(self, msgs: list[Message]) -> None:
        """Securely aggregated tasks, each trained alone: every one's keys sent first, and
        between two trainings the secure steps that came meanwhile answered (peers with
        shares, masking with the masked update of a client already trained). The round's
        key and share steps so run while its clients train (SecAgg's setup before the
        masked input, Bonawitz et al. 2017 §4), where one task after another used to send
        its keys only when the tasks before it had trained, and every share waited for the
        node's last training."""
        admitted = []
        for msg in msgs:
            self._answered.add(msg.dst)
            try:
                if self._admit(msg):
                    admitted.append(msg)
            except Exception as err:  # noqa: BLE001 - as _safely: this client's task only
                self._task_failed(msg, err)
        for msg in admitted:
            self._answer_secure_steps()
            try:
                self._train(msg)
            except Exception as err:  # noqa: BLE001 (_task_failed logs it)
                self._task_failed(msg, err)
        self._answer_secure_steps()

    def _answer_secure_steps(self) -> None:
        """The secure-aggregation steps already received, answered now; any other message
        waits its turn in _pending, in the order it came."""
        if self.peer is None:  # driven by handle() alone (the simulator): nothing queued
            return
        while True:
            msg = self._recv(0.0)
            if msg is None:
                return
            if msg.kind == "secagg":
                self._safely(msg, self.on_secagg)
            else:
                self._pending.append(msg)

    def handle(self, msg: Message) -> None:
        body = msg.body if isinstance(msg.body, dict) else {}
        if msg.kind == "config":
            self.configure(str(body.get("run", "")), body["config"])
        elif msg.kind == "flush":
            self.on_flush(msg)
        elif msg.kind == "error":
            log.warning("server error", **{k: v for k, v in body.items() if k != "payload"})
        elif self.pool is None:
            log.warning("no config yet: ignored", kind=msg.kind)
        elif msg.kind == "task":
            self._safely(msg, self.on_task)
        elif msg.kind in SENT_BATCHES:
            # (serve unpacks a batch into its queue first; a driver of handle alone, such as
            # the simulator, gets its members one by one here, their answers sent at its end)
            kind = SENT_BATCHES[msg.kind]
            self._unbatch(msg)
            while self._pending and self._pending[0].kind == kind:
                self._safely(self._pending.popleft(),
                             self.on_task if kind == "task" else self.on_eval)
            self._flush_updates()
        elif msg.kind == "eval":
            self._safely(msg, self.on_eval)
        elif msg.kind == "secagg":
            self._safely(msg, self.on_secagg)

    def _safely(self, msg: Message, fn) -> None:
        try:
            fn(msg)
        except Exception as err:  # noqa: BLE001 - a handler bug must not take every client down
            self._task_failed(msg, err)

    def _task_failed(self, msg: Message, err: Exception) -> None:
        log.exception("handler failed", kind=msg.kind, client=msg.dst)
        self._send("error", msg, {"code": "handler_failed", "reason": repr(err)[:500],
                                  "task": msg.body.get("task"), "eval": msg.body.get("eval")})

    def _send(self, kind: str, msg: Message, body: dict[str, Any]) -> None:
        out = self.peer.send(kind, SERVER, body, src=msg.dst, round=msg.round)
        if self.msglog is not None:
            self.msglog.write("out", time.time(), out.frames)

    def on_flush(self, msg: Message) -> None:
        """The server's flush (PROTOCOL.md §4.2): `flushed` once every client state snapshot
        taken before it is on disk (at once without a store: nothing to write)."""
        body = msg.body if isinstance(msg.body, dict) else {}
        round_, durable, mark = body.get("round"), body.get("durable"), body.get("mark")
        if not all(isinstance(v, int) and not isinstance(v, bool)
                   for v in (round_, durable, mark)):
            log.warning("malformed flush: ignored", body=str(body)[:200])
            return
        peer = self.peer

        def flushed() -> None:  # (from the writer's thread: Peer.send is thread-safe)
            peer.send("flushed", SERVER, {"round": round_, "mark": mark}, src=self.name,
                      round=round_)

        if self.writer is None:
            flushed()
        else:
            self.writer.barrier(round_, durable, flushed)

    def on_task(self, msg: Message) -> None:
        if self._admit(msg):
            self._train(msg)

    def _train(self, msg: Message) -> None:
        """An admitted task trained alone and finished (its update sent, held or deferred)."""
        started = time.monotonic()
        handler = self._handler(msg)
        update, took = run_task(handler, msg.body)
        self._finish(msg, handler, update, started + took)

    def _finish(self, msg: Message, handler: ClientHandler, update: dict[str, Any],
                due: float) -> None:
        """A trained task: the client's state snapshot taken (written at the server's next
        flush, for a resume: client_state's rule), its update sent, or held back until
        `due` (a simulated slow device)."""
        body = msg.body
        client = client_index(msg.dst)
        if self.writer is not None:
            state = self.states.snapshot_client(client, msg.round, handler)
            if state is not None:
                self.writer.put(client, msg.round, state)
        bad = non_finite(update["payload"])
        if bad:  # sent all the same: the server rejects it and ends this task at once
            log.warning("update not finite: the client's model diverged", client=client,
                        task=body["task"], arrays=bad,
                        hint="lower train.lr or the algorithm's regulariser weight (lam)")
        if client in self.cfg.system.get("hold_clients", ()):
            # a straggler by events: it leaves when the next round's first message comes
            # (_release_held); copied now, as with a deferred update
            self.held.append((msg.round, msg, copy.deepcopy(update)))
            log.info("update held", client=client, round=msg.round)
        elif due > time.monotonic():
            # a simulated slow device: its answer leaves when that device would be done,
            # while this node serves its other clients; its arrays are copied now, as the
            # client's network may serve another client before then
            update = copy.deepcopy(update)
            heapq.heappush(self.deferred, (due, next(self._order), msg, update))
        else:
            self._send_update(msg, update, batch=True)

    def _send_update(self, msg: Message, update: dict[str, Any], batch: bool = False) -> None:
        """Send a trained update: masked first under secure aggregation (held until the
        round's peers are known), or not at all for a client simulating a drop after its
        shares (system.drop_stage)."""
        if self.secure is not None and "secagg" in msg.body:
            state = self.secure.sessions.get(msg.dst)
            if state is not None and state.get("drop") == "shares":
                log.info("simulated drop", client=msg.dst, task=update["task"], stage="shares")
                self.secure.sessions.pop(msg.dst, None)
                return
            update = self.secure.ready(msg.dst, update)
            if update is None:
                return  # masked and sent when the peers come
        key = (msg.dst, update.get("task"))
        if key in self._batch_of:
            self._batch_of.discard(key)
            if batch:  # (held and slow-device answers leave alone, when they are due)
                # copied now: the client's arrays may change before the batch leaves
                self._outbox.append((msg.round, {"from": msg.dst, **copy.deepcopy(update)}))
                return
        self._send("update", msg, update)

    def on_secagg(self, msg: Message) -> None:
        """The server's secure-aggregation steps: peers (answered with shares), masking
        (answered with the masked update, once trained), unmask (answered with a reveal)."""
        step = msg.body.get("step")
        if step == "peers":
            self._send("secagg", msg, self.secure.on_peers(msg.dst, msg.body))
        elif step == "masking":
            update = self.secure.on_masking(msg.dst, msg.body)
            if update is not None:
                self._send("update", msg, update)
        elif step == "survivors":
            self._send("secagg", msg, self.secure.on_survivors(msg.dst, msg.body))
        elif step == "unmask":
            state = self.secure.sessions.get(msg.dst)
            if state is not None and state.get("drop") == "input":
                self.secure.sessions.pop(msg.dst, None)
                log.info("simulated drop", client=msg.dst, stage="input")
                return
            self._send("secagg", msg, self.secure.on_unmask(msg.dst, msg.body))
        else:
            log.warning("unknown secagg step: ignored", step=step, client=msg.dst)

    def _handler(self, msg: Message) -> ClientHandler:
        """The client's handler; on its first message after a restart, with the state it
        saved after its last task of a round before the first round this node was sent
        (fedbus.node.client_state: the server redoes the rounds from there), an
        evaluation of round r counting as round r + 1."""
        client = client_index(msg.dst)
        handler = self.pool.get(client)
        # an evaluation of round r scores the state after round r: a resumed server that
        # re-sends one (its record was pending at the kill) redoes no round before r + 1
        first = msg.round + 1 if msg.kind == "eval" else msg.round
        if client in self._unrestored:
            self._unrestored.discard(client)
            if self._resume_cutoff is None:
                self._resume_cutoff = first
            saved = self.states.newest_before(client, self._resume_cutoff)
            if saved is not None:
                try:
                    handler.load_state_dict(self.states.load(client, saved))
                except (ValueError, RuntimeError, KeyError) as err:  # damaged: say so, go on
                    log.error("client state not restored: the client continues from its "
                              "initial state", client=client, error=str(err))
                else:
                    log.info("client state restored", client=client, after_round=saved,
                             resumed_at=self._resume_cutoff)
        elif self._resume_cutoff is None and self.states is not None:
            self._resume_cutoff = first
        return handler

    def send_due(self) -> float:
        """Send held-back updates whose time has come; seconds until the next."""
        while self.deferred and self.deferred[0][0] <= time.monotonic():
            _, _, msg, update = heapq.heappop(self.deferred)
            self._send_update(msg, update)
        return self.deferred[0][0] - time.monotonic() if self.deferred else 1.0

    def on_eval(self, msg: Message) -> None:
        body = msg.body
        handler = self._handler(msg)
        result: dict[str, Any] = {"eval": body["eval"], "version": body["version"],
                                  "metrics": handler.evaluate(body["payload"])}
        if body.get("embed"):
            h, y = handler.embed(int(body["embed"]))
            result["embeddings"] = {"h": h, "y": y}
        if body.get("masks"):  # segmentation only: handler.masks is None otherwise
            masks = handler.masks(body["payload"], int(body["masks"]))
            if masks is not None:
                result["masks"] = masks
        self._send("eval_result", msg, result)


def _array_bytes(value: Any) -> int:
    """The bytes of the arrays in a body (what dominates its encoded size)."""
    if isinstance(value, dict):
        return sum(_array_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_array_bytes(v) for v in value)
    return int(value.nbytes) if isinstance(value, np.ndarray) else 0


def held_flushes(node: str) -> int | None:
    """(tests) FEDBUS_HOLD_STATE_WRITES=R or R:NODE: the first round whose flushes this
    node's writer holds back (client_state's module docstring), or None."""
    hold = os.environ.get("FEDBUS_HOLD_STATE_WRITES", "")
    first, _, name = hold.partition(":")
    if not hold or (name and name != node):
        return None
    try:
        return int(first)
    except ValueError:
        raise ValueError(f"FEDBUS_HOLD_STATE_WRITES={hold!r}: expected ROUND or "
                         "ROUND:NODE") from None


WARM_CLIENTS = 64
# train.cohort: a round's tasks arriving within this many seconds of each other are gathered
# into one batch of tasks (they leave the server in one burst)
COHORT_GATHER_S = 0.02


def node_threads(cfg: Config) -> int:
    """Torch threads for a node: launch.threads, or (0 = auto) the cores this process may
    use shared among the launch.nodes node processes of a `fedbus run`, at least 1. A node
    started by hand on its own machine is given --threads (or the config's value)."""
    if cfg.launch.threads:
        return int(cfg.launch.threads)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(cfg.launch.nodes)))


def seed_torch(seed: int, device: torch.device) -> None:
    """Seed what a local update may draw from (dropout, augmentation).
    torch.manual_seed would do, at ~250 us a call: a lot per task for a node
    hosting a thousand clients; seeding the generators in use is ~1 us."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)


def make_run(handler: ClientHandler, body: dict[str, Any]) -> LocalRun:
    """The LocalRun of a task body (its epochs, seed, partial work, budget, slowness and
    train.lr_decay factor)."""
    sim = body.get("sim", {})
    return LocalRun(handler.ctx, epochs=int(body["epochs"]), seed=int(body["seed"]),
                    epochs_to_run=float(sim.get("epochs_to_run", body["epochs"])),
                    budget_s=float(body.get("budget_s", 0.0)),
                    slow_factor=float(sim.get("slow_factor", 1.0)),
                    lr_factor=float(handler.ctx.train.get("lr_decay", 1.0))
                    ** int(body["version"]))


def finish_task(handler: ClientHandler, body: dict[str, Any], run: LocalRun,
                payload: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """The update body of a trained task (privacy applied) and its (virtual) seconds."""
    took = run.elapsed()
    privacy = handler.ctx.extra.get("privacy")
    if privacy:
        payload = protect(payload, privacy, int(body["seed"]))
        payload = dp_release(handler, payload, privacy, int(body["seed"]))
    return {"task": body["task"], "version": body["version"],
            "num_samples": int(len(handler.ctx.train_y)), "work": run.work.to_dict(),
            "payload": payload, "train_s": round(took, 4)}, took


def run_task(handler: ClientHandler, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """One local update from a task body: the update body to send, and the
    (virtual) seconds it took. Also used by `fedbus replay --client`. Where train.cohort
    puts this client in cohorts, it trains as a cohort of one, so that its arithmetic is
    the same whichever tasks it was gathered with (and a replay recomputes it)."""
    if cohort_reason(handler, handler.ctx.train.get("cohort", "auto")) is None:
        return run_tasks([handler], [body], handler.ctx.train.get("cohort", "auto"))[0]
    return run_alone(handler, body)


def run_alone(handler: ClientHandler, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """run_task one by one: the handler's own train() and run_local loop."""
    seed_torch(int(body["seed"]), handler.ctx.device)
    run = make_run(handler, body)
    payload = handler.train(body["payload"], run)
    return finish_task(handler, body, run, payload)


# train.cohort = auto on the CPU, for a model that is no affine chain (the generic vmap
# path): the hosted clients' mean training-set size over the largest (ClientPool.size_balance)
# below which it trains one by one. A vmapped step costs about as much whichever clients are
# still running, so such a cohort's time follows its longest run: measured on the 2-core CPU
# (docs/PERFORMANCE.md), the mlp through vmap on Michieli's synthetic data ran 2x faster
# vectorised at equal sizes (balance 1) and 1.7x slower on its power-law sizes (balance
# 0.2). An affine chain (the mlps) is faster vectorised at any balance and any cohort size,
# one client included (measured 1.3-2.5x), so auto vectorises it on the CPU regardless.
AUTO_MIN_BALANCE = 0.5


def cohort_reason(handler: ClientHandler, mode: str) -> str | None:
    """Why `handler` trains one by one under train.cohort = `mode` ("auto" | "on" | "off"),
    or None when it may join a cohort. auto: on where measured faster, vectorised: every
    supported model on CUDA; on the CPU, models without convolutions (MLPs; cnn4
    vectorised on this CPU was measured no faster than one by one) on a node whose clients'
    sizes are balanced enough (AUTO_MIN_BALANCE) unless the model is an affine chain (the
    mlps: vectorised at any balance). Every input is fixed for the run (the client's model
    and algorithm, the node's hosted clients), so a client's way of training never depends
    on timing."""
    if mode == "off":
        return "train.cohort = off"
    from fedbus.algorithms.core.cohort import affine_chain, cohort_unsupported

    reason = cohort_unsupported(handler)
    if reason is None and mode == "auto" and handler.ctx.device.type != "cuda":
        convs = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)
        balance = float(handler.ctx.extra.get("node_balance", 1.0))
        model = handler.ctx.model
        if any(isinstance(m, convs) for m in model.modules()):
            reason = "auto: convolutions on the CPU are no faster vectorised"
        elif balance < AUTO_MIN_BALANCE and affine_chain(
                model, [n for n, p in model.named_parameters() if p.requires_grad]) is None:
            reason = (f"auto: the node's client sizes are unbalanced (mean/max "
                      f"{balance:.2f} < {AUTO_MIN_BALANCE}): on the CPU a cohort then runs "
                      "as long as its largest client")
    return reason


def run_tasks(handlers: list[ClientHandler], bodies: list[dict[str, Any]],
              mode: str = "auto", logged: set | None = None
              ) -> list[tuple[dict[str, Any], float]]:
    """Several clients' tasks of one round: those that may (cohort_reason) trained together
    as cohorts (fedbus.algorithms.core.cohort), the rest one by one as run_task; each
    (update body, seconds) as run_task returns it, in the order given. Under a cohort a
    client's run and budget see the cohort's clock: its clients train at the same time.
    The reason a client trains one by one is logged once per reason (`logged`)."""
    from fedbus.algorithms.core.cohort import train_handlers

    logged = set() if logged is None else logged
    out: list[tuple[dict[str, Any], float] | None] = [None] * len(handlers)
    joint: list[int] = []
    for i, h in enumerate(handlers):
        # a lone supported task too: a client's arithmetic must not depend on which tasks
        # arrived with it (the node's gathering is a matter of timing)
        reason = cohort_reason(h, mode)
        if reason is None:
            joint.append(i)
        elif reason not in logged and mode != "off":
            logged.add(reason)
            log.info("cohort off", reason=reason, algorithm=type(h).__name__)
    if joint:
        hs = [handlers[i] for i in joint]
        bs = [bodies[i] for i in joint]
        runs = [make_run(h, b) for h, b in zip(hs, bs)]
        start = time.monotonic()
        payloads, fallbacks = train_handlers(
            hs, [b["payload"] for b in bs], runs,
            before_train=lambda j: seed_torch(int(bs[j]["seed"]), hs[j].ctx.device))
        for j, reason in fallbacks.items():
            if reason not in logged:
                logged.add(reason)
                log.info("cohort off", reason=reason, algorithm=type(hs[j]).__name__)
        for j, payload in enumerate(payloads):
            if payload is not None:
                out[joint[j]] = finish_task(hs[j], bs[j], runs[j], payload)
        log.info("cohort trained", clients=sum(p is not None for p in payloads),
                 seconds=round(time.monotonic() - start, 4))
    for i, h in enumerate(handlers):
        if out[i] is None:
            out[i] = run_alone(h, bodies[i])
    return out


def dp_release(handler: ClientHandler, payload: dict[str, Any], privacy: dict[str, Any],
               seed: int) -> dict[str, Any]:
    """privacy.dp on the client, before anything leaves it (fedbus.node.privacy.dp): "record"
    replaces the prototypes and counts with a record-level DP release over the client's
    training set (each sample's feature clipped, per-class sums and counts noised);
    "client" clips the weight delta (the server noises the round's sum)."""
    mechanism = privacy.get("dp", "off")
    # sgd: DP in training (fedbus.algorithms.core.dp_sgd), the delta goes as it is
    if mechanism in ("off", "sgd"):
        return payload
    from fedbus.node.privacy import dp

    clip = float(privacy["dp_clip"])
    if mechanism == "record":
        ctx = handler.ctx
        # the task seed is derivable by the server and every node: noise drawn from it
        # could be recomputed and removed; None draws fresh OS entropy (dp._rng)
        noise_seed = None if privacy.get("dp_noise", "secret") == "secret" else seed
        stats: dict[str, int] = {}
        release = dp.dp_prototypes(ctx.model, ctx.train_x, ctx.train_y, ctx.num_classes,
                                   clip, float(privacy["dp_noise_multiplier"]), noise_seed,
                                   stats=stats)
        # counted here, in the client's own log: sent, it would be an unnoised statistic
        log.debug("dp clip", mechanism="record", features=stats.get("features", 0),
                  clipped=stats.get("clipped", 0))
        return {**payload, **release}
    # the learned (float) arrays are clipped together; integer buffers (BatchNorm's step
    # counters) pass as they are, as the update's work report tells their value anyway
    delta = payload["delta"]
    floats = {k: v for k, v in delta.items() if np.asarray(v).dtype.kind == "f"}
    if privacy.get("secure_aggregation"):
        # secure aggregation rounds each value to its fixed-point grid: clipped to C less
        # the most that rounding adds, the encoded delta stays within C (the sensitivity)
        length = sum(int(np.asarray(v).size) for v in floats.values())
        margin = dp.secagg_clip_margin(length, int(privacy["secagg_frac_bits"]))
        if margin >= clip:
            raise ValueError(f"privacy.dp_clip = {clip} is within secure aggregation's "
                             f"rounding ({margin:.3g} for {length} values at secagg_frac_bits "
                             f"= {privacy['secagg_frac_bits']}): raise one of them")
        clip -= margin
    clipped, norm = dp.clip_update(floats, clip)
    log.debug("dp clip", mechanism="client", norm=round(norm, 6), clipped=norm > clip)
    return {**payload, "delta": {k: clipped.get(k, v) for k, v in delta.items()}}

