"""The fedbus wire format: one envelope, two zmq frames, msgpack everywhere, no pickle.

See broker/PROTOCOL.md for the byte-level specification. In short, a message is

    frame 0  header: a msgpack map {"v", "kind", "src", "dst", "run", "round", "seq", "inc", "ts"}
    frame 1  body:   msgpack of any value; numpy arrays / torch tensors as ext type 1

The broker decodes only the header (cheaply, with a cache of validated header prefixes) and
forwards the body frame untouched. Bodies are decoded by a bounded, zero-copy decoder: arrays
come back as read-only ``np.frombuffer`` views of the received frame.

Every rejection raises :class:`WireError` (a ``ValueError``) with a precise message.
"""
from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

__all__ = [
    "ARRAY_EXT",
    "BROADCAST",
    "BROKER",
    "DATA_ALIGN",
    "DEFAULT_MAX_FRAME",
    "KINDS",
    "MAX_DEPTH_C",
    "MAX_HEADER_BYTES",
    "MAX_NDIM",
    "MAX_STR_BYTES",
    "PROTOCOL_VERSION",
    "RESERVED_ADDRESSES",
    "SERVER",
    "Message",
    "WireError",
    "body_digest",
    "decode",
    "decode_body",
    "frame_view",
    "decode_header",
    "encode",
    "encode_body",
    "encode_header",
    "header_fields",
]

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME = 64 * 1024 * 1024
MAX_HEADER_BYTES = 2048  # a header frame is never larger than this (4 strings x 255 B + 60 B)
MAX_STR_BYTES = 255  # kind, src, dst, run: at most 255 bytes of UTF-8 each
MAX_DEPTH_C = 1024  # body nesting depth: the stack of msgpack's C parser
MAX_NDIM = 32  # array rank, as numpy's own limit
ARRAY_EXT = 1  # msgpack ext type code of an array

BROKER = "broker"
SERVER = "server"
BROADCAST = "*"
RESERVED_ADDRESSES = frozenset({BROKER, SERVER, BROADCAST, ""})

# The message kinds. The engine may add kinds later only through this set (PROTOCOL.md §4).
KINDS = frozenset(
    {
        "register",
        "ready",
        "heartbeat",
        "ack",
        "task",
        "update",
        "merged",
        "eval",
        "eval_result",
        "error",
        "shutdown",
        "join",
        "leave",
        "config",
    }
)

_HEADER_KEYS = ("v", "kind", "src", "dst", "run", "round", "seq", "inc", "ts")
_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1


class WireError(ValueError):
    """A frame or a value that cannot be encoded/decoded by the fedbus wire codec."""


# --------------------------------------------------------------------------- Message
@dataclass
class Message:
    """One fedbus message: the envelope fields and the decoded body.

    ``frames`` holds the two raw frames as sent (bytes, set by :func:`encode`) or as received
    (header bytes and the body buffer exactly as handed to :func:`decode` -- bytes, memoryview
    or zmq.Frame -- so that arrays in ``body`` stay zero-copy views of it).
    """

    kind: str
    src: str
    dst: str
    body: Any = None
    run: str = ""
    round: int = -1
    seq: int = 0
    inc: int = 0
    ts: float = 0.0
    frames: list | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Total wire size of the two frames (0 if the message was never encoded/decoded)."""
        if not self.frames:
            return 0
        return sum(_nbytes(f) for f in self.frames)

    def header(self) -> dict:
        """The envelope as the header map (without the body)."""
        return {
            "v": PROTOCOL_VERSION,
            "kind": self.kind,
            "src": self.src,
            "dst": self.dst,
            "run": self.run,
            "round": self.round,
            "seq": self.seq,
            "inc": self.inc,
            "ts": self.ts,
        }


def _nbytes(f) -> int:
    if isinstance(f, memoryview):
        return f.nbytes
    return len(f)


# --------------------------------------------------------------------------- header
# Canonical header encoding (what every fedbus sender writes; PROTOCOL.md §2.1):
#   fixmap(9), then the pairs in this order with these value encodings:
#   "v": fixint 1 | "kind","src","dst","run": str (fixstr or str8) |
#   "round": int64 (0xd3) | "seq": uint64 (0xcf) | "inc": uint64 (0xcf) | "ts": float64 (0xcb)
# The last four pairs therefore have a fixed width of 53 bytes (the "tail"). Receivers accept
# any valid msgpack map with the right keys/types; canonical headers just decode faster.
_PREFIX_START = b"\x89\xa1v\x01\xa4kind"
_K_SRC = b"\xa3src"
_K_DST = b"\xa3dst"
_K_RUN = b"\xa3run"
_T_ROUND = b"\xa5round\xd3"
_T_SEQ = b"\xa3seq\xcf"
_T_INC = b"\xa3inc\xcf"
_T_TS = b"\xa2ts\xcb"
_TAIL = struct.Struct(">7sq5sQ5sQ4sd")
_TAIL_LEN = _TAIL.size  # 53
# the tail's keys and round only (the broker's check: seq/inc/ts are any 8 bytes)
_TAIL_KEYS_ONLY = struct.Struct(">7sq5s8x5s8x4s8x")
_TAIL_KEYS = (_T_ROUND, _T_SEQ, _T_INC, _T_TS)

# validated prefix bytes -> (kind, src, dst, run); bounded, cleared when full
_PREFIX_CACHE: dict[bytes, tuple[str, str, str, str]] = {}
_PREFIX_CACHE_MAX = 16384
# (kind, src, dst, run) -> prefix bytes, for encoding
_ENC_CACHE: dict[tuple[str, str, str, str], bytes] = {}


def _mp_str(s: str, what: str) -> bytes:
    if type(s) is not str:
        raise WireError(f"header field {what!r} must be str, got {type(s).__name__}")
    b = s.encode("utf-8")
    n = len(b)
    if n < 32:
        return bytes((0xA0 | n,)) + b
    if n <= MAX_STR_BYTES:
        return b"\xd9" + bytes((n,)) + b
    raise WireError(f"header field {what!r} is {n} bytes of UTF-8 (max {MAX_STR_BYTES})")


def _encode_prefix(kind: str, src: str, dst: str, run: str) -> bytes:
    key = (kind, src, dst, run)
    p = _ENC_CACHE.get(key)
    if p is None:
        if kind not in KINDS:
            raise WireError(f"unknown message kind {kind!r}")
        if not src:
            raise WireError("header field 'src' must not be empty")
        if not dst:
            raise WireError("header field 'dst' must not be empty")
        p = (
            _PREFIX_START
            + _mp_str(kind, "kind")
            + _K_SRC
            + _mp_str(src, "src")
            + _K_DST
            + _mp_str(dst, "dst")
            + _K_RUN
            + _mp_str(run, "run")
        )
        if len(_ENC_CACHE) >= _PREFIX_CACHE_MAX:
            _ENC_CACHE.clear()
        _ENC_CACHE[key] = p
    return p


def encode_header(
    kind: str, src: str, dst: str, *, run: str = "", round: int = -1, seq: int = 0, inc: int = 0,
    ts: float = 0.0,
) -> bytes:
    """The canonical header frame for these envelope fields."""
    prefix = _encode_prefix(kind, src, dst, run)
    if type(round) is not int or not -1 <= round <= _I64_MAX:
        raise WireError(f"header field 'round' must be an int in [-1, 2**63), got {round!r}")
    if type(seq) is not int or not 0 <= seq < _U64:
        raise WireError(f"header field 'seq' must be an int in [0, 2**64), got {seq!r}")
    if type(inc) is not int or not 0 <= inc < _U64:
        raise WireError(f"header field 'inc' must be an int in [0, 2**64), got {inc!r}")
    try:
        ts = float(ts)
    except (TypeError, ValueError):
        raise WireError(f"header field 'ts' must be a float, got {ts!r}") from None
    return prefix + _TAIL.pack(_T_ROUND, round, _T_SEQ, seq, _T_INC, inc, _T_TS, ts)


def _to_bytes(buf) -> bytes:
    if type(buf) is bytes:
        return buf
    b = getattr(buf, "bytes", None)  # zmq.Frame
    if isinstance(b, bytes):
        return b
    try:
        return bytes(buf)
    except TypeError:
        raise WireError(f"a frame must be bytes-like, got {type(buf).__name__}") from None


def header_fields(
    buf, *, max_frame: int = DEFAULT_MAX_FRAME
) -> tuple[str, str, str, str, int, int, int, float]:
    """Decode and validate a header frame; return (kind, src, dst, run, round, seq, inc, ts).

    The broker's hot path: a canonical header whose prefix (v, kind, src, dst, run) has been
    seen before costs one dict lookup and one struct unpack.
    """
    b = buf if type(buf) is bytes else _to_bytes(buf)
    n = len(b)
    if _TAIL_LEN < n <= MAX_HEADER_BYTES and n <= max_frame:
        f = _PREFIX_CACHE.get(b[:-_TAIL_LEN])
        if f is not None:
            k1, rnd, k2, seq, k3, inc, k4, ts = _TAIL.unpack_from(b, n - _TAIL_LEN)
            if k1 == _T_ROUND and k2 == _T_SEQ and k3 == _T_INC and k4 == _T_TS and rnd >= -1:
                return f + (rnd, seq, inc, ts)
    return _header_slow(b, max_frame)


def _header_slow(b: bytes, max_frame: int):
    n = len(b)
    if n == 0:
        raise WireError("empty header frame")
    if n > max_frame:
        raise WireError(f"header frame of {n} bytes exceeds max_frame={max_frame}")
    if n > MAX_HEADER_BYTES:
        raise WireError(f"header frame of {n} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(
            b,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_STR_BYTES,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises a zoo of ValueError/TypeError/StackError/...
        raise WireError(f"header is not a valid msgpack map: {type(e).__name__}: {e}") from None
    if type(h) is not dict:
        raise WireError(f"header must be a msgpack map, got {type(h).__name__}")
    v = h.get("v")
    if type(v) is not int:
        raise WireError(f"header field 'v' missing or not an int: {v!r}")
    if v != PROTOCOL_VERSION:
        raise WireError(f"unsupported protocol version {v} (this is version {PROTOCOL_VERSION})")
    if len(h) != len(_HEADER_KEYS) or any(k not in h for k in _HEADER_KEYS):
        missing = [k for k in _HEADER_KEYS if k not in h]
        extra = [k for k in h if k not in _HEADER_KEYS]
        raise WireError(f"header keys wrong: missing {missing}, unexpected {extra}")
    kind, src, dst, run = h["kind"], h["src"], h["dst"], h["run"]
    for name, val in (("kind", kind), ("src", src), ("dst", dst), ("run", run)):
        if type(val) is not str:
            raise WireError(f"header field {name!r} must be str, got {type(val).__name__}")
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    if not src:
        raise WireError("header field 'src' must not be empty")
    if not dst:
        raise WireError("header field 'dst' must not be empty")
    rnd, seq, inc, ts = h["round"], h["seq"], h["inc"], h["ts"]
    if type(rnd) is not int or not -1 <= rnd <= _I64_MAX:
        raise WireError(f"header field 'round' must be an int in [-1, 2**63), got {rnd!r}")
    if type(seq) is not int or not 0 <= seq < _U64:
        raise WireError(f"header field 'seq' must be an int in [0, 2**64), got {seq!r}")
    if type(inc) is not int or not 0 <= inc < _U64:
        raise WireError(f"header field 'inc' must be an int in [0, 2**64), got {inc!r}")
    if type(ts) is int:
        ts = float(ts)
    elif type(ts) is not float:
        raise WireError(f"header field 'ts' must be a float, got {type(ts).__name__}")
    out = (kind, src, dst, run, rnd, seq, inc, ts)
    # Remember canonical prefixes so the next header from this stream takes the fast path.
    if n > _TAIL_LEN:
        prefix = b[:-_TAIL_LEN]
        try:
            canonical = _encode_prefix(kind, src, dst, run) == prefix and _TAIL.pack(
                _T_ROUND, rnd, _T_SEQ, seq, _T_INC, inc, _T_TS, ts
            ) == b[-_TAIL_LEN:]
        except (WireError, struct.error):
            canonical = False
        if canonical:
            if len(_PREFIX_CACHE) >= _PREFIX_CACHE_MAX:
                _PREFIX_CACHE.clear()
            _PREFIX_CACHE[prefix] = (kind, src, dst, run)
    return out


def decode_header(buf, *, max_frame: int = DEFAULT_MAX_FRAME) -> dict:
    """Decode and validate a header frame into the header map (WireError if invalid)."""
    kind, src, dst, run, rnd, seq, inc, ts = header_fields(buf, max_frame=max_frame)
    return {
        "v": PROTOCOL_VERSION,
        "kind": kind,
        "src": src,
        "dst": dst,
        "run": run,
        "round": rnd,
        "seq": seq,
        "inc": inc,
        "ts": ts,
    }


# --------------------------------------------------------------------------- arrays
# dtype code -> numpy dtype (always little-endian on the wire)
_CODE_DTYPE: dict[int, np.dtype] = {
    1: np.dtype("?"),
    2: np.dtype("<i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<u1"),
    7: np.dtype("<u2"),
    8: np.dtype("<u4"),
    9: np.dtype("<u8"),
    10: np.dtype("<f2"),
    11: np.dtype("<f4"),
    12: np.dtype("<f8"),
    13: np.dtype("<c8"),
    14: np.dtype("<c16"),
}
_KIND_SIZE_CODE: dict[tuple[str, int], int] = {(d.kind, d.itemsize): c for c, d in _CODE_DTYPE.items()}
_ARR_HEAD = struct.Struct("<BB")
_U64LE = struct.Struct("<Q")
DATA_ALIGN = 64  # array data offsets in the body frame are multiples of this
_MAX_EXT = 2 + 8 * MAX_NDIM + 8
_LITTLE = np.dtype("=i4").str[0] == "<"


def _supported_dtypes() -> str:
    return ", ".join(str(d) for d in _CODE_DTYPE.values())


def _as_wire_array(a: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(C-contiguous little-endian array, ext header without the offset) or WireError."""
    dt = a.dtype
    code = None
    if dt.fields is None and dt.subdtype is None:
        code = _KIND_SIZE_CODE.get((dt.kind, dt.itemsize))
    if code is None:
        raise WireError(f"cannot encode array of dtype {dt} (supported: {_supported_dtypes()})")
    if a.ndim > MAX_NDIM:
        raise WireError(f"cannot encode array of rank {a.ndim} (max {MAX_NDIM})")
    if dt.byteorder == ">" or (dt.byteorder == "=" and not _LITTLE):
        a = a.astype(dt.newbyteorder("<"))
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would turn a 0-d array into 1-d)
    head = _ARR_HEAD.pack(code, a.ndim) + struct.pack(f"<{a.ndim}Q", *a.shape)
    return a, head


def _to_numpy(obj) -> np.ndarray | None:
    """Duck-typed torch.Tensor -> numpy (never imports torch); None if obj is no tensor."""
    detach = getattr(obj, "detach", None)
    if detach is None or not callable(detach) or not hasattr(obj, "numpy"):
        return None
    t = detach()
    if hasattr(t, "resolve_conj"):
        t = t.resolve_conj()
    if hasattr(t, "resolve_neg"):
        t = t.resolve_neg()
    if hasattr(t, "cpu"):
        t = t.cpu()
    try:
        return np.asarray(t.numpy())
    except Exception as e:  # e.g. bfloat16 has no numpy dtype
        raise WireError(f"cannot encode tensor of dtype {getattr(t, 'dtype', '?')}: {e}") from None


def _scalar(obj):
    """numpy scalar -> plain Python number/str/bytes, or raise WireError for anything else."""
    if isinstance(obj, np.generic):
        if isinstance(obj, (np.complexfloating, np.void, np.datetime64, np.timedelta64)):
            raise WireError(f"cannot encode numpy scalar of type {type(obj).__name__}")
        return obj.item()
    raise WireError(f"cannot encode object of type {type(obj).__module__}.{type(obj).__qualname__}")


# --------------------------------------------------------------------------- body
def encode_body(obj: Any) -> bytes:
    """Encode a body: the msgpack document, then the 64-byte aligned array data section.

    Deterministic: the same value gives the same bytes (dict order is kept). Tuples become
    lists, numpy scalars plain numbers, arrays/tensors C-contiguous little-endian data.
    """
    arrays: list[np.ndarray] = []
    heads: list[bytes] = []

    def first(o):
        a = o if isinstance(o, np.ndarray) else _to_numpy(o)
        if a is None:
            return _scalar(o)
        a, head = _as_wire_array(a)
        arrays.append(a)
        heads.append(head)
        return msgpack.ExtType(ARRAY_EXT, head + b"\0\0\0\0\0\0\0\0")

    doc = _packb(obj, first)
    if not arrays:
        return doc
    # second pass: the document length is now known, so the data offsets are too
    offsets = []
    pos = len(doc)
    for a in arrays:
        pos = -(-pos // DATA_ALIGN) * DATA_ALIGN
        offsets.append(pos)
        pos += a.nbytes
    exts = iter(
        [msgpack.ExtType(ARRAY_EXT, h + _U64LE.pack(off)) for h, off in zip(heads, offsets)]
    )

    def second(o):
        if isinstance(o, np.generic):
            return o.item()
        return next(exts)

    doc2 = _packb(obj, second)
    if len(doc2) != len(doc):  # cannot happen: ext payload sizes do not depend on offsets
        raise WireError("internal error: body document changed size between passes")
    parts = [doc2]
    cur = len(doc2)
    for a, off in zip(arrays, offsets):
        if off > cur:
            parts.append(bytes(off - cur))
        if a.nbytes:
            parts.append(a.reshape(-1).view(np.uint8).data)
        cur = off + a.nbytes
    return b"".join(parts)


def _packb(obj, default) -> bytes:
    try:
        return msgpack.packb(obj, default=default, use_bin_type=True, datetime=False)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise WireError(f"cannot encode body: {type(e).__name__}: {e}") from None


def frame_view(buf) -> memoryview:
    """A received frame (zmq.Frame, bytes, memoryview) as a flat byte view, no copy."""
    return _view(buf)


def _view(buf) -> memoryview:
    b = getattr(buf, "buffer", None)  # zmq.Frame
    mv = b if isinstance(b, memoryview) else None
    if mv is None:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise WireError(f"a frame must be bytes-like, got {type(buf).__name__}") from None
    if mv.ndim != 1 or mv.format != "B":
        try:
            mv = mv.cast("B")
        except TypeError:
            raise WireError("a frame must be a contiguous byte buffer") from None
    return mv if mv.readonly else mv.toreadonly()


_FIRST_FEED = 65536


def _unpack_stream(mv: memoryview, n: int, hook):
    """Parse the document at the start of a large frame without copying the data section."""
    up = msgpack.Unpacker(
        ext_hook=hook, raw=False, strict_map_key=False, use_list=True, max_buffer_size=n,
        max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2, max_ext_len=_MAX_EXT,
    )
    end = _FIRST_FEED
    up.feed(mv[:end])
    while True:
        try:
            obj = up.unpack()
            return obj, up.tell()
        except msgpack.OutOfData:
            if end >= n:
                raise WireError("body truncated: the msgpack document is incomplete") from None
            nxt = min(n, end * 4)
            up.feed(mv[end:nxt])
            end = nxt


def decode_body(buf, *, max_frame: int = DEFAULT_MAX_FRAME) -> Any:
    """Decode a body frame. Arrays are read-only zero-copy views of ``buf``.

    Bounded: the frame must be <= max_frame bytes; msgpack lengths are capped by the frame
    size; nesting is capped by msgpack's parser stack (MAX_DEPTH_C); array data must lie in
    the data section after the document. Raises WireError on any problem.
    """
    mv = _view(buf)
    n = mv.nbytes
    if n > max_frame:
        raise WireError(f"body frame of {n} bytes exceeds max_frame={max_frame}")
    if n == 0:
        raise WireError("empty body frame")
    spans: list[tuple[int, int]] = []

    def hook(code: int, data: bytes):
        if code != ARRAY_EXT:
            raise WireError(f"unknown msgpack ext type {code}")
        k = len(data)
        if k < 10:
            raise WireError(f"array ext of {k} bytes is shorter than its 10-byte minimum")
        dcode, ndim = _ARR_HEAD.unpack_from(data, 0)
        dt = _CODE_DTYPE.get(dcode)
        if dt is None:
            raise WireError(f"array ext has unknown dtype code {dcode}")
        if ndim > MAX_NDIM:
            raise WireError(f"array ext has rank {ndim} (max {MAX_NDIM})")
        if k != 10 + 8 * ndim:
            raise WireError(f"array ext of rank {ndim} must be {10 + 8 * ndim} bytes, got {k}")
        shape = struct.unpack_from(f"<{ndim}Q", data, 2)
        (off,) = _U64LE.unpack_from(data, 2 + 8 * ndim)
        count = math.prod(shape)
        nbytes = count * dt.itemsize
        if off > n or nbytes > n - off:
            raise WireError(
                f"array data [{off}, {off}+{nbytes}) of shape {shape} {dt} is outside the "
                f"{n}-byte body frame"
            )
        if any(s > _I64_MAX for s in shape):  # only possible when another dim is 0
            raise WireError(f"array ext has an impossible shape {shape}")
        spans.append((off, nbytes))
        if count == 0:
            a = np.empty(shape, dtype=dt)
            a.flags.writeable = False
            return a
        a = np.frombuffer(mv, dtype=dt, count=count, offset=off)
        return a if ndim == 1 else a.reshape(shape)

    try:
        if n <= _FIRST_FEED:
            # small frame: one C call; a data section shows up as ExtraData
            try:
                obj = msgpack.unpackb(
                    mv, ext_hook=hook, raw=False, strict_map_key=False, use_list=True,
                    max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n // 2,
                    max_ext_len=_MAX_EXT,
                )
                doc_end = n
            except msgpack.ExtraData as e:
                obj = e.unpacked
                doc_end = n - len(e.extra)
        else:
            obj, doc_end = _unpack_stream(mv, n, hook)
    except WireError:
        raise
    except msgpack.StackError:
        raise WireError(f"body nested deeper than {MAX_DEPTH_C}") from None
    except UnicodeDecodeError as e:
        raise WireError(f"body has a str that is not valid UTF-8: {e.reason}") from None
    except Exception as e:  # msgpack's FormatError/ValueError/TypeError/..., numpy errors
        raise WireError(f"malformed body: {type(e).__name__}: {e}") from None
    # the data section: arrays in document order, after the document, no overlap, no tail
    last = doc_end
    for off, nbytes in spans:
        if off < last:
            raise WireError(
                f"array data at offset {off} overlaps the document or a previous array "
                f"(which end at {last})"
            )
        last = off + nbytes
    if last != n:
        raise WireError(f"body has {n - last} trailing bytes after its last value")
    return obj


# --------------------------------------------------------------------------- message
def encode(msg: Message) -> list[bytes]:
    """Encode a Message into its two frames; sets ``msg.frames`` and returns it."""
    hdr = encode_header(
        msg.kind, msg.src, msg.dst, run=msg.run, round=msg.round, seq=msg.seq, inc=msg.inc,
        ts=msg.ts,
    )
    frames = [hdr, encode_body(msg.body)]
    msg.frames = frames
    return frames


def decode(frames: Sequence, *, max_frame: int = DEFAULT_MAX_FRAME) -> Message:
    """Decode two frames (bytes, memoryview or zmq.Frame) into a Message (WireError if bad)."""
    try:
        nf = len(frames)
    except TypeError:
        raise WireError("frames must be a sequence of two buffers") from None
    if nf != 2:
        raise WireError(f"a message has 2 frames, got {nf}")
    hdr = _to_bytes(frames[0])
    kind, src, dst, run, rnd, seq, inc, ts = header_fields(hdr, max_frame=max_frame)
    body = decode_body(frames[1], max_frame=max_frame)
    return Message(kind, src, dst, body, run, rnd, seq, inc, ts, [hdr, frames[1]])


def body_digest(frames: Sequence) -> str:
    """sha256 (hex) of the body frame of a message's frames."""
    f = frames[1]
    b = getattr(f, "buffer", None)
    return hashlib.sha256(b if b is not None else f).hexdigest()
