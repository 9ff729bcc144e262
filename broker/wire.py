"""The fedbus wire format: one envelope, two zmq frames, msgpack everywhere, no pickle.

See broker/PROTOCOL.md for the byte-level specification. In short, a message is

    frame 0  header: a msgpack map {"v", "kind", "src", "dst", "run", "round", "seq", "inc", "ts"}
    frame 1  body:   msgpack of any value; numpy arrays / torch tensors as ext type 1

The broker decodes only the header (cheaply, with a cache of validated header prefixes) and
forwards the body frame untouched. Bodies are decoded by a bounded, zero-copy decoder: arrays
come back as read-only ``np.frombuffer`` views of the received frame; nesting is capped at
MAX_DEPTH levels and a body at MAX_ITEMS values, so a frame of N bytes cannot turn into more
than a bounded number of Python objects (PROTOCOL.md §8).

Every rejection raises :class:`WireError` (a ``ValueError``) with a precise message.
"""
from __future__ import annotations

import gc
import hashlib
import math
import struct
import sys
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
    "MAX_DEPTH",
    "MAX_DEPTH_C",
    "MAX_HEADER_BYTES",
    "MAX_ITEMS",
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
MAX_DEPTH_C = 1024  # the stack of msgpack's C parser (measured at import, below)
# A body nests lists/maps at most this deep: real bodies need 5 or 6 (a merged update:
# body -> members -> member -> work map; a config: body -> config -> section -> table), and
# code that walks a body recursively must stay far from Python's recursion limit (1000).
MAX_DEPTH = 32
# A body holds at most this many msgpack values: every list item, map key and map value,
# nested or not, counts one (an array ext counts one, whatever its size). 1 Mi values is
# about 6 times a 10,000-member merged update (~160 k values), and bounds what one frame can
# allocate as Python objects (73 MiB at worst: a million empty maps) whatever its size.
MAX_ITEMS = 1 << 20
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
        "tasks",
        "update",
        "updates",
        "merged",
        "eval",
        "evals",
        "eval_result",
        "error",
        "shutdown",
        "join",
        "leave",
        "config",
        "secagg",
        "flush",
        "flushed",
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
        # memoryview, not bytes(): bytes(5) would be five zero bytes, not an error
        return memoryview(buf).tobytes()
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
_WIRE_DTYPES = frozenset(_CODE_DTYPE.values())  # as they travel: little-endian
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


def body_size(obj: Any) -> int:
    """len(encode_body(obj)) without building the body: the document once, the data
    section's size from the arrays' lengths and alignment. A batch's member is charged
    this, its size as its own message would carry it (PROTOCOL.md §4.3)."""
    sizes: list[int] = []

    def first(o):
        a = o if isinstance(o, np.ndarray) else _to_numpy(o)
        if a is None:
            return _scalar(o)
        if a.dtype not in _WIRE_DTYPES or a.ndim > MAX_NDIM:
            # the encoder's own check: it refuses what encode_body refuses (a big-endian
            # array passes, converted, at the same size)
            a, _ = _as_wire_array(a)
        sizes.append(a.dtype.itemsize * a.size)
        return msgpack.ExtType(ARRAY_EXT, bytes(2 + 8 * a.ndim + 8))

    pos = len(_packb(obj, first))
    for n in sizes:
        pos = -(-pos // DATA_ALIGN) * DATA_ALIGN + n
    return pos


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


_FIRST_FEED = 65536  # frames up to this size are parsed first, then depth-checked


def _probe_c_stack() -> int:
    """How many nested arrays msgpack's C parser holds (1024 in msgpack 1.x), or 0 if it
    holds more than 65,536 (then depth is checked by walking the decoded value instead)."""

    def fits(k: int) -> bool:
        up = msgpack.Unpacker(max_buffer_size=k + 16)
        up.feed(b"\x91" * k + b"\xc0")
        try:
            up.skip()
        except Exception:  # StackError
            return False
        return True

    lo, hi = 1, 1 << 16
    if fits(hi) or not fits(lo):
        return 0
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


_C_STACK = _probe_c_stack()
if _C_STACK:
    MAX_DEPTH_C = _C_STACK
# The depth check: msgpack's parser raises StackError past _C_STACK open containers, so a
# document behind (_C_STACK - d) one-element arrays overflows it exactly when it nests
# deeper than d. Skipping (no objects built) prefix + document checks depth in C.
_WRAP = b"\x91" * _C_STACK
_CPYTHON = sys.implementation.name == "cpython"
_is_tracked = gc.is_tracked


def _depth_within(obj, limit: int) -> bool:
    """Whether obj nests lists/dicts at most `limit` deep, walking it level by level (no
    recursion). Only used where msgpack's parser cannot check depth (see _C_STACK).

    On CPython a dict is tracked by the garbage collector only if it holds a list or dict
    (or another collected object; arrays are not), so an untracked dict is a leaf."""
    t = type(obj)
    if t is not dict and t is not list:
        return True
    if limit < 1:
        return False
    level = [obj]
    depth = 1
    while True:
        nxt = []
        for o in level:
            if type(o) is dict:
                if _CPYTHON and not _is_tracked(o):
                    continue
                vals = o.values()
            else:
                vals = o
            for v in vals:
                tv = type(v)
                if tv is list or tv is dict:
                    nxt.append(v)
        if not nxt:
            return True
        depth += 1
        if depth > limit:
            return False
        level = nxt


# every list/map header starts with one of these bytes: fixmap, fixarray, array16/32, map16/32
_CONTAINER_BYTES = bytes(range(0x80, 0xA0)) + b"\xdc\xdd\xde\xdf"
_OTHER_BYTES = bytes(b for b in range(256) if b not in _CONTAINER_BYTES)


def _check_small_depth(obj, mv: memoryview, n: int, doc_end: int, max_depth: int) -> None:
    """WireError if obj, just parsed from the document mv[:doc_end] of a small frame, nests
    deeper than max_depth. Each level of nesting takes a header byte, so a short document
    with at most max_depth bytes that could start a header is shallow enough; otherwise
    msgpack's parser tells (Unpacker.skip behind wrapper arrays, in C)."""
    if doc_end <= 4096:
        doc = mv[:doc_end].tobytes()
        if len(doc.translate(None, _OTHER_BYTES)) <= max_depth:
            return
    if _prefix_len(max_depth) is None:
        if not _depth_within(obj, max_depth):
            raise WireError(_too_deep(max_depth))
        return
    _skip_document(mv, n, doc_end, max_depth)  # raises StackError if too deep


def _prefix_len(max_depth: int) -> int | None:
    """Wrapper arrays that make msgpack's parser enforce max_depth; None if it cannot."""
    if not _C_STACK or max_depth >= _C_STACK:
        return None if not _C_STACK else 0
    return _C_STACK - max(max_depth, 0)


def _skip_document(mv: memoryview, n: int, doc_end: int | None, max_depth: int) -> int:
    """Parse the document at the start of the frame without building it (Unpacker.skip, in
    C): its end offset; StackError if it nests deeper than max_depth, WireError if it is
    truncated. It is fed in growing chunks, so little of the data section is copied."""
    p = _prefix_len(max_depth) or 0
    limit = n if doc_end is None else doc_end
    up = msgpack.Unpacker(max_buffer_size=limit + p + 16)
    if p:
        up.feed(_WRAP[:p])
    end = min(limit, 16384)
    up.feed(mv[:end])
    while True:
        try:
            up.skip()
            return up.tell() - p
        except msgpack.OutOfData:
            if end >= limit:
                raise WireError("body truncated: the msgpack document is incomplete") from None
            nxt = min(limit, end * 4)
            up.feed(mv[end:nxt])
            end = nxt


# Bytes taken by a msgpack value's own encoding, by its first byte (a list/map header counts
# only itself: its items follow as values of their own); 0: variable (str/bin/ext 8/16/32,
# whose length follows) or never used (0xc1).
_SIZE = [0] * 256
for _t in range(256):
    if _t < 0xA0 or _t >= 0xE0 or _t in (0xC0, 0xC2, 0xC3):
        _SIZE[_t] = 1
    elif _t < 0xC0:
        _SIZE[_t] = 1 + (_t & 0x1F)  # fixstr
for _t, _k in {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5,
               0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18, 0xDC: 3, 0xDD: 5, 0xDE: 3,
               0xDF: 5}.items():
    _SIZE[_t] = _k
del _t, _k
# first byte -> (bytes of the length, extra bytes before the payload: ext's type code)
_VAR = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),
        0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}


def _count_values(mv: memoryview, end: int, limit: int) -> int:
    """The number of msgpack values in mv[:end] (a well-formed document), counting no
    further than limit + 1: a linear scan of the encoding, nothing built."""
    size = _SIZE
    pos = count = 0
    while pos < end:
        count += 1
        if count > limit:
            break
        t = mv[pos]
        k = size[t]
        if k:
            pos += k
            continue
        w, x = _VAR[t]
        pos += 1 + w + x + int.from_bytes(mv[pos + 1:pos + 1 + w], "big")
    return count


def _too_deep(max_depth: int) -> str:
    return f"body nested deeper than {min(max_depth, MAX_DEPTH_C)} levels of lists/maps"


def decode_body(buf, *, max_frame: int = DEFAULT_MAX_FRAME, max_depth: int = MAX_DEPTH,
                max_items: int = MAX_ITEMS) -> Any:
    """Decode a body frame. Arrays are read-only zero-copy views of ``buf``.

    Bounded (PROTOCOL.md §8): the frame must be <= max_frame bytes; lists and maps nest at
    most max_depth levels; the document holds at most max_items values (list items, map
    keys and values), each str/bin no longer than the frame; array data must lie in the
    data section after the document. So a frame becomes at most max_items Python objects
    (besides str/bin payloads the size of the frame and zero-copy arrays). Frames above
    64 KiB are checked before anything is built: msgpack's parser skips the document in C
    behind wrapper arrays that leave it max_depth levels of stack, and a document longer
    than max_items bytes (a value takes at least one byte) has its values counted by a scan
    of its encoding; smaller frames (at most 64 Ki values) are depth-checked right after
    parsing. Raises WireError on any problem.
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
        if n <= _FIRST_FEED and n <= max_items:
            # small frame: one C call, at most n values; a data section shows up as ExtraData
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
            t = type(obj)
            if (t is list or t is dict) and not (t is dict and _CPYTHON and max_depth >= 1
                                                 and not _is_tracked(obj)):
                _check_small_depth(obj, mv, n, doc_end, max_depth)
        else:
            doc_end = _skip_document(mv, n, None, max_depth)
            if doc_end > max_items and _count_values(mv, doc_end, max_items) > max_items:
                raise WireError(f"body holds more than {max_items} values (list items, map "
                                f"keys and map values)")
            obj = msgpack.unpackb(
                mv[:doc_end], ext_hook=hook, raw=False, strict_map_key=False, use_list=True,
                max_str_len=n, max_bin_len=n, max_array_len=min(n, max_items),
                max_map_len=min(n // 2, max_items // 2), max_ext_len=_MAX_EXT,
            )
            if _prefix_len(max_depth) is None and not _depth_within(obj, max_depth):
                raise WireError(_too_deep(max_depth))
    except WireError:
        raise
    except msgpack.StackError:
        raise WireError(_too_deep(max_depth)) from None
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
