"""The message log on disk: round trip, torn tails after a crash, corruption
named by record and offset, and appending after a torn tail."""
from __future__ import annotations

import hashlib
import json
import struct
import zlib

import msgpack
import pytest

from fedbus.broker.wire import Message, decode, encode
from fedbus.record.msglog import MAGIC, LogCorrupt, MessageLogWriter, read_log, scan


def _message(kind: str, src: str, dst: str, round_: int, seq: int, body: dict) -> Message:
    msg = Message(kind, src, dst, body, "run1", round_, seq, 0, 1.5)
    encode(msg)
    return msg


def _header(msg: Message) -> dict:
    return {"kind": msg.kind, "src": msg.src, "dst": msg.dst, "round": msg.round,
            "seq": msg.seq}


MESSAGES = [
    ("in", _message("join", "broker", "server", -1, 0, {"role": "client", "clients": ["c0"]})),
    ("out", _message("task", "server", "c0", 0, 1, {"task": 1, "payload": {"w": b"x" * 300}})),
    ("tick", None),
    ("in", _message("update", "c0", "server", 0, 2, {"task": 1, "payload": {"w": b"y" * 500}})),
    ("out", _message("shutdown", "server", "*", 1, 3, {"reason": "run complete"})),
]


def _write_log(folder, messages=MESSAGES) -> list[dict]:
    w = MessageLogWriter(folder)
    for i, (direction, msg) in enumerate(messages):
        if msg is None:
            w.write(direction, 100.0 + i, [])
        else:
            w.write(direction, 100.0 + i, msg.frames, _header(msg))
    w.close()
    return _index(folder)


def _index(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "messages.jsonl").read_text().splitlines()]


def _drop_index_lines_from(folder, i: int) -> None:
    lines = (folder / "messages.jsonl").read_text().splitlines(keepends=True)
    (folder / "messages.jsonl").write_text("".join(lines[:i]))


def test_round_trip_records_and_index(tmp_path):
    index = _write_log(tmp_path)
    records, end = scan(tmp_path / "messages.bin")
    assert end == (tmp_path / "messages.bin").stat().st_size
    assert [r.direction for r in records] == ["in", "out", "tick", "in", "out"]
    assert [r.index for r in records] == [0, 1, 2, 3, 4]
    assert [r.time for r in records] == [100.0, 101.0, 102.0, 103.0, 104.0]
    for rec, (direction, msg) in zip(records, MESSAGES):
        if msg is None:
            assert rec.frames == []
            continue
        assert rec.frames == [bytes(f) for f in msg.frames]
        again = decode(rec.frames)
        assert (again.kind, again.src, again.dst, again.round) == \
            (msg.kind, msg.src, msg.dst, msg.round)
        assert again.body == msg.body
    # one index line per record, pointing at it, with the body's digest
    assert [e["i"] for e in index] == [0, 1, 2, 3, 4]
    assert [e["off"] for e in index] == [r.offset for r in records]
    assert records[0].offset == len(MAGIC)
    assert [e["kind"] for e in index] == ["join", "task", "tick", "update", "shutdown"]
    assert [e["dir"] for e in index] == ["in", "out", "tick", "in", "out"]
    task = index[1]
    assert (task["src"], task["dst"], task["round"], task["seq"]) == ("server", "c0", 0, 1)
    assert task["bytes"] == records[1].nbytes
    assert task["sha256"] == hashlib.sha256(records[1].frames[1]).hexdigest()
    assert index[2]["sha256"] == "" and index[2]["bytes"] == 0
    assert [r.index for r in read_log(tmp_path)] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("keep", [3, 7, -5], ids=["in-header", "in-payload", "last-bytes"])
def test_torn_tail_the_index_does_not_list_is_ignored(tmp_path, keep):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    size = path.stat().st_size
    last = index[-1]["off"]
    cut = last + keep if keep > 0 else size + keep
    path.write_bytes(path.read_bytes()[:cut])
    _drop_index_lines_from(tmp_path, 4)  # the killed process never wrote its line
    records, end = scan(path)
    assert len(records) == 4 and end == last
    assert records[-1].direction == "in"


def test_torn_tail_with_a_torn_index_line_is_ignored(tmp_path):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    path.write_bytes(path.read_bytes()[:index[-1]["off"] + 20])
    lines = (tmp_path / "messages.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "messages.jsonl").write_text("".join(lines[:4]) + lines[4][:9])
    records, _ = scan(path)
    assert len(records) == 4


def test_flipped_byte_in_a_middle_record_is_corruption_named_by_index_and_offset(tmp_path):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    data = bytearray(path.read_bytes())
    off = index[1]["off"]
    data[off + 8 + 100] ^= 0x01  # inside the task's payload
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt) as err:
        scan(path)
    assert f"record 1 at offset {off}" in str(err.value)
    assert "checksum" in str(err.value)
    # the index plays no part in this verdict
    (tmp_path / "messages.jsonl").unlink()
    with pytest.raises(LogCorrupt, match=f"record 1 at offset {off}"):
        scan(path)


def test_flipped_byte_in_the_last_record_the_index_lists_is_corruption(tmp_path):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=f"record 4 at offset {index[4]['off']}"):
        scan(path)


@pytest.mark.parametrize("keep", [3, 40], ids=["in-header", "in-payload"])
def test_truncated_record_that_the_index_lists_is_corruption(tmp_path, keep):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    off = index[-1]["off"]
    path.write_bytes(path.read_bytes()[:off + keep])
    with pytest.raises(LogCorrupt, match=f"record 4 at offset {off}"):
        scan(path)


def test_checksummed_record_that_does_not_parse_is_corruption(tmp_path):
    _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    junk = b"\xc1\xc1\xc1"  # msgpack's never-used byte
    with open(path, "ab") as f:
        f.write(struct.pack("<II", len(junk), zlib.crc32(junk)) + junk)
    with pytest.raises(LogCorrupt, match="record 5"):
        scan(path)


def test_length_past_the_end_in_the_middle_is_caught_by_the_index(tmp_path):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    data = bytearray(path.read_bytes())
    off = index[2]["off"]
    struct.pack_into("<I", data, off, 1 << 30)  # a length that runs past the end
    path.write_bytes(bytes(data))
    with pytest.raises(LogCorrupt, match=f"record 2 at offset {off}"):
        scan(path)


def test_bad_magic(tmp_path):
    _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    path.write_bytes(b"NOTALOG!" + path.read_bytes()[8:])
    with pytest.raises(LogCorrupt, match="bad magic"):
        scan(path)
    (tmp_path / "other.bin").write_bytes(b"FBLOG2\n\x00")
    with pytest.raises(LogCorrupt, match="bad magic"):
        scan(tmp_path / "other.bin")
    (tmp_path / "other.bin").write_bytes(MAGIC[:3] + b"x")
    with pytest.raises(LogCorrupt, match="bad magic"):
        scan(tmp_path / "other.bin")


@pytest.mark.parametrize("cut", [0, 3, 7])
def test_a_log_read_or_cut_before_its_magic_is_whole_is_empty(tmp_path, cut):
    """A reader polling a live run can open the log between its creation and the magic's
    write, and a kill can cut it there: no records, not a corrupt log; appending to it
    starts it again."""
    path = tmp_path / "messages.bin"
    path.write_bytes(MAGIC[:cut])
    assert scan(path) == ([], 0)
    assert list(read_log(tmp_path)) == []
    w = MessageLogWriter(tmp_path, append=True)
    msg = _message("task", "server", "c1", 1, 9, {"task": 2})
    w.write("out", 1.0, msg.frames, _header(msg))
    w.close()
    records, end = scan(path)
    assert path.read_bytes()[:len(MAGIC)] == MAGIC and end == path.stat().st_size
    assert [r.frames for r in records] == [msg.frames]


def test_append_after_a_torn_tail_truncates_it_and_continues(tmp_path):
    index = _write_log(tmp_path)
    path = tmp_path / "messages.bin"
    good_end = index[-1]["off"]
    path.write_bytes(path.read_bytes()[:good_end + 11])  # torn last record
    # the killed process also lost its unflushed index lines, and left half a line
    lines = (tmp_path / "messages.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "messages.jsonl").write_text("".join(lines[:2]) + lines[2][:7])

    w = MessageLogWriter(tmp_path, append=True)
    assert w.count == 4
    w.write("resume", 200.0, [b"", b"checkpoint"])
    msg = _message("task", "server", "c1", 1, 9, {"task": 2})
    w.write("out", 201.0, msg.frames, _header(msg))
    w.close()

    records, end = scan(path)
    assert end == path.stat().st_size
    assert [r.direction for r in records] == ["in", "out", "tick", "in", "resume", "out"]
    assert records[4].offset == good_end
    assert records[4].frames == [b"", b"checkpoint"]
    assert decode(records[5].frames).dst == "c1"
    # the index is whole again: one parseable line per record, in order
    again = _index(tmp_path)
    assert [e["i"] for e in again] == list(range(6))
    assert [e["off"] for e in again] == [r.offset for r in records]
    assert again[:4] == index[:4]
    assert [e["kind"] for e in again[4:]] == ["resume", "task"]
    assert again[5]["dst"] == "c1" and again[5]["round"] == 1


def test_append_to_a_whole_log_keeps_every_record(tmp_path):
    index = _write_log(tmp_path)
    w = MessageLogWriter(tmp_path, append=True)
    w.write("tick", 300.0, [])
    w.close()
    records, _ = scan(tmp_path / "messages.bin")
    assert len(records) == 6 and records[-1].direction == "tick"
    assert _index(tmp_path)[:5] == index


def test_a_fresh_writer_replaces_an_old_log(tmp_path):
    _write_log(tmp_path)
    w = MessageLogWriter(tmp_path)
    w.write("tick", 1.0, [])
    w.close()
    assert len(scan(tmp_path / "messages.bin")[0]) == 1
    assert len(_index(tmp_path)) == 1


def test_every_record_reaches_the_file_before_close(tmp_path):
    """A SIGKILL loses no whole record: each is written unbuffered."""
    w = MessageLogWriter(tmp_path)
    for i in range(3):
        w.write("tick", float(i), [])
    records, _ = scan(tmp_path / "messages.bin")  # not closed, not flushed
    assert len(records) == 3
    w.close()


def test_payload_is_msgpack_direction_time_frames(tmp_path):
    """The documented layout, so other tools can read the log."""
    _write_log(tmp_path)
    data = (tmp_path / "messages.bin").read_bytes()
    assert data[:8] == MAGIC
    length, crc = struct.unpack_from("<II", data, 8)
    payload = data[16:16 + length]
    assert zlib.crc32(payload) == crc
    direction, t, *frames = msgpack.unpackb(payload, raw=False)
    assert direction == "in" and t == 100.0 and len(frames) == 2
