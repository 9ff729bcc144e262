"""`fedbus broker`: start the message broker (a ROUTER socket; see broker/PROTOCOL.md)."""
from __future__ import annotations

import argparse
import signal
import threading

DEFAULT_BIND = "tcp://0.0.0.0:5555"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--bind", action="append", metavar="ENDPOINT",
        help=f"endpoint to bind, repeatable (tcp://HOST:PORT or ipc://PATH; default {DEFAULT_BIND})",
    )
    parser.add_argument("--heartbeat-s", type=float, default=1.0,
                        help="heartbeat interval in seconds (default 1.0)")
    parser.add_argument("--liveness", type=int, default=3,
                        help="heartbeats a node may miss before it is purged (default 3)")
    parser.add_argument("--max-frame-mb", type=float, default=64.0,
                        help="largest frame accepted, in MiB (default 64)")
    parser.add_argument("--grace-s", type=float, default=None,
                        help="after start, hold messages for not-yet-registered addresses this "
                             "long (default max(10, 4 x heartbeat x liveness))")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="log level (debug logs one line per routed message)")
    parser.add_argument("--log-file", default=None, help="also append JSON lines to this file")


def main(args: argparse.Namespace) -> int:
    from fedbus.broker.broker import Broker
    from fedbus.broker.log import configure_logging, get_logger

    configure_logging(level=args.log_level, json_file=args.log_file, process="broker")
    log = get_logger("broker.cli")
    binds = args.bind or [DEFAULT_BIND]
    max_frame = int(args.max_frame_mb * 1024 * 1024)
    try:
        broker = Broker(binds, heartbeat_s=args.heartbeat_s, liveness=args.liveness,
                        max_frame=max_frame, grace_s=args.grace_s)
    except Exception as e:  # a bad endpoint, a port in use, ...
        log.error("broker failed to start", endpoints=binds, error=f"{type(e).__name__}: {e}")
        return 1
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal received, stopping", signal=signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        broker.run(stop)
    finally:
        broker.close()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
