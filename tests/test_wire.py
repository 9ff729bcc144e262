"""The wire codec: envelope, body, arrays (zero-copy), determinism, bounded decoding."""
from __future__ import annotations

import hashlib
import math
import random
import struct

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedbus.broker import wire
from fedbus.broker.wire import Message, WireError

DTYPES = ["?", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8"]


def roundtrip(obj, **kw):
    return wire.decode_body(wire.encode_body(obj), **kw)


def same(a, b) -> bool:
    """Structural equality where arrays compare by dtype, shape and values (NaN == NaN)."""
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------------------- envelope
def test_message_roundtrip_and_fields():
    m = Message("update", "c7", "server", {"x": [1, 2.5, "s", None, True, b"\x00\x01"]},
                run="run-1", round=12, seq=3, inc=(1 << 63) - 1, ts=1712345678.25)
    frames = wire.encode(m)
    assert m.frames is frames and len(frames) == 2
    assert m.nbytes == len(frames[0]) + len(frames[1])
    d = wire.decode(frames)
    assert (d.kind, d.src, d.dst, d.run, d.round, d.seq, d.inc, d.ts) == (
        "update", "c7", "server", "run-1", 12, 3, (1 << 63) - 1, 1712345678.25)
    assert d.body == m.body
    assert wire.decode_header(frames[0]) == {
        "v": 1, "kind": "update", "src": "c7", "dst": "server", "run": "run-1", "round": 12,
        "seq": 3, "inc": (1 << 63) - 1, "ts": 1712345678.25}
    # the header is a plain msgpack map any msgpack library reads
    assert msgpack.unpackb(frames[0])["kind"] == "update"
    assert wire.body_digest(frames) == hashlib.sha256(frames[1]).hexdigest()


def test_decode_accepts_frames_of_any_buffer_type():
    frames = wire.encode(Message("task", "server", "c0", {"a": np.arange(3)}))
    for conv in (bytes, bytearray, memoryview, zmq.Frame):
        d = wire.decode([conv(frames[0]), conv(frames[1])])
        assert d.kind == "task" and list(d.body["a"]) == [0, 1, 2]


def test_noncanonical_header_is_accepted():
    h = msgpack.packb({"v": 1, "kind": "task", "src": "server", "dst": "c0", "run": "",
                       "round": 2, "seq": 5, "inc": 9, "ts": 1})  # small ints, int ts
    assert wire.decode_header(h) == {"v": 1, "kind": "task", "src": "server", "dst": "c0",
                                     "run": "", "round": 2, "seq": 5, "inc": 9, "ts": 1.0}


def test_canonical_header_fast_path_matches_slow_path():
    h = wire.encode_header("eval", "server", "c1", run="r", round=0, seq=1, inc=2, ts=3.0)
    first = wire.header_fields(h)  # slow path, caches the prefix
    h2 = wire.encode_header("eval", "server", "c1", run="r", round=4, seq=99, inc=2, ts=5.0)
    assert wire.header_fields(h2) == ("eval", "server", "c1", "r", 4, 99, 2, 5.0)
    assert first == ("eval", "server", "c1", "r", 0, 1, 2, 3.0)
    # a cached prefix with a broken tail still goes through full validation
    bad = bytearray(h2)
    bad[-11] ^= 0xFF  # inside the "ts" key (the tail starts at -53, "ts" at -12)
    with pytest.raises(WireError):
        wire.header_fields(bytes(bad))


def _hdr(**over):
    h = {"v": 1, "kind": "task", "src": "server", "dst": "c0", "run": "", "round": -1,
         "seq": 1, "inc": 1, "ts": 0.0}
    h.update(over)
    return h


@pytest.mark.parametrize("header, reason", [
    ({k: v for k, v in _hdr().items() if k != "dst"}, "missing ['dst']"),
    ({**_hdr(), "extra": 1}, "unexpected ['extra']"),
    (_hdr(v=2), "unsupported protocol version 2"),
    (_hdr(v="1"), "'v' missing or not an int"),
    (_hdr(kind="teleport"), "unknown message kind 'teleport'"),
    (_hdr(kind=5), "'kind' must be str"),
    (_hdr(src=""), "'src' must not be empty"),
    (_hdr(dst=b"c0"), "'dst' must be str"),
    (_hdr(run=None), "'run' must be str"),
    (_hdr(round=-2), "'round' must be an int"),
    (_hdr(round=1.5), "'round' must be an int"),
    (_hdr(seq=-1), "'seq' must be an int"),
    (_hdr(inc="x"), "'inc' must be an int"),
    (_hdr(ts="now"), "'ts' must be a float"),
    (_hdr(ts=True), "'ts' must be a float"),
    (_hdr(src="x" * 300), "not a valid msgpack map"),
    ([1, 2, 3], "must be a msgpack map, got list"),
    ("header", "must be a msgpack map"),
])
def test_bad_headers_raise_wire_error_with_reason(header, reason):
    with pytest.raises(WireError) as e:
        wire.decode_header(msgpack.packb(header))
    assert reason in str(e.value)


def test_header_size_and_frame_count_limits():
    with pytest.raises(WireError, match="exceeds 2048"):
        wire.decode_header(b"\x89" + b"\x00" * 3000)
    with pytest.raises(WireError, match="empty header"):
        wire.decode_header(b"")
    frames = wire.encode(Message("task", "server", "c0", None))
    with pytest.raises(WireError, match="2 frames, got 1"):
        wire.decode(frames[:1])
    with pytest.raises(WireError, match="2 frames, got 3"):
        wire.decode(frames + [b""])
    with pytest.raises(WireError):
        wire.encode(Message("nope", "a", "b"))
    with pytest.raises(WireError):
        wire.encode(Message("task", "", "b"))


def test_kinds_cover_the_protocol():
    assert {"register", "ready", "heartbeat", "ack", "task", "update", "eval", "eval_result",
            "error", "shutdown", "join", "leave"} <= wire.KINDS
    assert isinstance(WireError("x"), ValueError)


# ---------------------------------------------------------------------------- arrays
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hnp.arrays(dtype=st.sampled_from(DTYPES),
                  shape=hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=6)))
def test_array_roundtrip(a):
    b = roundtrip({"a": a})["a"]
    assert isinstance(b, np.ndarray)
    assert b.dtype == a.dtype and b.shape == a.shape
    assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    assert not b.flags.writeable


scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
           | st.binary(max_size=20))
small_arrays = hnp.arrays(dtype=st.sampled_from(DTYPES),
                          shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
values = st.recursive(
    scalars | small_arrays,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), children, max_size=5),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_nested_roundtrip(v):
    assert same(v, roundtrip(v))


@settings(max_examples=200, deadline=None)
@given(values)
def test_encoding_is_deterministic(v):
    assert wire.encode_body(v) == wire.encode_body(v)


@settings(max_examples=200, deadline=None)
@given(values)
def test_body_size_is_the_encoded_length(v):
    """A batch member's charged bytes (PROTOCOL.md §4.3) are its body's, computed without
    encoding it."""
    assert wire.body_size(v) == len(wire.encode_body(v))


def test_body_size_of_layouts_and_refusals():
    for v in ({"t": np.arange(12, dtype=">i4").reshape(3, 4).T}, [np.zeros(0), np.float32(1)],
              {"a": [np.ones((2, 3), np.float16)] * 3, "b": {"c": np.array(True)}}):
        assert wire.body_size(v) == len(wire.encode_body(v))
    for bad in (np.zeros(2, dtype=[("a", "<i4")]), np.array(["2026-12-07"], "datetime64[D]"),
                np.array([1, "x"], dtype=object)):
        with pytest.raises(WireError, match="dtype"):  # what encode_body refuses, alike
            wire.encode_body({"x": bad})
        with pytest.raises(WireError, match="dtype"):
            wire.body_size({"x": bad})


def test_dict_order_is_kept():
    a = wire.encode_body({"x": 1, "y": 2})
    b = wire.encode_body({"y": 2, "x": 1})
    assert a != b
    assert list(wire.decode_body(a)) == ["x", "y"] and list(wire.decode_body(b)) == ["y", "x"]


def test_conversions_numpy_scalars_tuples_layouts():
    body = {
        "f32": np.float32(1.5), "i64": np.int64(-7), "u8": np.uint8(200), "b": np.bool_(True),
        "f16": np.float16(0.5), "tup": (1, (2, 3)),
        "strided": np.arange(20, dtype=np.int32)[::3],
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        "big_endian": np.arange(4, dtype=">i4"),
        "bools": np.array([True, False, True]),
        "complex": np.array([1 + 2j], dtype=np.complex64),
    }
    d = roundtrip(body)
    assert d["f32"] == 1.5 and type(d["f32"]) is float
    assert d["i64"] == -7 and type(d["i64"]) is int
    assert d["u8"] == 200 and d["b"] is True and d["f16"] == 0.5
    assert d["tup"] == [1, [2, 3]]
    assert list(d["strided"]) == list(range(0, 20, 3)) and d["strided"].dtype == np.int32
    assert np.array_equal(d["fortran"], body["fortran"]) and d["fortran"].flags.c_contiguous
    assert d["big_endian"].dtype == np.dtype("<i4") and list(d["big_endian"]) == [0, 1, 2, 3]
    assert d["bools"].dtype == np.bool_ and list(d["bools"]) == [True, False, True]
    assert d["complex"][0] == 1 + 2j
    # numpy scalars encode exactly like the plain numbers
    assert wire.encode_body(np.float64(2.0)) == wire.encode_body(2.0)
    assert wire.encode_body(np.int8(3)) == wire.encode_body(3)


@pytest.mark.parametrize("bad", [
    np.array([object()], dtype=object),
    np.zeros(2, dtype=[("a", "i4")]),
    np.array(["2024-01-01"], dtype="datetime64[D]"),
    {1, 2},
    object(),
    np.complex64(1j),
])
def test_unencodable_values_raise_wire_error(bad):
    with pytest.raises(WireError):
        wire.encode_body({"x": bad})


def test_torch_tensors_encode_like_numpy():
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert wire.encode_body({"t": t}) == wire.encode_body({"t": t.numpy()})
    g = torch.ones(2, 2, requires_grad=True) * 3  # needs detach()
    assert np.array_equal(roundtrip(g), np.full((2, 2), 3, np.float32))
    nc = t.t()  # non-contiguous
    assert np.array_equal(roundtrip(nc), t.numpy().T)
    for dt in (torch.float16, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
               torch.uint8, torch.bool):
        x = (torch.arange(6) % 2).to(dt)
        y = roundtrip(x)
        assert np.array_equal(y, x.numpy()) and y.dtype == x.numpy().dtype
    with pytest.raises(WireError, match="bfloat16"):
        wire.encode_body(torch.zeros(2, dtype=torch.bfloat16))
    # the decoded view goes back to torch without a copy
    arr = roundtrip({"p": torch.randn(10, 512)})["p"]
    back = torch.from_numpy(arr.copy())  # torch wants writable memory; copy is explicit
    assert back.shape == (10, 512)


def test_arrays_are_zero_copy_views_of_the_frame():
    protos = np.random.default_rng(0).standard_normal((10, 512)).astype(np.float32)
    body = wire.encode_body({"protos": protos, "counts": np.arange(10), "n": 3})
    buf = bytearray(body)
    d = wire.decode_body(buf)
    p = d["protos"]
    assert not p.flags.writeable and not d["counts"].flags.writeable
    raw = np.frombuffer(buf, dtype=np.uint8)
    assert np.shares_memory(p, raw) and np.shares_memory(d["counts"], raw)
    # 64-byte aligned inside the frame
    start = raw.ctypes.data
    assert (p.ctypes.data - start) % 64 == 0 and (d["counts"].ctypes.data - start) % 64 == 0
    # a view, not a copy: changing the frame changes the array
    off = p.ctypes.data - start
    buf[off:off + 4] = struct.pack("<f", 42.0)
    assert p[0, 0] == 42.0
    # the same through a zmq.Frame, which the array keeps alive
    frame = zmq.Frame(body)
    q = wire.decode_body(frame)["protos"]
    del frame
    assert np.array_equal(q, protos)
    base = q
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    assert isinstance(base.base, memoryview)


def test_large_body_is_parsed_without_copying_the_data_section():
    big = np.arange(3_000_000, dtype=np.float64)  # 24 MB: the streaming path
    body = wire.encode_body({"w": big, "meta": {"layers": list(range(50_000))}})
    d = wire.decode_body(body)
    assert np.array_equal(d["w"], big) and d["meta"]["layers"][-1] == 49_999
    assert np.shares_memory(d["w"], np.frombuffer(body, dtype=np.uint8))
    with pytest.raises(WireError, match="exceeds max_frame"):
        wire.decode_body(body, max_frame=1 << 20)


# ---------------------------------------------------------------------------- bounded decoding
def test_specific_body_rejections():
    ok = wire.encode_body({"a": np.arange(4, dtype=np.int32)})
    cases = {
        "empty body": b"",
        "trailing bytes": wire.encode_body(1) + b"\x00",
        "ext type 7": msgpack.packb(msgpack.ExtType(7, b"abc")),
        "unknown dtype code 99": msgpack.packb(msgpack.ExtType(1, bytes([99, 1]) + bytes(16))),
        "rank 40": msgpack.packb(msgpack.ExtType(1, bytes([11, 40]) + bytes(16))),
        "must be 18 bytes": msgpack.packb(msgpack.ExtType(1, bytes([11, 1]) + bytes(9))),
        "outside the": msgpack.packb(msgpack.ExtType(
            1, bytes([11, 1]) + struct.pack("<QQ", 10, 64))),
        "nested deeper than 32": b"\x91" * 2000 + b"\x01",
        "truncated": ok[:-5],
        "not valid UTF-8": b"\xa2\xff\xfe",
        "cannot fit": b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items in 5 bytes
        "overlaps": msgpack.packb([msgpack.ExtType(1, bytes([6, 1]) + struct.pack("<QQ", 4, 0)),
                                   1, 2, 3]),
    }
    for reason, frame in cases.items():
        with pytest.raises(WireError) as e:
            wire.decode_body(frame)
        msg = str(e.value)
        assert msg, reason
        if reason == "cannot fit":
            continue  # msgpack words this one itself ("... exceeds max_array_len")
        if reason == "truncated":
            assert "truncated" in msg or "trailing" in msg or "outside" in msg or \
                "incomplete" in msg, msg
            continue
        assert reason in msg, (reason, msg)


def _mutations(rng: random.Random, valid: list[bytes], max_frame: int):
    """Yield (header, body) pairs: random, truncated, oversized, bit-flipped, spliced."""
    while True:
        k = rng.randrange(6)
        h, b = rng.choice(valid)
        if k == 0:
            yield rng.randbytes(rng.randrange(0, 200)), rng.randbytes(rng.randrange(0, 400))
        elif k == 1:
            yield h[: rng.randrange(len(h))], b[: rng.randrange(len(b) + 1)]
        elif k == 2:
            yield h, rng.randbytes(max_frame + rng.randrange(1, 100))
        elif k == 3:
            hb, bb = bytearray(h), bytearray(b)
            for _ in range(rng.randrange(1, 6)):
                tgt = hb if rng.random() < 0.5 or not bb else bb
                tgt[rng.randrange(len(tgt))] ^= 1 << rng.randrange(8)
            yield bytes(hb), bytes(bb)
        elif k == 4:
            cut = rng.randrange(len(b) + 1)
            yield h, b[:cut] + rng.randbytes(rng.randrange(0, 50)) + b[cut:]
        else:
            yield b, h  # swapped frames


def test_ten_thousand_bad_frames_raise_only_wire_error():
    rng = random.Random(1234)
    max_frame = 4096
    valid = [wire.encode(Message(kind, "c1", "server", body, run="r", round=r, seq=s, inc=7))
             for kind, body, r, s in [
                 ("update", {"p": np.ones((3, 4), np.float32), "n": [1, 2, 3]}, 1, 1),
                 ("task", {"w": np.arange(10, dtype=np.int16), "e": 5, "x": "abc"}, 2, 9),
                 ("eval", [None, True, 1.5, b"raw", {"k": np.zeros(0)}], 0, 3),
                 ("error", {"code": "x", "reason": "é" * 10}, -1, 4),
             ]]
    gen = _mutations(rng, valid, max_frame)
    rejected = accepted = 0
    for _ in range(10_000):
        h, b = next(gen)
        try:
            m = wire.decode([h, b], max_frame=max_frame)
        except WireError as e:
            assert str(e)
            rejected += 1
        else:
            accepted += 1  # a mutation that is still a valid message (e.g. a flipped value)
            assert m.kind in wire.KINDS
    assert rejected > 8_000, (rejected, accepted)


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_wire_error(data):
    for fn in (wire.decode_body, wire.decode_header):
        try:
            fn(data, max_frame=256)
        except WireError:
            pass


# ---------------------------------------------------------------------------- depth and size caps
def _nested(depth: int) -> bytes:
    """A document of `depth` nested one-element lists around an int."""
    return b"\x91" * depth + b"\x01"


def _big(doc: bytes) -> bytes:
    """[doc, 70 kB bin]: a frame above 64 KiB (the path checked before anything is built),
    one level deeper than doc."""
    return b"\x92" + doc + msgpack.packb(bytes(70_000))


def _values(v) -> int:
    """How many msgpack values a decoded body holds (the unit of MAX_ITEMS)."""
    if isinstance(v, list):
        return 1 + sum(map(_values, v))
    if isinstance(v, dict):
        return 1 + sum(_values(k) + _values(x) for k, x in v.items())
    return 1


def test_depth_is_capped_far_below_the_recursion_limit():
    assert wire.MAX_DEPTH == 32 and wire.MAX_DEPTH_C == 1024
    # small frames (parsed, then checked) and large ones (checked before anything is built)
    for frame in (_nested(32), _big(_nested(31))):
        d = wire.decode_body(frame)
        assert len(repr(d)) > 32  # a recursive walk of it is fine
    for frame in (_nested(33), _nested(1000), _nested(1023), _big(_nested(32)),
                  _big(_nested(999)), _nested(5000), _big(_nested(5000))):
        with pytest.raises(WireError, match="nested deeper than 32 levels"):
            wire.decode_body(frame)
    # maps count as levels too, and the caller may ask for less
    m = msgpack.packb({"a": {"b": {"c": [1, {"d": []}]}}})  # 6 levels
    assert wire.decode_body(m, max_depth=6)["a"]["b"]["c"][1] == {"d": []}
    with pytest.raises(WireError, match="nested deeper than 5 levels"):
        wire.decode_body(m, max_depth=5)
    # bytes that look like list headers in strings, bins and array data are not nesting
    fake = {"blob": b"\x91" * 3000, "s": "\x11" * 40, "l": [[1]],
            "a": np.full(100, 0x91, np.uint8), "h": [np.full(5000, 0x91, np.uint8)]}
    d = wire.decode_body(wire.encode_body(fake))
    assert d["blob"] == fake["blob"] and d["l"] == [[1]]


def test_real_bodies_are_well_within_the_caps():
    # a relay's merged update of 10,000 members: [address, task, samples, work map] each
    work = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 10, "samples": 100,
            "stopped": "done"}
    merged = {"version": 3, "rule": "fedproto", "members": [
        [f"c{i}", i, 100, dict(work)] for i in range(10_000)],
        "payload": {"sums": np.ones((10, 64)), "mass": np.ones(10)}}
    d = wire.decode_body(wire.encode_body(merged))
    assert d["members"][-1] == ["c9999", 9999, 100, work]
    assert _values(d) < wire.MAX_ITEMS // 4
    # a config, nested a few levels
    cfg = {"run": "r", "config": {"federation": {"clients": 10, "sites": {"a": {"x": [1, 2]}}},
                                  "model": {"arch": "mlp", "layers": [[64, 32], [32, 10]]}}}
    assert wire.decode_body(wire.encode_body(cfg)) == cfg


def test_a_frame_of_empty_maps_is_refused_without_allocating_them():
    # The attack: one frame, every byte an empty map (0x80), in one array32. Unbounded, a
    # decoder builds one 64-byte dict per byte: 4.2 GB for a 64 MiB frame. Here: a max-size
    # frame (max_frame = 16 MiB) must fail fast, allocating about the frame once, no more.
    import tracemalloc
    size = 16 << 20
    frame = b"\xdd" + (size - 5).to_bytes(4, "big") + b"\x80" * (size - 5)
    assert len(frame) == size
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="more than 1048576 values"):
            wire.decode_body(frame, max_frame=size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * size, peak  # (16 M dicts would be > 1 GB)
    # the same maps, nested two deep so that no single list is long: still counted
    part = b"\xdd" + (1 << 19).to_bytes(4, "big") + b"\x80" * (1 << 19)
    with pytest.raises(WireError, match="more than 1048576 values"):
        wire.decode_body(b"\x93" + part * 3)
    # and ints that each cost a Python object (-32..-6 are not cached), in a small frame
    # with a small cap
    with pytest.raises(WireError, match="more than 1000 values"):
        wire.decode_body(b"\xdc" + (2000).to_bytes(2, "big") + b"\xe0" * 2000, max_items=1000)


def test_values_are_capped_per_body():
    cap = wire.MAX_ITEMS
    assert cap == 1 << 20
    # [{}, {}, ...]: the list and its items; cap - 1 items make exactly cap values
    ok = msgpack.packb([{}] * (cap - 1))
    assert len(wire.decode_body(ok)) == cap - 1
    for bad in (msgpack.packb([{}] * cap),                  # a list one over
                msgpack.packb({i: None for i in range(cap // 2)}),  # keys and values count
                msgpack.packb([[0] * 1000] * (cap // 1000))):   # nested
        with pytest.raises(WireError, match=f"more than {cap} values"):
            wire.decode_body(bad)
    # a long str or bin is one value, however long
    assert wire.decode_body(msgpack.packb(["x" * (4 << 20), b"y" * (4 << 20)]))[1][:1] == b"y"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_the_value_count_is_exact(v):
    # the count of values in the encoding (the scan behind max_items) is exact, on either path
    frame = wire.encode_body(v)
    c = _values(wire.decode_body(frame))
    assert same(v, wire.decode_body(frame, max_items=c))
    with pytest.raises(WireError, match=f"more than {c - 1} values"):
        wire.decode_body(frame, max_items=c - 1)


def test_the_value_scan_knows_every_msgpack_encoding():
    # every kind of header the scan must step over, as msgpack writes it
    parts = [None, True, False, 0, 127, -1, -32, 200, 60_000, 2**31, 2**63, -100, -30_000,
             -2**31, -2**63, 1.5, "", "x" * 31, "y" * 32, "z" * 300, "w" * 70_000, b"", b"b" * 300,
             b"c" * 70_000, [], [1] * 20, [2] * 70_000, {}, {"k": 1}, {i: i for i in range(20)}]
    parts += [msgpack.ExtType(5, b"e" * k) for k in (1, 2, 4, 8, 16, 3, 300, 70_000)]
    doc = msgpack.packb(parts, use_single_float=False) + msgpack.packb(
        [1.5], use_single_float=True)
    mv = memoryview(doc)
    up = msgpack.Unpacker(max_buffer_size=len(doc), ext_hook=lambda c, d: msgpack.ExtType(c, d),
                          strict_map_key=False)
    up.feed(doc)
    decoded = list(up)
    want = sum(_values(x) for x in decoded)
    assert wire._count_values(mv, len(doc), 10**9) == want
    assert wire._count_values(mv, len(doc), 10) == 11  # stops one past the limit
