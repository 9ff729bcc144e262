"""`fedbus bench NAME`: benchmarks that print their figures (they are not tests); each time
is printed beside the raw-zmq floor measured in the same run (bench.common), so that a
ratio, not a machine-bound time, is what moves between commits."""
from __future__ import annotations

import argparse
import importlib
import sys

from fedbus.launch.cli import chosen_command

# bench name -> (module under fedbus.bench, help); each offers add_arguments(p) and main_args(args)
BENCHES = {
    "startup": ("startup", ("time to first task, first aggregation and stop of a 1-round "
                            "run, against one bare `import torch`")),
    "broker": ("broker", "broker throughput against a plain zmq.proxy (--curve: CURVE cost)"),
    "rounds": ("rounds", ("framework overhead per round with no-op training, each time as a "
                          "ratio to the raw-zmq floor measured in the same run (--quick: "
                          "CI's perf smoke)")),
    "stragglers": ("stragglers", "time to finish R rounds with deadline/async vs wait-for-all"),
    "accuracy": ("accuracy", "the algorithms' accuracy table on offline MNIST over seeds"),
    "reproduce": ("reproduce", ("one paper's table rerun offline at its settings, scaled "
                                "to this machine, beside the paper's numbers")),
    "train": ("train", ("real FedProto training (20 clients, MNIST-10k Dir(0.1), cnn4) per "
                        "round: fedbus beside a single-process HtFLlib-style reference loop")),
    "authors": ("authors", ("FedNH and FPL beside their authors' code (patched locally to read "
                            "an exported fedbus partition): per-round accuracy and seconds")),
    "attack": ("attack", ("a hostile participant's attacks (issue 30's holes) against a real "
                          "secure federation: refused, global state unchanged, processes "
                          "up, peak memory")),
    "segmentation": ("segmentation", ("FedAvg and proto-attention on the generated "
                                      "shapes-seg segmentation set over seeds (mIoU, pixel "
                                      "accuracy)")),
    "fuzz": ("fuzz", ("coverage-guided fuzzing (atheris) of every decoder of outside input: "
                      "frames, configs, partition, checkpoint, message log, metrics, keys, "
                      "client states; inputs tried and crashes per target")),
    "chaos": ("chaos", ("a long federation under a seeded storm of kills and stops (nodes, "
                        "broker, relay, server with --resume); invariants checked from the "
                        "run's files at the end")),
    "sim": ("sim", ("many seeds of a deterministic simulation of the whole federation (one "
                    "process, simulated clock and network, seeded faults), every invariant "
                    "checked; seeds per second and each violating seed's replay command")),
    "shamir": ("shamir", ("secret sharing alone: the prime-field numpy Shamir beside "
                          "pycryptodome's, split and batched combine per threshold")),
    "secagg": ("secagg", ("time and bytes per round at 10, 100 and 1,000 clients with and "
                          "without secure aggregation (no-op training), the secure round's "
                          "phases, against the issue's target")),
}


NESTED = True  # the CLI hands add_arguments the words after `bench`


def add_arguments(p: argparse.ArgumentParser, rest: list[str]) -> None:
    # Only the chosen benchmark's module is imported: they pull in psutil and friends.
    chosen = chosen_command(rest)
    sub = p.add_subparsers(dest="bench", metavar="NAME")
    for name, (module, help_text) in BENCHES.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        if name != chosen:
            continue
        mod = importlib.import_module(f"fedbus.bench.{module}")
        mod.add_arguments(q)
        q.set_defaults(_bench=mod.main_args)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "_bench", None) is None:
        print("fedbus bench: choose one of " + ", ".join(BENCHES), file=sys.stderr)
        return 2
    return int(args._bench(args) or 0)
