"""Re-executing a run from its message log.

Server replay: a fresh engine and server handler, built from the run's
config and seed, receive the logged inputs (messages and deadline ticks) in
logged order through the live server's own `dispatch`; every message it
sends is compared, byte for byte, with the logged output. Arrival order is
whatever the log says it was, so async and straggler runs replay exactly.

Client replay: one client is rebuilt from the config (partition, model,
seed) and fed every task and eval request it was sent, in order; its update
for the chosen round is compared with the one it sent. Under secure aggregation
the update travelled masked (only the round's sum can be unmasked), so its
payload cannot be compared: the replay compares its work record and returns
the recomputed update for the caller to show.

Rounds are 0-based, as on the wire and in metrics.jsonl: round 0 is the first
aggregation; `until_round=R` replays rounds 0 to R, both included.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from fedbus.broker.wire import (DEFAULT_MAX_FRAME, Message, WireError, decode, decode_body,
                                encode_body)
from fedbus.node.privacy.budget import run_noise_seed, uses_secret_server_noise
from fedbus.node.privacy.secure_round import run_graph_key
from fedbus.node.config import Config, build_config
from fedbus.node.engine import (NOTED_KINDS, SENT_BATCHES, Engine, Out, Refusal, client_address,
                                out_params, unbatch_tasks)
from fedbus.record.msglog import LogCorrupt, Record, read_log
from fedbus.node.server import build_engine, dispatch


# Keys added since runs were first recorded, whose default is not what a run recorded
# before them did: (section, key, algorithm or None) -> the behaviour those runs had. A
# config.json that lacks such a key is read with this value, so a replayed client computes
# what the logged one did. (A key whose default kept the old behaviour needs no entry.)
LEGACY_VALUES: dict[tuple[str, str, str | None], Any] = {
    ("train", "optimizer_state", None): "persist",  # issue 25: momentum carried over
    ("algorithm", "proto_model", "fedavg-proto"): "local",  # issue 25: local models' means
    # issue 28: every client trained one by one (a cohort equals it to float32 rounding only)
    ("train", "cohort", None): "off",
}


def load_run(run_dir: str | Path) -> tuple[Config, str]:
    run_dir = Path(run_dir)
    try:
        raw = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{run_dir} has no config.json: not a fedbus run directory") \
            from None
    run_id_path = run_dir / "run_id"
    return build_config(with_legacy_values(raw)), \
        run_id_path.read_text().strip() if run_id_path.exists() else ""


def with_legacy_values(raw: dict[str, Any]) -> dict[str, Any]:
    """A run's saved config with LEGACY_VALUES filled in where it predates a key."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    algorithm = (out.get("algorithm") or {}).get("name")
    for (section, key, only), value in LEGACY_VALUES.items():
        table = out.setdefault(section, {})
        if isinstance(table, dict) and key not in table and only in (None, algorithm):
            table[key] = value
    return out


def _config_as_logged(body: Any, logged: Any) -> Any:
    """A replayed config message's body without the config keys the logged one lacks: a
    run recorded before a key existed sent its config without it, and the added key (at
    its default, or its LEGACY_VALUES value) is not part of what is compared."""
    if not (isinstance(body, dict) and isinstance(logged, dict)
            and isinstance(body.get("config"), dict)
            and isinstance(logged.get("config"), dict)):
        return body
    theirs = logged["config"]
    config = {section: {k: v for k, v in table.items() if k in theirs.get(section, {})}
              if isinstance(table, dict) and isinstance(theirs.get(section), dict) else table
              for section, table in body["config"].items() if section in theirs}
    return {**body, "config": config}


class NoMessageLog(FileNotFoundError):
    """The run directory holds no message log: the message says why (log.messages off)."""


def require_message_log(run_dir: str | Path, cfg: Config) -> None:
    """Raise NoMessageLog, saying why, if the run kept no message log to replay."""
    run_dir = Path(run_dir)
    if (run_dir / "messages.bin").exists():
        return
    if not cfg.log.messages:
        raise NoMessageLog(f"{run_dir} ran with log.messages = false: it kept no message log, "
                           "so there is nothing to replay (log.messages = true, the default, "
                           "keeps one)")
    raise NoMessageLog(f"{run_dir} has no messages.bin: its message log is missing")


@dataclass
class Divergence:
    index: int  # message log record
    round: int
    field: str
    detail: str

    def __str__(self) -> str:
        return f"record {self.index} (round {self.round}): {self.field}: {self.detail}"


@dataclass
class ReplayResult:
    messages: int  # records replayed (inputs and outputs)
    rounds: int
    divergence: Divergence | None
    engine: Engine
    cut: bool = False  # the log ends mid-run (server killed): its last outputs were never logged


def _first_difference(a: Any, b: Any, path: str = "body") -> str | None:
    """The first field where two decoded bodies differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if key not in a or key not in b:
                return f"{path}.{key}"
            d = _first_difference(a[key], b[key], f"{path}.{key}")
            if d:
                return d
        return None
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or \
                a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            return path
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return path
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else path


def _decode(rec: Record, max_frame: int) -> Message:
    """A logged message; a record that passed its checksum but is no message is corrupt."""
    try:
        return decode(rec.frames, max_frame=max_frame)
    except WireError as err:
        raise LogCorrupt(f"record {rec.index} at offset {rec.offset}: not a message: {err}") \
            from None


def _compare(out: Out, rec: Record, logged: Message) -> Divergence | None:
    for name, mine, theirs in (("kind", out.kind, logged.kind), ("dst", out.dst, logged.dst),
                               ("round", out.round, logged.round)):
        if mine != theirs:
            return Divergence(rec.index, logged.round, name, f"replay {mine!r}, log {theirs!r}")
    mine = _config_as_logged(out.body, logged.body) if out.kind == "config" else out.body
    body = encode_body(mine)
    if hashlib.sha256(body).digest() != hashlib.sha256(rec.frames[1]).digest():
        where = _first_difference(mine, logged.body) or "body"
        return Divergence(rec.index, logged.round, where,
                          f"sha256 {hashlib.sha256(body).hexdigest()[:16]} != logged "
                          f"{hashlib.sha256(rec.frames[1]).hexdigest()[:16]}")
    return None


def replay_server(run_dir: str | Path, *, until_round: int | None = None) -> ReplayResult:
    """Replay the server through round `until_round` (0-based, included), else the whole
    log."""
    torch.set_num_threads(1)
    cfg, run_id = load_run(run_dir)
    require_message_log(run_dir, cfg)
    engine = build_engine(cfg, run_id)
    secret_noise = uses_secret_server_noise(cfg.privacy)
    if secret_noise:
        engine.noise_seed = run_noise_seed(run_dir, create=False)
    if cfg.privacy.secure_aggregation:
        engine.secagg_key = run_graph_key(run_dir, create=False)
    max_frame = max(int(cfg.bus.max_frame_mb) << 20, DEFAULT_MAX_FRAME)
    records = list(read_log(run_dir))
    pending: list[Out] = []
    count = 0
    for rec in records:
        # round R's aggregation makes version R + 1; its outputs (evaluations, the next
        # round's tasks) are checked before stopping
        if until_round is not None and engine.version > until_round and not pending:
            break
        count += 1
        if rec.direction == "out":
            m = _decode(rec, max_frame)
            if m.kind == "error":  # (logs made before answers to refusals went unlogged)
                continue
            if not pending:
                return ReplayResult(count, engine.version, Divergence(
                    rec.index, m.round, "kind", f"log has an extra {m.kind} to {m.dst}"), engine)
            out = pending.pop(0)
            div = _compare(out, rec, m)
            if div:
                return ReplayResult(count, engine.version, div, engine)
            if out.kind in NOTED_KINDS:
                engine.note_sent(out, rec.nbytes, out_params(out))
            continue
        if pending and rec.direction != "resume":
            return ReplayResult(count, engine.version, Divergence(
                rec.index, pending[0].round, "kind",
                f"replay sent {pending[0].kind} to {pending[0].dst}, the log has none"), engine)
        # (before a "resume" record, outputs still pending are those the killed server
        # never logged: the resumed server starts again from its checkpoint)
        pending = []
        if rec.direction == "in":
            pending = dispatch(engine, _decode(rec, max_frame), rec.time)
        elif rec.direction == "refused":
            pending = take_refused(engine, rec)
        elif rec.direction == "tick":
            pending = engine.on_tick(rec.time)
        elif rec.direction == "resume":
            seed, key = engine.noise_seed, engine.secagg_key
            engine = build_engine(cfg, run_id)
            engine.noise_seed, engine.secagg_key = seed, key
            engine.load_state_dict(decode_body(rec.frames[1],
                                               max_frame=max(len(rec.frames[1]), 1)))
            pending = engine.on_resumed(rec.time)
        pending = [o for o in pending if o.kind != "error"]  # answers: never logged
        engine.records.clear()
        engine.events.clear()
    # A finished run's log ends with its shutdown; any other log was cut short (the
    # server was killed or stopped), and the outputs it had not logged yet are unknown.
    cut = not records or records[-1].direction != "out" or \
        _decode(records[-1], max_frame).kind != "shutdown"
    if pending and until_round is None and not cut:
        return ReplayResult(count, engine.version, Divergence(
            len(records), pending[0].round, "kind",
            f"replay sent {pending[0].kind} to {pending[0].dst} after the log ends"), engine)
    return ReplayResult(count, engine.version, None, engine, cut=cut)


def take_refused(engine: Engine, rec: Record) -> list[Out]:
    """A "refused" record: a refusal the engine takes as an event, or the count of those
    that changed only a counter (the server logs neither the refused message)."""
    body = decode_body(rec.frames[1], max_frame=max(len(rec.frames[1]), 1))
    if "count" in body:
        for key, n in body["count"].items():
            engine.totals[key] = engine.totals.get(key, 0) + int(n)
        return []
    return engine.on_refused(Refusal.from_dict(body), rec.time)


# --- one client ---

WORK_DONE = ("epochs_asked", "epochs_done", "steps", "samples")


@dataclass
class ClientReplay:
    client: int
    round: int
    task: int
    identical: bool  # the recomputed payload's bytes are the logged one's (False if masked)
    max_abs_diff: dict[str, float]  # per array; inf: missing from the log or shaped otherwise
    update: dict[str, Any]  # the recomputed update body, decoded as the server would have
    logged_work: dict[str, Any]  # the work record the client sent
    masked: bool = False  # secure aggregation: the logged payload is masked, not compared
    # Why there is no logged update to compare, or None: "dropped (at STAGE)" for a task
    # whose simulated drop (system.drop_prob, drop_clients) the client obeyed, as `fedbus
    # log` shows it; "refused: REASON" for an update the server refused; "no update in the
    # log" for a task never answered before the log ends (late, or lost with its node: the
    # round's record says which)
    no_update: str | None = None

    @property
    def work_identical(self) -> bool:
        """The work done matches the logged record's (its "stopped" aside: a replay of a
        task the time budget cut runs the logged steps as partial work, _as_logged)."""
        mine = self.update.get("work") or {}
        return all(mine.get(k) == self.logged_work.get(k) for k in WORK_DONE)


def _arrays(value: Any, path: str = "payload") -> Iterator[tuple[str, np.ndarray]]:
    if isinstance(value, np.ndarray):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _arrays(v, f"{path}.{k}")


def _as_logged(handler: Any, body: dict[str, Any], logged: Message | None) -> dict[str, Any]:
    """A task whose time budget cut it short stopped where the live client's clock
    said (a slow device's virtual clock runs on real time): replay the steps it
    logged instead of timing itself again. Handlers see only run.batches()."""
    from fedbus.algorithms.core.handlers import LocalRun

    work = logged.body.get("work") if logged is not None and isinstance(logged.body, dict) \
        else None
    if not isinstance(work, dict) or work.get("stopped") != "budget":
        return body
    steps = int(work.get("steps", 0))
    body = {**body, "budget_s": 0.0}
    if steps == 0:
        body["epochs"] = 0  # no minibatch at all
        return body
    per_epoch = LocalRun(handler.ctx, epochs=int(body["epochs"]), seed=0).steps_per_epoch()
    body["sim"] = {**body.get("sim", {}), "epochs_to_run": steps / per_epoch}
    return body


def dropped_at(task: dict[str, Any]) -> str | None:
    """The stage at which a task's client simulates a drop (system.drop_prob,
    drop_clients), or None: as `fedbus log` names it."""
    sim = task.get("sim") if isinstance(task.get("sim"), dict) else {}
    return str(sim.get("drop_stage", "task")) if sim.get("drop") else None


def trains_before_drop(task: dict[str, Any]) -> bool:
    """Whether a dropping client trains the task first: under secure aggregation a drop
    after its keys or shares (system.drop_stage) comes after training, as the node does it
    (fedbus.node.client_host._admit)."""
    return dropped_at(task) not in (None, "task") and "secagg" in task


def replay_client(run_dir: str | Path, client: int, round_: int) -> ClientReplay:
    from fedbus.node.client_host import ClientPool, node_threads, run_task

    cfg, _ = load_run(run_dir)
    require_message_log(run_dir, cfg)
    torch.set_num_threads(node_threads(cfg))  # as the live node did (on this machine)
    max_frame = max(int(cfg.bus.max_frame_mb) << 20, DEFAULT_MAX_FRAME)
    address = client_address(client)
    records = list(read_log(run_dir))
    updates: dict[int, Message] = {}
    refusals: dict[int, str] = {}  # task -> why the server refused its update
    for rec in records:
        if rec.direction == "in":
            m = _decode(rec, max_frame)
            if m.kind == "update" and m.src == address and isinstance(m.body, dict):
                updates[m.body.get("task")] = m
            elif m.kind == "updates" and isinstance(m.body, dict):  # a batch (§4.3)
                for member in m.body.get("members") or ():
                    if isinstance(member, dict) and member.get("from") == address:
                        body = {k: v for k, v in member.items() if k != "from"}
                        updates[body.get("task")] = Message("update", address, m.dst, body,
                                                            run=m.run, round=m.round)
        elif rec.direction == "refused":
            body = decode_body(rec.frames[1], max_frame=max(len(rec.frames[1]), 1))
            if isinstance(body, dict) and body.get("src") == address and \
                    isinstance(body.get("task"), int):
                refusals[body["task"]] = f"refused: {body.get('reason', '?')}"
    pool = ClientPool(cfg, torch.device("cpu"), clients=[client], max_resident=1)
    handler = pool.get(client)
    for rec in records:
        if rec.direction != "out":
            continue
        m = _decode(rec, max_frame)
        if m.kind in SENT_BATCHES:  # a batch (PROTOCOL.md §4.3): this client's member, if any
            mine = [body for to, body in unbatch_tasks(m.body, m.kind) if to == address]
            if not mine:
                continue
            m = Message(SENT_BATCHES[m.kind], m.src, address, mine[0], run=m.run,
                        round=m.round)
        if m.dst != address:
            continue
        if m.kind == "eval":
            handler.evaluate(m.body["payload"])
            continue
        if m.kind != "task":
            continue
        tid = int(m.body["task"])
        stage = dropped_at(m.body)
        if stage is not None and not trains_before_drop(m.body):
            if m.round == round_:  # the client never trained it: nothing to recompute
                return ClientReplay(client, round_, tid, False, {}, {}, {},
                                    no_update=f"dropped (at {stage})")
            continue
        logged = updates.get(tid)
        mine, _ = run_task(handler, _as_logged(handler, m.body, logged))
        if m.round != round_:
            continue
        update = decode_body(encode_body(mine))
        if logged is None:
            why = f"dropped (at {stage})" if stage is not None else \
                refusals.get(tid) or "no update in the log"
            return ClientReplay(client, round_, tid, False, {}, update, {}, no_update=why)
        work = dict(logged.body.get("work") or {})
        if "masked" in logged.body["payload"]:  # secure aggregation: the upload was masked
            return ClientReplay(client, round_, int(m.body["task"]), False, {}, update, work,
                                masked=True)
        theirs = dict(_arrays(logged.body["payload"]))
        diffs = {}
        for path, arr in _arrays(update["payload"]):
            other = theirs.get(path)
            if other is None or other.shape != arr.shape:
                diffs[path] = float("inf")
            else:
                diffs[path] = float(np.max(np.abs(arr.astype(np.float64) -
                                                  other.astype(np.float64)), initial=0.0))
        identical = encode_body(mine["payload"]) == encode_body(logged.body["payload"])
        return ClientReplay(client, round_, int(m.body["task"]), identical, diffs, update, work)
    raise LookupError(f"the log has no task for c{client} in round {round_}")
