"""log.tensorboard: the server's optional TensorBoard writer, read back from its event file."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, SMALL, merged, metrics, run_federation, write_config

from fedbus.record.tensorboard import scalars


def _run_py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          check=False, capture_output=True, text=True, timeout=120,
                          cwd=REPO)


def test_scalars_keep_numbers_and_group_them_by_tag():
    rec = {"round": 2, "version": 3, "time": 1.7e9, "acc_mean": 0.5, "updates": 4,
           "sampled": 5, "failed": 1, "bytes_up": 100, "round_s": 0.25, "flag": True,
           "participants": [0, 1], "failures": {"3": "late"}, "agg": {"spread": 0.1},
           "proto_acc_mean": None, "loss_mean": float("nan")}
    assert scalars(rec) == {"eval/acc_mean": 0.5, "participation/updates": 4.0,
                            "participation/sampled": 5.0, "participation/failed": 1.0,
                            "comm/bytes_up": 100.0, "time/round_s": 0.25,
                            "agg/spread": 0.1}


def test_event_file_holds_every_round_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    cfg = merged(SMALL, algorithm={"name": "fedproto"}, log={"tensorboard": True})
    run, summary = run_federation(tmp_path, cfg)
    recs = metrics(run)
    assert [r["round"] for r in recs] == [0, 1, 2]
    files = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("eval/acc_mean", "eval/proto_acc_mean", "eval/loss_mean",
                "participation/sampled", "participation/updates", "participation/failed",
                "participation/late", "participation/dead", "participation/eval_clients",
                "comm/bytes_up", "comm/bytes_down", "time/round_s", "time/wall_s"):
        assert tag in tags, tag
    assert tags == set().union(*(scalars(r) for r in recs))
    for tag in tags:
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [0, 1, 2], tag  # one value per round
    for key, tag in (("acc_mean", "eval/acc_mean"), ("proto_acc_mean", "eval/proto_acc_mean"),
                     ("updates", "participation/updates"), ("bytes_up", "comm/bytes_up")):
        got = [e.value for e in acc.Scalars(tag)]
        assert got == pytest.approx([r[key] for r in recs], rel=1e-6), tag
    assert [e.value for e in acc.Scalars("participation/updates")] == [6, 6, 6]
    # the record's own time is the event's wall time
    assert [e.wall_time for e in acc.Scalars("eval/acc_mean")] == \
        pytest.approx([r["time"] for r in recs], abs=1e-3)
    assert summary["final"]["acc_mean"] == pytest.approx(acc.Scalars("eval/acc_mean")[-1].value,
                                                         rel=1e-6)


def test_off_by_default_writes_no_folder_and_imports_no_tensorboard(tmp_path):
    cfg = write_config(tmp_path / "c.toml", SMALL)
    proc = _run_py("""
        import sys
        from pathlib import Path
        from fedbus.node.config import load_config
        from fedbus.node.server import ServerNode

        run = Path(sys.argv[2])
        server = ServerNode(load_config(sys.argv[1]), run, "tcp://127.0.0.1:1")
        server.run.append_metrics([{"round": 0, "version": 1, "time": 0.0, "acc_mean": 0.5}])
        server.run.close()
        loaded = sorted(m for m in sys.modules if "tensorboard" in m)
        assert not loaded, loaded
        assert not (run / "tensorboard").exists()
        assert (run / "metrics.jsonl").read_text().count("acc_mean") == 1
        print("ok")
    """, str(cfg), str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


def test_on_without_tensorboard_is_a_one_line_config_error(tmp_path):
    cfg = write_config(tmp_path / "c.toml", SMALL)
    # `fedbus server` as on a machine without TensorBoard: importing it fails
    proc = _run_py("""
        import sys
        sys.modules["tensorboard"] = None
        from fedbus.launch.cli import main
        sys.exit(main(sys.argv[1:]))
    """, "server", "--broker", "tcp://127.0.0.1:1", str(cfg), "--out", str(tmp_path / "run"),
                   "--set", "log.tensorboard=true")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "log.tensorboard" in lines[0] and "pip install tensorboard" in lines[0]
