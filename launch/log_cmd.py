"""`fedbus log RUN`: the run's message timeline, from the message log index.

    fedbus log runs/exp1 --round 3 --client 7 --kind update
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("arrows: <- received, -> sent, x- refused (the log keeps the refusal, not the "
                "refused message; refusals that changed only a counter appear as one "
                "'refused' line with their count); answers to refusals are not logged")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--round", type=int, default=None, help="only this round")
    p.add_argument("--client", type=int, default=None, help="only messages to or from client ID")
    p.add_argument("--kind", action="append", default=None,
                   help="only these kinds (task, update, eval, eval_result, join, leave, "
                   "error, secagg, tick, ...); repeatable")
    p.add_argument("--json", action="store_true", help="print the raw index lines")


def load_index(run: Path) -> list[dict]:
    path = run / "messages.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run} has no message log (messages.jsonl); was log.messages off?")
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def select(entries: list[dict], *, round_: int | None, client: int | None,
           kinds: list[str] | None) -> list[dict]:
    address = None if client is None else f"c{client}"
    picked = []
    for e in entries:
        if round_ is not None and e.get("round") != round_:
            continue
        if address is not None and address not in (e.get("src"), e.get("dst")):
            continue
        if kinds and e.get("kind") not in kinds:
            continue
        picked.append(e)
    return picked


def main(args: argparse.Namespace) -> int:
    run = Path(args.run)
    try:
        entries = load_index(run)
    except FileNotFoundError as err:
        print(f"fedbus log: {err}", file=sys.stderr)
        return 2
    picked = select(entries, round_=args.round, client=args.client, kinds=args.kind)
    if not entries:
        print("(empty log)")
        return 0
    t0 = entries[0]["t"]
    try:
        for e in picked:
            if args.json:
                print(json.dumps(e))
                continue
            # "x-": a refused message (the log holds the refusal, not the message)
            arrow = {"in": "<-", "out": "->", "refused": "x-"}.get(e["dir"], "..")
            peer = e["src"] if e["dir"] in ("in", "refused") else e["dst"]
            rnd = "" if e.get("round", -1) < 0 else f"r{e['round']}"
            print(f"{e['t'] - t0:9.3f}s {arrow} {e['kind']:<12} {peer:<10} {rnd:<5} "
                  f"{e['bytes']:>10,} B  seq {e['seq']}")
        ended = _round_outcomes(run, args.round, args.client, entries)
        if ended:
            print(ended)
        sys.stdout.flush()
    except BrokenPipeError:  # `fedbus log RUN | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _ids(addresses: list) -> str:
    return ",".join(str(a).removeprefix("c") for a in addresses) or "-"


def _round_outcomes(run: Path, round_: int | None, client: int | None,
                    entries: list[dict] = ()) -> str:
    """Who was sampled (the tasks of the round, from the index), answered, late
    or dead (from metrics.jsonl)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return ""
    sampled: dict[int, list[int]] = {}
    for e in entries:
        dst = str(e.get("dst", ""))
        if e.get("kind") == "task" and e.get("dir") == "out" and dst[1:].isdigit():
            sampled.setdefault(e.get("round"), []).append(int(dst[1:]))
    lines = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            break
        if round_ is not None and rec.get("round") != round_:
            continue
        answered = rec.get("participants", [])
        failed = rec.get("failures", {})
        if client is not None:
            state = "answered" if client in answered else failed.get(str(client), "not sampled")
            lines.append(f"round {rec['round']}: c{client} {state}")
        else:
            by = {}
            for c, why in failed.items():
                by.setdefault(why, []).append(c)
            extra = "  ".join(f"{why}: {','.join(cs)}" for why, cs in sorted(by.items()))
            asked = sorted(set(sampled.get(rec["round"], [])))
            who = _ids(asked) if asked else rec.get("sampled", "?")  # the index may be cut
            lines.append(f"round {rec['round']}: sampled {who}  answered {_ids(answered)}  "
                         f"{extra}".rstrip())
    return "\n".join(lines)
