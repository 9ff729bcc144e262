"""The `fedbus` command line: one sub-command per module, imported only when used."""
from __future__ import annotations

import argparse
import importlib
import sys
import warnings

# sub-command -> (module under fedbus.launch, one-line help). Each module offers
# add_arguments(parser) and main(args) -> int.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run_cmd", "run a whole federation on this machine (broker, server, nodes)"),
    "algorithms": ("algorithms_cmd", ("list the algorithms: paper, what clients upload, "
                                      "options (NAME: every option of one)")),
    "broker": ("broker_cmd", "start the message broker"),
    "server": ("server_cmd", "start the server node for a config"),
    "node": ("node_cmd", "start a client node hosting some clients"),
    "relay": ("relay_cmd", "start a regional relay (one participant upstream, the server of "
                           "its site's nodes)"),
    "partition": ("partition_cmd", "build, show or export a data partition"),
    "replay": ("replay_cmd", "re-run a run's server (or one client) from its message log"),
    "log": ("log_cmd", "print a run's message timeline"),
    "plot": ("plot_cmd", "plot one or more runs"),
    "timeline": ("timeline_cmd", "every client's tasks on a time axis, coloured by fate "
                                 "(PNG and HTML), from a run's message log"),
    "sweep": ("sweep_cmd", "run a grid of configs x seeds, several at a time, resumable"),
    "table": ("table_cmd", "one table across runs: mean, std and paired differences by group"),
    "bench": ("bench_cmd", "benchmarks: {names}"),
    "keygen": ("keygen_cmd", "write a CurveZMQ keypair"),
    "slurm": ("slurm_cmd", "submit a whole federation as one Slurm job and follow it"),
}

# sub-command -> the registry (module under fedbus.launch, attribute) of what its help
# lists: "{names}" in its help is filled from it, so the listing cannot drift from what
# the sub-command accepts. The module must be cheap to import (no torch).
LISTS: dict[str, tuple[str, str]] = {
    "bench": ("bench_cmd", "BENCHES"),
}


def command_help(name: str) -> str:
    """A sub-command's one-line help, its "{names}" filled from LISTS."""
    help_text = COMMANDS[name][1]
    if name not in LISTS:
        return help_text
    registry_module, attribute = LISTS[name]
    try:
        names = getattr(importlib.import_module(f"fedbus.launch.{registry_module}"), attribute)
    except ModuleNotFoundError as err:  # not in this build: `fedbus NAME` says so
        if err.name != f"fedbus.launch.{registry_module}":
            raise
        return help_text.replace(": {names}", "")
    return help_text.format(names=", ".join(names))


# optional package -> the extra that installs it
EXTRAS = {"psutil": "bench", "matplotlib": "plot", "torchvision": "vision",
          "tensorboard": "tensorboard"}


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("fedbus")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Version(argparse.Action):
    """--version, looked up only when asked (importlib.metadata costs ~60 ms)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"fedbus {version()}")
        parser.exit()


def chosen_command(argv: list[str]) -> str | None:
    """The sub-command named in argv: the first word that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None,
                 rest: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser with every sub-command listed and only `command`'s arguments
    built: a sub-command's module (and whatever it imports: torch, psutil,
    matplotlib) is loaded only when that sub-command is the one chosen. A module
    with sub-commands of its own (NESTED = True) is handed the words after its
    name (`rest`) so that it too builds only the one chosen."""
    parser = argparse.ArgumentParser(prog="fedbus", description=__doc__)
    parser.add_argument("--version", action=_Version, help="print fedbus's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, _) in COMMANDS.items():
        help_text = command_help(name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name != command:
            continue
        try:
            mod = importlib.import_module(f"fedbus.launch.{module}")
        except ModuleNotFoundError as err:
            if err.name != f"fedbus.launch.{module}":
                raise
            p.set_defaults(_missing=name)
            continue
        if getattr(mod, "NESTED", False):
            mod.add_arguments(p, rest or [])
        else:
            mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def _show_warning(message, category, filename, lineno, file=None, line=None,
                  _default=warnings.showwarning):
    """A config warning (fedbus.node.config.ConfigWarning) is one line for the user, from
    whichever sub-command loaded the config; other warnings keep Python's form."""
    if category.__name__ != "ConfigWarning":
        return _default(message, category, filename, lineno, file, line)
    print(f"fedbus: config warning: {message}", file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    argv = sys.argv[1:] if argv is None else list(argv)
    command = chosen_command(argv)
    rest = argv[argv.index(command) + 1:] if command else []
    parser = build_parser(command, rest)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"fedbus {args._missing}: not available in this build", file=sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"fedbus {args.command}: needs the optional package {top!r} "
              f"(pip install 'fedbus[{EXTRAS[top]}]')",
              file=sys.stderr)
        return 2


def console_main() -> None:
    """The `fedbus` console script: main(), then leave without tearing the
    interpreter down. With torch loaded a teardown takes about a second, as long
    as a one-round federation's training; what we own is closed by then (run
    files, message logs), and logs and standard streams are flushed here."""
    import logging
    import os

    try:
        code = main()
        logging.shutdown()
        sys.stdout.flush()
    except BrokenPipeError:
        # the reader left (`fedbus log RUN | head`): stop quietly, as a shell tool does
        # (128 + SIGPIPE), without a traceback for output nobody reads
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    console_main()
