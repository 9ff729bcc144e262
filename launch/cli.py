"""The `fedbus` command line: one sub-command per module, imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys

# sub-command -> (module under fedbus.launch, one-line help). Each module offers
# add_arguments(parser) and main(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run_cmd", "run a whole federation on this machine (broker, server, nodes)"),
    "broker": ("broker_cmd", "start the message broker"),
    "server": ("server_cmd", "start the server node for a config"),
    "node": ("node_cmd", "start a client node hosting some clients"),
    "partition": ("partition_cmd", "build, show or export a data partition"),
    "replay": ("replay_cmd", "re-run a run's server (or one client) from its message log"),
    "log": ("log_cmd", "print a run's message timeline"),
    "plot": ("plot_cmd", "plot one or more runs"),
    "bench": ("bench_cmd", "benchmarks: broker, rounds, stragglers"),
    "keygen": ("keygen_cmd", "write a CurveZMQ keypair"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedbus", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(f"fedbus.launch.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"fedbus.launch.{module}":
                raise
            p.set_defaults(_missing=name)
            continue
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"fedbus {args._missing}: not available in this build", file=sys.stderr)
        return 2
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
