"""The server node: the I/O shell around the round engine.

It receives messages from the broker, turns them into engine events, sends
what the engine answers, and records everything (message log, metrics,
checkpoints, status). `dispatch` is the only place where a message becomes
an event, and `fedbus replay` calls the same function, so a replay takes
exactly the live server's path.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.base import ServerContext, ServerHandler
from fedbus.broker.log import get_logger
from fedbus.broker.peer import Peer
from fedbus.broker.wire import Message, decode_body, encode_body
from fedbus.models import describe_group
from fedbus.node.config import Config
from fedbus.node.engine import SERVER, Engine, Out, client_index, count_params
from fedbus.node.msglog import MessageLogWriter
from fedbus.node.rundir import RunDir, atomic_write, summarise
from fedbus.node.setup import (arch_builder, check_models, distinct_archs, federated_data,
                               make_model, pooled_train)
from fedbus.node.validate import Rejected, check_merged, check_update

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


def build_engine(cfg: Config, run_id: str) -> Engine:
    data = federated_data(cfg)
    sizes = {i: len(data.parts[i].train) for i in range(cfg.federation.clients)}
    engine = Engine(cfg, build_handler(cfg), run_id, train_sizes=sizes)
    engine.label_pixels = data.label_pixels
    return engine


def dispatch(engine: Engine, msg: Message, now: float) -> list[Out]:
    """One received message -> engine event -> messages to send."""
    body: Any = msg.body
    kind = msg.kind
    if kind in ("join", "leave"):
        if not isinstance(body, dict) or body.get("role", "client") != "client":
            return []
        clients = [c for c in body.get("clients", []) if isinstance(c, str)]
        node = str(body.get("node", msg.src))
        if kind == "join":
            return engine.on_join(node, clients, now)
        return engine.on_leave(node, clients, now)
    if kind == "update":
        reason = engine.is_expected_update(msg.src, body if isinstance(body, dict) else {},
                                           run=msg.run, round=msg.round)
        answers_task = reason is None
        if answers_task:
            try:
                check_update(body, engine.handler.update_spec(),
                             num_classes=engine.handler.ctx.num_classes,
                             max_samples=engine.max_samples(client_index(msg.src)),
                             max_bytes=int(engine.cfg.bus.max_frame_mb) << 20,
                             nbytes=msg.nbytes, label_pixels=engine.label_pixels)
            except Rejected as err:
                reason = str(err)
        if reason is not None:
            engine.totals["rejected"] += 1
            engine.events.append({"event": "rejected", "src": msg.src, "reason": reason})
            task = body.get("task") if isinstance(body, dict) else None
            outs = [Out("error", msg.src, msg.round,
                        {"code": "rejected", "reason": reason,
                         "task": task if isinstance(task, int) else None})]
            if answers_task:  # the client's answer to a live task: that task is over
                outs += engine.on_task_failed(msg.src, task, now, reason="rejected")
            return outs
        return engine.on_update(msg.src, body, msg.nbytes, now)
    if kind == "merged":
        return _dispatch_merged(engine, msg, body, now)
    if kind == "config" and isinstance(body, dict):
        return engine.on_configured(str(body.get("node", "")), str(body.get("run", "")), now)
    if kind == "error" and isinstance(body, dict) and body.get("code") == "handler_failed":
        return engine.on_task_failed(msg.src, body.get("task"), now)
    if kind == "eval_result":
        if isinstance(body, dict) and isinstance(body.get("metrics"), dict):
            try:
                return engine.on_eval_result(msg.src, body, now)
            except ValueError:
                return []
        return []
    return []


def _dispatch_merged(engine: Engine, msg: Message, body: Any, now: float) -> list[Out]:
    """A relay's pre-aggregated update: checked whole, then one engine event. A refused one
    is answered with an error and ends its members' tasks, so the round need not wait."""
    rule = engine.handler.merge_rule()
    reason = None
    try:
        if rule is None:
            raise Rejected(f"{type(engine.handler).__name__} declares no merge rule")
        check_merged(body, rule.spec(engine.handler), max_samples=engine.max_samples,
                     max_bytes=int(engine.cfg.bus.max_frame_mb) << 20, nbytes=msg.nbytes,
                     units=engine.label_pixels)
        reason = rule.check(body["payload"], body["members"]) or \
            engine.is_expected_merged(msg.src, body, run=msg.run, round=msg.round)
    except (Rejected, ValueError) as err:
        reason = str(err)
    if reason is None:
        return engine.on_merged(msg.src, body, msg.nbytes, now)
    engine.totals["rejected"] += 1
    engine.events.append({"event": "rejected", "src": msg.src, "reason": reason})
    outs = [Out("error", msg.src, msg.round, {"code": "rejected", "reason": reason})]
    hosted = set(engine.nodes.get(msg.src, ()))
    members = body.get("members") if isinstance(body, dict) else None
    for m in members if isinstance(members, list) else ():
        # only the tasks of clients the sender hosts: a relay cannot end another's tasks
        if isinstance(m, list) and len(m) == 4 and isinstance(m[0], str) and \
                m[0][1:].isdigit() and int(m[0][1:]) in hosted:
            outs += engine.on_task_failed(m[0], m[1], now, reason="rejected")
    return outs


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
        if cfg.log.ffd_reference:  # analysis metric, not part of the replayed mathematics
            from fedbus.node.ffd import FeatureDiscrepancy

            ffd = FeatureDiscrepancy(cfg)
            for note in ffd.notes:
                log.warning("ffd reference", note=note)
            self.engine.eval_metrics.append(ffd.record_metrics)
        self.started = time.time()
        self.msglog: MessageLogWriter | None = None
        self._status_at = 0.0

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
            log.warning("resume asked but no checkpoint yet: starting from round 0")
            return
        raw = ckpt.read_bytes()
        state = decode_body(raw, max_frame=max(len(raw), 1))
        self.engine.load_state_dict(state)
        self.started = time.time() - float(state.get("wall_s", 0.0))
        if self.msglog is not None:
            self.msglog.write("resume", time.time(), [b"", raw])
        log.info("resumed", version=self.engine.version, rounds=self.cfg.federation.rounds)

    def _checkpoint(self) -> None:
        state = self.engine.state_dict()
        state["wall_s"] = time.time() - self.started
        atomic_write(self.run.path / "checkpoint.fbk", encode_body(state))

    def serve(self) -> int:
        cfg = self.cfg
        torch.set_num_threads(1)  # replay runs the server's mathematics on one thread too
        if not self.resume:
            self.run.write_config(cfg.to_dict())
        if cfg.log.messages:
            self.msglog = MessageLogWriter(self.run.path, append=self.resume)
        if self.resume:
            self._restore()
        self._describe_models()
        peer = Peer(self.broker, self.curve.name if self.curve else SERVER, role="server",
                    run=self.run_id, heartbeat_s=cfg.bus.heartbeat_s, liveness=cfg.bus.liveness,
                    max_frame=cfg.bus.max_frame_mb << 20, curve=self.curve)
        peer.start()
        log.info("server ready", run=self.run_id, algorithm=cfg.algorithm.name,
                 mode=cfg.federation.mode, clients=cfg.federation.clients,
                 rounds=cfg.federation.rounds)
        engine = self.engine
        # A deadline that passed and was ticked with nothing received since: a round past
        # its deadline still short of min_updates (the broker down, say), or a start
        # timeout with too few clients, stays the next deadline until a message comes, and
        # ticking it again changes nothing: tick it twice a second, not in a busy loop.
        ticked = None
        try:
            while not engine.done:
                deadline = engine.next_deadline()
                if deadline is None or deadline == ticked:
                    wait = 0.5
                else:
                    wait = max(0.0, min(0.5, deadline - time.time()))
                msg = peer.recv(timeout=wait)
                now = time.time()
                version = engine.version
                if msg is not None:
                    ticked = None
                    if self.msglog is not None:
                        self.msglog.write("in", now, msg.frames, _header(msg))
                    outs = dispatch(engine, msg, now)
                elif deadline is not None and now >= deadline:
                    if self.msglog is not None:
                        self.msglog.write("tick", now, [])
                    outs = engine.on_tick(now)
                    ticked = None if outs else deadline
                else:
                    outs = []
                self._send(peer, outs)
                self._record(version)
        except KeyboardInterrupt:
            log.warning("server interrupted")
            return 130
        finally:
            self._finish()
            peer.close()
        return 0

    def _describe_models(self) -> None:
        """Parameter counts and feature dims of the federation's networks."""
        cfg = self.cfg
        data = federated_data(cfg)
        rows = describe_group(cfg.model, num_clients=cfg.federation.clients,
                              in_shape=tuple(data.in_shape), num_classes=data.num_classes)
        atomic_write(self.run.path / "models.json", json.dumps(rows).encode())
        for row in rows:
            log.info("model", **row)

    def _send(self, peer: Peer, outs: list[Out]) -> None:
        for out in outs:
            msg = peer.send(out.kind, out.dst, out.body, round=out.round)
            if self.msglog is not None:
                self.msglog.write("out", time.time(), msg.frames, _header(msg))
            if out.kind in ("task", "eval"):
                self.engine.note_sent(out, msg.nbytes, count_params(out.body.get("payload")))

    def _record(self, version_before: int) -> None:
        engine = self.engine
        for ev in engine.events:
            log.info(ev.pop("event"), **ev)
        engine.events.clear()
        drained = bool(engine.records)
        if drained:
            for rec in engine.records:
                rec["wall_s"] = round(rec["time"] - self.started, 3)
                log.info("round", round=rec["round"], updates=rec["updates"],
                         failed=rec["failed"], acc=rec.get("acc_mean"),
                         proto_acc=rec.get("proto_acc_mean"))
            self.run.append_metrics(engine.records)
            engine.records.clear()
        # A sync round ends with its evaluation, so its checkpoint waits for the record:
        # a resumed run then never lacks the metrics of a round it counts as done.
        if drained or (engine.async_mode and engine.version != version_before):
            self._checkpoint()
            if self.msglog is not None:
                self.msglog.flush()
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
                "elapsed_s": now - self.started, "done": e.done}

    def _finish(self) -> None:
        e = self.engine
        wall = time.time() - self.started
        summary = summarise(self.run.records, algorithm=self.cfg.algorithm.name,
                            totals=e.totals, wall_s=wall,
                            target_acc=self.cfg.federation.target_acc)
        self.run.write_summary(summary)
        self.run.write_csv()
        embeddings = getattr(e, "final_embeddings", None)
        if embeddings:
            atomic_write(self.run.path / "embeddings.fbk",
                         encode_body({"clients": {str(k): v for k, v in embeddings.items()},
                                      **global_prototypes(e.handler.state_dict())}))
        masks = getattr(e, "final_masks", None)
        if masks:  # segmentation: the mask plot's images (fedbus.node.plots)
            atomic_write(self.run.path / "masks.fbk",
                         encode_body({"clients": {str(k): v for k, v in masks.items()}}))
        self.run.write_status(self._status(time.time()))
        if self.msglog is not None:
            self.msglog.close()
        self.run.close()
        log.info("server finished", rounds=summary["rounds_completed"], wall_s=summary["wall_s"],
                 final=summary["final"])


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
