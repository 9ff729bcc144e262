"""Long-term signing identities of client nodes for secure aggregation against a server,
broker or relay that lies (Bonawitz et al. CCS 2017, the active-adversary variant).

Each client node has an Ed25519 key pair beside its CurveZMQ certificate in the keys folder:

    NAME.sign         public: the node's name, the client addresses it hosts (those of its
                      NAME.key certificate) and its Ed25519 verification key. Every client
                      node reads every NAME.sign of its keys folder.
    NAME.sign_secret  the Ed25519 private key (mode 0600). It stays on the node's machine.

`fedbus keygen NAME --clients ...` and the local run's keys (fedbus run with bus.curve) write
both. A node signs each round's key advertisement (context, client, c_pk, s_pk) and the
survivor set it is told with the key of the node hosting the client; every receiving client
verifies with the key the .sign file covering the sender's address names. The server,
broker and relays never hold a signing key and forward signatures opaquely, so they cannot
forge one: the guarantee rests on each node's copy of the .sign files having come from the
nodes themselves (distributed with the keys folder), not through the server. A .sign file
whose client set differs from its NAME.key certificate's, or two .sign files covering one
address, are refused at load.

Messages signed (all fields length-prefixed; the context is "fedbus-secagg/RUN/ROUND", so
a signature of another run or round does not verify):

    advert_message(context, client, c_pk, s_pk)
    survivors_message(context, survivors)
"""
from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from fedbus.broker.log import get_logger

if TYPE_CHECKING:  # the cryptography package is the privacy extra's: imported on use
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

__all__ = [
    "SIGNATURE_BYTES",
    "Identity",
    "IdentityError",
    "advert_message",
    "load_identity",
    "signed_dropout_refusal",
    "survivors_message",
    "write_signing_key",
]

log = get_logger("fedbus.identity")

SIGN_SUFFIX = ".sign"
SIGN_SECRET_SUFFIX = ".sign_secret"
SIGNATURE_BYTES = 64
_ADVERT_LABEL = b"fedbus-secagg advert v1"
_SURVIVORS_LABEL = b"fedbus-secagg survivors v1"


class IdentityError(ValueError):
    """A signing-key file that cannot be used (one line, naming the file)."""


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


def advert_message(context: bytes, client: int, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client's key advertisement signature covers."""
    return b"".join((_field(_ADVERT_LABEL), _field(context), struct.pack("<q", client),
                     _field(c_pk), _field(s_pk)))


def survivors_message(context: bytes, survivors: Iterable[int]) -> bytes:
    """What a survivor's consistency signature covers: the round's whole survivor set."""
    ids = sorted(int(v) for v in survivors)
    return b"".join((_field(_SURVIVORS_LABEL), _field(context), struct.pack("<I", len(ids)),
                     *(struct.pack("<q", v) for v in ids)))


class Identity:
    """A node's signing key and the verification keys of every client it may meet.

    verifier(client) -> the Ed25519 public key of the node hosting `client`, or None when
    none is known (its advertisements are then refused)."""

    def __init__(self, signer: Ed25519PrivateKey,
                 verifier: Callable[[int], Ed25519PublicKey | None]):
        self._signer = signer
        self._verifier = verifier

    @classmethod
    def from_keys(cls, signer: Ed25519PrivateKey,
                  verifiers: Mapping[int, Ed25519PublicKey]) -> Identity:
        table = dict(verifiers)
        return cls(signer, table.get)

    def sign(self, message: bytes) -> bytes:
        return self._signer.sign(message)

    def verify(self, client: int, signature: object, message: bytes) -> str | None:
        """None if `signature` is `client`'s on `message`, else why not (one phrase)."""
        if signature is None:
            return "it carries no signature"
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            return f"its signature is not {SIGNATURE_BYTES} bytes"
        try:
            key = self._verifier(int(client))
        except IdentityError as err:
            return str(err)
        if key is None:
            return "no verification key is known for it (no NAME.sign covers it)"
        from cryptography.exceptions import InvalidSignature

        try:
            key.verify(signature, message)
        except InvalidSignature:
            return "its signature does not verify"
        return None


def signed_dropout_refusal(cfg) -> str | None:
    """Why a config cannot run signed secure aggregation, or None: every signing client
    refuses a threshold below floor(2m/3)+1 of its m holders (threshold-too-low), which
    needs privacy.secagg_dropout below 1/3."""
    if float(cfg.privacy.secagg_dropout) >= 1 / 3:
        return (f"privacy.secagg_dropout = {cfg.privacy.secagg_dropout}: signed secure "
                "aggregation (bus.curve) needs a threshold above 2/3 of a client's holders, "
                "so secagg_dropout below 1/3")
    return None


def write_signing_key(directory: str | os.PathLike, name: str, clients: str, *,
                      force: bool = False) -> tuple[Path, Path]:
    """NAME.sign (public) and NAME.sign_secret (0600) in directory; -> their paths."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub, sec = d / f"{name}{SIGN_SUFFIX}", d / f"{name}{SIGN_SECRET_SUFFIX}"
    if not force:
        for p in (pub, sec):
            if p.exists():
                raise IdentityError(f"{p} exists (pass --force to replace it)")
    key = Ed25519PrivateKey.generate()
    tmp = sec.with_name(sec.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"name = {name}\ned25519-secret = {key.private_bytes_raw().hex()}\n")
    os.replace(tmp, sec)
    tmp = pub.with_name(pub.name + ".tmp")
    tmp.write_text(f"name = {name}\nclients = {clients}\n"
                   f"ed25519 = {key.public_key().public_bytes_raw().hex()}\n")
    os.replace(tmp, pub)
    return pub, sec


def _fields(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as err:
        raise IdentityError(f"{path}: {err.strerror}") from None
    for line in text.splitlines():
        if line.strip():
            key, sep, value = line.partition("=")
            if not sep:
                raise IdentityError(f"{path}: line {line[:40]!r} is not 'key = value'")
            out[key.strip()] = value.strip()
    return out


def _hex32(path: Path, fields: Mapping[str, str], key: str) -> bytes:
    try:
        raw = bytes.fromhex(fields.get(key, ""))
    except ValueError:
        raw = b""
    if len(raw) != 32:
        raise IdentityError(f"{path}: {key} must be 32 bytes in hex")
    return raw


def load_identity(keys_dir: str | os.PathLike, name: str) -> Identity | None:
    """NAME's signing identity from keys_dir, or None when it has no NAME.sign_secret (the
    run is then protected against an honest-but-curious server only). Every NAME.sign of
    the folder is a verifier; IdentityError for a file that cannot be used."""
    d = Path(keys_dir)
    secret_path = d / f"{name}{SIGN_SECRET_SUFFIX}"
    if not secret_path.exists():
        return None
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from fedbus.broker.auth import PUBLIC_SUFFIX, AddressSet, AuthError, read_certificate
    if secret_path.stat().st_mode & 0o077:
        log.warning("signing key file is readable by other users: chmod 600 it",
                    file=str(secret_path))
    signer = Ed25519PrivateKey.from_private_bytes(
        _hex32(secret_path, _fields(secret_path), "ed25519-secret"))
    entries: list[tuple[str, object, Ed25519PublicKey]] = []
    for path in sorted(d.glob(f"*{SIGN_SUFFIX}")):
        fields = _fields(path)
        stem = path.name[:-len(SIGN_SUFFIX)]
        if fields.get("name") != stem:
            raise IdentityError(f"{path}: names {fields.get('name')!r}, not {stem!r}")
        clients = fields.get("clients", "")
        cert = d / f"{stem}{PUBLIC_SUFFIX}"
        try:
            if cert.exists() and read_certificate(cert).clients != clients:
                raise IdentityError(f"{path} lists clients {clients!r}, its certificate "
                                    f"{cert.name} {read_certificate(cert).clients!r}")
            addresses = AddressSet(clients)
        except AuthError as err:
            raise IdentityError(f"{path}: {err}") from None
        entries.append((stem, addresses,
                        Ed25519PublicKey.from_public_bytes(_hex32(path, fields, "ed25519"))))
    if not any(stem == name for stem, _, _ in entries):
        raise IdentityError(f"{d / (name + SIGN_SUFFIX)} is missing beside its secret")
    cache: dict[int, Ed25519PublicKey | None] = {}

    def verifier(client: int) -> Ed25519PublicKey | None:
        if client not in cache:
            found = [(stem, key) for stem, addresses, key in entries
                     if f"c{client}" in addresses]  # type: ignore[operator]
            if len(found) > 1:
                raise IdentityError(f"c{client} is covered by {found[0][0]}{SIGN_SUFFIX} and "
                                    f"{found[1][0]}{SIGN_SUFFIX}: one node hosts a client")
            cache[client] = found[0][1] if found else None
        return cache[client]

    return Identity(signer, verifier)
