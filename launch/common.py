"""Argument and logging plumbing shared by the fedbus sub-commands."""
from __future__ import annotations

import argparse
import sys
import warnings

from fedbus.broker.log import configure_logging
from fedbus.node.config import Config, ConfigError, ConfigWarning, load_config


def add_config_arguments(p: argparse.ArgumentParser, *, required: bool = False) -> None:
    p.add_argument("config", nargs=None if required else "?", metavar="CONFIG",
                   help="TOML config (default: the embedded digits federation)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


def add_log_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-file", default=None, help="also append JSON-lines logs here")


def setup_logging(args: argparse.Namespace, process: str) -> None:
    configure_logging(level=args.log_level, json_file=args.log_file, process=process)


def config_from_args(args: argparse.Namespace) -> Config | None:
    """The validated config, or None after printing why it is not valid; what the config
    holds but likely does not mean (ConfigWarning: a key its partition ignores) is printed
    as one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            cfg = load_config(args.config, args.overrides)
        except ConfigError as err:
            print(f"fedbus: config error: {err}", file=sys.stderr)
            return None
    for w in caught:
        if issubclass(w.category, ConfigWarning) and not getattr(args, "quiet", False):
            print(f"fedbus: config warning: {w.message}", file=sys.stderr)
        elif not issubclass(w.category, ConfigWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return cfg
