"""The server node: the I/O shell around the round engine.

It receives messages from the broker, turns them into engine events, sends
what the engine answers, and records everything (message log, metrics,
checkpoints, status). `dispatch` is the only place where a message becomes
an event, and `fedbus replay` calls the same function, so a replay takes
exactly the live server's path.
"""
from __future__ import annotations

import hashlib

import json
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.handlers import ServerContext, ServerHandler, Work
from fedbus.broker.log import get_logger
from fedbus.broker.peer import Peer, PeerError
from fedbus.broker.wire import BROADCAST, BROKER, Message, body_size, decode_body, encode_body
from fedbus.models import describe_group
from fedbus.node.config import Config, ConfigError
from fedbus.node.engine import (NOTED_KINDS, SENT_BATCHES, SERVER, Engine, Out, Refusal,
                                client_address, client_index, out_params)
from fedbus.node.privacy.budget import run_noise_seed, uses_secret_server_noise
from fedbus.node.privacy.secure_round import privacy_refusal, run_graph_key
from fedbus.node.setup import (arch_builder, check_models, distinct_archs, federated_data,
                               make_model, pooled_train)
from fedbus.node.validate import Rejected, check_eval_result, check_merged, check_update
from fedbus.record.msglog import MessageLogWriter
from fedbus.record.rundir import RunDir, atomic_write, summarise

log = get_logger("fedbus.server")


def build_handler(cfg: Config) -> ServerHandler:
    algo = get_algorithm(cfg.algorithm.name)
    data = federated_data(cfg)
    feature_dim = check_models(cfg, algo.server.needs_same_model, algo.server.needs_same_head)
    archs = {make_model(cfg, i, data).arch for i in range(min(cfg.federation.clients,
                                                              len(cfg.model.group) or 1))}
    ctx = ServerContext(params=dict(cfg.algorithm), train=dict(cfg.train),
                        num_classes=data.num_classes, feature_dim=feature_dim,
                        clients=cfg.federation.clients, rounds=cfg.federation.rounds,
                        seed=cfg.federation.seed, homogeneous=len(archs) == 1,
                        make_model=lambda i: make_model(cfg, i, data),
                        pooled_train=lambda: pooled_train(data),
                        archs=distinct_archs(cfg), build_arch=arch_builder(cfg, data))
    return algo.server(ctx)


def presence_counts(privacy: Any) -> bool:
    """Whether honest clients send class presence flags (0/1) as their counts: record-level
    DP and privacy.withhold_counts. A count above 1 would then weigh one client's
    prototypes as that many honest clients' (issue 42 Why 9), so it is refused."""
    return privacy.dp == "record" or bool(privacy.withhold_counts)


def build_engine(cfg: Config, run_id: str) -> Engine:
    reason = privacy_refusal(cfg)  # (a server started by hand skips the launcher's preflight)
    if reason is not None:
        raise ConfigError(reason)
    data = federated_data(cfg)
    n = cfg.federation.clients
    sizes = {i: len(data.parts[i].train) for i in range(n)}
    engine = Engine(cfg, build_handler(cfg), run_id, train_sizes=sizes)
    engine.label_pixels = data.label_pixels
    engine.test_sizes = {i: len(data.parts[i].test) for i in range(n)}
    # per-class bounds; segmentation counts pixels: the total bounds only. Record-level DP
    # sends noisy class presence (a class the client lacks may show, fedbus.node.privacy.dp),
    # withhold_counts plain presence: a flag of 1 each, which bounds a relay's or a secure
    # round's summed mass by its members
    if presence_counts(cfg.privacy):
        engine.class_samples = {i: np.ones(data.num_classes, np.int64) for i in range(n)}
    elif data.label_pixels == 1:
        per_class = data.class_counts("train")
        engine.class_samples = {i: per_class[i] for i in range(n)}
    return engine


def judge(engine: Engine, msg: Message) -> Refusal | None:
    """Why the server refuses a received message, or None. Reads the engine, changes
    nothing: the shell logs a refusal compactly (the message itself is not stored) and the
    engine takes it as an event (Engine.on_refused), live and in a replay alike."""
    try:
        return _judge(engine, msg)
    except Exception as err:  # a check that itself failed: the message is refused
        return Refusal(msg.kind, msg.src, f"unreadable {msg.kind}: {type(err).__name__}: "
                       f"{err}"[:300], msg.round, answer=msg.kind in ANSWERED)


# kinds whose refusal is answered with an error (their senders wait for an outcome)
ANSWERED = ("update", "updates", "merged", "eval_result")

# an update's refusals count as "rejected" (Engine.on_refused), a batch's envelope too
UPDATE_KINDS = ("update", "updates", "merged")


@dataclass
class Member(Message):
    """One member of an `updates` batch (PROTOCOL.md §4.3) as the `update` it stands for:
    its sender the client address, its size its body's as that `update` would carry it
    (so a record's bytes do not depend on how a node's answers happened to be batched)."""

    size: int = 0

    @property
    def nbytes(self) -> int:
        return self.size


def batch_members(msg: Message) -> list[Member]:
    """An accepted `updates` batch's members, in order, each as an `update` message."""
    out = []
    for m in msg.body["members"]:
        body = {k: v for k, v in m.items() if k != "from"}
        out.append(Member("update", m["from"], SERVER, body, run=msg.run, round=msg.round,
                          size=body_size(body)))
    return out


def _updates_problem(engine: Engine, msg: Message) -> str | None:
    """Why an `updates` batch is refused whole, or None: its envelope only; each member is
    judged as an `update` when it is taken (take_updates)."""
    body: Any = msg.body
    if engine.secure:
        return "under secure aggregation each update travels alone (PROTOCOL.md §4.3)"
    hosted = engine.nodes.get(msg.src)
    if hosted is None:
        return f"updates come from a node of this run, not {msg.src!r}"
    if not isinstance(body, dict) or not isinstance(body.get("members"), list) or \
            not body["members"]:
        return "an updates body must be a map with a non-empty list members"
    if len(body["members"]) > len(hosted):
        return f"{len(body['members'])} members, more than the {len(hosted)} clients the " \
               "sender hosts"
    for i, m in enumerate(body["members"]):
        if not isinstance(m, dict) or not isinstance(m.get("from"), str):
            return f"members[{i}] must be an update map with 'from' (its client's address)"
    return None


def take_updates(engine: Engine, msg: Message, now: float) -> list[Out]:
    """An accepted `updates` batch: each member judged and taken as the `update` it stands
    for, one by one in the batch's order, so a bad member is refused alone (and ends its
    own task) while the others count. A member for a client the sender does not host is
    refused without touching that client's task (no node speaks for another's clients)."""
    hosted = set(engine.nodes.get(msg.src, ()))
    out: list[Out] = []
    for m in batch_members(msg):
        try:
            client = client_index(m.src)
        except ValueError:
            client = None
        if client not in hosted:
            out += engine.on_refused(Refusal("update", msg.src, f"{m.src!r} is not a client "
                                             f"of node {msg.src!r}", msg.round), now)
            continue
        refusal = judge(engine, m)
        out += take(engine, m, now) if refusal is None else engine.on_refused(refusal, now)
    return out


def _judge(engine: Engine, msg: Message) -> Refusal | None:
    body: Any = msg.body
    kind, src = msg.kind, msg.src

    def refuse(reason: str, **kw: Any) -> Refusal:
        return Refusal(kind, src, reason, msg.round, answer=kind in ANSWERED, **kw)

    if kind in ("join", "leave"):
        if src != BROKER:
            return refuse(f"{kind} comes from the broker only, not {src!r}")
        if not isinstance(body, dict) or not isinstance(body.get("node"), str) or \
                not isinstance(body.get("clients", []), list):
            return refuse(f"{kind} body must be {{node: str, clients: list}}")
        return None
    if kind == "update":
        if not isinstance(body, dict):
            return refuse(f"update body must be a map, got {type(body).__name__}")
        reason = engine.is_expected_update(src, body, run=msg.run, round=msg.round)
        if reason is not None:
            return refuse(reason)
        client = client_index(src)
        if engine.secure:  # a masked input: its shape and sender; the sum is checked whole
            reason = engine.secure_input_problem([client], body.get("payload"))
            n = body.get("num_samples")
            if reason is None and (isinstance(n, bool) or not isinstance(n, int) or
                                   not 0 <= n <= engine.max_samples(client)):
                reason = f"num_samples {n!r} is not within 0..{engine.max_samples(client)}"
            return None if reason is None else refuse(reason, task=body["task"])
        try:
            check_update(body, engine.handler.update_spec(),
                         num_classes=engine.handler.ctx.num_classes,
                         max_samples=engine.max_samples(client),
                         class_samples=engine.class_max(client),
                         max_bytes=int(engine.cfg.bus.max_frame_mb) << 20,
                         nbytes=msg.nbytes, label_pixels=engine.label_pixels,
                         norms=engine.norms, count_epochs=engine.count_epochs,
                         presence=presence_counts(engine.cfg.privacy))
        except Rejected as err:  # the client's answer to a live task: that task is over
            return refuse(str(err), task=body["task"])
        return None
    if kind == "merged":
        return _judge_merged(engine, msg, refuse)
    if kind == "updates":
        reason = _updates_problem(engine, msg)
        return None if reason is None else refuse(reason)
    if kind == "secagg":
        if not isinstance(body, dict):
            return refuse("a secagg body must be a map")
        try:
            reason = engine.is_expected_secagg(src, body)
        except ValueError:
            reason = f"sender {src!r} is not a client"
        return None if reason is None else refuse(reason)
    if kind == "config":
        if not isinstance(body, dict) or body.get("run") != engine.run_id:
            return refuse("a config acknowledgement must name this run")
        if config_sender(engine, src) is None:
            return refuse(f"{src!r} is no node of this run")
        return None
    if kind == "error":
        if not isinstance(body, dict):
            return refuse("error body must be a map")
        if src == BROKER:
            return None
        task = engine.tasks.get(body.get("task")) if isinstance(body.get("task"), int) \
            else None
        if body.get("code") != "handler_failed" or task is None or \
                client_address(task.client) != src:
            return refuse("an error from a client must end a task sent to it")
        return None
    if kind == "eval_result":
        if not isinstance(body, dict):
            return refuse(f"eval result must be a map, got {type(body).__name__}")
        try:
            client = client_index(src)
        except ValueError:
            return refuse(f"sender {src!r} is not a client")
        eid = body.get("eval")
        ev = engine.evals.get(eid) if isinstance(eid, int) and not isinstance(eid, bool) \
            else None
        if ev is None or client not in ev.expected or client in ev.results:
            # (a late result of an honest client, too: nothing to answer)
            return Refusal(kind, src, f"evaluation {eid!r} does not wait for {src}",
                           msg.round, answer=False)
        try:
            check_eval_result(body, test_size=engine.test_size(client),
                              units=engine.label_pixels)
        except Rejected as err:  # this client's part of the evaluation is over
            return refuse(str(err), eval=eid)
        return None
    return refuse(f"the server takes no {kind!r} messages")


def _judge_merged(engine: Engine, msg: Message, refuse) -> Refusal | None:
    """A relay's pre-aggregated update: checked whole. A refused one ends the tasks of its
    members the sender hosts, so the round need not wait."""
    body: Any = msg.body
    rule = engine.handler.merge_rule()
    try:
        if engine.secure:
            reason = _secure_merged_problem(engine, msg)
            if reason is None:
                return None
            raise Rejected(reason)
        if rule is None:
            raise Rejected(f"{type(engine.handler).__name__} declares no merge rule")
        check_merged(body, rule.spec(engine.handler), max_samples=engine.max_samples,
                     max_bytes=int(engine.cfg.bus.max_frame_mb) << 20, nbytes=msg.nbytes,
                     units=engine.label_pixels, num_classes=engine.handler.ctx.num_classes,
                     class_samples=engine.class_max, norms=engine.norms,
                     count_epochs=engine.count_epochs)
        reason = rule.check(body["payload"], body["members"]) or \
            engine.is_expected_merged(msg.src, body, run=msg.run, round=msg.round)
    except (Rejected, ValueError) as err:
        reason = str(err)
    if reason is None:
        return None
    hosted = set(engine.nodes.get(msg.src, ()))
    members = body.get("members") if isinstance(body, dict) else None
    tasks = []
    for m in members if isinstance(members, list) else ():
        # only the tasks of clients the sender hosts: a relay cannot end another's tasks
        if isinstance(m, list) and len(m) == 4 and isinstance(m[1], int):
            try:
                client = client_index(m[0])
            except ValueError:
                continue
            if client in hosted and [m[0], m[1]] not in tasks and len(tasks) < len(hosted):
                tasks.append([m[0], m[1]])
    return refuse(reason, tasks=tasks)


def _secure_merged_problem(engine: Engine, msg: Message) -> str | None:
    """Why a relay's sum of masked inputs must be refused, or None: the members' part as
    for any merged update, the payload one masked vector of the round's shape."""
    body: Any = msg.body
    if not isinstance(body, dict) or not isinstance(body.get("members"), list) or \
            not body["members"]:
        return "merged body must be a map with a non-empty member list"
    members = body["members"]
    if len(members) > len(engine.nodes.get(msg.src, ())):
        return "more members than the sender hosts"
    clients, seen = [], set()
    for i, m in enumerate(members):
        if not isinstance(m, list) or len(m) != 4 or not isinstance(m[0], str):
            return f"members[{i}] must be [client, task, num_samples, work]"
        client = client_index(m[0])
        n = m[2]
        if client in seen:
            return f"{m[0]} is listed twice"
        seen.add(client)
        if isinstance(n, bool) or not isinstance(n, int) or \
                not 0 <= n <= engine.max_samples(client):
            return f"members[{i}] num_samples {n!r} is out of range"
        try:
            Work.from_dict(m[3])
        except (KeyError, TypeError, ValueError, AttributeError):
            return f"members[{i}] work is malformed"
        clients.append(client)
    return engine.is_expected_merged(msg.src, body, run=msg.run, round=msg.round) or \
        engine.secure_input_problem(clients, body.get("payload"))


def config_sender(engine: Engine, src: str) -> str | None:
    """The node a config acknowledgement is credited to: the sender the broker authenticated
    (the node itself, or the node hosting the client address it sent from), never what the
    body says."""
    if src in engine.nodes:
        return src
    try:
        return engine.host.get(client_index(src))
    except ValueError:
        return None


def apply(engine: Engine, msg: Message, now: float) -> list[Out]:
    """An accepted message -> engine event -> messages to send."""
    body: Any = msg.body
    kind = msg.kind
    if kind in ("join", "leave"):
        if body.get("role", "client") != "client":
            return []
        clients = [c for c in body.get("clients", []) if isinstance(c, str)]
        if kind == "join":
            return engine.on_join(body["node"], clients, now)
        return engine.on_leave(body["node"], clients, now)
    if kind == "update":
        return engine.on_update(msg.src, body, msg.nbytes, now)
    if kind == "merged":
        return engine.on_merged(msg.src, body, msg.nbytes, now)
    if kind == "updates":
        return take_updates(engine, msg, now)
    if kind == "config":
        node = config_sender(engine, msg.src)
        # a node that takes batched tasks (and evaluations) says so (PROTOCOL.md §4.3)
        said = body.get("batch")
        batch = [k for k in said if k in SENT_BATCHES] if isinstance(said, list) else []
        return [] if node is None else engine.on_configured(node, body["run"], now, batch)
    if kind == "error" and body.get("code") == "handler_failed":
        return engine.on_task_failed(msg.src, body.get("task"), now)
    if kind == "eval_result":
        return engine.on_eval_result(msg.src, body, now)
    if kind == "secagg":
        return engine.on_secagg(msg.src, body, now, msg.nbytes)
    return []


def dispatch(engine: Engine, msg: Message, now: float) -> list[Out]:
    """One received message -> engine event -> messages to send: judged, then applied (the
    live server and `fedbus replay` take this one path). A handler that raises on an
    accepted message is logged with the sender; the message counts as refused."""
    refusal = judge(engine, msg)
    if refusal is not None:
        return engine.on_refused(refusal, now)
    return take(engine, msg, now)


def take(engine: Engine, msg: Message, now: float) -> list[Out]:
    """apply(), where a handler that raises costs the message, not the server."""
    try:
        return apply(engine, msg, now)
    except Exception as err:
        log.error("message handling failed", kind=msg.kind, src=msg.src,
                  error=f"{type(err).__name__}: {err}", exc_info=True)
        return engine.on_refused(Refusal(msg.kind, msg.src, f"handling failed: "
                                         f"{type(err).__name__}", msg.round,
                                         answer=msg.kind in ANSWERED), now)


class CheckpointError(ValueError):
    """A checkpoint a resume cannot use; the message names the file and what to do."""


# checkpoints held in memory while their flushes are answered (a node whose state writes
# fail never answers: the oldest then goes, so memory stays bounded)
MAX_PENDING_CHECKPOINTS = 4
CHECKPOINT_KEYS = ("version", "rng", "next_task_id", "next_eval_id", "totals", "handler")
# The checkpoint is the encoded state followed by this line and its SHA-256: a truncated
# file loses the line, a flipped byte fails the digest, and neither is resumed from as if
# it were whole. Files written before the digest (no line) are read as they are.
CHECKSUM_LINE = b"\n#fedbus-checkpoint sha256="


def checkpoint_bytes(state: dict[str, Any]) -> bytes:
    """The file a checkpoint is written as: the encoded state, then its digest line."""
    body = encode_body(state)
    return body + CHECKSUM_LINE + hashlib.sha256(body).hexdigest().encode() + b"\n"


def read_checkpoint(path: Path, keys: tuple[str, ...] = CHECKPOINT_KEYS
                    ) -> tuple[bytes, dict[str, Any]]:
    """The encoded state (without its digest line) and the decoded state of a server
    checkpoint; CheckpointError (one line) for a file that is truncated, damaged or not a
    checkpoint (one without `keys`). It is written atomically, so a stop never leaves half
    of one: damage comes from elsewhere (a disk, a copy, a hand)."""
    redo = "the run cannot resume from it: start it again with --force"
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: {err}); "
                              f"{redo}") from None
    cut = raw.rfind(CHECKSUM_LINE)
    if cut >= 0:
        digest = raw[cut + len(CHECKSUM_LINE):]
        raw = raw[:cut]
        if digest != hashlib.sha256(raw).hexdigest().encode() + b"\n":
            raise CheckpointError(f"{path} is damaged: its SHA-256 does not match its "
                                  f"contents (a changed or cut-short file); {redo}")
    try:
        state = decode_body(raw, max_frame=max(len(raw), 1))
    except ValueError as err:  # WireError is a ValueError
        raise CheckpointError(f"{path} cannot be read ({type(err).__name__}: "
                              f"{' '.join(str(err).split())}); {redo}") from None
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path} is not a fedbus checkpoint (it lacks "
                              f"{', '.join(missing)}); start the run again with --force")
    return raw, state


def restore_checkpoint(engine: Engine, path: Path) -> tuple[bytes, dict[str, Any]]:
    """Load a checkpoint into the engine (read_checkpoint, then the engine's and handler's
    load_state_dict); CheckpointError for a file that is damaged or does not fit the run.
    Returns what read_checkpoint returns."""
    raw, state = read_checkpoint(path)
    try:
        engine.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError, AttributeError, IndexError,
            OverflowError) as err:
        raise CheckpointError(f"{path} does not fit this run's algorithm and config "
                              f"({type(err).__name__}: {' '.join(str(err).split())[:300]}); "
                              f"start the run again with --force") from None
    return raw, state


class ServerNode:
    def __init__(self, cfg: Config, run_dir: str | Path, broker: str, *, resume: bool = False,
                 run_id: str | None = None, curve=None):
        self.cfg = cfg
        self.curve = curve  # fedbus.broker.auth.PeerCurve, or None for plaintext
        self.resume = resume
        self.run = RunDir(run_dir, resume=resume, tensorboard=cfg.log.tensorboard)
        self.run_id = self._run_id(run_id)
        self.broker = broker
        self.engine = build_engine(cfg, self.run_id)
        if uses_secret_server_noise(cfg.privacy):
            self.engine.noise_seed = run_noise_seed(self.run.path, create=True)
        if cfg.privacy.secure_aggregation:
            self.engine.secagg_key = run_graph_key(self.run.path, create=True)
        self.started = time.time()
        self.msglog: MessageLogWriter | None = None
        self._status_at = 0.0
        # refusals that changed nothing but a counter, not logged one by one (a flood of
        # them must not fill the disk): their counts go into the log as one record
        self._quiet_refusals: dict[str, int] = {}
        self._rejections = RejectionLog()
        # Client-state flushes (PROTOCOL.md §4.2): a sync checkpoint is written once every
        # node sent a task before it has its clients' states on disk. Marks count the tasks
        # sent: a node's last task, the newest flush sent to it and the one it answered.
        self._peer: Peer | None = None
        self._tasks_sent = 0
        self._last_task: dict[str, int] = {}
        self._flushing: dict[str, int] = {}
        self._covered: dict[str, int] = {}
        self._rejoined: set[str] = set()
        # checkpoints waiting for flushes, oldest first: (version, file, node -> mark)
        self._pending: list[tuple[int, bytes, dict[str, int]]] = []
        self._flushed_for: tuple[int, dict[str, int]] | None = None  # (version, waits)
        self._on_disk = 0  # the version of checkpoint.fbk

    def _run_id(self, given: str | None) -> str:
        path = self.run.path / "run_id"
        if self.resume and path.exists():
            return path.read_text().strip()
        rid = given or uuid.uuid4().hex[:12]
        path.write_text(rid)  # replay rebuilds the server under this id
        return rid

    def _restore(self) -> None:
        ckpt = self.run.path / "checkpoint.fbk"
        if not ckpt.exists():
            # stopped between the first record and the first checkpoint: round 0 runs again,
            # so its record goes, or metrics.jsonl holds it twice (found by `fedbus bench sim`)
            dropped = self.run.keep_through(0)
            log.warning("resume asked but no checkpoint yet: starting from round 0",
                        records_dropped=dropped)
            return
        raw, state = restore_checkpoint(self.engine, ckpt)
        self._on_disk = self.engine.version
        dropped = self.run.keep_through(self.engine.version)
        if dropped:
            log.info("records after the checkpoint dropped: their rounds run again",
                     records=dropped, version=self.engine.version)
        self.started = time.time() - float(state.get("wall_s", 0.0))
        if self.msglog is not None:
            self.msglog.write("resume", time.time(), [b"", raw])
        log.info("resumed", version=self.engine.version, rounds=self.cfg.federation.rounds)

    def _checkpoint(self) -> None:
        """The engine's state now, as the checkpoint file. In sync mode it is written once
        every node sent a task since its last answered flush has answered a new one (or
        left): until then a node could lose client states of rounds it counts done
        (fedbus.node.client_state's rule). The next round goes on meanwhile."""
        e = self.engine
        state = e.state_dict()
        state["wall_s"] = time.time() - self.started
        data = checkpoint_bytes(state)
        if e.async_mode or e.done:  # async: no exact resume to keep; done: none to resume
            self._pending.clear()
            self._write_checkpoint(e.version, data)
            return
        asked, self._flushed_for = self._flushed_for, None
        waits = asked[1] if asked is not None and asked[0] == e.version else \
            self._flush(e.version)
        self._pending.append((e.version, data, waits))
        if len(self._pending) > MAX_PENDING_CHECKPOINTS:  # a node that never answers
            dropped = self._pending.pop(0)
            log.warning("a checkpoint still waiting for flushes is given up for newer ones",
                        version=dropped[0], waiting_for=sorted(
                            n for n, m in dropped[2].items()
                            if n in e.nodes and self._covered.get(n, 0) < m)[:10])
        self._flush_progress()

    def _flush(self, version: int) -> dict[str, int]:
        """Send `flush` to each live node sent a task since its last answered flush (unless
        one covering that task is on its way); returns what checkpoint `version` waits for:
        node -> the mark its answer must reach."""
        nodes = self.engine.nodes
        waits = {node: mark for node, mark in self._last_task.items()
                 if mark > self._covered.get(node, 0) and node in nodes}
        for node, mark in waits.items():
            if self._flushing.get(node, 0) < mark:
                self._send_flush(node, version)
        return waits

    def _write_checkpoint(self, version: int, data: bytes) -> None:
        atomic_write(self.run.path / "checkpoint.fbk", data)
        self._on_disk = version

    def _send_flush(self, node: str, version: int) -> None:
        """Ask `node` to answer once its client states so far are on disk. Not in the
        message log: the checkpoint's timing is the shell's, not the engine's."""
        mark = self._flushing[node] = self._tasks_sent
        try:
            self._peer.send("flush", node, {"round": version, "durable": self._on_disk,
                                            "mark": mark}, round=version)
        except (ValueError, PeerError) as err:  # (a node name the broker would refuse)
            log.warning("flush not sent", node=node, error=str(err))

    def flush_input(self, msg: Message) -> bool:
        """A message of the flush exchange, taken here (True), never by the engine: a
        node's `flushed`, or the broker's error about a flush (the node is gone: its
        leave ends the wait). A node's join is noted, so that a flush it may have lost
        with its last connection is sent again (False: the engine takes the join too)."""
        kind, body = msg.kind, msg.body
        if kind == "flushed":
            node = config_sender(self.engine, msg.src)  # the sender the broker vouches for
            mark = body.get("mark") if isinstance(body, dict) else None
            if node is not None and type(mark) is int and \
                    self._covered.get(node, 0) < mark <= self._flushing.get(node, 0):
                self._covered[node] = mark
            return True
        if kind == "error" and msg.src == BROKER and isinstance(body, dict) and \
                body.get("kind") == "flush":
            return True
        if kind == "join" and msg.src == BROKER and isinstance(body, dict) and self._pending:
            self._rejoined.add(str(body.get("node")))
        return False

    def _flush_progress(self) -> None:
        """Write the newest waiting checkpoint whose nodes have all answered or left (the
        older ones with it: a newer one waits for at least their marks)."""
        if not self._pending:
            return
        nodes = self.engine.nodes
        for node in self._rejoined:
            if node in nodes and any(node in waits for _, _, waits in self._pending) and \
                    self._covered.get(node, 0) < self._flushing.get(node, 0):
                self._send_flush(node, self._pending[-1][0])
        self._rejoined.clear()
        ready = None
        for i, (_, _, waits) in enumerate(self._pending):
            if all(node not in nodes or self._covered.get(node, 0) >= mark
                   for node, mark in waits.items()):
                ready = i
        if ready is not None:
            version, data, _ = self._pending[ready]
            del self._pending[:ready + 1]
            self._write_checkpoint(version, data)

    def serve(self) -> int:
        """Run until the engine is done (0), or until SIGINT/SIGTERM (128 + the signal's
        number): a stopped run is left resumable, never marked complete (_stopped)."""
        torch.set_num_threads(1)  # replay runs the server's mathematics on one thread too
        stop = StopSignals()
        try:
            return self._serve(stop)
        finally:
            stop.restore()

    def _serve(self, stop: StopSignals) -> int:
        cfg = self.cfg
        if not self.resume:
            self.run.write_config(cfg.to_dict())
        if cfg.log.messages:
            self.msglog = MessageLogWriter(self.run.path, append=self.resume)
        if self.resume:
            try:
                self._restore()
            except CheckpointError as err:
                log.error("cannot resume", error=str(err))
                print(f"fedbus server: {err}", file=sys.stderr)
                return 2
        self._describe_models()
        # (a resumed run that had already ended only says so again: see Engine.on_resumed)
        outs = self.engine.on_resumed(time.time()) if self.resume else []
        peer = Peer(self.broker, self.curve.name if self.curve else SERVER, role="server",
                    run=self.run_id, heartbeat_s=cfg.bus.heartbeat_s, liveness=cfg.bus.liveness,
                    max_frame=cfg.bus.max_frame_mb << 20, curve=self.curve)
        peer.start()
        log.info("server ready", run=self.run_id, algorithm=cfg.algorithm.name,
                 mode=cfg.federation.mode, clients=cfg.federation.clients,
                 rounds=cfg.federation.rounds, batch=self._batch_choice())
        engine = self.engine
        # A deadline that passed and was ticked with nothing received since: a round past
        # its deadline still short of min_updates (the broker down, say), or a start
        # timeout with too few clients, stays the next deadline until a message comes, and
        # ticking it again changes nothing: tick it twice a second, not in a busy loop.
        ticked = None
        why = "failed"
        try:
            self._emit(peer, outs, engine.version)
            # a signal is a flag looked at between events, so a stop never lands inside
            # the record-then-checkpoint step of _emit
            while not engine.done and not stop.signum:
                deadline = engine.next_deadline()
                if deadline is None or deadline == ticked:
                    wait = 0.5
                else:
                    wait = max(0.0, min(0.5, deadline - time.time()))
                msg = peer.recv(timeout=wait)
                if stop.signum:
                    # Ctrl-C signals the whole process group: a node's leave, sent as it
                    # stops, must not close a round the uninterrupted run would not
                    break
                now = time.time()
                version = engine.version
                if msg is not None:
                    ticked = None
                    if self.flush_input(msg):
                        outs = []
                    elif (refusal := judge(engine, msg)) is None:
                        self._log("in", now, msg.frames, _header(msg))
                        outs = take(engine, msg, now)
                    else:
                        self._log_refusal(refusal, now)
                        outs = engine.on_refused(refusal, now)
                elif deadline is not None and now >= deadline:
                    self._log("tick", now, [])
                    outs = engine.on_tick(now)
                    ticked = None if outs else deadline
                else:
                    outs = []
                self._emit(peer, outs, version)
            why = stop.name or "done"
        except KeyboardInterrupt:  # signals not caught (not the main thread)
            why = "SIGINT"
        finally:
            if engine.done:
                self._finish()
                self._await_shutdown(peer, stop)
            else:
                self._stopped(why)
            peer.close()
        if engine.done:
            return 0
        return 128 + (signal.SIGTERM if why == "SIGTERM" else signal.SIGINT)

    def _batch_choice(self) -> str:
        """bus.batch as this run uses it (PROTOCOL.md §4.3), for the log."""
        choice = self.cfg.bus.get("batch", "off")
        if choice == "auto" and self.cfg.privacy.secure_aggregation:
            return "off (secure aggregation: each task opens its own session, so tasks " \
                   "stay one a client)"
        return "auto (a round's tasks and an evaluation's requests one message a node)" \
            if choice == "auto" else "off"

    def _await_shutdown(self, peer: Peer, stop: StopSignals) -> None:
        """Keep the connection until the shutdown is delivered (every client node live when
        it left acknowledged it or is gone, or a broker with none refused it; the broker
        keeps it for nodes that come back, PROTOCOL.md §5), at most Peer.delivery_wait_s:
        a broker down as the run ended would lose it, and a node that missed it would wait
        for ever."""
        if not peer.undelivered(BROADCAST):
            return
        wait = peer.delivery_wait_s
        if not peer.connected:
            log.info("broker away: waiting to deliver the shutdown", up_to_s=wait)
        if not peer.wait_delivered(BROADCAST, wait, lambda: stop.signum):
            log.warning("the shutdown was not delivered: a node that missed it waits until "
                        "it is stopped", waited_s=wait, broker=self.broker,
                        connected=peer.connected)

    def _describe_models(self) -> None:
        """Parameter counts and feature dims of the federation's networks."""
        cfg = self.cfg
        data = federated_data(cfg)
        rows = describe_group(cfg.model, num_clients=cfg.federation.clients,
                              in_shape=tuple(data.in_shape), num_classes=data.num_classes)
        atomic_write(self.run.path / "models.json", json.dumps(rows).encode())
        for row in rows:
            log.info("model", **row)

    def _log(self, direction: str, now: float, frames: list, header: dict | None = None) -> None:
        if self.msglog is None:
            return
        self._log_quiet(now)
        self.msglog.write(direction, now, frames, header)

    def _log_quiet(self, now: float) -> None:
        if self._quiet_refusals and self.msglog is not None:
            counts, self._quiet_refusals = self._quiet_refusals, {}
            self.msglog.write("refused", now, [b"", encode_body({"count": counts})],
                              {"kind": "refused"})

    def _log_refusal(self, refusal: Refusal, now: float) -> None:
        """A refusal that ends a task or an evaluation's wait is an engine event the replay
        must take: one small record (not the refused bytes); any other only counts."""
        if refusal.changes_state():
            self._log("refused", now, [b"", encode_body(refusal.to_dict())],
                      {"kind": refusal.kind, "src": refusal.src, "round": refusal.round})
        else:
            key = "rejected" if refusal.kind in UPDATE_KINDS else "refused"
            self._quiet_refusals[key] = self._quiet_refusals.get(key, 0) + 1

    def _send(self, peer: Peer, outs: list[Out]) -> None:
        for out in outs:
            msg = peer.send(out.kind, out.dst, out.body, round=out.round)
            if out.kind != "error":  # answers to refusals: a replay makes them, unlogged
                self._log("out", time.time(), msg.frames, _header(msg))
            if out.kind in NOTED_KINDS:
                self.engine.note_sent(out, msg.nbytes, out_params(out))
            if out.kind == "task":  # the node's client states change: a flush will ask
                node = self.engine.host.get(client_index(out.dst))
                if node is not None:
                    self._tasks_sent += 1
                    self._last_task[node] = self._tasks_sent
            elif out.kind == "tasks":  # (a batch: its node, once for all its members)
                self._tasks_sent += len(out.body["members"])
                self._last_task[out.dst] = self._tasks_sent

    def _emit(self, peer: Peer, outs: list[Out], version_before: int) -> None:
        """An input's outputs sent and what it changed recorded. The shutdown leaves after
        the last checkpoint is on disk: a server killed between the two resumes to a clean
        end (Engine.on_resumed), while nodes that took the shutdown first would be gone
        for the round it reran."""
        self._peer = peer
        e = self.engine
        if e.records and not e.done and not e.async_mode:
            # a sync round closed: its checkpoint's flushes leave before the next round's
            # tasks, so a node answers them before it trains again (PROTOCOL.md §4.2)
            self._flushed_for = (e.version, self._flush(e.version))
        self._send(peer, [o for o in outs if o.kind != "shutdown"])
        self._record(version_before)
        self._send(peer, [o for o in outs if o.kind == "shutdown"])

    def _record(self, version_before: int) -> None:
        engine = self.engine
        for ev in engine.events:
            name = ev.pop("event")
            if name == "rejected":
                self._rejections.note(ev, time.time())
            else:
                log.info(name, **ev)
        engine.events.clear()
        self._rejections.summarise(time.time())
        drained = bool(engine.records)
        if drained:
            for rec in engine.records:
                rec["wall_s"] = round(rec["time"] - self.started, 3)
                log.info("round", round=rec["round"], updates=rec["updates"],
                         failed=rec["failed"], acc=rec.get("acc_mean"),
                         proto_acc=rec.get("proto_acc_mean"))
            if self._pending and not engine.async_mode:
                # written before the record it explains: a kill right after the record
                # finds why the checkpoint on disk is more than one round behind it
                nodes = engine.nodes
                log.info("checkpoint waits for flushes", version=engine.records[-1]["version"],
                         checkpoint=self._on_disk, held=[v for v, _, _ in self._pending],
                         waiting_for=sorted({n for _, _, waits in self._pending
                                             for n, mark in waits.items() if n in nodes
                                             and self._covered.get(n, 0) < mark})[:10])
            self.run.append_metrics(engine.records)
            engine.records.clear()
        # A sync round ends with its evaluation, so its checkpoint waits for the record:
        # a resumed run then never lacks the metrics of a round it counts as done. An async
        # evaluation's record comes when it ends, after later aggregations: no checkpoint
        # while one is outstanding, or a resume would count its version done unrecorded.
        # (and once the run is done: a run a privacy budget stopped between records must
        # resume stopped)
        if drained or engine.done or \
                (engine.async_mode and engine.version != version_before):
            if not (engine.async_mode and engine.evals):
                self._checkpoint()
            if self.msglog is not None:
                self._log_quiet(time.time())
                self.msglog.flush()
        self._flush_progress()
        now = time.time()
        if now - self._status_at > 0.25 or engine.done:
            self._status_at = now
            self.run.write_status(self._status(now))

    def _status(self, now: float) -> dict[str, Any]:
        e = self.engine
        last = next((r for r in reversed(self.run.records) if "acc_mean" in r), {})
        r = e.round
        return {"run": self.run_id, "version": e.version, "rounds": e.rounds,
                "live": len(e.live), "sampled": len(r.sampled) if r else len(e.tasks),
                "pending": len(r.pending()) if r else len(e.tasks),
                "late": e.totals["late_dropped"] + e.totals["late_folded"],
                "acc": last.get("acc_mean"), "proto_acc": last.get("proto_acc_mean"),
                "elapsed_s": now - self.started, "done": e.done,
                "state": "complete" if e.done else "running",
                # how many live clients that accuracy is over (issue 47), whom the round
                # waits for and when it must close
                "eval_clients": last.get("eval_clients"), "eval_live": last.get("eval_live"),
                **e.waiting(now)}

    def _stopped(self, why: str) -> None:
        """A run stopped before its last round (a signal, a crash): no summary.json, which
        would call it complete; status.json says it stopped and why, the records and the
        message log are closed whole, and the last checkpoint is where --resume goes on."""
        e = self.engine
        self.run.write_csv()
        status = self._status(time.time())
        status["state"] = "interrupted" if why.startswith("SIG") else "failed"
        status["stopped_by"] = why
        self.run.write_status(status, durable=True)
        self._rejections.summarise(time.time(), force=True)
        if self.msglog is not None:
            self._log_quiet(time.time())
            self.msglog.close()
        self.run.close()
        log.warning("server stopped before the run's end: resumable", stopped_by=why,
                    version=e.version, rounds=e.rounds)

    def _finish(self) -> None:
        e = self.engine
        wall = time.time() - self.started
        summary = summarise(self.run.records, algorithm=self.cfg.algorithm.name,
                            totals=e.totals, wall_s=wall,
                            target_acc=self.cfg.federation.target_acc)
        if e.ledger is not None:  # what the run spent (fedbus.node.privacy.budget)
            summary["privacy"] = {**e.ledger.record(), "stopped": e.stopped or None}
        if e.secure:
            failed = sum(1 for r in self.run.records if r.get("secagg", {}).get("failed"))
            summary["secure_aggregation"] = {"rounds_failed": failed}
        self.run.write_summary(summary)
        self.run.write_csv()
        embeddings = getattr(e, "final_embeddings", None)
        if embeddings:
            atomic_write(self.run.path / "embeddings.fbk",
                         encode_body({"clients": {str(k): v for k, v in embeddings.items()},
                                      **global_prototypes(e.handler.state_dict())}))
        masks = getattr(e, "final_masks", None)
        if masks:  # segmentation: the mask plot's images (fedbus.analysis.plots)
            atomic_write(self.run.path / "masks.fbk",
                         encode_body({"clients": {str(k): v for k, v in masks.items()}}))
        self.run.write_status(self._status(time.time()), durable=True)
        self._rejections.summarise(time.time(), force=True)
        if self.msglog is not None:
            self._log_quiet(time.time())
            self.msglog.close()
        self.run.close()
        log.info("server finished", rounds=summary["rounds_completed"], wall_s=summary["wall_s"],
                 final=summary["final"])


class StopSignals:
    """SIGINT and SIGTERM as a flag (`signum`, `name`) the server's loop looks at between
    events; a raised KeyboardInterrupt could land between a round's record and its
    checkpoint. Outside the main thread the handlers cannot be set: Python's defaults stay."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, Any] = {}
        try:
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._hit)
        except ValueError:  # not the main thread
            self.restore()

    def _hit(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


class RejectionLog:
    """Refusals in the server's log, bounded: the first PER_SENDER of each sender in a
    WINDOW_S window are logged one by one (with the reason), the rest counted and logged
    as one summary line per window. Every refusal is counted in summary.json all the same."""

    PER_SENDER = 5
    WINDOW_S = 10.0
    MAX_SENDERS = 10_000

    def __init__(self) -> None:
        self.window = 0.0
        self.seen: dict[str, int] = {}
        self.suppressed = 0

    def note(self, ev: dict[str, Any], now: float) -> None:
        self.summarise(now)
        src = str(ev.get("src"))
        n = self.seen.get(src, 0)
        if n < self.PER_SENDER and len(self.seen) < self.MAX_SENDERS:
            self.seen[src] = n + 1
            log.warning("rejected", **ev)
        else:
            self.suppressed += 1

    def summarise(self, now: float, force: bool = False) -> None:
        if now - self.window < self.WINDOW_S and not force:
            return
        if self.suppressed:
            log.warning("rejections not logged one by one", count=self.suppressed,
                        senders=len(self.seen), window_s=self.WINDOW_S)
        self.window, self.seen, self.suppressed = now, {}, 0


def global_prototypes(state: dict[str, Any]) -> dict[str, Any]:
    """The server's global prototypes under whichever name the algorithm keeps
    them: "protos" [C, D] (FedProto, FedTGP, FedAvg-proto), "agg_protos"
    (attention) or "pool" [C, K, D] (MP-FedCL), with the mask of valid ones."""
    for key, mask in (("protos", "has"), ("agg_protos", "agg_mask"), ("pool", "pool_mask")):
        if key in state:
            return {"protos": state[key], "mask": state.get(mask)}
    return {}


def _header(msg: Message) -> dict[str, Any]:
    return {"kind": msg.kind, "src": msg.src, "dst": msg.dst, "round": msg.round,
            "seq": msg.seq}
