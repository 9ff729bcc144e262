"""What a deadline or async mode saves when some clients are slow.

    fedbus bench stragglers --clients 10 --rounds 5

30% of the clients (seeded) are 10x slower. The same federation (FedAvg on
digits, one client per node so a slow client delays only itself) runs three
times: wait for every client, close rounds at a deadline, and async FedBuff.
Prints the time from the first task to the R-th aggregation (process
start-up excluded), final accuracy, and the speed-up over wait-for-all. Target: >= 2x (FedBuff reports 3.3x).
Each time is also printed beside R times the raw-zmq floor of the wait-for-all run's round
of messages, measured in the same run, and its ratio (--json: each mode's `floor_ms` and
`ratio`): training dominates here, so the ratio is large and moves with the training.
"""
from __future__ import annotations

import argparse
import json

from fedbus.bench.common import floor_table, run, run_floor


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--slow-fraction", type=float, default=0.3)
    p.add_argument("--slow-factor", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=0.0,
                   help="round deadline (default: 2x the median fast-client round of the "
                   "wait-for-all run)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


def config(args: argparse.Namespace, **federation) -> dict:
    return {
        "federation": {"clients": args.clients, "rounds": args.rounds, "seed": 0,
                       "eval_every": args.rounds, "start_timeout_s": 300.0, **federation},
        "data": {"dataset": "digits", "partition": "dirichlet", "alpha": 1.0},
        "model": {"arch": "cnn"},
        "algorithm": {"name": "fedavg"},
        "train": {"epochs": args.epochs, "batch_size": 16, "lr": 0.05},
        "system": {"slow_fraction": args.slow_fraction, "slow_factor": args.slow_factor},
        "launch": {"nodes": args.clients},
        "log": {"level": "warning"},
    }


def main_args(args: argparse.Namespace) -> int:
    everyone = run(config(args), "wait-for-all")
    # the time of a fast client: rounds where every sampled client answered are set by the
    # slowest; use the train times reported by the updates instead (fast clients ~ 1x)
    deadline = args.deadline_s or 2.0 * _fast_round_estimate(everyone, args.slow_factor)
    deadline_run = run(config(args, deadline_s=deadline, late="fold"), "deadline")
    asynchronous = run(config(args, mode="async", concurrency=args.clients,
                              buffer=max(1, args.clients // 2)), "async")
    base = training_time(everyone)
    floor = run_floor(everyone.summary, everyone.records, args.clients)
    print(f"fedbus bench stragglers: {args.clients} clients, {args.slow_fraction:.0%} of them "
          f"{args.slow_factor:g}x slower, {args.rounds} rounds of {args.epochs} local epochs")
    print(f"  {'mode':<28}{'time to R rounds':>18}{'final acc':>11}{'speed-up':>10}")
    modes = []
    for label, res in (("wait for all", everyone),
                       (f"deadline {deadline:.2f}s + fold", deadline_run),
                       ("async (buffer = clients/2)", asynchronous)):
        acc = res.summary["final"].get("acc_mean", float("nan"))
        took = training_time(res)
        print(f"  {label:<28}{took:>16.2f} s{100 * acc:>10.1f}%{base / took:>9.2f}x")
        modes.append({"mode": label, "time_ms": took * 1000, "acc": acc,
                      "speedup": base / took, "floor_ms": args.rounds * floor.ms,
                      "ratio": took * 1000 / (args.rounds * floor.ms)})
    print("\n".join(floor_table([(f"{m['mode']}, {args.rounds} rounds", m["time_ms"],
                                  m["floor_ms"]) for m in modes], floor)))
    if args.json:
        print(json.dumps({"clients": args.clients, "rounds": args.rounds, "modes": modes}))
    return 0


def training_time(res) -> float:
    """From the first task to the last aggregation: process start-up excluded."""
    recs = sorted(res.records, key=lambda r: r["version"])
    return recs[-1]["time"] - (recs[0]["time"] - recs[0]["round_s"])


def _fast_round_estimate(res, slow_factor: float) -> float:
    """A slow round lasts about slow_factor fast client-runs: estimate one fast run."""
    rounds = sorted(r["round_s"] for r in res.records)
    return max(0.05, rounds[len(rounds) // 2] / slow_factor)
