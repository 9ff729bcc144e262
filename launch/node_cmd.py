"""`fedbus node`: a client-node process hosting some clients on one device.

    fedbus node --broker tcp://HOST:5555 --clients 0-99 --device cuda:0

The node needs no config file: the server sends its resolved config when the
node joins. The data must be reachable on this machine under the same
dataset name (npz:PATH, or a data_dir for downloadable sets).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from fedbus.launch.common import add_log_arguments, setup_logging
from fedbus.launch.devices import parse_ids
from fedbus.launch.keygen_cmd import add_peer_curve_arguments, named_peer_curve


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--broker", required=True, help="broker address, e.g. tcp://10.0.0.5:5555")
    p.add_argument("--clients", required=True, help="client ids to host: 0-99 or 0,3,7-9")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--name", default=None, help="node name, unique per broker "
                   "(default HOST-PID)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="memory budget for materialised clients in MiB (default: "
                   "launch.node_memory_mb)")
    p.add_argument("--max-resident", type=int, default=None,
                   help="at most this many clients materialised (default: "
                   "launch.max_resident; 0 = the memory budget alone decides)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: launch.threads; auto there means the "
                   "cores divided by launch.nodes)")
    p.add_argument("--evict-to", choices=["memory", "disk"], default=None)
    p.add_argument("--spool-dir", default=None, help="folder for clients evicted to disk")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--liveness", type=int, default=3)
    p.add_argument("--state-dir", default=None,
                   help="where each client's state is saved after a task that changed it "
                   "(written off the message path when the server's checkpoint asks, "
                   "PROTOCOL.md §4.2), so that a resumed server continues with it; "
                   "files are keyed by run id and client "
                   "(nodes on one machine can share the folder) and deleted when the run "
                   "completes (default: $XDG_STATE_HOME/fedbus/clients, else "
                   "~/.local/state/fedbus/clients; 'none' saves nothing, and a resume then "
                   "restarts these clients from their initial state)")
    p.add_argument("--message-log-dir", default=None,
                   help="where to write this node's message log when log.client_messages")
    add_peer_curve_arguments(p)
    add_log_arguments(p)


def state_dir(given: str | None) -> Path | None:
    if given == "none":
        return None
    if given:
        return Path(given)
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") \
        / "fedbus" / "clients"


def resolve_device(spec: str) -> str:
    """cuda when asked and present, else the CPU with a clear warning."""
    import torch

    from fedbus.broker.log import get_logger

    if spec == "cpu":
        return "cpu"
    if not spec.startswith("cuda"):
        raise ValueError(f"--device {spec!r}: expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        get_logger("fedbus.node").warning("no CUDA device visible: running on the CPU",
                                          asked=spec)
        return "cpu"
    index = int(spec.split(":", 1)[1]) if ":" in spec else 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"--device {spec}: only {torch.cuda.device_count()} GPU(s) visible")
    return f"cuda:{index}"


def main(args: argparse.Namespace) -> int:
    from fedbus.broker.auth import AuthError

    try:  # under CURVE the node's name is its key's
        curve, name = named_peer_curve(args, f"{socket.gethostname()}-{os.getpid()}")
    except AuthError as err:
        print(f"fedbus node: {err}", file=sys.stderr)
        return 2
    setup_logging(args, name)
    identity = None
    if curve is not None:  # its secure-aggregation signing key sits beside its CURVE key
        from fedbus.launch.keygen_cmd import DEFAULT_KEYS_DIR
        from fedbus.node.privacy.identity import IdentityError, load_identity

        try:
            identity = load_identity(args.keys_dir or DEFAULT_KEYS_DIR, name)
        except IdentityError as err:
            print(f"fedbus node: {err}", file=sys.stderr)
            return 2
    try:
        clients = parse_ids(args.clients)
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"fedbus node: {err}", file=sys.stderr)
        return 2
    from fedbus.node.client_host import ClientNode

    node = ClientNode(args.broker, clients, name=name, device=device,
                      max_resident=args.max_resident, memory_mb=args.memory_mb,
                      threads=args.threads, evict_to=args.evict_to,
                      heartbeat_s=args.heartbeat_s, liveness=args.liveness,
                      spool_dir=args.spool_dir, log_dir=args.message_log_dir,
                      state_dir=state_dir(args.state_dir),
                      curve=curve, identity=identity)
    from fedbus.node.config import ConfigError

    try:
        return node.serve()
    except ConfigError as err:  # the server's config names what this machine lacks (a plugin)
        print(f"fedbus node: the server's config cannot be used here: {err}", file=sys.stderr)
        return 2
