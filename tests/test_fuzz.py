"""Every decoder of outside input (bench/fuzz.py's targets) either decodes an input or raises
its documented error: on its real seeds, on Hypothesis-drawn and mutated inputs, under
atheris for a few seconds each (where atheris is installed), and on the inputs that once
crashed one (regressions). Plus the damaged checkpoint cases the fuzzer cannot judge: a
changed byte that still decodes, a cut, a file written before checkpoints had a digest."""
from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedbus.bench import fuzz

TARGETS = list(fuzz.TARGETS)
FUZZ_RUNS = 500  # inputs each coverage-guided run executes (seeds and mutants)


def test_the_targets_cover_every_decoder_the_issue_names():
    assert {"wire-header", "wire-body", "wire-message", "config-toml", "config-set",
            "partition", "checkpoint", "message-log", "key-file"} <= set(TARGETS)
    for t in fuzz.TARGETS.values():
        assert t.errors and all(issubclass(e, Exception) for e in t.errors), t.name


@pytest.mark.parametrize("name", TARGETS)
def test_every_seed_is_a_real_input_that_decodes(name, tmp_path):
    target = fuzz.TARGETS[name]
    seeds = target.seeds()
    assert seeds
    for seed in seeds:
        assert fuzz.check(target, seed, tmp_path) is True, (name, seed[:60])


def _mutated(seeds: list[bytes]):
    """A seed with a few bytes changed, cut short, or grown: what damage looks like."""
    edit = st.tuples(st.sampled_from(["set", "cut", "insert", "delete"]),
                     st.integers(0, 1 << 16), st.binary(min_size=1, max_size=8))

    def apply(seed: bytes, edits) -> bytes:
        b = bytearray(seed)
        for op, at, data in edits:
            i = at % (len(b) + 1)
            if op == "set" and b:
                b[i % len(b)] = data[0]
            elif op == "cut":
                del b[i:]
            elif op == "insert":
                b[i:i] = data
            else:
                del b[i:i + len(data)]
        return bytes(b)

    return st.builds(apply, st.sampled_from(seeds), st.lists(edit, min_size=1, max_size=6))


@pytest.mark.parametrize("name", TARGETS)
def test_drawn_and_mutated_inputs_decode_or_raise_the_documented_error(name, tmp_path):
    target = fuzz.TARGETS[name]
    seeds = target.seeds()
    outcomes = []

    # few examples for the slow targets (each loads an engine or torch state); the bench
    # runs millions under atheris
    slow = name in ("checkpoint", "client-state", "allow-list", "config-toml")

    @settings(max_examples=40 if slow else 150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck), derandomize=True)
    @given(st.one_of(st.binary(max_size=2048), _mutated(seeds)))
    def run(data: bytes) -> None:
        outcomes.append(fuzz.check(target, data, tmp_path))  # a Crash fails the test

    run()
    if name != "allow-list":  # it skips an unreadable certificate, logging why (by design)
        assert False in outcomes, f"{name}: no drawn input raised the documented error"


@pytest.mark.skipif(not fuzz.have_atheris(), reason=f"atheris is not installed: "
                                                    f"{fuzz.FUZZ_EXTRA}")
@pytest.mark.parametrize("name", TARGETS)
def test_a_short_coverage_guided_run_finds_no_crash(name, tmp_path):
    # a count of inputs from a fixed seed, not seconds: the same run on any machine (the
    # seconds are a liveness guard)
    r = fuzz.fuzz_one(name, tmp_path, seconds=240, runs=FUZZ_RUNS, seed=1)
    assert r.crash == "", r.crash
    assert r.inputs == FUZZ_RUNS, r
    assert r.coverage and r.coverage > 0, r
    assert (tmp_path / name).is_dir()  # the corpus, seeded and grown


def test_the_bench_lists_its_targets_and_refuses_unknown_ones(capsys):
    assert fuzz.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(n in listed for n in TARGETS) and "WireError" in listed
    assert fuzz.main(["no-such-target"]) == 2
    assert "unknown target" in capsys.readouterr().err


def test_reproduce_reruns_one_input(tmp_path, capsys):
    good = tmp_path / "good"
    good.write_bytes(fuzz.TARGETS["partition"].seeds()[0])
    assert fuzz.main(["partition", "--reproduce", str(good)]) == 0
    assert "decoded" in capsys.readouterr().out
    bad = tmp_path / "bad"
    bad.write_bytes(b'{"clients": 3}')
    assert fuzz.main(["partition", "--reproduce", str(bad)]) == 0
    assert "documented error" in capsys.readouterr().out
    assert fuzz.main(["partition", "--reproduce", str(tmp_path / "gone")]) == 2
    assert "cannot read" in capsys.readouterr().err


# --- inputs that crashed a decoder once ------------------------------------------------------

def test_regression_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    from fedbus.node.config import ConfigError, load_config
    path = tmp_path / "c.toml"
    path.write_bytes(b"[federation]\nclients = 3 # \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path)  # a folder


def test_regression_a_path_of_tilde_and_no_such_user_is_read_as_a_plain_path(tmp_path):
    """atheris (CI, 2026-11-27): `dataset = "npz:~.npz"` made Path.expanduser look up a
    user named ".npz" and raise RuntimeError out of load_config. os.path.expanduser leaves
    such a path as it is; loading it is then an ordinary not-found."""
    from fedbus.node.config import load_config
    from fedbus.node.data.datasets import DatasetUnavailable, load_dataset
    data = b'[federation]\nclients = 3\n[data]\ndataset = "npz:~.npz"\n'  # the found input
    assert fuzz.check(fuzz.TARGETS["config-toml"], data, tmp_path) is True
    path = tmp_path / "c.toml"
    path.write_bytes(data.replace(b"~.npz", b"~no-such-user-fedbus/x.npz"))
    assert load_config(path).data.dataset == "npz:~no-such-user-fedbus/x.npz"
    with pytest.raises(DatasetUnavailable, match="not found"):
        load_dataset("npz:~no-such-user-fedbus/x.npz")


def test_regression_an_algorithm_name_that_is_no_string_is_a_config_error(tmp_path):
    """atheris (CI, 2026-11-27): `algorithm.name=[]` reached the registry's dict lookup and
    raised TypeError (unhashable list) out of build_config."""
    from fedbus.node.config import ConfigError, build_config
    for name in ([], {"a": 1}, 3):
        with pytest.raises(ConfigError, match="a name is a string"):
            build_config({"algorithm": {"name": name}})
    data = b"federation.rounds=6\nalgorithm.name=[]\ntrain.lr=01=v7\n"  # the found input
    assert fuzz.check(fuzz.TARGETS["config-set"], data, tmp_path) is False


def test_regression_a_partition_index_beyond_int64_is_a_partition_error(tmp_path):
    """atheris (CI, 2026-11-27): an index of 23 digits raised OverflowError in np.asarray."""
    from fedbus.node.data.partition import PartitionError, load_partition
    data = (b'{"num_clien":2,"clients":[{"train":[0,1,2,22222222222222222222223,4],'
            b'"test":[8,9]}]}')
    assert fuzz.check(fuzz.TARGETS["partition"], data, tmp_path) is False
    path = tmp_path / "p.json"
    path.write_text('{"num_clients": 1, "clients": [{"train": [0, %d], "test": [1]}]}'
                    % 2**63)
    with pytest.raises(PartitionError, match="too large to be an index"):
        load_partition(path)


def _log_file(tmp_path: Path, record: list) -> Path:
    from fedbus.record.msglog import MAGIC
    payload = msgpack.packb(record)
    path = tmp_path / "messages.bin"
    path.write_bytes(MAGIC + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload)
    return path


@pytest.mark.parametrize("record", [
    ["in", 1.5, -17],          # an int frame: bytes(-17) raised ValueError downstream
    ["in", 1.5, 3],            # and bytes(3) would have been three zero bytes
    ["in", {"t": 1}, b"x"],    # a time that is no number
    [b"in", 1.5, b"x"],        # a direction that is no string
    ["in"],                    # too short
    {"in": 1.5},               # not a list
])
def test_regression_a_checksummed_record_of_the_wrong_shape_is_log_corrupt(tmp_path, record):
    from fedbus.record.msglog import LogCorrupt, RecordReader, scan
    path = _log_file(tmp_path, record)
    with pytest.raises(LogCorrupt, match="record 0 at offset"):
        scan(path)
    with RecordReader(path) as reader, pytest.raises(LogCorrupt, match="record 0"):
        reader.at(len(b"FBLOG1\n\x00"), 0)


def test_regression_a_frame_of_an_int_is_a_wire_error():
    from fedbus.broker.wire import WireError, decode
    header = fuzz.TARGETS["wire-header"].seeds()[0]
    for frames in ([-17, b""], [3, b"\x80"], [header, 5]):
        with pytest.raises(WireError, match="bytes-like"):
            decode(frames)


# --- a damaged checkpoint ----------------------------------------------------------------------

def _checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "checkpoint.fbk"
    path.write_bytes(fuzz.TARGETS["checkpoint"].seeds()[0])
    return path


def test_a_checkpoint_carries_its_digest_and_reads_back(tmp_path):
    from fedbus.node.server import CHECKSUM_LINE, read_checkpoint
    path = _checkpoint(tmp_path)
    raw = path.read_bytes()
    assert CHECKSUM_LINE in raw and raw.endswith(b"\n")
    body, state = read_checkpoint(path)
    assert raw.startswith(body) and state["version"] == 0


def test_a_changed_byte_that_still_decodes_is_refused(tmp_path):
    from fedbus.broker.wire import decode_body
    from fedbus.node.server import CHECKSUM_LINE, CheckpointError, read_checkpoint
    path = _checkpoint(tmp_path)
    raw = bytearray(path.read_bytes())
    body_len = raw.rfind(CHECKSUM_LINE)
    raw[body_len - 3] ^= 0x01  # the last bytes of the body: array data
    decode_body(bytes(raw[:body_len]), max_frame=body_len)  # it still decodes ...
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="SHA-256 does not match") as err:
        read_checkpoint(path)  # ... but is not resumed from
    assert str(path) in str(err.value) and "--force" in str(err.value)


@pytest.mark.parametrize("cut", [1, 40, 70])
def test_a_cut_checkpoint_is_refused(tmp_path, cut):
    from fedbus.node.server import CheckpointError, read_checkpoint
    path = _checkpoint(tmp_path)
    path.write_bytes(path.read_bytes()[:-cut])
    with pytest.raises(CheckpointError, match=str(path)):
        read_checkpoint(path)


def test_a_checkpoint_written_before_the_digest_is_read_as_it_is(tmp_path):
    from fedbus.node.server import CHECKSUM_LINE, read_checkpoint
    path = _checkpoint(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[:raw.rfind(CHECKSUM_LINE)])
    _body, state = read_checkpoint(path)
    assert state["version"] == 0


def test_a_checkpoint_of_another_algorithm_does_not_fit(tmp_path):
    from fedbus.node.config import build_config
    from fedbus.node.server import CheckpointError, build_engine, restore_checkpoint
    path = _checkpoint(tmp_path)  # FedProto's
    cfg = build_config({"federation": {"clients": 4}, "algorithm": {"name": "fedavg"}})
    with pytest.raises(CheckpointError, match="does not fit this run"):
        restore_checkpoint(build_engine(cfg, "r"), path)
