"""The invariants of a simulated federation's history (fedbus.bench.simworld).

The chaos bench's own checks (fedbus.bench.chaos) run unchanged on the history the
simulation records as the live server takes messages and writes checkpoints:

  once          each client's update for a (round, version) taken at most once, across
                server restarts (check_once)
  incarnation   no update from a killed node incarnation (its Peer's `inc`) taken after its
                replacement registered (check_incarnations)
  replay        every resume loaded a state the live server checkpointed, and the final
                checkpoint is the last one written (check_resumes: the chaos bench compares
                against a replay of the message log; here the checkpoint file's round trip)
  window        at each server kill the records are never behind the checkpoint and at most
                one aggregation ahead (of the newest checkpoint, written or waiting for its
                flushes); in the end metrics.jsonl holds each round once, in
                order (check_window)
  completion    the server ended with every round done, every node took the shutdown, the
                run ended within the simulated horizon (check_completion)

and two that read the final records:

  aggregated    each client's update of a version is aggregated once: fresh in its round or
                folded (late) into a later one, never both, never twice
  counted       the handler counted what the records say it aggregated (the no-op
                algorithm's `updates_seen` is the running sum of the records' participants)
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Any


def check_aggregated(records: list[dict[str, Any]]) -> list:
    from fedbus.bench.chaos import Violation

    seen: dict[tuple[int, int], int] = {}
    out = []
    for rec in sorted(records, key=lambda r: int(r.get("version", 0))):
        stale = Counter(int(s[0]) for s in rec.get("stale", ()))
        fresh = Counter(int(c) for c in rec.get("participants", ())) - stale
        keys = [(c, int(rec["round"])) for c in fresh.elements()] + \
            [(int(s[0]), int(s[1])) for s in rec.get("stale", ())]
        for key in keys:
            if key in seen:
                out.append(Violation(
                    "aggregated", f"client {key[0]}'s update of version {key[1]} aggregated "
                    f"twice (versions {seen[key]} and {rec['version']})",
                    [seen[key] - 1, int(rec["round"])]))
            else:
                seen[key] = int(rec["version"])
    return out


def check_counted(records: list[dict[str, Any]]) -> list:
    from fedbus.bench.chaos import Violation

    total = 0
    # (async: a record waits for its evaluation while later aggregations are recorded)
    for rec in sorted(records, key=lambda r: int(r.get("version", 0))):
        total += len(rec.get("participants", ()))
        seen = rec.get("agg", {}).get("updates_seen")
        if seen is not None and int(seen) != total:
            return [Violation("counted", f"the handler counted {int(seen)} updates by round "
                              f"{rec['round']}, the records list {total}", [int(rec["round"])])]
    return []


def check_world(world: Any) -> list:
    """Every invariant on a finished World; sets world.rounds_done."""
    from fedbus.bench.chaos import (
        check_completion,
        check_incarnations,
        check_once,
        check_resumes,
        check_window,
        final_checkpoint,
        read_metrics,
    )

    run = world.run_dir
    records = read_metrics(run)
    final_digest, final_version, out = final_checkpoint(run)
    out += check_once(world.history)
    out += check_incarnations(world.history)
    out += check_resumes([e for e in world.history if e.get("digest") != ""], final_digest,
                         final_version)
    # a sync checkpoint waiting for the nodes' flushes is the window's end: the records
    # may run ahead of the file by the rounds it waits, which a resume drops and redoes
    kills = [{**k, "checkpoint_version": k["pending_version"]}
             if k.get("pending_version") is not None else k for k in world.kills]
    out += check_window(kills, records, world.rounds, world.mode)
    summary = None
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
    world.rounds_done = (summary or {}).get("rounds_completed", 0)
    out += check_completion(world.server_rc, summary, world.rounds, world.problems, [])
    out += check_aggregated(records)
    out += check_counted(records)
    return out
