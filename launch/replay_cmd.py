"""`fedbus replay RUN`: re-execute a run's server (or one client) from its log.

    fedbus replay runs/exp1                       # every server output, byte for byte
    fedbus replay runs/exp1 --until-round 4 --dump-state state.json   # rounds 0-4
    fedbus replay runs/exp1 --client 3 --round 4  # re-run one client's local update

Rounds are 0-based, as in metrics.jsonl, `fedbus log` and the wire: round 0 is the
first aggregation.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Two modes. Server (the default): a fresh server is fed the logged inputs "
                "and every message it sends is compared, byte for byte, with the logged one; "
                "exit 0 identical, 1 diverged (the record, round and field are named). "
                "Client (--client ID --round R): that client is rebuilt and fed every task "
                "and evaluation it was sent up to round R, and its round-R update is "
                "compared with the one it sent; exit 0 identical, 1 differs. Under secure "
                "aggregation the logged update is masked and cannot be compared: the "
                "recomputed update is summarised and its work record compared instead. A "
                "task with no update to compare is said to be so, as `fedbus log` says it: "
                "dropped (the simulated drop its task carried), refused (the validator's "
                "reason), or unanswered in the log (the round's record says late or dead); "
                "exit 0 unless the record says it answered. "
                "Rounds are 0-based (round 0 is the first aggregation). Exit 2: a usage "
                "error, no message log, a damaged log or a data set not found.")
    p.add_argument("run", metavar="RUN", help="run directory")
    p.add_argument("--until-round", type=int, default=None, metavar="R",
                   help="server mode: stop after round R (0-based, included: R = 0 replays "
                   "the first aggregation and what the server sent after it)")
    p.add_argument("--dump-state", default=None, metavar="PATH",
                   help="server mode: write the server's state where replay stopped to PATH "
                   "(JSON; arrays of more than 10,000 values as dtype and shape only)")
    p.add_argument("--client", type=int, default=None, metavar="ID",
                   help="client mode: re-run client ID's local update of --round and compare "
                   "it with the logged one")
    p.add_argument("--round", type=int, default=None, metavar="R",
                   help="client mode (with --client): the round (0-based) whose update to "
                   "recompute")


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


def refused_combination(args: argparse.Namespace) -> str | None:
    """Why these options do not go together (one would be ignored), or None."""
    if args.client is not None:
        if args.round is None:
            return "--client needs --round (the round whose update to recompute)"
        for given, option in ((args.until_round, "--until-round"),
                              (args.dump_state, "--dump-state")):
            if given is not None:
                return (f"{option} is for server replay; with --client only the client's "
                        "update is recomputed")
    elif args.round is not None:
        return ("--round needs --client (one client's update); to replay the server up to "
                "a round use --until-round")
    return None


def check_ranges(args: argparse.Namespace, cfg) -> str | None:
    """Why a round or client is outside the run, naming the valid range, or None."""
    rounds, clients = int(cfg.federation.rounds), int(cfg.federation.clients)
    for value, option in ((args.until_round, "--until-round"), (args.round, "--round")):
        if value is not None and not 0 <= value < rounds:
            return f"{option} {value}: this run has rounds 0-{rounds - 1} " \
                   f"(federation.rounds = {rounds})"
    if args.client is not None and not 0 <= args.client < clients:
        return f"--client {args.client}: this run has clients 0-{clients - 1} " \
               f"(federation.clients = {clients})"
    return None


def dataset_problem(dataset: str, err: Exception) -> str:
    """One line: the run's data set does not load here, and where a relative path was
    looked for (the directory `fedbus run` was started in may be another)."""
    line = f"data.dataset = {dataset!r} cannot be loaded: {' '.join(str(err).split())}"
    if dataset.startswith("npz:") and not Path(os.path.expanduser(dataset[4:])).is_absolute():
        line += (f"; a relative path is looked up from the current directory ({Path.cwd()}): "
                 "replay from the directory the run was started in")
    return line


def _update_line(update: dict) -> str:
    from fedbus.launch.log_cmd import summarize, summary_text

    entry = {"kind": "update", "dir": "in"}
    return summary_text(entry, summarize(entry, update))


def _work_line(res) -> str:
    mine = res.update.get("work") or {}
    done = (f"{mine.get('epochs_done'):g}/{mine.get('epochs_asked')} epochs, "
            f"{mine.get('steps')} steps, {mine.get('samples')} samples seen")
    if res.work_identical:
        return f"  work identical: {done}"
    theirs = res.logged_work
    return (f"  work differs: recomputed {done}; logged {theirs.get('epochs_done'):g}/"
            f"{theirs.get('epochs_asked')} epochs, {theirs.get('steps')} steps, "
            f"{theirs.get('samples')} samples seen")


def logged_outcome(run: str, client: int, round_: int) -> str | None:
    """What the round's record says became of the client ("answered", "late", "dropped",
    "dead", ...), as `fedbus log --client --round` shows it; None: no record of the round."""
    from fedbus.launch.log_cmd import round_outcomes

    found = round_outcomes(Path(run), round_, client)
    return found[0]["state"] if found else None


def _no_update(res, outcome: str | None) -> int:
    """A task with no logged update to compare: say why, as the log does. Exit 0 when the
    replay's finding agrees with the round's record, 1 when the record says it answered."""
    head = f"client {res.client} round {res.round} (task {res.task})"
    if res.no_update.startswith("dropped"):
        print(f"{head}: {res.no_update}: the client dropped the task (system.drop_prob or "
              "drop_clients), trained nothing and sent no update; nothing to compare")
    else:
        said = f"the round's record: {outcome}" if outcome else "no record of the round"
        print(f"{head}: {res.no_update} ({said}); nothing to compare")
        if res.update:
            print(f"  recomputed: {_update_line(res.update)}")
    return 1 if outcome in ("answered",) else 0


def client_main(args: argparse.Namespace) -> int:
    from fedbus.analysis.replay import replay_client

    try:
        res = replay_client(args.run, args.client, args.round)
    except LookupError as err:  # no task at all: the log says so too
        outcome = logged_outcome(args.run, args.client, args.round)
        raise LookupError(f"{err} ({outcome})" if outcome else str(err)) from None
    outcome = logged_outcome(args.run, args.client, args.round)
    if res.no_update is not None:
        return _no_update(res, outcome)
    # an update was logged for this task, so the client was sampled: an async record is
    # keyed by the version it made, not the task's round, and may not list the client
    said = f", {outcome}" if outcome not in (None, "answered", "not sampled") else ""
    head = f"client {res.client} round {res.round} (task {res.task}{said})"
    if res.masked:
        print(f"{head}: update not compared: under secure aggregation (privacy."
              "secure_aggregation = true) it travelled masked, and only the round's sum can "
              "be unmasked")
        print(_work_line(res))
        print(f"  recomputed: {_update_line(res.update)}")
        return 0 if res.work_identical else 1
    worst = max(res.max_abs_diff.values(), default=0.0)
    verdict = "identical" if res.identical else f"differs (max abs diff {worst:.3g})"
    print(f"{head}: update {verdict}")
    for path, diff in sorted(res.max_abs_diff.items()):
        what = f"max abs diff {diff:.3g}" if np.isfinite(diff) else \
            "missing from the logged update, or shaped otherwise"
        print(f"  {path}: {what}")
    print(_work_line(res))
    print(f"  recomputed: {_update_line(res.update)}")
    return 0 if res.identical else 1


def main(args: argparse.Namespace) -> int:
    why = refused_combination(args)
    if why:
        print(f"fedbus replay: {why}", file=sys.stderr)
        return 2
    from fedbus.analysis.replay import load_run, replay_server
    from fedbus.node.config import ConfigError
    from fedbus.node.data import DatasetUnavailable
    from fedbus.record.msglog import LogCorrupt

    try:
        cfg, _ = load_run(args.run)
        why = check_ranges(args, cfg)
        if why:
            print(f"fedbus replay: {why}", file=sys.stderr)
            return 2
        if args.client is not None:
            return client_main(args)
        res = replay_server(args.run, until_round=args.until_round)
    except DatasetUnavailable as err:  # e.g. a relative npz path, from another directory
        print(f"fedbus replay: {dataset_problem(cfg.data.dataset, err)}", file=sys.stderr)
        return 2
    except LogCorrupt as err:
        print(f"fedbus replay: {' '.join(str(err).split())}; the records before it are whole: "
              f"`fedbus log {args.run}` shows them, and `fedbus replay {args.run} "
              f"--until-round R` replays the rounds before the damage", file=sys.stderr)
        return 2
    except (FileNotFoundError, LookupError, ConfigError) as err:
        print(f"fedbus replay: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if args.dump_state:
        state = res.engine.state_dict()
        with open(args.dump_state, "w") as f:
            json.dump(_jsonable(state), f, indent=1)
    if res.divergence is not None:
        print(f"replay diverged at {res.divergence}", file=sys.stderr)
        return 1
    through = f" (rounds 0-{res.rounds - 1})" if res.rounds else ""
    print(f"replay identical: {res.messages} messages, {res.rounds} rounds{through}")
    if res.cut:
        print("note: the log ends before the run did (server killed or stopped); "
              "everything logged replays")
    return 0
