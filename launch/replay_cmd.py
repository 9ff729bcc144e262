"""`fedbus replay RUN`: re-execute a run's server (or one client) from its log.

    fedbus replay runs/exp1                       # every server output, byte for byte
    fedbus replay runs/exp1 --until-round 5 --dump-state state.json
    fedbus replay runs/exp1 --client 3 --round 4  # re-run one client's local update
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--until-round", type=int, default=None, metavar="R",
                   help="stop once R aggregations have been replayed")
    p.add_argument("--dump-state", default=None, metavar="PATH",
                   help="write the server's state where replay stopped (JSON summary)")
    p.add_argument("--client", type=int, default=None, metavar="ID",
                   help="re-run this client's local update instead (needs --round)")
    p.add_argument("--round", type=int, default=None, metavar="R")


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return {"dtype": str(value.dtype), "shape": list(value.shape),
                "values": value.tolist() if value.size <= 10_000 else "(large)"}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def main(args: argparse.Namespace) -> int:
    from fedbus.record.msglog import LogCorrupt
    from fedbus.analysis.replay import replay_client, replay_server

    try:
        if args.client is not None:
            if args.round is None:
                print("fedbus replay: --client needs --round", file=sys.stderr)
                return 2
            res = replay_client(args.run, args.client, args.round)
            worst = max(res.max_abs_diff.values(), default=0.0)
            verdict = "identical" if res.identical else f"differs (max abs diff {worst:.3g})"
            print(f"client {res.client} round {res.round} (task {res.task}): update {verdict}")
            for path, diff in sorted(res.max_abs_diff.items()):
                print(f"  {path}: max abs diff {diff:.3g}")
            return 0 if res.identical else 1
        res = replay_server(args.run, until_round=args.until_round)
    except (LogCorrupt, FileNotFoundError, LookupError) as err:
        print(f"fedbus replay: {err}", file=sys.stderr)
        return 2
    if args.dump_state:
        state = res.engine.state_dict()
        with open(args.dump_state, "w") as f:
            json.dump(_jsonable(state), f, indent=1)
    if res.divergence is not None:
        print(f"replay diverged at {res.divergence}", file=sys.stderr)
        return 1
    print(f"replay identical: {res.messages} messages, {res.rounds} rounds")
    if res.cut:
        print("note: the log ends before the run did (server killed or stopped); "
              "everything logged replays")
    return 0
