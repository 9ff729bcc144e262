"""`fedbus log RUN`: the run's message timeline, from the message log, with what each
message carried.

    fedbus log runs/exp1 --round 3 --client 7 --kind update
    fedbus log runs/exp1 --json | jq -c 'select(.kind == "eval_result") | .summary.metrics'

The index (messages.jsonl) says who sent what, when and how big; the payload summary of
each message shown is read from its record in messages.bin, found by the index's
offset, so a filtered listing reads only the records it shows.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

# what the index's "kind" can be: a message kind (fedbus.broker.wire.KINDS) or a record
# that is no message (PROTOCOL.md §13)
RECORD_KINDS = ("tick", "refused", "resume")


def _kinds() -> list[str]:
    from fedbus.broker.wire import KINDS

    return sorted(KINDS) + list(RECORD_KINDS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Rounds are 0-based (round 0 is the first aggregation), as in metrics.jsonl "
                "and the wire's round field. Arrows: <- received, -> sent, x- refused (the "
                "log keeps the refusal, not the refused message; refusals that changed only "
                "a counter appear as one 'refused' line with their count); answers to "
                "refusals are not logged. After the sequence number each line summarises "
                "the payload: a task's epochs and budget, an update's work (epochs done of "
                "asked, steps, samples seen, the training set's size), per-class arrays "
                "(classes present, mean L2 norm of their vectors), class counts, a weight "
                "delta's L2 norm, an eval_result's metrics, an error's code and reason, a "
                "secagg step. The message-log format: PROTOCOL.md section 13.")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--round", type=int, default=None, metavar="R",
                   help="only round R (0-based); a round the log does not hold is an error "
                   "naming those it does")
    p.add_argument("--client", type=int, default=None, metavar="ID",
                   help="only messages to or from client ID (0-based, as c0, c1, ... on the "
                   "wire), and its state in each round's outcome")
    p.add_argument("--kind", action="append", default=None, choices=_kinds(), metavar="KIND",
                   help="only messages of this kind; repeatable. One of: "
                   + ", ".join(_kinds()))
    p.add_argument("--outcomes-only", action="store_true",
                   help="print only the round outcomes (who was sampled, answered, or "
                   "failed and how: dropped its task, late, dead with its node, refused with "
                   "the validator's reason, error; late updates folded in), no message lines")
    p.add_argument("--json", action="store_true",
                   help="JSON lines only: each message's index line (messages.jsonl) with its "
                   "payload summary under \"summary\", then one {\"outcome\": {...}} line per "
                   "round (jq: select(.kind) for messages, select(.outcome) for outcomes)")


def load_index(run: Path) -> list[dict]:
    path = run / "messages.jsonl"
    if not path.exists():
        if _config(run).get("log", {}).get("messages") is False:
            raise FileNotFoundError(f"{run} ran with log.messages = false: it kept no message "
                                    "log to show (log.messages = true, the default, keeps one)")
        raise FileNotFoundError(f"{run} has no message log (messages.jsonl): not a run "
                                "directory, or its log was removed")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def select(entries: list[dict], *, round_: int | None, client: int | None,
           kinds: list[str] | None, batches: Summaries | None = None) -> list[dict]:
    """The entries asked for. With `client`, those it sent or was sent, and (given
    `batches`, which reads bodies) the batches holding a member of it. A kind `task` or
    `update` also takes the `tasks` or `updates` batches (bus.batch), whose members are
    that kind's messages."""
    address = None if client is None else f"c{client}"
    picked = []
    for e in entries:
        if round_ is not None and e.get("round") != round_:
            continue
        if address is not None and address not in (e.get("src"), e.get("dst")) and not (
                batches is not None and e.get("kind") in BATCHES and e.get("dir") != "refused"
                and batches.of(e, client) is not None):
            continue
        if kinds and e.get("kind") not in kinds and not (
                e.get("kind") in BATCHES and BATCHES[e["kind"]][1] in kinds):
            continue  # (--kind task takes the tasks batches too, update the updates ones)
        picked.append(e)
    return picked


# ------------------------------------------------------------------ valid rounds, clients

def spans(numbers: list[int]) -> str:
    """0,1,2,4 -> "0-2, 4"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive numbers
    for n in sorted(set(numbers)):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_round(entries: list[dict], round_: int) -> str | None:
    """Why --round is out of range, or None. The range named leaves out the shutdown's
    round (the wire gives it the round count, one past the last aggregation), though
    asking for it shows the shutdown."""
    held = {e.get("round", -1) for e in entries}
    if round_ in held and round_ >= 0:
        return None
    rounds = [r for r in {e.get("round", -1) for e in entries if e.get("kind") != "shutdown"}
              if r >= 0]
    return (f"--round {round_}: the log holds rounds {spans(rounds)}" if rounds else
            f"--round {round_}: the log holds no round")


def _config(run: Path) -> dict:
    """The run's config.json as plain JSON ({} if absent or unreadable): cheap, no
    validation (that would import every algorithm)."""
    try:
        raw = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def run_clients(run: Path, entries: list[dict]) -> list[int]:
    """The run's client ids: 0 .. federation.clients - 1 from config.json, else those the
    log names."""
    try:
        return list(range(int(_config(run)["federation"]["clients"])))
    except (KeyError, TypeError, ValueError):
        ids = {str(e.get(k, ""))[1:] for e in entries for k in ("src", "dst")
               if str(e.get(k, "")).startswith("c")}
        return sorted(int(i) for i in ids if i.isdigit())


# ------------------------------------------------------------------ payload summaries

def _finite(x: float) -> float | None:
    """A number for JSON: non-finite values (a nan loss) become null, never NaN."""
    x = float(x)
    return x if math.isfinite(x) else None


def _norm(a: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.square(a, dtype=np.float64))))


def _arrays(tree: Mapping) -> list[np.ndarray]:
    out = []
    for v in tree.values():
        if isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, Mapping):
            out.extend(_arrays(v))
    return out


# arrays that say which classes (rows of the per-class arrays beside them) are present
PRESENCE = ("counts", "has", "mass")


def _presence(payload: Mapping) -> np.ndarray | None:
    for key in PRESENCE:
        v = payload.get(key)
        if isinstance(v, np.ndarray) and v.ndim == 1:
            return v > 0
    return None


def payload_summary(payload: Any) -> dict[str, Any]:
    """What a task, update or eval payload holds, by the handler conventions
    (fedbus.algorithms.core.handlers): per-class arrays ("protos", "logits", a merge
    rule's "sums") with the classes present (by "counts", "has" or "mass") and the mean
    and largest L2 norm of their vectors; class counts; a dict of arrays ("delta",
    "weights") as its L2 norm over every value and its parameter count; other arrays as
    dtype and shape (and L2 norm for floats); short scalars as they are."""
    if not isinstance(payload, Mapping):
        return {}
    present = _presence(payload)
    out: dict[str, Any] = {}
    for key, v in payload.items():
        key = str(key)
        if isinstance(v, np.ndarray):
            if key in PRESENCE and v.ndim == 1:
                nonzero = np.flatnonzero(v > 0)
                entry: dict[str, Any] = {"classes": int(len(nonzero)), "of": int(len(v))}
                if key != "has":
                    entry["total"] = _finite(v.sum()) if v.dtype.kind == "f" else int(v.sum())
                if key == "counts" and len(nonzero) <= 12:
                    entry["by_class"] = {str(int(c)): int(v[c]) for c in nonzero}
                out[key] = entry
            elif (v.ndim >= 2 and v.dtype.kind == "f" and present is not None
                  and v.shape[0] == len(present)):
                rows = v[present].reshape(-1, v.shape[-1]).astype(np.float64)
                norms = np.linalg.norm(rows, axis=1) if len(rows) else np.zeros(0)
                out[key] = {"classes": int(present.sum()), "of": int(v.shape[0]),
                            "dim": int(v.shape[-1]),
                            "norm_mean": _finite(norms.mean()) if len(norms) else None,
                            "norm_max": _finite(norms.max()) if len(norms) else None}
            else:
                entry = {"dtype": str(v.dtype), "shape": list(v.shape)}
                if v.dtype.kind in "fc":
                    entry["norm"] = _finite(_norm(v))
                out[key] = entry
        elif isinstance(v, Mapping):
            arrays = _arrays(v)
            floats = [a for a in arrays if a.dtype.kind == "f"]
            out[key] = {"tensors": len(arrays), "params": int(sum(a.size for a in arrays)),
                        "norm": _finite(math.sqrt(sum(_norm(a) ** 2 for a in floats)))}
        elif isinstance(v, (bool, int)) or v is None:
            out[key] = v
        elif isinstance(v, float):
            out[key] = _finite(v)
        elif isinstance(v, str):
            out[key] = v[:80]
        elif isinstance(v, (bytes, bytearray)):
            out[key] = {"bytes": len(v)}
        elif isinstance(v, (list, tuple)):
            out[key] = {"items": len(v)}
    return out


def _pick(body: Mapping, *keys: str) -> dict[str, Any]:
    return {k: body[k] for k in keys if k in body}


def summarize(entry: Mapping, body: Any) -> dict[str, Any]:
    """The summary of one logged record (its index entry and decoded body): plain JSON."""
    kind, direction = entry.get("kind"), entry.get("dir")
    if direction == "refused":
        if isinstance(body, Mapping) and "count" in body:
            return {"count": {str(k): int(n) for k, n in body["count"].items()}}
        return _pick(body, "reason", "task", "tasks", "eval") if isinstance(body, Mapping) \
            else {}
    if direction == "resume":
        return _pick(body, "version") if isinstance(body, Mapping) else {}
    if not isinstance(body, Mapping):
        return {}
    if kind == "task":
        out = _pick(body, "task", "version", "epochs")
        if body.get("budget_s"):
            out["budget_s"] = _finite(body["budget_s"])
        sim = body.get("sim") if isinstance(body.get("sim"), Mapping) else {}
        if float(sim.get("slow_factor", 1.0)) != 1.0:
            out["slow_factor"] = _finite(sim["slow_factor"])
        if "epochs_to_run" in sim and float(sim["epochs_to_run"]) < float(body.get("epochs", 0)):
            out["epochs_to_run"] = _finite(sim["epochs_to_run"])
        if sim.get("drop"):
            out["drop"] = str(sim.get("drop_stage", "task"))
        if "secagg" in body:
            out["secure_aggregation"] = True
        out["payload"] = payload_summary(body.get("payload"))
        return out
    if kind == "update":
        out = _pick(body, "task", "version", "num_samples")
        if isinstance(body.get("work"), Mapping):
            out["work"] = {k: (_finite(v) if isinstance(v, float) else v)
                           for k, v in body["work"].items()}
        if "train_s" in body:
            out["train_s"] = _finite(body["train_s"])
        if "clipped" in body:
            out["clipped"] = body["clipped"]
        out["payload"] = payload_summary(body.get("payload"))
        return out
    if kind in BATCHES:
        return batch_summary(kind, body)
    if kind == "merged":
        out = _pick(body, "version", "rule")
        out["members"] = len(body.get("members") or ())
        out["payload"] = payload_summary(body.get("payload"))
        return out
    if kind == "eval":
        out = _pick(body, "eval", "version")
        if body.get("embed"):
            out["embed"] = body["embed"]
        out["payload"] = payload_summary(body.get("payload"))
        return out
    if kind == "eval_result":
        out = _pick(body, "eval", "version")
        metrics = body.get("metrics") if isinstance(body.get("metrics"), Mapping) else {}
        out["metrics"] = {str(k): _finite(v) if isinstance(v, float) else v
                          for k, v in metrics.items() if isinstance(v, (int, float))}
        return out
    if kind == "error":
        out = _pick(body, "code", "kind", "dst", "task", "eval")
        if "reason" in body:
            out["reason"] = " ".join(str(body["reason"]).split())[:200]
        return out
    if kind == "secagg":
        out = _pick(body, "step", "task", "t")
        for key, v in body.items():  # how many peers, shares, survivors ... a step names
            if key not in ("step", "task") and isinstance(v, (list, tuple, Mapping)) \
                    and key != "ring":
                out[str(key)] = len(v)
        return out
    if kind in ("join", "leave"):
        out = _pick(body, "node", "reason")
        out["clients"] = len(body.get("clients") or ())
        return out
    if kind == "config":
        cfg = body.get("config")
        if isinstance(cfg, Mapping):  # the server's: the run config it sent
            out = {"algorithm": (cfg.get("algorithm") or {}).get("name")}
            out.update(_pick(cfg.get("federation") or {}, "clients", "rounds", "mode"))
            return out
        return _pick(body, "node")  # a node's acknowledgement
    if kind == "shutdown":
        return _pick(body, "reason")
    return {"keys": sorted(str(k) for k in body)[:12]}


# batched tasks, evaluations and updates (PROTOCOL.md §4.3): one message for several clients
BATCHES = {"tasks": ("to", "task"), "evals": ("to", "eval"), "updates": ("from", "update")}


def batch_members(kind: str, body: Any) -> list[tuple[str, dict[str, Any]]]:
    """A `tasks`, `evals` or `updates` body's members as (client address, the body of the
    `task`, `eval` or `update` it stands for), in order. ValueError names what is
    malformed."""
    from fedbus.node.engine import unbatch_tasks, unbatch_updates

    return unbatch_updates(body) if kind == "updates" else unbatch_tasks(body, kind)


def batch_summary(kind: str, body: Any) -> dict[str, Any]:
    """A batch's summary: its members' clients and tasks (evaluations), and (for `tasks`
    and `evals`) how many distinct payloads it carried, each encoded once, with the
    first's summary."""
    members = batch_members(kind, body)
    what = "eval" if kind == "evals" else "task"
    out: dict[str, Any] = {"members": len(members), "clients": [a for a, _ in members],
                           "tasks": [b.get(what) for _, b in members]}
    if kind in ("tasks", "evals"):
        payloads = body.get("payloads") or []
        out["payloads"] = len(payloads)
        if payloads:
            out["payload"] = payload_summary(payloads[0])
    return out


def member_summary(entry: Mapping, body: Any, address: str) -> dict[str, Any] | None:
    """The summary of `address`'s member of a batch, as its own `task` or `update` would
    be summarised (with "batch": the batch's member count), or None if it has none."""
    kind = entry.get("kind")
    for to, member in batch_members(kind, body):
        if to == address:
            single = {**entry, "kind": BATCHES[kind][1]}
            return {**summarize(single, member), "batch": len(body["members"])}
    return None


def _g(x: Any, digits: int = 3) -> str:
    if x is None:
        return "nan"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def payload_text(summary: Mapping[str, Any]) -> str:
    parts = []
    # the classes present are said by the per-class arrays when there are any
    per_class = any(isinstance(v, Mapping) and "norm_mean" in v for v in summary.values())
    for key, v in summary.items():
        if not isinstance(v, Mapping):
            parts.append(f"{key}={v}")
        elif "by_class" in v:
            parts.append(f"{key} " + " ".join(f"{c}:{n}" for c, n in v["by_class"].items()))
        elif key in PRESENCE:
            if not per_class:
                parts.append(f"{key} {v['classes']}/{v['of']} classes")
        elif "norm_mean" in v:
            parts.append(f"{key} {v['classes']}/{v['of']} classes, mean |v| "
                         f"{_g(v['norm_mean'])} (max {_g(v['norm_max'])})")
        elif "tensors" in v:
            parts.append(f"{key} |{key[:1]}| {_g(v['norm'])} ({v['params']:,} params)")
        elif "shape" in v:
            shape = ",".join(map(str, v["shape"]))
            norm = f" |x| {_g(v['norm'])}" if "norm" in v else ""
            parts.append(f"{key} {v['dtype']}[{shape}]{norm}")
        elif "bytes" in v:
            parts.append(f"{key} {v['bytes']} B")
        elif "items" in v:
            parts.append(f"{key} [{v['items']}]")
    return " | ".join(parts)


def summary_text(entry: Mapping, s: Mapping[str, Any]) -> str:
    """One line from summarize()'s dict."""
    if "error" in s:
        return f"(unreadable: {s['error']})"
    kind, direction = entry.get("kind"), entry.get("dir")
    payload = payload_text(s.get("payload") or {})
    tail = f" | {payload}" if payload else ""
    if direction == "refused":
        if "count" in s:
            return "count " + " ".join(f"{k} {n}" for k, n in s["count"].items())
        return f"refused: {s.get('reason', '?')}"
    if direction == "resume":
        return f"resumed at version {s.get('version', '?')}"
    if kind == "task":
        words = [f"task {s.get('task', '?')} v{s.get('version', '?')}: "
                 f"epochs {s.get('epochs', '?')}"]
        if "budget_s" in s:
            words.append(f"budget {_g(s['budget_s'])} s")
        if "epochs_to_run" in s:
            words.append(f"runs {_g(s['epochs_to_run'])} of them")
        if "slow_factor" in s:
            words.append(f"slow x{_g(s['slow_factor'])}")
        if "drop" in s:
            words.append(f"dropped (at {s['drop']})")
        if s.get("secure_aggregation"):
            words.append("secure aggregation")
        return ", ".join(words) + tail
    if kind == "update":
        w = s.get("work") or {}
        words = [f"task {s.get('task', '?')}: {_g(w.get('epochs_done'))}/"
                 f"{w.get('epochs_asked', '?')} epochs, {w.get('steps', '?')} steps, "
                 f"{w.get('samples', '?')} samples seen (train set {s.get('num_samples', '?')})"]
        if w.get("stopped", "done") != "done":
            words.append(f"stopped: {w['stopped']}")
        if "clipped" in s:
            words.append(f"clipped {s['clipped']}")
        return ", ".join(words) + tail
    if "batch" in s:  # one client's member of a batch, shown as its own message
        inner = summary_text({**entry, "kind": BATCHES[kind][1]},
                             {k: v for k, v in s.items() if k != "batch"})
        return f"(1 of {s['batch']} in the batch) {inner}"
    if kind in BATCHES:
        who = _ids(s.get("clients") or [])
        ids = ",".join(str(t) for t in s.get("tasks") or [])
        once = f", {s['payloads']} payload(s) sent once" if "payloads" in s else ""
        word = "from" if kind == "updates" else "for"
        ids_of = "evals" if kind == "evals" else "tasks"
        return f"{s.get('members', 0)} {BATCHES[kind][1]}s {word} clients {who} " \
               f"({ids_of} {ids}){once}{tail}"
    if kind == "merged":
        return (f"{s.get('members', 0)} members, rule {s.get('rule', '?')} "
                f"v{s.get('version', '?')}{tail}")
    if kind == "eval":
        embed = f", embed {s['embed']}" if "embed" in s else ""
        return f"eval {s.get('eval', '?')} v{s.get('version', '?')}{embed}{tail}"
    if kind == "eval_result":
        m = dict(s.get("metrics") or {})
        n = m.pop("num_test", None)
        text = " ".join(f"{k} {_g(v)}" for k, v in m.items())
        return text + (f" ({n} test)" if n is not None else "")
    if kind == "error":
        about = f" ({s['kind']} to {s.get('dst', '?')})" if "kind" in s else ""
        return f"{s.get('code', '?')}{about}: {s.get('reason', '')}".rstrip(": ")
    if kind == "secagg":
        rest = " ".join(f"{k} {v}" for k, v in s.items() if k not in ("step", "task"))
        return f"step {s.get('step', '?')}, task {s.get('task', '?')}" + \
            (f": {rest}" if rest else "")
    if kind in ("join", "leave"):
        return f"node {s.get('node', '?')}, {s.get('clients', 0)} clients, " \
               f"{s.get('reason', '')}".rstrip(", ")
    return " ".join(f"{k} {v}" for k, v in s.items())


class Summaries:
    """Each shown record's summary, read from messages.bin at the index's offset."""

    def __init__(self, run: Path):
        from fedbus.record.msglog import LogCorrupt, RecordReader

        self.reader = None
        self.missing = None
        try:
            self.reader = RecordReader(run / "messages.bin")
        except FileNotFoundError:
            self.missing = f"{run / 'messages.bin'} is missing: no payload summaries"
        except LogCorrupt as err:
            self.missing = f"{err}: no payload summaries"

    def of(self, entry: Mapping, client: int | None = None) -> dict[str, Any] | None:
        """The entry's summary; with `client`, a batch's is that client's member's (None:
        the batch holds no member of it)."""
        if self.reader is None:  # (main said so once)
            return None if client is not None and entry.get("kind") in BATCHES else {}
        from fedbus.broker.wire import WireError, decode_body
        from fedbus.record.msglog import LogCorrupt

        try:
            rec = self.reader.at(int(entry["off"]), int(entry.get("i", -1)))
            if len(rec.frames) < 2 or not rec.frames[1]:
                return {}  # a tick: no frames
            body = decode_body(rec.frames[1], max_frame=len(rec.frames[1]) + 1)
            if client is not None and entry.get("kind") in BATCHES and \
                    entry.get("dir") != "refused":
                return member_summary(entry, body, f"c{client}")
            return summarize(entry, body)
        except (LogCorrupt, WireError, KeyError, ValueError, TypeError) as err:
            return {"error": " ".join(str(err).split())[:200]}

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()


# ------------------------------------------------------------------ the command

def main(args: argparse.Namespace) -> int:
    run = Path(args.run)
    try:
        entries = load_index(run)
    except FileNotFoundError as err:
        print(f"fedbus log: {err}", file=sys.stderr)
        return 2
    if args.round is not None:
        why = check_round(entries, args.round)
        if why:
            print(f"fedbus log: {why}", file=sys.stderr)
            return 2
    if args.client is not None:
        clients = run_clients(run, entries)
        if args.client not in clients:
            print(f"fedbus log: --client {args.client}: this run has clients "
                  f"{spans(clients) or 'none'}", file=sys.stderr)
            return 2
    if not entries:
        if not args.json:
            print("(empty log)")
        return 0
    summaries = Summaries(run)
    picked = [] if args.outcomes_only else \
        select(entries, round_=args.round, client=args.client, kinds=args.kind,
               batches=None if args.client is None else summaries)
    if summaries.missing and picked:
        print(f"fedbus log: {summaries.missing}", file=sys.stderr)
    t0 = entries[0]["t"]
    try:
        for e in picked:
            summary = summaries.of(e, args.client)
            if args.json:
                print(json.dumps({**e, "summary": summary}, allow_nan=False))
                continue
            # "x-": a refused message (the log holds the refusal, not the message)
            arrow = {"in": "<-", "out": "->", "refused": "x-"}.get(e["dir"], "..")
            peer = e["src"] if e["dir"] in ("in", "refused") else e["dst"]
            rnd = "" if e.get("round", -1) < 0 else f"r{e['round']}"
            text = summary_text(e, summary) if summary else ""
            print(f"{e['t'] - t0:9.3f}s {arrow} {e['kind']:<12} {peer:<10} {rnd:<5} "
                  f"{e['bytes']:>10,} B  seq {e['seq']:<6} {text}".rstrip())
        for outcome in round_outcomes(run, args.round, args.client, entries, summaries):
            if args.json:
                print(json.dumps({"outcome": outcome}, allow_nan=False))
            else:
                print(outcome_text(outcome))
        sys.stdout.flush()
    except BrokenPipeError:  # `fedbus log RUN | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        summaries.close()
    return 0


def _ids(addresses: list) -> str:
    return ",".join(str(a).removeprefix("c") for a in addresses) or "-"


def round_outcomes(run: Path, round_: int | None, client: int | None,
                   entries: list[dict] = (), summaries: Summaries | None = None
                   ) -> list[dict[str, Any]]:
    """Who was sampled (the tasks of the round, from the index, and the members of its
    `tasks` batches, read by `summaries`), answered, late or dead (from metrics.jsonl),
    one dict a round."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    sampled: dict[int, list[int]] = {}
    for e in entries:
        dst = str(e.get("dst", ""))
        if e.get("dir") != "out" or (round_ is not None and e.get("round") != round_):
            continue
        if e.get("kind") == "task" and dst[1:].isdigit():
            sampled.setdefault(e.get("round"), []).append(int(dst[1:]))
        elif e.get("kind") == "tasks" and summaries is not None:
            got = summaries.of(e) or {}
            sampled.setdefault(e.get("round"), []).extend(
                int(a[1:]) for a in got.get("clients") or () if str(a)[1:].isdigit())
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    # where each late update went: (client, the round it was late for) -> what became of it
    fate: dict[tuple[int, int], str] = {}
    for rec in records:
        for entry in rec.get("stale") or ():
            fate[(int(entry[0]), int(entry[1]))] = f"folded into round {rec['round']}"
        for c, v in rec.get("late_discarded") or ():
            fate[(int(c), int(v))] = f"discarded in round {rec['round']}"
    out = []
    for rec in records:
        if round_ is not None and rec.get("round") != round_:
            continue
        # participants include the late updates of earlier rounds folded in here ("stale"):
        # a client answered this round's task only beyond those
        fresh = Counter(int(c) for c in rec.get("participants", [])) - \
            Counter(int(e[0]) for e in rec.get("stale") or ())
        answered = sorted(fresh)
        failed = {str(c): FAILURE_WORDS.get(why, why)
                  for c, why in rec.get("failures", {}).items()}
        refusals = {str(c): why for c, why in (rec.get("refusals") or {}).items()}
        late = {str(c): fate[(c, rec["round"])] for c in map(int, failed)
                if (c, rec["round"]) in fate}
        if client is not None:
            state = failed.get(str(client)) or \
                ("answered" if client in fresh else "not sampled")
            detail = refusals.get(str(client)) or late.get(str(client))
            out.append({"round": rec["round"], "client": client, "state": state,
                        **({"detail": detail} if detail else {})})
            continue
        asked = sorted(set(sampled.get(rec["round"], [])))
        # the index may be cut short (a killed server): the record's count then
        out.append({"round": rec["round"], "sampled": asked or rec.get("sampled"),
                    "answered": answered, "failures": failed,
                    "folded": [[int(e[0]), int(e[1])] for e in rec.get("stale") or ()],
                    **({"refusals": refusals} if refusals else {})})
    return out


# a record's failure codes (fedbus.node.engine.FAILURES) as the outcome lines say them
FAILURE_WORDS = {"rejected": "refused", "dead": "dead", "timed_out": "timed out"}


def outcome_text(o: Mapping[str, Any]) -> str:
    if "client" in o:
        detail = f" ({o['detail']})" if o.get("detail") else ""
        return f"round {o['round']}: c{o['client']} {o['state']}{detail}"
    by: dict[str, list[str]] = {}
    for c, why in o["failures"].items():
        by.setdefault(why, []).append(c)
    parts = [f"{why}: {','.join(sorted(cs, key=int))}" for why, cs in sorted(by.items())]
    if o.get("folded"):  # late updates of earlier rounds aggregated in this one
        parts.append("folded: " + ",".join(f"{c} (r{v})" for c, v in o["folded"]))
    for c, why in sorted((o.get("refusals") or {}).items()):
        parts.append(f"c{c} refused: {why}")
    extra = "  ".join(parts)
    sampled = o["sampled"]
    who = _ids(sampled) if isinstance(sampled, list) else ("?" if sampled is None else sampled)
    return f"round {o['round']}: sampled {who}  answered {_ids(o['answered'])}  {extra}".rstrip()
