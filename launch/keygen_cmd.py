"""`fedbus keygen`: write a CurveZMQ keypair (and its allow-list entry). See SECURITY.md.

    fedbus keygen broker                                   # the broker's keypair
    fedbus keygen server                                   # the server node's
    fedbus keygen node-a --clients 0-49                    # a client node hosting c0..c49
    fedbus keygen --list                                   # what a keys folder holds

Each writes DIR/NAME.key (public certificate: key, role, clients; it is the node's allow-list
entry at the broker, and broker.key is what every node needs of the broker) and
DIR/NAME.key_secret (mode 0600; stays on the machine that runs NAME). A client key also
gets its secure-aggregation signing key (fedbus.node.privacy.identity; SECURITY.md 3a):
DIR/NAME.sign (public: its clients and Ed25519 verification key; every client node needs
every node's) and DIR/NAME.sign_secret (mode 0600), unless --no-signing-key (a relay's key:
a relay signs nothing).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

DEFAULT_KEYS_DIR = os.environ.get("FEDBUS_KEYS_DIR", "keys")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", default=None,
                   help="key name = the node's name (broker, server, node-a, ...)")
    p.add_argument("--role", choices=["broker", "server", "client"], default=None,
                   help="default: broker for NAME broker, server for NAME server, else client")
    p.add_argument("--clients", default=None,
                   help="client ids a client node may host: 0-99 or 0,3,7-9 (clients only)")
    p.add_argument("--addresses", default=None,
                   help="raw address set instead of --clients, e.g. 'c0-99,c200'")
    p.add_argument("--dir", default=DEFAULT_KEYS_DIR,
                   help=f"keys folder (default {DEFAULT_KEYS_DIR}; env FEDBUS_KEYS_DIR)")
    p.add_argument("--force", action="store_true", help="replace an existing keypair")
    p.add_argument("--no-signing-key", action="store_true",
                   help="a client key without the secure-aggregation signing key NAME.sign "
                        "(for a relay's key; without one, secure aggregation holds against an "
                        "honest-but-curious server only)")
    p.add_argument("--list", action="store_true",
                   help="list the certificates in --dir: file, the name inside, role, clients, "
                        "public key; flags a name that is not the file's and a key in two "
                        "files (the broker refuses both)")


def _list(directory: Path) -> int:
    """One line per certificate: file, NAME inside, role, clients, public key; then what the
    broker would refuse (a name inside that is not the file's, a key in two files)."""
    from fedbus.broker.auth import PUBLIC_SUFFIX, SECRET_SUFFIX, AuthError, read_certificate

    if not directory.is_dir():
        print(f"fedbus keygen: {directory} does not exist", file=sys.stderr)
        return 2
    rows = []
    public_files: dict[bytes, list[str]] = {}
    stems = {p.name[:-len(PUBLIC_SUFFIX)] for p in directory.iterdir()
             if p.name.endswith(PUBLIC_SUFFIX)}
    for path in sorted(directory.iterdir()):
        if not path.name.endswith((PUBLIC_SUFFIX, SECRET_SUFFIX)):
            continue
        try:
            c = read_certificate(path)
        except AuthError as e:
            rows.append((path.name, "?", "?", "", str(e), ""))
            continue
        secret = c.secret is not None
        stem = path.name[:-len(SECRET_SUFFIX if secret else PUBLIC_SUFFIX)]
        flag = ""
        if c.name != stem:
            flag = f"!! name {c.name!r} is not the file's"
            if not secret and c.name in stems:
                flag += f" but {c.name}{PUBLIC_SUFFIX}'s"
            flag += ": the broker refuses it"
        if not secret and c.role != "broker":
            public_files.setdefault(c.public, []).append(path.name)
        rows.append((path.name, c.name, c.role, c.clients,
                     f"{'secret' if secret else 'public'} {c.public.decode()}", flag))
    print(f"{'file':<28} {'name':<20} {'role':<7} {'clients':<24} key")
    for fname, name, role, clients, key, flag in rows:
        print(f"{fname:<28} {name:<20} {role:<7} {clients or '-':<24} {key}"
              + (f"  {flag}" if flag else ""))
    for key, files in public_files.items():
        if len(files) > 1:
            print(f"!! {' and '.join(files)} hold the same public key {key.decode()}: the "
                  "broker refuses the newcomer (or both, at its start)")
    return 0


def main(args: argparse.Namespace) -> int:
    from fedbus.broker.auth import AuthError, format_addresses, write_keypair

    directory = Path(args.dir)
    if args.list:
        return _list(directory)
    if not args.name:
        print("fedbus keygen: give a NAME (or --list)", file=sys.stderr)
        return 2
    role = args.role or {"broker": "broker", "server": "server"}.get(args.name, "client")
    clients = ""
    if args.clients is not None or args.addresses is not None:
        if role != "client":
            print(f"fedbus keygen: a {role} key lists no clients", file=sys.stderr)
            return 2
        if args.addresses is not None:
            clients = args.addresses
        else:
            from fedbus.launch.devices import parse_ids
            from fedbus.node.engine import client_address

            try:
                clients = format_addresses([client_address(i) for i in parse_ids(args.clients)])
            except ValueError as e:
                print(f"fedbus keygen: {e}", file=sys.stderr)
                return 2
    elif role == "client":
        print("fedbus keygen: a client key needs --clients (the client ids its node may host)",
              file=sys.stderr)
        return 2
    try:
        pub, sec = write_keypair(directory, args.name, role, clients=clients, force=args.force)
    except (AuthError, OSError) as e:
        print(f"fedbus keygen: {e}", file=sys.stderr)
        return 2
    use = "every node needs it" if role == "broker" else "it goes in the broker's allow-list"
    print(f"wrote {pub} (public: {use})")
    print(f"wrote {sec} (SECRET, mode 0600: keep it on the {role}'s machine only)")
    if role == "client":
        print(f"  role client, may host: {clients}")
        if not args.no_signing_key:
            return _signing_key(directory, args.name, clients, args.force)
    return 0


def _signing_key(directory: Path, name: str, clients: str, force: bool) -> int:
    try:
        import cryptography  # noqa: F401

        from fedbus.node.privacy.identity import IdentityError, write_signing_key
    except ImportError:
        print("  no signing key: the cryptography package is missing (pip install "
              "'fedbus[privacy]'); secure aggregation holds against an honest-but-curious "
              "server only")
        return 0
    try:
        pub, sec = write_signing_key(directory, name, clients, force=force)
    except (IdentityError, OSError) as e:
        print(f"fedbus keygen: {e}", file=sys.stderr)
        return 2
    print(f"wrote {pub} (public: every client node's keys folder needs it)")
    print(f"wrote {sec} (SECRET, mode 0600: signs its clients' secure-aggregation keys)")
    return 0


# --------------------------------------------------------------------------- for node commands
def add_peer_curve_arguments(p: argparse.ArgumentParser) -> None:
    """--curve/--keys-dir/--key/--broker-key for the commands that start a node's Peer."""
    p.add_argument("--curve", action="store_true",
                   help="encrypt and authenticate with CurveZMQ (keys from --keys-dir)")
    p.add_argument("--keys-dir", default=None,
                   help="CurveZMQ keys folder with this node's NAME.key_secret and the broker's "
                        "broker.key (implies --curve; default $FEDBUS_KEYS_DIR or ./keys)")
    p.add_argument("--key", default=None,
                   help="this node's key name, which is also its node name (default: --name, "
                        "else the only node key in --keys-dir)")
    p.add_argument("--broker-key", default=None,
                   help="the broker's public certificate (default KEYS_DIR/broker.key)")


def named_peer_curve(args: argparse.Namespace, default_name: str):
    """(PeerCurve or None, node name) for a command started with --name and the CURVE
    options (`fedbus node`, `fedbus relay`): under CURVE the name is the key's, and a --name
    that differs is an error; without keys it is --name, else `default_name`. Raises
    fedbus.broker.auth.AuthError with what to do."""
    from fedbus.broker.auth import AuthError

    curve = peer_curve_from_args(args, default_key=args.name)
    if curve is not None and args.name and args.name != curve.name:
        raise AuthError(f"--name {args.name} differs from the key's name {curve.name}")
    return curve, curve.name if curve else args.name or default_name


def peer_curve_from_args(args: argparse.Namespace, *, default_key: str | None = None,
                         config_curve: bool = False, config_keys_dir: str = ""):
    """The PeerCurve the options (or the config's [bus] curve/keys_dir) ask for, or None for
    plaintext. Raises fedbus.broker.auth.AuthError with what to do when keys are missing."""
    from fedbus.broker.auth import find_node_key, load_peer_curve

    if not (args.curve or args.keys_dir or config_curve):
        return None
    keys_dir = args.keys_dir or config_keys_dir or DEFAULT_KEYS_DIR
    name = args.key or default_key or find_node_key(keys_dir)
    return load_peer_curve(keys_dir, name, broker_key=args.broker_key)
