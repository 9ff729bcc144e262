"""`fedbus bench NAME`: benchmarks that print their figures (they are not tests)."""
from __future__ import annotations

import argparse
import importlib

# bench name -> module under fedbus.bench; each offers add_arguments(p) and main_args(args)
BENCHES = {
    "broker": ("broker", "broker throughput against a plain zmq.proxy (--curve: CURVE cost)"),
    "rounds": ("rounds", "framework overhead per round with no-op training"),
    "stragglers": ("stragglers", "time to finish R rounds with deadline/async vs wait-for-all"),
    "accuracy": ("accuracy", "the algorithms' accuracy table on offline MNIST over seeds"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="NAME")
    for name, (module, help_text) in BENCHES.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(f"fedbus.bench.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"fedbus.bench.{module}":
                raise
            continue
        mod.add_arguments(q)
        q.set_defaults(_bench=mod.main_args)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "_bench", None) is None:
        print("fedbus bench: choose one of " + ", ".join(BENCHES))
        return 2
    return int(args._bench(args) or 0)
