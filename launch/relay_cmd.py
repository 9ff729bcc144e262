"""`fedbus relay`: a regional aggregator between a site's nodes and the server.

    fedbus relay --upstream tcp://SERVER-SITE:5555 --bind tcp://0.0.0.0:5600 --name relay-a

registers with the server's broker as one client node, starts this site's broker on
--bind (or uses --downstream, a broker already running), and serves the site's `fedbus
node` processes, which connect to it as they would to a server's broker. Per sync round
it sends the server one pre-aggregated update for algorithms that declare how their
updates merge (fedavg, fedprox, fedproto, mpfedcl, noop), and forwards everything else
unchanged; see fedbus.node.relay and docs/RELAYS.md.

Keys (CurveZMQ): upstream, like a node: --keys-dir holds this relay's client key (its
name is the relay's name; `fedbus keygen relay-a --clients 0-499` on the server site,
whose broker allow-lists it) and the server site's broker.key. Downstream, --site-keys-dir
is an ordinary single-site keys folder: the site broker's keypair (broker), the key this
relay uses as the site's server (--site-key, default server) and the site's node keys.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

from fedbus.launch.common import add_log_arguments, setup_logging
from fedbus.launch.keygen_cmd import add_peer_curve_arguments, named_peer_curve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--upstream", required=True,
                   help="the server's broker, e.g. tcp://10.0.0.5:5555")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--bind", help="start this site's broker on ENDPOINT, e.g. "
                       "tcp://0.0.0.0:5600 (the site's nodes connect there)")
    where.add_argument("--downstream", help="use this site's broker already running at "
                       "ENDPOINT instead of starting one")
    p.add_argument("--name", default=None, help="the relay's node name upstream, unique there "
                   "(default relay-HOST-PID; under CURVE its key's name)")
    p.add_argument("--deadline-fraction", type=float, default=0.9,
                   help="close a round here this fraction of the server's round deadline "
                   "after its first task, so the merged update still arrives in time "
                   "(default 0.9)")
    p.add_argument("--no-merge", action="store_true",
                   help="forward every update unmerged (for comparison and debugging)")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--liveness", type=int, default=3)
    p.add_argument("--max-frame-mb", type=int, default=64)
    add_peer_curve_arguments(p)
    p.add_argument("--site-keys-dir", default=None,
                   help="CurveZMQ keys of this site (its broker's keypair, this relay's "
                   "server key, the nodes' keys): encrypts the site's side")
    p.add_argument("--site-key", default="server",
                   help="the key this relay uses as the site's server (default server)")
    p.add_argument("--insecure", action="store_true",
                   help="a plaintext site broker on a non-loopback --bind")
    add_log_arguments(p)
    from fedbus.broker.metrics import add_metrics_argument

    add_metrics_argument(p)


def main(args: argparse.Namespace) -> int:
    from fedbus.broker.auth import AuthError, load_peer_curve

    if not 0.0 < args.deadline_fraction <= 1.0:
        print("fedbus relay: --deadline-fraction must lie in (0, 1]", file=sys.stderr)
        return 2
    try:  # under CURVE the relay's name upstream is its key's
        curve_up, name = named_peer_curve(args, f"relay-{socket.gethostname()}-{os.getpid()}")
        curve_down = (load_peer_curve(args.site_keys_dir, args.site_key)
                      if args.site_keys_dir else None)
    except AuthError as err:
        print(f"fedbus relay: {err}", file=sys.stderr)
        return 2
    setup_logging(args, name)
    from fedbus.broker.peer import PeerError
    from fedbus.node.relay import Relay, spawn_site_broker

    broker = None
    downstream = args.downstream
    if args.bind:
        broker = spawn_site_broker(args.bind, heartbeat_s=args.heartbeat_s,
                                   liveness=args.liveness, max_frame_mb=args.max_frame_mb,
                                   keys_dir=args.site_keys_dir, insecure=args.insecure,
                                   log_file=(args.log_file + ".broker") if args.log_file
                                   else None)
        downstream = _connectable(args.bind)
    relay = Relay(args.upstream, downstream, name, curve_up=curve_up, curve_down=curve_down,
                  down_name=curve_down.name if curve_down else "server",
                  heartbeat_s=args.heartbeat_s, liveness=args.liveness,
                  max_frame_mb=args.max_frame_mb, deadline_fraction=args.deadline_fraction,
                  merge=not args.no_merge)
    from fedbus.broker.metrics import start_from_args
    from fedbus.node.metrics import relay_families

    try:
        metrics = start_from_args(args, lambda: relay_families(relay), "relay")
    except SystemExit:
        if broker is not None:
            broker.terminate()
        raise
    try:
        return relay.serve()
    except PeerError as err:
        if broker is not None and broker.poll() is not None:
            print(f"fedbus relay: the site broker for {args.bind} exited with code "
                  f"{broker.returncode} (its log line above says why)", file=sys.stderr)
        else:
            print(f"fedbus relay: {err}", file=sys.stderr)
        return 2
    finally:
        if metrics is not None:
            metrics.shutdown()
        if broker is not None:
            broker.terminate()
            try:
                broker.wait(5)
            except subprocess.TimeoutExpired:
                broker.kill()


def _connectable(bind: str) -> str:
    """The address this host reaches its own bound endpoint at (0.0.0.0 / * -> 127.0.0.1)."""
    for wildcard in ("://0.0.0.0:", "://*:"):
        if wildcard in bind:
            return bind.replace(wildcard, "://127.0.0.1:")
    return bind
