"""`fedbus server`: the server node for one run.

    fedbus server --broker tcp://HOST:5555 CONFIG.toml --out runs/exp1
    fedbus server --broker tcp://HOST:5555 --resume runs/exp1
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fedbus.launch.common import add_config_arguments, add_log_arguments, setup_logging
from fedbus.launch.keygen_cmd import add_peer_curve_arguments, peer_curve_from_args
from fedbus.launch.preflight import check_inputs
from fedbus.node.config import ConfigError, build_config, load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker address, e.g. tcp://10.0.0.5:5555")
    add_config_arguments(p)
    p.add_argument("--out", default=None, help="run directory (default runs/DATE-ALGORITHM)")
    p.add_argument("--resume", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR from its last checkpoint")
    add_peer_curve_arguments(p)
    from fedbus.broker.metrics import add_metrics_argument

    add_metrics_argument(p)
    add_log_arguments(p)


def default_run_dir(algorithm: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{algorithm}"


def load_run_config(path: Path, overrides: list[str]):
    import json

    return build_config(json.loads(path.read_text()), overrides)


def main(args: argparse.Namespace) -> int:
    try:
        if args.resume:
            if args.overrides or args.config:
                print("fedbus server: --resume continues a run with its own config "
                      "(replay depends on it); drop CONFIG and --set", file=sys.stderr)
                return 2
            run_dir = Path(args.resume)
            cfg = load_run_config(run_dir / "config.json", args.overrides)
        elif args.config and args.config.endswith(".json"):
            cfg = load_run_config(Path(args.config), args.overrides)
            run_dir = Path(args.out) if args.out else default_run_dir(cfg.algorithm.name)
        else:
            cfg = load_config(args.config, args.overrides)
            run_dir = Path(args.out) if args.out else default_run_dir(cfg.algorithm.name)
        check_inputs(cfg)  # PreflightError is a ConfigError: one line, exit 2
    except (ConfigError, FileNotFoundError) as err:
        print(f"fedbus server: {err}", file=sys.stderr)
        return 2
    if args.log_file is None:
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        args.log_file = str(run_dir / "logs" / "server.jsonl")
    args.log_level = args.log_level if args.log_level != "info" else cfg.log.level
    setup_logging(args, "server")
    from fedbus.broker.auth import AuthError
    from fedbus.node.server import ServerNode

    try:
        curve = peer_curve_from_args(args, default_key="server", config_curve=cfg.bus.curve,
                                     config_keys_dir=cfg.bus.keys_dir)
    except AuthError as err:
        print(f"fedbus server: {err}", file=sys.stderr)
        return 2
    from fedbus.record import DamagedFile, MissingExtra

    try:
        server = ServerNode(cfg, run_dir, args.broker, resume=bool(args.resume), curve=curve)
        if cfg.log.ffd_reference:
            attach_ffd(server, cfg)
    except (ConfigError, MissingExtra) as err:
        print(f"fedbus server: config error: {err}", file=sys.stderr)
        return 2
    except DamagedFile as err:
        print(f"fedbus server: {err}", file=sys.stderr)
        return 2
    from fedbus.broker.metrics import start_from_args
    from fedbus.node.metrics import server_families

    metrics = start_from_args(args, lambda: server_families(server), "server")
    try:
        code = server.serve()
    finally:
        if metrics is not None:
            metrics.shutdown()
    if code in (130, 143):  # SIGINT, SIGTERM: the run stopped where its checkpoint is
        redo = (f"continue with `fedbus server --broker {args.broker} --resume {run_dir}`"
                if (run_dir / "checkpoint.fbk").is_file() else
                "it stopped before its first round closed: start it again")
        print(f"fedbus server: interrupted after {server.engine.version} of "
              f"{cfg.federation.rounds} rounds; {redo}", file=sys.stderr)
    return code


def attach_ffd(server, cfg) -> None:
    """log.ffd_reference: every evaluated record also gets the federated feature
    discrepancy against the reference run (fedbus.analysis.ffd). An analysis metric, not
    part of the replayed mathematics, so it is wired here and not in the server."""
    from fedbus.analysis.ffd import FeatureDiscrepancy
    from fedbus.broker.log import get_logger

    log = get_logger("fedbus.server")
    ffd = FeatureDiscrepancy(cfg)
    for note in ffd.notes:
        log.warning("ffd reference", note=note)
    server.engine.eval_metrics.append(ffd.record_metrics)
