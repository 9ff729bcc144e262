"""`fedbus broker`: start the message broker (a ROUTER socket; see broker/PROTOCOL.md).

CurveZMQ (PROTOCOL.md §10, SECURITY.md) is on whenever an endpoint is not loopback/ipc (the
default tcp://0.0.0.0:5555 included): the broker then needs its keypair and an allow-list,
`fedbus keygen broker` etc. in ./keys (or --keys-dir). --curve forces it on loopback too;
--insecure forces plaintext, with a loud warning on exposed endpoints.

The routing loop runs in C where pip built the optional extension (broker/_fastroute.c),
else in Python with the same checks; its first log line says which (fast_path="C").
FEDBUS_BROKER_FASTPATH=0 picks the Python loop, as does --log-level debug.

Rate limits (PROTOCOL.md §11): what each client node sends into the broker is limited to
--peer-msg-rate messages and --peer-mb-rate MiB a second (bursts of --burst-s seconds of
each), the server's to --server-msg-rate / --server-mb-rate (unlimited by default), and
registrations to --register-rate a second per key after a burst of --register-burst; 0 =
unlimited. A message over its sender's limit is dropped and answered `rate_limited`.
"""
from __future__ import annotations

import argparse
import os
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
    parser.add_argument("--ended-runs", default=None, metavar="FILE",
                        help="keep the shutdowns of ended runs in FILE (written at each run's "
                             "end, read at start): a broker restarted on it still sends a node "
                             "that was away when its run ended the shutdown it missed "
                             "(default: in memory only)")
    parser.add_argument("--curve", action="store_true",
                        help="require CurveZMQ on every endpoint (default: on when an endpoint "
                             "is not loopback/ipc)")
    parser.add_argument("--insecure", action="store_true",
                        help="plaintext even on a non-loopback endpoint (anyone who reaches "
                             "the port can join, read and forge traffic)")
    parser.add_argument("--keys-dir", default=None,
                        help="CurveZMQ keys folder holding BROKER.key_secret (default: "
                             "$FEDBUS_KEYS_DIR or ./keys); see `fedbus keygen`")
    parser.add_argument("--key", default="broker",
                        help="the broker's key name in --keys-dir (default broker)")
    parser.add_argument("--allow-dir", default=None,
                        help="allow-list folder of node public keys (*.key; default --keys-dir)")
    limits = parser.add_argument_group(
        "rate limits (PROTOCOL.md §11; 0 = unlimited)")
    limits.add_argument("--peer-msg-rate", type=float, default=20_000, metavar="N",
                        help="messages a second one client node may send (default 20000)")
    limits.add_argument("--peer-mb-rate", type=float, default=1024, metavar="MIB",
                        help="MiB a second one client node may send (default 1024)")
    limits.add_argument("--server-msg-rate", type=float, default=0, metavar="N",
                        help="messages a second the server node may send (default 0: "
                             "unlimited)")
    limits.add_argument("--server-mb-rate", type=float, default=0, metavar="MIB",
                        help="MiB a second the server node may send (default 0: unlimited)")
    limits.add_argument("--burst-s", type=float, default=2.0, metavar="S",
                        help="a node may send this many seconds' worth of its rates at once "
                             "(default 2)")
    limits.add_argument("--register-rate", type=float, default=1.0, metavar="N",
                        help="registrations a second per key, after the burst (default 1; "
                             "one over it waits, the newest per key)")
    limits.add_argument("--register-burst", type=int, default=10, metavar="N",
                        help="registrations per key at once (default 10)")
    parser.add_argument("--log-level", default="info",
                        choices=["debug", "info", "warning", "error"],
                        help="log level (debug logs one line per routed message, so it also "
                             "routes in Python, not in the C fast path)")
    parser.add_argument("--log-file", default=None, help="also append JSON lines to this file")
    from fedbus.broker.metrics import add_metrics_argument

    add_metrics_argument(parser)


def main(args: argparse.Namespace) -> int:
    from fedbus.broker.auth import AllowListConflict, AuthError, is_loopback, load_broker_curve
    from fedbus.broker.broker import Broker, Limits
    from fedbus.broker.log import configure_logging, get_logger

    configure_logging(level=args.log_level, json_file=args.log_file, process="broker")
    log = get_logger("broker.cli")
    binds = args.bind or [DEFAULT_BIND]
    max_frame = int(args.max_frame_mb * 1024 * 1024)
    curve = None
    exposed = [ep for ep in binds if not is_loopback(ep)]
    if args.curve and args.insecure:
        log.error("--curve and --insecure contradict each other")
        return 2
    if args.curve or (exposed and not args.insecure):
        keys_dir = args.keys_dir or os.environ.get("FEDBUS_KEYS_DIR", "keys")
        try:
            curve = load_broker_curve(keys_dir, name=args.key, allow_dir=args.allow_dir)
        except AllowListConflict as e:
            log.error(str(e))
            return 2
        except AuthError as e:
            why = "--curve" if args.curve else f"endpoint(s) {exposed} are not loopback"
            log.error("CurveZMQ keys needed (" + why + "): " + str(e) + ". Create them "
                      "(fedbus keygen, SECURITY.md) or pass --insecure to run in plaintext",
                      keys_dir=keys_dir)
            return 2
    elif exposed:
        log.warning("!!! INSECURE: CurveZMQ is OFF on non-loopback endpoints: anyone who can "
                    "reach them can register as a node, read every prototype and forge updates."
                    " Use this only on a trusted private network (SECURITY.md) !!!",
                    endpoints=exposed)
    try:
        limits = Limits(peer_msg_rate=args.peer_msg_rate,
                        peer_byte_rate=args.peer_mb_rate * 1024 * 1024,
                        server_msg_rate=args.server_msg_rate,
                        server_byte_rate=args.server_mb_rate * 1024 * 1024,
                        burst_s=args.burst_s, register_rate=args.register_rate,
                        register_burst=args.register_burst)
    except ValueError as e:
        log.error(f"bad rate limit: {e}")
        return 2
    try:
        broker = Broker(binds, heartbeat_s=args.heartbeat_s, liveness=args.liveness,
                        max_frame=max_frame, grace_s=args.grace_s, curve=curve, limits=limits,
                        ended_file=args.ended_runs)
    except Exception as e:  # a bad endpoint, a port in use, ...
        log.error("broker failed to start", endpoints=binds, error=f"{type(e).__name__}: {e}")
        return 1
    from fedbus.broker.metrics import broker_families, start_from_args

    try:
        metrics = start_from_args(args, lambda: broker_families(broker), "broker")
    except SystemExit:
        broker.close()
        raise
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("signal received, stopping", signal=signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        broker.run(stop)
    finally:
        broker.close()
        if metrics is not None:
            metrics.shutdown()
        for s, h in old.items():
            signal.signal(s, h)
    return 0
