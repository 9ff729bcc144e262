"""Coverage-guided fuzzing of every decoder that reads outside input (issue 27, item 2).

    fedbus bench fuzz --list                          # the targets and their documented errors
    fedbus bench fuzz                                 # every target, 60 s each
    fedbus bench fuzz wire-body checkpoint --seconds 600 --corpus runs/fuzz

A target takes one input (bytes) to the decoder as a user or a peer would hand it over: a
wire frame, a file's contents, --set lines. Its promise: every input either decodes or
raises the target's documented error (WireError, ConfigError, PartitionError,
CheckpointError, LogCorrupt, DamagedFile, AuthError, ...); any other exception is a crash,
and so is an input that takes longer than --timeout seconds (a hang) or drives the process
past --rss-mb (an unbounded allocation).

The fuzzer is atheris (Google's libFuzzer for Python; `pip install 'fedbus[fuzz]'`): each
target runs in a process of its own (atheris.Fuzz never returns), with fedbus's bytecode
instrumented for coverage, its corpus seeded from real frames and files (`seeds`: a task
and an update as the engine sends them, a checkpoint and a message log of a real round, the
embedded config, a partition file, a certificate). A crash leaves its input as
CORPUS/crashes/TARGET-*; `fedbus bench fuzz TARGET --reproduce FILE` reruns one input
with its traceback. The table printed at the end gives inputs tried, new coverage units
and crashes per target.

tests/test_fuzz.py runs every target on its seeds and on Hypothesis-drawn and mutated
inputs (bounded, seconds), and each under atheris for 500 inputs from a fixed libFuzzer
seed (`--runs 500 --seed 1`: the same inputs on any machine) where atheris is installed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import msgpack

FUZZ_EXTRA = "pip install 'fedbus[fuzz]' (atheris, Linux x86-64)"


@dataclass(frozen=True)
class Target:
    name: str
    what: str
    run: Callable[[bytes, Path], object]  # (input, a scratch folder) -> anything
    error_names: str  # what the decoder documents, resolved when first needed (imports)
    seeds: Callable[[], list[bytes]]

    @property
    def errors(self) -> tuple[type[BaseException], ...]:
        return _errors(self.error_names)


# --- the decoders, as outside input reaches them ---------------------------------------------

def _wire_header(data: bytes, work: Path) -> object:
    from fedbus.broker.wire import decode_header
    return decode_header(data)


def _wire_body(data: bytes, work: Path) -> object:
    from fedbus.broker.wire import decode_body
    return decode_body(data)


def _wire_message(data: bytes, work: Path) -> object:
    """Two frames: a 2-byte big-endian header length, the header, the body."""
    from fedbus.broker.wire import decode
    n = int.from_bytes(data[:2], "big")
    return decode([data[2:2 + n], data[2 + n:]])


def _config_toml(data: bytes, work: Path) -> object:
    from fedbus.node.config import load_config
    path = work / "config.toml"
    path.write_bytes(data)
    return load_config(path)


def _config_set(data: bytes, work: Path) -> object:
    """Each line one --set SECTION.KEY=VALUE (at most 16)."""
    from fedbus.node.config import build_config
    lines = data.decode("utf-8", "replace").splitlines()[:16]
    return build_config({}, lines)


def _partition(data: bytes, work: Path) -> object:
    from fedbus.node.data.partition import load_partition
    path = work / "partition.json"
    path.write_bytes(data)
    return load_partition(path, dataset_size=1797)


@lru_cache(maxsize=1)
def _engine_config():
    from fedbus.node.config import build_config
    return build_config({"federation": {"clients": 4, "rounds": 2}})


def _checkpoint(data: bytes, work: Path) -> object:
    """What `fedbus run --resume` does with RUN/checkpoint.fbk: read it, then load it into
    a new engine of the run's config (FedProto on digits, 4 clients)."""
    from fedbus.node.server import build_engine, restore_checkpoint
    path = work / "checkpoint.fbk"
    path.write_bytes(data)
    engine = build_engine(_engine_config(), "fuzz")
    return restore_checkpoint(engine, path)


def _message_log(data: bytes, work: Path) -> object:
    """RUN/messages.bin as `fedbus log` and `fedbus replay` read it: every record by scan(),
    then each again by its offset, and its frames as a message. The first byte chooses
    the file: odd = the rest as it is; even = the rest cut into records (each a 2-byte
    big-endian length, then that many bytes) given valid lengths and checksums, so the
    fuzzer reaches what lies behind the checksum."""
    from fedbus.broker.wire import WireError, decode
    from fedbus.record.msglog import MAGIC, RecordReader, scan
    if data[:1] and data[0] & 1:
        blob = data[1:]
    else:
        blob = MAGIC
        rest = data[1:]
        while rest:
            n = min(len(rest), 2 + int.from_bytes(rest[:2], "big"))
            payload, rest = rest[2:n], rest[n:]
            blob += struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    folder = work / "run"
    folder.mkdir(exist_ok=True)
    path = folder / "messages.bin"
    path.write_bytes(blob)
    records, _ = scan(path)
    with RecordReader(path) as reader:
        for rec in records:
            again = reader.at(rec.offset, rec.index)
            if again.frames != rec.frames:
                raise AssertionError(f"record {rec.index} reads differently by offset")
    for rec in records:
        with contextlib.suppress(WireError):
            decode(rec.frames)
    return records


def _metrics(data: bytes, work: Path) -> object:
    from fedbus.record.rundir import read_metrics
    (work / "metrics.jsonl").write_bytes(data)
    return read_metrics(work)


def _certificate(data: bytes, work: Path) -> object:
    from fedbus.broker.auth import read_certificate
    path = work / "node.key_secret"
    path.write_bytes(data)
    return read_certificate(path)


def _allow_list(data: bytes, work: Path) -> object:
    """A folder of public certificates (the broker's --allow): the input is one of them,
    beside a valid one."""
    from fedbus.broker.auth import AllowList
    folder = work / "allow"
    folder.mkdir(exist_ok=True)
    for f in folder.iterdir():
        f.unlink()
    (folder / "server.key").write_bytes(_seed_files()["server.key"])
    (folder / "node.key").write_bytes(data)
    return AllowList.load(folder)


def _client_state(data: bytes, work: Path) -> object:
    from fedbus.node.client_state import ClientStateStore
    store = ClientStateStore(work / "states", "fuzz")
    (store.path / "client-0-r0.pt").write_bytes(data)
    return store.load(0, 0)


# --- seeds: real frames and files ------------------------------------------------------------

@lru_cache(maxsize=1)
def _seed_files() -> dict[str, bytes]:
    """Real inputs, made once per process: a task and an update of a real round, the
    checkpoint and message log it leaves, the embedded config, a partition and keys."""
    import numpy as np
    import torch

    from fedbus.broker.auth import write_keypair
    from fedbus.broker.wire import Message, encode
    from fedbus.node.data.partition import ClientSplit, save_partition
    from fedbus.node.server import build_engine, checkpoint_bytes
    from fedbus.record.msglog import MessageLogWriter

    out: dict[str, bytes] = {}
    engine = build_engine(_engine_config(), "fuzz")
    state = engine.state_dict()
    out["checkpoint.fbk"] = checkpoint_bytes(state)
    task = Message("task", "server", "c0", {"round": 0, "weights": {
        "w": np.arange(12, dtype=np.float32).reshape(3, 4)}, "protos": torch.ones(2, 3)},
        run="r", round=0)
    update = Message("update", "c0", "server", {"protos": np.eye(3, dtype=np.float32),
                     "counts": np.array([3, 0, 1]), "num_samples": 4, "loss": 0.25,
                     "meta": {"epochs": 1.0, "nan": float("nan")}}, run="r", round=0)
    with tempfile.TemporaryDirectory() as tmp:
        frames = []
        writer = MessageLogWriter(Path(tmp))
        for msg in (task, update):
            f = encode(msg)
            frames.append(f)
            writer.write("in", 1.5, f)
        writer.close()
        out["messages.bin"] = (Path(tmp) / "messages.bin").read_bytes()
        save_partition([ClientSplit(np.arange(0, 8), np.arange(8, 10)),
                        ClientSplit(np.arange(10, 18), np.arange(18, 20))],
                       Path(tmp) / "p.json")
        out["partition.json"] = (Path(tmp) / "p.json").read_bytes()
        write_keypair(tmp, "server", "server")
        out["server.key"] = (Path(tmp) / "server.key").read_bytes()
        out["server.key_secret"] = (Path(tmp) / "server.key_secret").read_bytes()
        write_keypair(tmp, "node", "client", clients="0-3")
        out["node.key"] = (Path(tmp) / "node.key").read_bytes()
        torch.save({"weights": {"w": torch.ones(2, 2)}, "round": 3}, Path(tmp) / "s.pt")
        out["state.pt"] = (Path(tmp) / "s.pt").read_bytes()
    out["header"], out["body"] = frames[1][0], frames[1][1]
    out["task-header"], out["task-body"] = frames[0][0], frames[0][1]
    from importlib import resources
    out["default.toml"] = resources.files("fedbus.launch").joinpath("default.toml").read_bytes()
    out["metrics.jsonl"] = (json.dumps({"round": 0, "acc_mean": 0.5, "failures": {}})
                            + "\n" + json.dumps({"round": 1, "acc_mean": 0.6}) + "\n").encode()
    return out


def _framed(header: bytes, body: bytes) -> bytes:
    return len(header).to_bytes(2, "big") + header + body


def _records(log: bytes) -> bytes:
    """A message log in _message_log's even (record-cutting) form."""
    from fedbus.record.msglog import MAGIC, scan
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "messages.bin"
        path.write_bytes(log)
        records, _ = scan(path)
    out = b"\x00"
    for rec in records:
        payload = msgpack.packb([rec.direction, rec.time, *rec.frames])
        out += len(payload).to_bytes(2, "big") + payload
    assert log.startswith(MAGIC)
    return out


def _seeds(*names: str, extra: Callable[[dict[str, bytes]], list[bytes]] | None = None
           ) -> Callable[[], list[bytes]]:
    def make() -> list[bytes]:
        files = _seed_files()
        return [files[n] for n in names] + (extra(files) if extra else [])
    return make


TARGETS: dict[str, Target] = {}


def _add(name: str, what: str, run: Callable[[bytes, Path], object], errors: str,
         seeds: Callable[[], list[bytes]]) -> None:
    TARGETS[name] = Target(name, what, run, errors, seeds)


@lru_cache(maxsize=None)
def _errors(names: str) -> tuple[type[BaseException], ...]:
    from fedbus.broker.auth import AuthError
    from fedbus.broker.wire import WireError
    from fedbus.node.config import ConfigError
    from fedbus.node.data.partition import PartitionError
    from fedbus.node.server import CheckpointError
    from fedbus.record import DamagedFile
    from fedbus.record.msglog import LogCorrupt
    known = {"WireError": WireError, "ConfigError": ConfigError,
             "PartitionError": PartitionError, "CheckpointError": CheckpointError,
             "LogCorrupt": LogCorrupt, "DamagedFile": DamagedFile, "AuthError": AuthError,
             "ValueError": ValueError}
    return tuple(known[n] for n in names.split())


_add("wire-header", "a header frame (broker/wire.decode_header)", _wire_header, "WireError",
     _seeds("header", "task-header"))
_add("wire-body", "a body frame with the msgpack array extension (broker/wire.decode_body)",
     _wire_body, "WireError", _seeds("body", "task-body"))
_add("wire-message", "a two-frame message (broker/wire.decode)", _wire_message, "WireError",
     _seeds(extra=lambda f: [_framed(f["header"], f["body"]),
                             _framed(f["task-header"], f["task-body"])]))
_add("config-toml", "a CONFIG.toml (node/config.load_config)", _config_toml, "ConfigError",
     _seeds("default.toml", extra=lambda f: [b"[federation]\nclients = 3\n[data]\n"
                                             b"dataset = \"npz:x.npz\"\n"]))
_add("config-set", "--set lines (node/config.build_config)", _config_set, "ConfigError",
     _seeds(extra=lambda f: [b"federation.rounds=3\nalgorithm.name=fedavg\n",
                             b"model.group=[\"cnn\",\"mlp\"]\ntrain.lr=0.1\n"]))
_add("partition", "a partition file (node/data/partition.load_partition)", _partition,
     "PartitionError", _seeds("partition.json"))
_add("checkpoint", "RUN/checkpoint.fbk, read and loaded (node/server.restore_checkpoint)",
     _checkpoint, "CheckpointError", _seeds("checkpoint.fbk"))
_add("message-log", "RUN/messages.bin (record/msglog.scan, RecordReader)", _message_log,
     "LogCorrupt", _seeds(extra=lambda f: [b"\x01" + f["messages.bin"],
                                           _records(f["messages.bin"])]))
_add("metrics", "RUN/metrics.jsonl (record/rundir.read_metrics)", _metrics, "DamagedFile",
     _seeds("metrics.jsonl"))
_add("key-file", "a certificate (broker/auth.read_certificate)", _certificate, "AuthError",
     _seeds("server.key_secret", "node.key"))
_add("allow-list", "an allow-list folder's certificate (broker/auth.AllowList.load)",
     _allow_list, "AuthError", _seeds("node.key"))
_add("client-state", "a saved client state (node/client_state.ClientStateStore.load)",
     _client_state, "ValueError", _seeds("state.pt"))


# --- one input ---------------------------------------------------------------------------------

class Crash(AssertionError):
    """An input that raised what its decoder does not document."""


def check(target: Target, data: bytes, work: Path) -> bool:
    """Run one input: True if it decoded, False if it raised the documented error; Crash
    (with the original exception as its cause) for anything else."""
    try:
        target.run(data, work)
        return True
    except target.errors:
        return False
    except Exception as err:
        raise Crash(f"{target.name}: {type(err).__name__}: {err}") from err


# --- atheris, one target per process ----------------------------------------------------------

def _atheris_child(name: str, corpus: Path, seconds: float, timeout: float, rss_mb: int,
                   runs: int, libfuzzer_seed: int = 0) -> None:
    """Fuzz one target until the time is up or `runs` inputs ran (atheris.Fuzz exits the
    process); `libfuzzer_seed` fixes libFuzzer's mutations (0: libFuzzer draws one)."""
    import atheris

    from fedbus.broker.log import configure_logging

    configure_logging(level="critical", console=False)  # no log line per input
    target = TARGETS[name]
    work = Path(tempfile.mkdtemp(prefix=f"fedbus-fuzz-{name}-"))
    # fedbus's modules are imported (by making and running the seeds) under
    # instrumentation, and only they: instrumenting torch's bytecode too takes minutes
    with atheris.instrument_imports(include=["fedbus"]):
        seeds = target.seeds()
        for seed in seeds:
            check(target, seed, work)
    seed_dir = corpus / name
    seed_dir.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds):
        (seed_dir / f"seed-{i}").write_bytes(seed)
    crashes = corpus / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)

    def one(data: bytes) -> None:
        with contextlib.redirect_stderr(io.StringIO()):
            check(target, data, work)

    argv = [sys.argv[0], str(seed_dir), f"-max_total_time={int(seconds)}",
            f"-timeout={int(timeout)}", f"-rss_limit_mb={rss_mb}", "-print_final_stats=1",
            f"-artifact_prefix={crashes}/{name}-", "-max_len=65536"]
    if runs:
        argv.append(f"-runs={runs}")
    if libfuzzer_seed:
        argv.append(f"-seed={libfuzzer_seed}")
    atheris.Setup(argv, one)
    atheris.Fuzz()


@dataclass
class Result:
    target: str
    inputs: int | None
    coverage: int | None
    corpus: int | None
    crash: str  # "" or the crash's first lines
    seconds: float


def fuzz_one(name: str, corpus: Path, seconds: float, *, timeout: float = 10.0,
             rss_mb: int = 2048, runs: int = 0, seed: int = 0) -> Result:
    """Run the atheris child for one target; its figures from libFuzzer's final stats."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "fedbus.bench.fuzz", "--child", name, "--corpus", str(corpus),
           "--seconds", str(seconds), "--timeout", str(timeout), "--rss-mb", str(rss_mb),
           "--runs", str(runs), "--seed", str(seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=seconds + 10 * timeout + 120,
                          env={**os.environ, "PYTHONHASHSEED": "0"})
    err = proc.stderr
    logs = corpus / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{name}.log").write_text(err)  # libFuzzer's whole account, for a failed run

    def stat(key: str) -> int | None:
        m = re.findall(rf"stat::{key}:\s*(\d+)", err)
        return int(m[-1]) if m else None

    cov = re.findall(r"\bcov: (\d+)", err)
    corp = re.findall(r"\bcorp: (\d+)", err)
    crash = ""
    if proc.returncode != 0:
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(
            ("#", "INFO:", "stat::", "WARNING: Failed to find function", "MS:", "base unit:"))]
        crash = "\n".join(lines[-12:] + [f"(exit {proc.returncode}; the whole log: "
                                          f"{logs / (name + '.log')})"])
    return Result(name, stat("number_of_executed_units"), int(cov[-1]) if cov else None,
                  int(corp[-1]) if corp else None, crash, time.monotonic() - t0)


def have_atheris() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


# --- CLI ---------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("targets", nargs="*", metavar="TARGET",
                   help=f"targets to fuzz (default: all): {', '.join(TARGETS)}")
    p.add_argument("--list", action="store_true", help="list the targets and exit")
    p.add_argument("--seconds", type=float, default=60.0, help="per target (default 60)")
    p.add_argument("--corpus", default=None,
                   help="corpus folder, kept and grown between runs (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds one input may take before it counts as a hang (default 10)")
    p.add_argument("--rss-mb", type=int, default=2048,
                   help="memory a target process may reach before it counts as an unbounded "
                        "allocation (default 2048)")
    p.add_argument("--runs", type=int, default=0, help="stop after this many inputs (0 = time)")
    p.add_argument("--seed", type=int, default=0,
                   help="libFuzzer's seed: with --runs, the same inputs on any machine "
                        "(default 0: libFuzzer draws one)")
    p.add_argument("--reproduce", default=None, metavar="FILE",
                   help="run one input file through TARGET and print what it raises")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)


def main_args(args: argparse.Namespace) -> int:
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        print(f"fedbus bench fuzz: unknown target(s) {', '.join(unknown)}; choose from "
              f"{', '.join(TARGETS)}", file=sys.stderr)
        return 2
    if args.list:
        for t in TARGETS.values():
            errs = t.error_names.replace(" ", ", ")
            print(f"{t.name:13s} {t.what}; documented error: {errs}")
        return 0
    if args.reproduce:
        if len(args.targets) != 1:
            print("fedbus bench fuzz: --reproduce needs exactly one TARGET", file=sys.stderr)
            return 2
        target = TARGETS[args.targets[0]]
        try:
            data = Path(args.reproduce).read_bytes()
        except OSError as err:
            print(f"fedbus bench fuzz: cannot read {args.reproduce}: {err.strerror or err}",
                  file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory() as tmp:
            ok = check(target, data, Path(tmp))  # a Crash propagates with its traceback
        print(f"{target.name}: {len(data)} bytes: " + ("decoded" if ok else "documented error"))
        return 0
    if args.child:
        _atheris_child(args.child, Path(args.corpus), args.seconds, args.timeout,
                       args.rss_mb, args.runs, args.seed)
        return 0
    if not have_atheris():
        print(f"fedbus bench fuzz needs atheris: {FUZZ_EXTRA}", file=sys.stderr)
        return 2
    names = args.targets or list(TARGETS)
    with contextlib.ExitStack() as stack:
        corpus = Path(args.corpus) if args.corpus else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="fedbus-fuzz-")))
        results = []
        print(f"fuzzing {len(names)} target(s), {args.seconds:g} s each (atheris; corpus "
              f"{corpus})", flush=True)
        print(f"{'target':13s} {'inputs':>10s} {'inputs/s':>9s} {'coverage':>9s} "
              f"{'corpus':>7s}  crash", flush=True)
        for name in names:
            r = fuzz_one(name, corpus, args.seconds, timeout=args.timeout,
                         rss_mb=args.rss_mb, runs=args.runs, seed=args.seed)
            results.append(r)
            rate = f"{r.inputs / r.seconds:9.0f}" if r.inputs else f"{'-':>9s}"
            first = r.crash.splitlines()[0] if r.crash else "none"
            print(f"{name:13s} {r.inputs if r.inputs is not None else '-':>10} {rate} "
                  f"{r.coverage if r.coverage is not None else '-':>9} "
                  f"{r.corpus if r.corpus is not None else '-':>7}  {first}", flush=True)
        crashed = [r for r in results if r.crash]
        for r in crashed:
            print(f"\n{r.target} crashed (input kept in {corpus}/crashes/):\n{r.crash}")
        if args.json:
            Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 1 if crashed else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedbus bench fuzz", description=__doc__.split("\n")[0])
    add_arguments(p)
    return main_args(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
