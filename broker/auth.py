"""CurveZMQ keys, the broker's allow-list, and its ZAP handler (PROTOCOL.md §10, SECURITY.md).

Keys are ZeroMQ certificate files (the ZPL text format of czmq / ``zmq.auth``), written by
``fedbus keygen NAME``:

    NAME.key         public certificate: the public key plus metadata (name, role, the client
                     addresses the node may host). It goes into the broker's allow-list folder.
    NAME.key_secret  the keypair (mode 0600). It stays on the machine of the node it names.

The broker has its own keypair (role ``broker``, conventionally NAME = ``broker``); every node
needs the broker's *public* certificate ``broker.key`` besides its own secret one.

The allow-list is a folder of public certificates of role ``server`` or ``client`` (certificates
of role ``broker`` found there are skipped), keyed by public key: each NAME.key must hold the
certificate named NAME, and a key may be in one file only (AllowList: a file that breaks either
rule is refused, naming both files; at the broker's start that is an error). The broker's ZAP
handler accepts a connection only if its CURVE public key is in it, and gives the connection
that key (z85) as its ZAP User-Id. At registration the broker finds the certificate by that key:
the node's name is the certificate's NAME, its role the certificate's role, and the client
addresses it registers a subset of the certificate's ``clients``. The folder is re-read whenever
its listing or a file's mtime changes, so adding a node needs no broker restart (a removed key
stops new connections and re-registrations; a connected node keeps its session until it
reconnects).

Address sets (the ``clients`` metadata) are comma-separated items, each an exact address or a
numeric range written ``PREFIXlo-hi`` (or ``PREFIXlo-PREFIXhi``): ``"c0-99,c200,c300-c349"``.
Numbers are canonical decimals (``c007`` is not in ``c0-9``).

This module imports nothing of fedbus but the logger: the broker knows no engine.
"""
from __future__ import annotations

import os
import re
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

from .log import get_logger

__all__ = [
    "AddressSet",
    "AllowEntry",
    "AllowList",
    "AllowListConflict",
    "AuthError",
    "BrokerCurve",
    "PeerCurve",
    "ZapHandler",
    "find_node_key",
    "format_addresses",
    "is_loopback",
    "load_broker_curve",
    "load_peer_curve",
    "peer_routing_id",
    "read_certificate",
    "write_keypair",
]

ROLES = ("broker", "server", "client")
PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"fedbus"
BROKER_KEY = "broker"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_RANGE_RE = re.compile(r"^(.*?)(0|[1-9][0-9]*)-(.*?)(0|[1-9][0-9]*)$")
_NUM_RE = re.compile(r"^(.*?)(0|[1-9][0-9]*)$")
_RESERVED = frozenset({"server", "broker", "*", ""})


class AuthError(ValueError):
    """A key file, an allow-list entry or an address set that cannot be used."""


# --------------------------------------------------------------------------- address sets
class AddressSet:
    """A set of client addresses given as exact names and numeric ranges (see the module doc)."""

    __slots__ = ("exact", "ranges", "text")

    def __init__(self, text: str = ""):
        self.text = text.strip()
        self.exact: set[str] = set()
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for item in self.text.split(","):
            item = item.strip()
            if not item:
                continue
            m = _RANGE_RE.match(item)
            if m and (m.group(3) in ("", m.group(1))):
                lo, hi = int(m.group(2)), int(m.group(4))
                if hi < lo:
                    raise AuthError(f"address range {item!r}: {hi} < {lo}")
                self.ranges.setdefault(m.group(1), []).append((lo, hi))
            else:
                if item in _RESERVED:
                    raise AuthError(f"{item!r} is reserved and cannot be a client address")
                self.exact.add(item)

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, str):
            return False
        if address in self.exact:
            return True
        if not self.ranges:
            return False
        m = _NUM_RE.match(address)
        if m is None:
            return False
        spans = self.ranges.get(m.group(1))
        if not spans:
            return False
        n = int(m.group(2))
        return any(lo <= n <= hi for lo, hi in spans)

    def __len__(self) -> int:
        return len(self.exact) + sum(hi - lo + 1 for spans in self.ranges.values()
                                     for lo, hi in spans)

    def __repr__(self) -> str:
        return f"AddressSet({self.text!r})"


def format_addresses(addresses) -> str:
    """["c0", "c1", "c2", "c5", "x"] -> "c0-2,c5,x" (the compact form AddressSet reads)."""
    by_prefix: dict[str, list[int]] = {}
    exact: list[str] = []
    for a in addresses:
        m = _NUM_RE.match(a)
        if m:
            by_prefix.setdefault(m.group(1), []).append(int(m.group(2)))
        else:
            exact.append(a)
    parts: list[str] = []
    for prefix, nums in by_prefix.items():
        nums = sorted(set(nums))
        start = prev = nums[0]
        for n in nums[1:] + [None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            parts.append(f"{prefix}{start}" if start == prev else f"{prefix}{start}-{prev}")
            if n is not None:
                start = prev = n
    return ",".join(parts + sorted(set(exact)))


# --------------------------------------------------------------------------- certificates
def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise AuthError(f"key name {name!r}: use 1..128 letters, digits, '.', '_' or '-' "
                        "(it is a file name and the node's name)")


def _quote(value: str) -> str:
    if '"' in value or "\n" in value:
        raise AuthError(f"metadata value {value!r} may not contain quotes or newlines")
    return f'"{value}"'


def _cert_text(kind: str, meta: dict[str, str], public: bytes, secret: bytes | None) -> str:
    lines = [
        (f"#   fedbus CurveZMQ {kind} certificate for {meta['name']!r} "
         f"(role {meta['role']}), written {time.strftime('%Y-%m-%d %H:%M:%S')}"),
    ]
    if secret is None:
        lines.append("#   Public: give it to the broker's operator (allow-list folder) or, for "
                     "the broker's own key, to every node.")
    else:
        lines.append("#   SECRET: keep it on this node's machine only (mode 0600).")
    lines += ["", "metadata"]
    lines += [f"    {k} = {_quote(v)}" for k, v in meta.items()]
    lines += ["curve", f'    public-key = "{public.decode("ascii")}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return "\n".join(lines) + "\n"


def write_keypair(directory: str | os.PathLike, name: str, role: str, *,
                  clients: str = "", force: bool = False) -> tuple[Path, Path]:
    """Create NAME.key (public, with metadata) and NAME.key_secret (0600) in directory.

    role: "broker", "server" or "client"; clients: an address set (clients only).
    Refuses to overwrite existing files unless force. Returns (public path, secret path).
    """
    _check_name(name)
    if role not in ROLES:
        raise AuthError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if role == "client" and name in _RESERVED:
        raise AuthError(f"a client key cannot be named {name!r}")
    if role != "client" and clients:
        raise AuthError(f"only client keys list clients (this one has role {role})")
    if role == "client" and not AddressSet(clients):
        raise AuthError("a client key needs the client addresses it may host")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub_path, sec_path = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    if not force:
        for p in (pub_path, sec_path):
            if p.exists():
                raise AuthError(f"{p} exists (pass --force to replace the keypair)")
    public, secret = zmq.curve_keypair()
    meta = {"name": name, "role": role}
    if role == "client":
        meta["clients"] = clients
    # the secret first, created 0600 (never world-readable, not even for a moment)
    tmp = sec_path.with_name(sec_path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_cert_text("secret", meta, public, secret))
    os.replace(tmp, sec_path)
    tmp = pub_path.with_name(pub_path.name + ".tmp")
    tmp.write_text(_cert_text("public", meta, public, None))
    os.replace(tmp, pub_path)
    return pub_path, sec_path


@dataclass(frozen=True)
class Certificate:
    path: Path
    name: str
    role: str
    clients: str
    public: bytes  # z85, 40 bytes
    secret: bytes | None  # z85, 40 bytes; None in a public certificate


def read_certificate(path: str | os.PathLike) -> Certificate:
    """Parse a certificate file (ours, or any ZPL certificate with public-key/secret-key).

    Metadata missing from a foreign certificate: name = the file stem, role = "client".
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AuthError(f"key file {p} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise AuthError(f"cannot read key file {p}: {e}") from None
    section = None
    meta: dict[str, str] = {}
    keys: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.rstrip()
        if not line.strip() or line.lstrip().startswith("#"):  # ('#' is a z85 character)
            continue
        if not line[0].isspace():
            section = line.strip()
            continue
        if "=" not in line:
            continue
        k, v = (s.strip() for s in line.split("=", 1))
        if len(v) >= 2 and v[0] == v[-1] == '"':
            v = v[1:-1]
        if section == "metadata":
            meta[k] = v
        elif section == "curve":
            keys[k] = v
    public = keys.get("public-key", "").encode("ascii", "replace")
    secret = keys.get("secret-key")
    if len(public) != 40:
        raise AuthError(f"{p}: no valid public-key (a 40-character z85 string)")
    try:
        z85.decode(public)
        if secret is not None:
            secret_b = secret.encode("ascii")
            if len(secret_b) != 40:
                raise ValueError("length")
            z85.decode(secret_b)
    except (ValueError, TypeError, KeyError, IndexError, struct.error):
        raise AuthError(f"{p}: malformed z85 key") from None
    stem = p.name[:-len(SECRET_SUFFIX)] if p.name.endswith(SECRET_SUFFIX) else p.stem
    name = meta.get("name", stem)
    role = meta.get("role", "client")
    if role not in ROLES:
        raise AuthError(f"{p}: role {role!r} is not one of {', '.join(ROLES)}")
    _check_name(name)
    return Certificate(p, name, role, meta.get("clients", ""), public,
                       secret.encode("ascii") if secret is not None else None)


# --------------------------------------------------------------------------- the allow-list
@dataclass(frozen=True)
class AllowEntry:
    name: str
    role: str  # "server" or "client"
    clients: AddressSet
    public: bytes  # z85
    path: str = ""

    def check(self, role: str, clients) -> str | None:
        """Why a registration (role, client addresses) is not allowed for this key, or None."""
        if role != self.role:
            return (f"key {self.name!r} is allow-listed for role {self.role!r}, "
                    f"not {role!r}")
        if role == "client":
            bad = [c for c in clients if c not in self.clients]
            if bad:
                return (f"key {self.name!r} may not host {bad[:10]}"
                        + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
                        + f" (allowed: {self.clients.text or 'none'})")
        return None


class AllowListConflict(AuthError):
    """Certificates in the allow-list folder that contradict each other (two files with the
    same key, or a name inside that is not the file's): at the broker's start the operator
    must fix the folder."""


@dataclass
class AllowList:
    """The public certificates of the nodes a broker admits, keyed by raw public key.

    Each file NAME.key must hold the certificate named NAME (the name inside is the node's
    identity, so it must be the file's and hence unique), and no public key may be in two
    files. A file that breaks either rule is refused with one line naming both files:

    * at the first load (the broker's start) as an AllowListConflict, raised;
    * on a reload (the folder changed), logged; what was loaded stays: a new file whose key
      is already loaded from another file, or whose name inside is not its file's (another
      node's name, ``server``...), is refused, and the genuine entry stays. Two new files
      with one key are both refused (neither was admitted before). A loaded file rewritten
      with a new key (``fedbus keygen NAME --force``) takes the new key (logged).
    """

    directory: Path
    by_key: dict[bytes, AllowEntry] = field(default_factory=dict)  # raw 32-byte key
    by_name: dict[str, AllowEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # refusals of the last (re)load
    _sig: tuple = ()
    _loaded: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> AllowList:
        """Load the folder; AllowListConflict if files contradict each other."""
        d = Path(directory)
        if not d.is_dir():
            raise AuthError(f"allow-list folder {d} does not exist")
        al = cls(d)
        al.refresh(force=True)
        return al

    def _signature(self) -> tuple:
        out = []
        try:
            with os.scandir(self.directory) as it:
                for e in it:
                    if e.name.endswith(PUBLIC_SUFFIX):
                        try:
                            st = e.stat()
                        except OSError:
                            continue
                        out.append((e.name, st.st_mtime_ns, st.st_size))
        except OSError:
            return ()
        return tuple(sorted(out))

    def refresh(self, force: bool = False) -> bool:
        """Re-read the folder if it changed; True if it was re-read. On the first load a
        conflict raises AllowListConflict; later ones are logged (see the class doc)."""
        log = get_logger("broker.auth")
        with self._lock:
            sig = self._signature()
            if sig == self._sig and not force:
                return False
            first = not self._loaded
            by_key, problems = self._read(sig, self.by_key if not first else {})
            if first and problems:
                raise AllowListConflict(
                    f"allow-list folder {self.directory}: " + "; ".join(problems)
                    + " (fix the folder: each NAME.key must hold the certificate named NAME, "
                    "and each public key one file; `fedbus keygen --list` shows them)")
            for p in problems:
                log.warning("allow-list certificate refused", folder=str(self.directory),
                            reason=p)
            if not first:
                old = {e.path: e for e in self.by_key.values()}
                for e in by_key.values():
                    o = old.get(e.path)
                    if o is not None and o.public != e.public:
                        log.warning("allow-list entry has a new key", name=e.name, file=e.path)
            by_name = {e.name: e for e in by_key.values()}
            self.by_key, self.by_name, self._sig = by_key, by_name, sig
            self.problems, self._loaded = problems, True
        servers = sorted(e.path for e in by_name.values() if e.role == "server")
        log.info("allow-list loaded", folder=str(self.directory), nodes=len(by_name),
                 servers=len(servers), refused=len(problems))
        if len(servers) > 1:
            log.warning("more than one server key is allow-listed: each may register as the "
                        "server while no other is live", files=servers)
        if not by_name:
            log.warning("the allow-list is empty: no node can connect", folder=str(self.directory))
        return True

    def _read(self, sig: tuple, loaded: dict[bytes, AllowEntry]
              ) -> tuple[dict[bytes, AllowEntry], list[str]]:
        """The entries of the folder's files (sig) and the reasons files were refused;
        `loaded` (the entries in use) wins a key collision with a new file."""
        log = get_logger("broker.auth")
        stems = {fname[:-len(PUBLIC_SUFFIX)]: fname for fname, _m, _s in sig}
        problems: list[str] = []
        candidates: dict[bytes, list[tuple[str, AllowEntry]]] = {}
        for fname, _m, _s in sig:
            path = self.directory / fname
            stem = fname[:-len(PUBLIC_SUFFIX)]
            try:
                cert = read_certificate(path)
                if cert.role == "broker":
                    continue  # the broker's own public key, kept beside the others
                entry = AllowEntry(cert.name, cert.role, AddressSet(cert.clients),
                                   cert.public, str(path))
                raw = z85.decode(cert.public)
            except AuthError as e:
                log.warning("allow-list entry skipped", file=str(path), reason=str(e))
                continue
            if cert.name != stem:
                other = stems.get(cert.name)
                problems.append(
                    f"{path} holds the certificate named {cert.name!r}, not {stem!r}"
                    + (f", the name of {self.directory / other}" if other else "")
                    + ": refused (a certificate's name must be its file's)")
                continue
            candidates.setdefault(raw, []).append((fname, entry))
        by_key: dict[bytes, AllowEntry] = {}
        for raw, group in candidates.items():
            if len(group) == 1:
                by_key[raw] = group[0][1]
                continue
            files = [str(self.directory / f) for f, _e in group]
            prev = loaded.get(raw)
            keep = next((e for _f, e in group if prev is not None and e.path == prev.path), None)
            if keep is not None:
                by_key[raw] = keep
                others = [f for f in files if f != keep.path]
                problems.append(f"{', '.join(others)} holds the public key of {keep.path} "
                                f"({keep.name!r}, loaded before): refused, {keep.path} stays")
            else:
                problems.append(f"{' and '.join(files)} hold the same public key: all refused "
                                "(a key is one node's)")
        return by_key, problems

    def entry(self, name: str) -> AllowEntry | None:
        return self.by_name.get(name)

    def entry_for_key(self, key: bytes | str | None) -> AllowEntry | None:
        """The entry of a public key (raw 32 bytes, or z85 text as the ZAP User-Id carries
        it), or None."""
        if not key:
            return None
        if isinstance(key, str):
            key = key.encode("ascii", "replace")
        if len(key) == 40:
            try:
                key = z85.decode(key)
            except (ValueError, TypeError, KeyError, IndexError, struct.error):
                return None
        return self.by_key.get(key)


# --------------------------------------------------------------------------- key bundles
@dataclass(frozen=True)
class BrokerCurve:
    """What a Broker needs for CURVE: its keypair (z85) and the allow-list."""

    public: bytes
    secret: bytes
    allow: AllowList
    name: str = BROKER_KEY


@dataclass(frozen=True)
class PeerCurve:
    """What a Peer needs for CURVE: its keypair, its name (= the key's name) and the broker's
    public key (all z85)."""

    name: str
    public: bytes
    secret: bytes
    broker_public: bytes
    role: str = "client"
    clients: str = ""

    def __repr__(self) -> str:  # never print the secret
        return f"PeerCurve(name={self.name!r}, role={self.role!r})"


def _secret_cert(directory: Path, name: str, hint: str) -> Certificate:
    path = directory / f"{name}{SECRET_SUFFIX}"
    if not path.exists():
        raise AuthError(f"no secret key {path}: create it with `fedbus keygen {name} "
                        f"{hint}--dir {directory}`")
    cert = read_certificate(path)
    if cert.secret is None:
        raise AuthError(f"{path} holds no secret-key")
    try:
        mode = path.stat().st_mode
        if mode & 0o077:
            get_logger("broker.auth").warning(
                "secret key file is readable by other users: chmod 600 it", file=str(path),
                mode=oct(mode & 0o777))
    except OSError:
        pass
    return cert


def load_broker_curve(keys_dir: str | os.PathLike, *, name: str = BROKER_KEY,
                      allow_dir: str | os.PathLike | None = None) -> BrokerCurve:
    """The broker's keypair (keys_dir/NAME.key_secret) and the allow-list (allow_dir, default
    keys_dir)."""
    d = Path(keys_dir)
    cert = _secret_cert(d, name, "--role broker ")
    if cert.role != "broker":
        raise AuthError(f"{cert.path}: role is {cert.role!r}, a broker needs a broker key")
    return BrokerCurve(cert.public, cert.secret, AllowList.load(allow_dir or d), name)


def load_peer_curve(keys_dir: str | os.PathLike, name: str, *,
                    broker_key: str | os.PathLike | None = None) -> PeerCurve:
    """A node's keypair (keys_dir/NAME.key_secret) and the broker's public key (broker_key,
    default keys_dir/broker.key)."""
    d = Path(keys_dir)
    cert = _secret_cert(d, name, "--role client --clients IDS ")
    if cert.role == "broker":
        raise AuthError(f"{cert.path} is a broker key, not a node's")
    bpath = Path(broker_key) if broker_key else d / f"{BROKER_KEY}{PUBLIC_SUFFIX}"
    if not bpath.exists():
        raise AuthError(f"no broker public key {bpath}: copy the broker's "
                        f"{BROKER_KEY}{PUBLIC_SUFFIX} there")
    bcert = read_certificate(bpath)
    return PeerCurve(cert.name, cert.public, cert.secret, bcert.public, cert.role, cert.clients)


def find_node_key(keys_dir: str | os.PathLike) -> str:
    """The name of the only node (server/client) secret key in keys_dir; AuthError if there is
    none or more than one."""
    d = Path(keys_dir)
    names = []
    for path in sorted(d.glob(f"*{SECRET_SUFFIX}")):
        try:
            cert = read_certificate(path)
        except AuthError:
            continue
        if cert.role != "broker":
            names.append(cert.name)
    if len(names) != 1:
        raise AuthError(f"{d} holds {len(names)} node secret keys "
                        f"({', '.join(names[:5]) or 'none'}): say which with --key NAME")
    return names[0]


def peer_routing_id(name: str) -> bytes:
    """A Peer's zmq routing id under CURVE: its name plus 64 random bits, drawn once per Peer.

    The broker binds a routing id to the key that registered it; the random part, which
    travels only inside the encrypted handshake, keeps another key holder from taking the
    routing id over (ROUTER_HANDOVER) and receiving this node's messages.
    """
    return f"{name[:200]}#{os.urandom(8).hex()}".encode()


def is_loopback(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// endpoints on a loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):]
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    else:
        host = host.rsplit(":", 1)[0]
    host = host.split(";")[-1]  # tcp://src;dst form: the bound address is the last
    return host in ("localhost", "::1", "lo") or host.startswith("127.")


# --------------------------------------------------------------------------- ZAP
class ZapHandler:
    """A ZAP (RFC 27) handler on inproc://zeromq.zap.01 of a zmq Context, in its own thread.

    CURVE requests are accepted iff the client's public key is in the allow-list; the reply's
    User-Id is that key in z85 (40 characters), which the broker reads from a message's
    metadata at registration to find the key's certificate (AllowList.entry_for_key). Every
    other request is refused. Refusals are logged (at most 5 lines a second).
    """

    def __init__(self, ctx: zmq.Context, allow: AllowList, *, watch: zmq.Socket | None = None):
        self.allow = allow
        self.log = get_logger("broker.auth")
        self.n_accepted = 0
        self.n_refused = 0
        self._stop = threading.Event()
        self._logged = (0.0, 0)
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        # handshakes that never reach ZAP (a plaintext node: mechanism mismatch) are seen by a
        # socket monitor on the watched (broker) socket, read in this same thread
        self.monitor = None
        if watch is not None:
            self.monitor = watch.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.thread = threading.Thread(target=self._run, name="fedbus-zap", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        sock, mon = self.sock, self.monitor
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if mon is not None:
            poller.register(mon, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                try:
                    events = dict(poller.poll(100))
                    if mon is not None and mon in events:
                        self._on_monitor(mon)
                    if sock not in events:
                        continue
                    req = sock.recv_multipart()
                except zmq.ZMQError:
                    break
                try:
                    reply = self.answer(req)
                except Exception as e:  # noqa: BLE001 -- it must answer every request
                    self.log.error("ZAP handler error", error=f"{type(e).__name__}: {e}")
                    reply = [b"1.0", req[1] if len(req) > 1 else b"", b"500",
                             b"internal error", b"", b""]
                try:
                    sock.send_multipart(reply)
                except zmq.ZMQError:
                    break
        finally:
            sock.close(0)
            if mon is not None:
                mon.close(0)

    def _on_monitor(self, mon: zmq.Socket) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while mon.poll(0):
            ev = recv_monitor_message(mon)
            if ev["event"] & (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                self._refused(ev["endpoint"].decode("utf-8", "replace"),
                              "handshake failed: a plaintext (or non-CURVE, or malformed) peer "
                              f"({getattr(ev['value'], 'name', None) or ev['value']})", None)

    def answer(self, req: list[bytes]) -> list[bytes]:
        """The reply frames to one ZAP request."""
        if len(req) < 6 or req[0] != b"1.0":
            return [b"1.0", req[1] if len(req) > 1 else b"", b"400", b"bad ZAP request", b"",
                    b""]
        _version, request_id, _domain, address, _identity, mechanism = req[:6]
        credentials = req[6:]
        peer = address.decode("utf-8", "replace")
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self._refused(peer, f"mechanism {mechanism.decode('ascii', 'replace')} refused "
                          "(this broker requires CURVE)", None)
            return [b"1.0", request_id, b"400", b"CURVE required", b"", b""]
        key = credentials[0]
        entry = self.allow.by_key.get(key)
        if entry is None and self.allow.refresh():
            entry = self.allow.by_key.get(key)
        if entry is None:
            self._refused(peer, "public key not in the allow-list", key)
            return [b"1.0", request_id, b"400", b"unknown key", b"", b""]
        self.n_accepted += 1
        self.log.info("node key accepted", name=entry.name, role=entry.role, address=peer)
        return [b"1.0", request_id, b"200", b"OK", entry.public, b""]

    def _refused(self, peer: str, reason: str, key: bytes | None) -> None:
        self.n_refused += 1
        now = time.monotonic()
        t, n = self._logged
        if now - t >= 1.0:
            t, n = now, 0
        n += 1
        self._logged = (t, n)
        if n <= 5:
            self.log.warning("connection refused", address=peer, reason=reason,
                             public_key=z85.encode(key).decode() if key else None,
                             refused_total=self.n_refused)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5.0)
