"""Argument and logging plumbing shared by the fedbus sub-commands."""
from __future__ import annotations

import argparse
import sys

from fedbus.broker.log import configure_logging
from fedbus.node.config import Config, ConfigError, load_config


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
    """The validated config, or None after printing why it is not valid."""
    try:
        return load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"fedbus: config error: {err}", file=sys.stderr)
        return None
