"""Framework overhead per round: no-op training, real processes, real bus.

    fedbus bench rounds --clients 100 --payload prototypes
    fedbus bench rounds --clients 1000 --nodes 4 --rounds 10

A round's time is measured by the server from sending its first task to
closing it (metrics.jsonl `round_s`); the first round, which also builds every
client lazily, is reported apart. Peak RSS is the sum over every process of
the federation. Targets on a 2-core machine: 100 clients with prototype
payloads < 50 ms per round; 1,000 clients in 4 nodes, 10 rounds, < 4 GB.
"""
from __future__ import annotations

import argparse
import statistics

from fedbus.bench.common import run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--payload", choices=["prototypes", "resnet18"], default="prototypes")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--message-log", action="store_true",
                   help="keep the server's message log on (off: measure the bus alone)")


def config(args: argparse.Namespace) -> dict:
    return {
        "federation": {"clients": args.clients, "rounds": args.rounds,
                       "eval_every": args.rounds, "seed": 0, "start_timeout_s": 300.0},
        "data": {"dataset": "digits", "partition": "iid", "test_fraction": 0.25},
        "model": {"arch": "mlp"},
        "algorithm": {"name": "noop", "payload": args.payload},
        "launch": {"nodes": args.nodes, "max_resident": 64},
        "log": {"messages": bool(args.message_log), "level": "warning"},
    }


def main_args(args: argparse.Namespace) -> int:
    res = run(config(args), f"rounds-{args.clients}-{args.payload}")
    # one metrics line per aggregation (eval results only on the last)
    per_round = [r["round_s"] for r in sorted(res.records, key=lambda r: r["round"])]
    steady = per_round[1:] or per_round
    print(f"fedbus bench rounds: {args.clients} clients, {args.nodes} nodes, "
          f"payload {args.payload}, {args.rounds} rounds, message log "
          f"{'on' if args.message_log else 'off'}")
    print(f"  first round (builds clients) {per_round[0] * 1000:9.1f} ms")
    print(f"  per round, median of the rest {statistics.median(steady) * 1000:9.1f} ms"
          f"   (mean {statistics.mean(steady) * 1000:.1f}, max {max(steady) * 1000:.1f})")
    print(f"  rounds completed             {res.summary['rounds_completed']:9d}")
    print(f"  bytes up / down              {res.summary['bytes_up']:,} / "
          f"{res.summary['bytes_down']:,}")
    print(f"  peak RSS, all processes      {res.peak_rss / 2**30:9.2f} GiB")
    print(f"  wall time incl. start-up     {res.wall_s:9.1f} s")
    return 0
