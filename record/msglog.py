"""The message log: every frame a server (or, optionally, a client node)
received or sent, payload included, plus the deadline ticks that moved the
engine, so `fedbus replay` can re-execute the run.

messages.bin  8-byte magic, then records: u32 length, u32 crc32, payload.
              payload = msgpack [direction, time, frame0, frame1] where
              direction is "in", "out", "tick" (frames empty for ticks),
              "resume" (frame 1: the checkpoint resumed from) or "refused"
              (frame 1: a refusal the engine took, fedbus.node.engine.Refusal,
              or {"count": {...}} of refusals that changed only a counter; the
              refused message itself is not stored). Answers to refusals
              ("error" messages) are not logged: a replay makes them again.
messages.jsonl one JSON line per record: i, off, t, dir, kind, src, dst,
              round, seq, bytes, sha256 of the body frame.

Each record reaches the OS in one unbuffered write() before its index line is
written, and the index is flushed at least once per aggregation: so a killed
process leaves at worst a torn last record, and every indexed record is whole.
A short length, short payload or bad checksum at the end of messages.bin is a
torn write and is ignored, unless the index lists a record there, or the
damage is followed by more data: then it is corruption, reported with the
record's index and offset, never misread.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import msgpack

MAGIC = b"FBLOG1\n\x00"
_HEAD = struct.Struct("<II")
MAX_RECORD = 1 << 31


class LogCorrupt(ValueError):
    """A record before the end of the log failed its length or checksum."""


@dataclass
class Record:
    index: int
    offset: int
    direction: str  # in | out | tick | resume | refused
    time: float
    frames: list[bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(f) for f in self.frames)


class MessageLogWriter:
    def __init__(self, folder: str | Path, *, append: bool = False):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.bin_path = folder / "messages.bin"
        self.index_path = folder / "messages.jsonl"
        resume = append and self.bin_path.exists()
        records: list[Record] = []
        if resume:
            records, good_end = scan(self.bin_path)
            resume = good_end > 0  # (0: cut before its magic was whole: start it again)
            with open(self.bin_path, "r+b") as f:
                f.truncate(good_end)  # drop a torn tail before appending
        self.count = 0
        self._bin = open(self.bin_path, "ab" if resume else "wb", buffering=0)
        # The index is rebuilt from the records: a killed process may have lost its
        # last unflushed index lines, or left half a line that appending would corrupt.
        self._index = open(self.index_path, "w")
        if not resume:
            self._bin.write(MAGIC)
        for rec in records:
            self._index_line(rec.offset, rec.direction, rec.time, rec.frames,
                             _header_of(rec.frames))
        self._index.flush()

    def write(self, direction: str, time: float, frames: list[bytes] | None,
              header: dict | None = None) -> None:
        frames = [bytes(f) for f in (frames or [])]
        payload = msgpack.packb([direction, time, *frames], use_bin_type=True)
        offset = self._bin.tell()
        self._bin.write(_HEAD.pack(len(payload), zlib.crc32(payload)) + payload)
        self._index_line(offset, direction, time, frames, header)

    def _index_line(self, offset: int, direction: str, time: float, frames: list[bytes],
                    header: dict | None) -> None:
        h = header or {}
        body = frames[1] if len(frames) > 1 else b""
        self._index.write(json.dumps({
            "i": self.count, "off": offset, "t": round(time, 6), "dir": direction,
            "kind": h.get("kind", direction), "src": h.get("src", ""), "dst": h.get("dst", ""),
            "round": h.get("round", -1), "seq": h.get("seq", 0),
            "bytes": sum(len(f) for f in frames),
            "sha256": hashlib.sha256(body).hexdigest() if frames else "",
        }) + "\n")
        self.count += 1

    def flush(self) -> None:
        self._index.flush()

    def close(self) -> None:
        self.flush()
        self._bin.close()
        self._index.close()


def scan(path: str | Path) -> tuple[list[Record], int]:
    """Read every intact record; return them and the offset where intact data ends.
    Raises LogCorrupt for damage that is not at the very end of the file."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < len(MAGIC) and MAGIC.startswith(data):
        # a log just created (read between its creation and the magic's write) or cut
        # there by a kill: no records yet, like a torn last record
        return [], 0
    if not data.startswith(MAGIC):
        raise LogCorrupt(f"{path}: not a fedbus message log (bad magic)")
    records: list[Record] = []
    pos = len(MAGIC)
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            _check_torn(path, pos, len(records), "the record header is cut short")
            break  # torn header at the end
        length, crc = _HEAD.unpack_from(data, pos)
        start, end = pos + _HEAD.size, pos + _HEAD.size + length
        if length > MAX_RECORD or end > len(data):
            _check_torn(path, pos, len(records), f"length {length} runs past the end of the file")
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            if end < len(data):
                raise LogCorrupt(f"{path}: record {len(records)} at offset {pos}: "
                                 "checksum mismatch")
            _check_torn(path, pos, len(records), "checksum mismatch")
            break
        records.append(_record(payload, len(records), pos, path))
        pos = end
    return records, pos


def _record(payload: bytes, index: int, offset: int, path: Path) -> Record:
    """A checksummed record's payload, [direction, time, *frames], as a Record; LogCorrupt
    when it does not parse or holds anything else (a checksum guards against damage, not
    against a file another program wrote)."""
    where = f"{path}: record {index} at offset {offset}"
    try:
        fields = msgpack.unpackb(payload, raw=False)
    except Exception as err:  # msgpack raises several types for malformed input
        raise LogCorrupt(f"{where}: {type(err).__name__}: {err}") from None
    if (not isinstance(fields, list) or len(fields) < 2 or not isinstance(fields[0], str)
            or isinstance(fields[1], bool) or not isinstance(fields[1], (int, float))
            or not all(isinstance(f, bytes) for f in fields[2:])):
        raise LogCorrupt(f"{where}: not [direction, time, frames...] (a direction string, "
                         f"a number and byte frames)")
    return Record(index, offset, fields[0], float(fields[1]), list(fields[2:]))


def _check_torn(path: Path, pos: int, index: int, what: str) -> None:
    """Damage at the end is a torn write unless the index says a whole record was there."""
    index_path = path.with_name("messages.jsonl")
    if index_path.exists():
        for line in index_path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn index line
            if entry.get("off", -1) >= pos:
                raise LogCorrupt(f"{path}: record {index} at offset {pos}: {what}")


def _header_of(frames: list[bytes]) -> dict | None:
    """The index fields of a logged message, from its header frame."""
    if len(frames) != 2 or not frames[0]:
        return None
    from fedbus.broker.wire import WireError, decode_header

    try:
        return decode_header(frames[0])
    except WireError:
        return None


class RecordReader:
    """Single records read by their offset (the index's "off"), so a tool that shows a few
    messages (`fedbus log RUN --round 3`) reads those and not the whole log. Each record's
    length and checksum are checked as scan() checks them; a record that fails is
    LogCorrupt naming its index and offset."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "rb")
        if self._file.read(len(MAGIC)) != MAGIC:
            self._file.close()
            raise LogCorrupt(f"{self.path}: not a fedbus message log (bad magic)")

    def at(self, offset: int, index: int = -1) -> Record:
        f = self._file
        f.seek(offset)
        head = f.read(_HEAD.size)
        if offset < len(MAGIC) or len(head) < _HEAD.size:
            raise LogCorrupt(f"{self.path}: record {index} at offset {offset}: "
                             "no record header there")
        length, crc = _HEAD.unpack(head)
        payload = f.read(length) if length <= MAX_RECORD else b""
        if len(payload) != length or zlib.crc32(payload) != crc:
            raise LogCorrupt(f"{self.path}: record {index} at offset {offset}: "
                             "cut short or checksum mismatch")
        return _record(payload, index, offset, self.path)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_log(folder: str | Path) -> Iterator[Record]:
    records, _ = scan(Path(folder) / "messages.bin")
    return iter(records)
