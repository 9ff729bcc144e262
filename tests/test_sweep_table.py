"""`fedbus sweep` and `fedbus table`: a real 2 x 2 sweep on digits (FedAvg and FedProto,
seeds 0 and 1, 4 clients, 2 rounds), made once for the module from a working directory
holding a decoy `fedbus` package, then tables whose numbers are checked against the runs'
own summary.json; resume by name; errors; and the statistics of fedbus.analysis.table
against hand-computed values."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until, write_config

from fedbus.analysis import table as stats
from fedbus.launch import sweep_cmd
from fedbus.launch.cli import main as fedbus

TINY = {
    "federation": {"clients": 4, "rounds": 2, "seed": 0, "start_timeout_s": 30.0},
    "data": {"dataset": "digits", "partition": "nway-kshot", "ways": 3, "shots": 20},
    "model": {"arch": "cnn"},
    "algorithm": {"name": "fedavg"},
    "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    "bus": {"heartbeat_s": 0.3, "liveness": 4},
    "launch": {"nodes": 1},
}
NAMES = ["fedavg-s0", "fedavg-s1", "fedproto-s0", "fedproto-s1"]
GRID = ["--grid", "algorithm.name=fedavg,fedproto", "--seeds", "2"]
T_975 = {1: 12.706204736174707, 2: 4.302652729749464, 4: 2.7764451051977934,
         9: 2.2621571628540993}  # Student t 0.975 quantiles (statistical tables, scipy)


def call(argv: list[str], cwd: Path | None = None) -> tuple[int, str, str]:
    """fedbus ARGV in this process, from `cwd`: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = fedbus(argv)
    finally:
        os.chdir(here)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(config path, sweep dir, sweep's stdout): the real 2 x 2 sweep, two runs at a time,
    started from a directory whose `fedbus` package would break any run importing it."""
    root = tmp_path_factory.mktemp("sweep")
    cfg = write_config(root / "tiny.toml", TINY)
    decoy = root / "cwd"
    for pkg in (decoy / "fedbus", decoy / "fedbus" / "launch"):
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise SystemExit('the decoy fedbus was imported')\n")
    out = root / "cmp"
    code, stdout, stderr = call(["sweep", str(cfg), *GRID, "--out", str(out), "--jobs", "2"],
                                cwd=decoy)
    assert code == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    return cfg, out, stdout


def summaries(out: Path) -> dict[str, dict]:
    return {n: json.loads((out / n / "summary.json").read_text()) for n in NAMES}


# --- the sweep ------------------------------------------------------------------------

def test_the_sweep_runs_every_grid_point_and_seed_as_a_run(sweep):
    cfg, out, stdout = sweep
    for name in NAMES:
        algorithm, seed = name.rsplit("-s", 1)
        config = json.loads((out / name / "config.json").read_text())
        assert config["algorithm"]["name"] == algorithm
        assert config["federation"]["seed"] == int(seed)
        assert config["federation"]["clients"] == 4  # the base config, kept
        summary = json.loads((out / name / "summary.json").read_text())
        assert summary["rounds_completed"] == 2 and summary["algorithm"] == algorithm
        assert f"done    {name}" in stdout
    assert "4 complete (0 skipped), 0 failed" in stdout
    record = json.loads((out / "sweep.json").read_text())
    assert record["config"] == str(cfg.resolve())
    assert record["grid"] == {"algorithm.name": ["fedavg", "fedproto"]}
    assert record["seeds"] == [0, 1]
    assert record["base_config"]["federation"]["rounds"] == 2
    assert [r["name"] for r in record["runs"]] == NAMES
    assert all(r["status"] == "complete" for r in record["runs"])
    assert record["runs"][3]["overrides"] == ["algorithm.name=fedproto", "federation.seed=1"]
    assert sorted(p.name for p in (out / "sweep-logs").iterdir()) == [f"{n}.log" for n in NAMES]


def test_the_table_matches_the_runs_summaries(sweep, tmp_path):
    _, out, _ = sweep
    code, stdout, stderr = call(["table", str(out), "--baseline", "fedavg",
                                 "--csv", str(tmp_path / "t.csv"),
                                 "--markdown", str(tmp_path / "t.md")])
    assert code == 0, stderr
    s = summaries(out)
    acc = {n: s[n]["final"]["acc_mean"] for n in NAMES}
    proto = {n: s[n]["final"]["proto_acc_mean"] for n in NAMES if n.startswith("fedproto")}
    rows = {(r["algorithm.name"], r["metric"]): r
            for r in csv.DictReader((tmp_path / "t.csv").open())}
    for algorithm in ("fedavg", "fedproto"):
        mine = [acc[f"{algorithm}-s0"], acc[f"{algorithm}-s1"]]
        row = rows[(algorithm, "acc")]
        assert int(row["n"]) == 2
        assert float(row["mean"]) == pytest.approx(statistics.mean(mine), abs=1e-12)
        assert float(row["std"]) == pytest.approx(statistics.stdev(mine), abs=1e-12)
        assert float(row["min"]) == min(mine) and float(row["max"]) == max(mine)
        assert row["runs"] == f"{algorithm}-s0 {algorithm}-s1"
    row = rows[("fedproto", "proto_acc")]
    assert float(row["mean"]) == pytest.approx(statistics.mean(proto.values()), abs=1e-12)
    assert rows[("fedavg", "proto_acc")]["n"] == "0"  # FedAvg has no prototypes
    # paired by seed: d_s = FedProto's acc - FedAvg's acc for s = 0, 1
    diffs = [acc[f"fedproto-s{s}"] - acc[f"fedavg-s{s}"] for s in (0, 1)]
    half = T_975[1] * statistics.stdev(diffs) / math.sqrt(2)
    row = rows[("fedproto", "acc")]
    assert int(row["pairs"]) == 2
    assert float(row["diff"]) == pytest.approx(statistics.mean(diffs), abs=1e-12)
    assert float(row["diff_low"]) == pytest.approx(statistics.mean(diffs) - half, abs=1e-9)
    assert float(row["diff_high"]) == pytest.approx(statistics.mean(diffs) + half, abs=1e-9)
    assert rows[("fedavg", "acc")]["diff"] == ""  # the baseline itself
    # the terminal and Markdown forms show the same numbers, in per cent
    shown = f"{100 * statistics.mean(acc[n] for n in NAMES[2:]):.2f}"
    shown += f" ± {100 * statistics.stdev(acc[n] for n in NAMES[2:]):.2f}"
    delta = (f"{100 * statistics.mean(diffs):+.2f} [{100 * (statistics.mean(diffs) - half):+.2f}"
             f", {100 * (statistics.mean(diffs) + half):+.2f}]")
    markdown = (tmp_path / "t.md").read_text()
    for text in (stdout, markdown):
        assert shown in text and delta in text
        assert "fedavg-s0" in text and "no proto_acc" in text  # listed, not dropped
    assert markdown.splitlines()[0].startswith("| algorithm.name | n | acc (%) | Δ acc (pp)")


def test_the_table_accepts_run_directories_and_groups_by_any_key(sweep):
    _, out, _ = sweep
    code, stdout, stderr = call(["table", *(str(out / n) for n in NAMES),
                                 "--group-by", "federation.seed", "--metric", "wall_s",
                                 "--metric", "best.acc", "--pair-by", "algorithm.name",
                                 "--baseline", "0"])
    assert code == 0, stderr
    s = summaries(out)
    best = [s[n]["best"]["acc_mean"] for n in ("fedavg-s1", "fedproto-s1")]
    assert f"{100 * statistics.mean(best):.2f} ± {100 * statistics.stdev(best):.2f}" in stdout
    assert "4 complete run(s) by federation.seed" in stdout


def test_a_second_sweep_skips_complete_runs_and_redoes_an_incomplete_one(sweep, tmp_path):
    cfg, out, _ = sweep
    again = shutil.copytree(out, tmp_path / "cmp")
    # as if stopped before its first checkpoint: nothing to resume from (an interrupted run
    # with a checkpoint is resumed: tests/test_interrupt.py)
    (again / "fedproto-s1" / "summary.json").unlink()
    (again / "fedproto-s1" / "checkpoint.fbk").unlink()
    kept = (again / "fedproto-s1" / "metrics.jsonl").read_text()
    code, stdout, stderr = call(["table", str(again)])
    assert code == 0, stderr
    assert f"not in the table: {again / 'fedproto-s1'} (unfinished: no summary.json" in stdout
    assert "3 complete run(s)" in stdout

    code, stdout, stderr = call(["sweep", str(cfg), *GRID, "--out", str(again)])
    assert code == 0, f"{stdout}\n{stderr}"
    for name in NAMES[:3]:
        assert f"skip    {name}: complete already" in stdout
    assert "fedproto-s1: unfinished: no summary.json" in stdout
    assert "moved to fedproto-s1.incomplete-1" in stdout
    assert "done    fedproto-s1" in stdout
    assert "4 complete (3 skipped), 0 failed" in stdout
    assert (again / "fedproto-s1.incomplete-1" / "metrics.jsonl").read_text() == kept
    assert json.loads((again / "fedproto-s1" / "summary.json").read_text())[
        "rounds_completed"] == 2
    record = json.loads((again / "sweep.json").read_text())
    assert record["runs"][3]["moved_incomplete_to"] == "fedproto-s1.incomplete-1"
    # and a third time, nothing left to do; a third seed would run two more
    code, stdout, _ = call(["sweep", str(cfg), *GRID, "--out", str(again), "--dry-run"])
    assert code == 0 and "0 to run" in stdout
    code, stdout, _ = call(["sweep", str(cfg), *GRID[:-1], "3", "--out", str(again),
                            "--dry-run"])
    assert code == 0 and "6 runs (2 grid point(s) x 3 seed(s))" in stdout
    assert "2 to run" in stdout and "fedproto-s2: --set algorithm.name=fedproto --set " \
        "federation.seed=2: would run" in stdout


def test_a_complete_run_of_another_config_is_refused_not_reused(sweep, tmp_path):
    cfg, out, _ = sweep
    again = shutil.copytree(out, tmp_path / "cmp")
    config_file = again / "fedavg-s0" / "config.json"
    config = json.loads(config_file.read_text())
    config["train"]["lr"] = 0.01
    config_file.write_text(json.dumps(config))
    code, stdout, stderr = call(["sweep", str(cfg), *GRID, "--out", str(again)])
    assert code == 2
    assert "fedavg-s0 is a complete run of another config (train.lr = 0.01 there, 0.05" \
        in stderr
    code, _, stderr = call(["sweep", str(cfg), *GRID, "--set", "train.lr=0.01",
                            "--out", str(again)])
    assert code == 2 and "holds a sweep of another base config" in stderr


@pytest.mark.parametrize("argv, says", [
    (["--grid", "algorithm.nme=fedavg"], "unknown key algorithm.nme"),
    (["--grid", "algorithm.name=fedavg,nosuch"], "unknown algorithm 'nosuch'"),
    (["--grid", "train.lr=0.1,-1"], "train.lr = -1.0: must be >= 0.0 (in run lr=-1-s0"),
    (["--grid", "train.lr"], "--grid 'train.lr': expected section.key=value1,value2"),
    (["--grid", "train.lr=0.1,,0.2"], "an empty value"),
    (["--grid", "federation.seed=1,2"], "give seeds with --seeds"),
    (["--set", "federation.seed=3", "--seeds", "2"], "give seeds with --seeds only"),
    (["--seeds", "0,0"], "--seeds '0,0': expected N"),
    (["--set", "train.lr=0.1", "--grid", "train.lr=0.2,0.3"], "both --set and --grid"),
])
def test_bad_sweep_arguments_are_one_line_and_exit_2(tmp_path, argv, says):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    code, stdout, stderr = call(["sweep", str(cfg), *argv, "--out", str(tmp_path / "o")])
    assert code == 2
    assert says in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not (tmp_path / "o").exists()  # nothing started, nothing written


def test_a_failed_run_is_reported_with_its_cause_and_the_sweep_exits_1(tmp_path):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "o"
    code, stdout, stderr = call(["sweep", str(cfg), "--set", "data.dataset=npz:/no/such.npz",
                                 "--grid", "algorithm.name=fedavg,fedproto", "--out",
                                 str(out), "--jobs", "2"])
    assert code == 1, stderr
    for name in ("fedavg-s0", "fedproto-s0"):
        assert f"FAILED  {name}" in stdout
    assert "exit 2: fedbus run: data.dataset = 'npz:/no/such.npz'" in stdout
    assert "0 complete (0 skipped), 2 failed" in stdout and "next:" not in stdout
    record = json.loads((out / "sweep.json").read_text())
    assert [r["status"] for r in record["runs"]] == ["failed", "failed"]
    assert "npz dataset not found" in record["runs"][0]["note"]
    code, _, stderr = call(["table", str(out)])
    assert code == 2 and "none of the 2 run(s) is complete" in stderr
    assert "not run (sweep status: failed)" in stderr


def test_ctrl_c_stops_the_running_runs_and_the_same_command_continues(tmp_path):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    out = tmp_path / "o"
    argv = ["sweep", str(cfg), "--seeds", "2", "--out", str(out), "--jobs", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", *argv], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (out / "s0" / "config.json").exists(), 120,
                   "the first run to start")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "the same command continues it" in stderr
    status = {r["name"]: r["status"] for r in json.loads((out / "sweep.json").read_text())[
        "runs"]}
    assert status["s0"] in ("interrupted", "complete")  # it may finish as we stop it
    assert status["s1"] == "pending"
    code, stdout, stderr = call(argv)
    assert code == 0, stderr
    assert "2 complete" in stdout


def test_bad_table_arguments_are_one_line_and_exit_2(sweep, tmp_path):
    _, out, _ = sweep
    for argv, says in ((["--group-by", "algorithm.nme"],
                        "--group-by algorithm.nme: no run's config.json has it; [algorithm] "
                        "keys are"),
                       (["--metric", "nosuch"], "--metric nosuch: no complete run"),
                       (["--baseline", "fedprox"], "--baseline fedprox: no group has "
                        "algorithm.name = fedprox; values: fedavg, fedproto"),
                       (["--group-by", "federation.seed"], "--pair-by federation.seed is "
                        "also a --group-by key")):
        code, _, stderr = call(["table", str(out), *argv])
        assert code == 2 and says in stderr and len(stderr.strip().splitlines()) == 1, stderr
    code, _, stderr = call(["table", str(tmp_path)])
    assert code == 2 and "not a run directory, a sweep" in stderr


def test_help_has_examples():
    for command in ("sweep", "table"):
        with contextlib.redirect_stdout(io.StringIO()) as text, pytest.raises(SystemExit):
            fedbus([command, "--help"])
        assert "examples:" in text.getvalue() and f"fedbus {command} " in text.getvalue()


# --- names, grids, seeds ------------------------------------------------------------------

def test_grid_values_split_at_top_level_commas():
    assert sweep_cmd.split_values('["cnn","cnn4"],["cnn"]') == ['["cnn","cnn4"]', '["cnn"]']
    assert sweep_cmd.split_values("0.01, 0.05") == ["0.01", "0.05"]
    assert sweep_cmd.split_values("'a,b',c") == ["'a,b'", "c"]


def test_seeds_are_a_count_a_list_or_a_range():
    assert sweep_cmd.parse_seeds("3") == [0, 1, 2]
    assert sweep_cmd.parse_seeds("0,1,5") == [0, 1, 5]
    assert sweep_cmd.parse_seeds("7,") == [7]
    assert sweep_cmd.parse_seeds("3-5") == [3, 4, 5]
    for bad in ("0", "a", "1,1", "5-3", ""):
        with pytest.raises(sweep_cmd.SweepError):
            sweep_cmd.parse_seeds(bad)


def test_run_names_are_stable_readable_and_filesystem_safe():
    keys = ["algorithm.name", "train.lr", "data.alpha", "algorithm.alpha"]
    parts = sweep_cmd.part_names(keys)
    point = {"algorithm.name": "fedavg", "train.lr": "0.01", "data.alpha": "0.1",
             "algorithm.alpha": "1"}
    assert sweep_cmd.run_name(point, 1, parts) == \
        "fedavg-lr=0.01-data.alpha=0.1-algorithm.alpha=1-s1"
    groups = sweep_cmd.part_names(["model.group"])
    assert sweep_cmd.run_name({"model.group": '["cnn", "cnn4"]'}, 0, groups) == \
        "group=cnn_cnn4-s0"
    long = sweep_cmd.run_name({"model.group": "x" * 300}, 0, groups)
    assert len(long) <= 120 and long == sweep_cmd.run_name({"model.group": "x" * 300}, 0,
                                                           groups)


# --- the statistics, by hand --------------------------------------------------------------

def test_t_quantiles_match_the_tables():
    for df, t in T_975.items():
        assert stats.t_quantile(0.975, df) == pytest.approx(t, rel=1e-10)
    assert stats.t_quantile(0.975, 10**7) == pytest.approx(1.959964, abs=1e-6)  # normal
    assert stats.t_quantile(0.025, 4) == pytest.approx(-T_975[4], rel=1e-10)
    assert stats.t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-12)
    assert stats.t_cdf(T_975[2], 2) == pytest.approx(0.975, abs=1e-12)
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 3, 7.5, 30):
        for p in (0.6, 0.9, 0.995):
            assert stats.t_quantile(p, df) == pytest.approx(scipy_stats.t.ppf(p, df),
                                                            rel=1e-9)


def test_paired_difference_by_hand():
    # differences 0.10, 0.05, 0.12: mean 0.09; sd = sqrt((0.01² + 0.04² + 0.03²) / 2)
    # = sqrt(0.0013) = 0.036056; half width t(0.975, 2) * sd / sqrt(3)
    # = 4.302653 * 0.020817 = 0.089567
    d = stats.paired_difference({"0": 0.80, "1": 0.85, "2": 0.90, "3": 0.5},
                                {"0": 0.70, "1": 0.80, "2": 0.78})
    assert d.pairs == 3
    assert d.mean == pytest.approx(0.09)
    assert d.std == pytest.approx(math.sqrt(0.0013))
    assert d.low == pytest.approx(0.09 - 0.0895672, abs=1e-6)
    assert d.high == pytest.approx(0.09 + 0.0895672, abs=1e-6)
    one = stats.paired_difference({"0": 0.8}, {"0": 0.7})
    assert one.pairs == 1 and one.mean == pytest.approx(0.1) and one.low is None
    assert stats.paired_difference({"0": 0.8}, {"1": 0.7}) is None


def test_mean_std_is_the_sample_std():
    assert stats.mean_std([1.0, 2.0, 4.0]) == (pytest.approx(7 / 3),
                                               pytest.approx(math.sqrt(7 / 3)))
    assert stats.mean_std([0.5]) == (0.5, None)
    assert stats.mean_std([]) == (None, None)


def test_metric_names():
    summary = {"final": {"acc_mean": 0.8, "acc_weighted": 0.7, "proto_acc_mean": 0.9},
               "best": {"acc_mean": 0.85, "acc_round": 3}, "wall_s": 12.5, "bytes_up": 10}
    assert stats.metric_value(summary, "acc") == 0.8
    assert stats.metric_value(summary, "proto_acc") == 0.9
    assert stats.metric_value(summary, "final.acc_weighted") == 0.7
    assert stats.metric_value(summary, "best.acc") == 0.85
    assert stats.metric_value(summary, "best.acc_round") == 3
    assert stats.metric_value(summary, "wall_s") == 12.5
    assert stats.metric_value(summary, "miou") is None


def fake(path: Path, algorithm: str, seed: int, acc: float | None, *, lr: float = 0.05,
         rounds: int = 3, done: int | None = None) -> Path:
    """A run directory with just what the table reads."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({
        "federation": {"rounds": rounds, "seed": seed}, "algorithm": {"name": algorithm},
        "train": {"lr": lr}}))
    if acc is not None:
        (path / "summary.json").write_text(json.dumps({
            "algorithm": algorithm, "rounds_completed": rounds if done is None else done,
            "final": {"acc_mean": acc}, "best": {}}))
    return path


def test_groups_by_two_keys_compare_within_the_other_keys(tmp_path):
    accs = {("a", 0.1): [0.50, 0.60], ("b", 0.1): [0.70, 0.75],
            ("a", 0.5): [0.40, 0.42], ("b", 0.5): [0.45, 0.50]}
    runs = [fake(tmp_path / f"{alg}-lr{lr}-s{s}", alg, s, acc, lr=lr)
            for (alg, lr), values in accs.items() for s, acc in enumerate(values)]
    runs.append(fake(tmp_path / "b-short", "b", 2, 0.99, done=2))  # 2 of 3 rounds
    runs.append(fake(tmp_path / "b-none", "b", 3, None))
    table = stats.build_table(stats.select_runs(runs).runs, ["algorithm.name", "train.lr"],
                              [], baseline="a")
    assert [r.values for r in table.rows] == [("a", "0.1"), ("a", "0.5"), ("b", "0.1"),
                                              ("b", "0.5")]
    b01 = table.rows[2].cells["acc"]
    assert b01.n == 2 and b01.mean == pytest.approx(0.725)
    # paired with a at lr 0.1: differences 0.20 and 0.15
    assert b01.diff.mean == pytest.approx(0.175)
    half = T_975[1] * statistics.stdev([0.20, 0.15]) / math.sqrt(2)
    assert b01.diff.low == pytest.approx(0.175 - half)
    assert table.rows[3].cells["acc"].diff.mean == pytest.approx(0.065)
    assert table.rows[0].cells["acc"].diff_note == "baseline"
    assert sorted((r.name, why) for r, why in table.excluded) == [
        ("b-none", "unfinished: no summary.json (stopped, or still running)"),
        ("b-short", "2 of 3 rounds completed")]


def test_runs_sharing_a_seed_in_a_group_are_not_paired(tmp_path):
    runs = [fake(tmp_path / "a0", "a", 0, 0.5), fake(tmp_path / "b0", "b", 0, 0.6),
            fake(tmp_path / "b0-lr", "b", 0, 0.7, lr=0.1)]
    table = stats.build_table(stats.select_runs(runs).runs, ["algorithm.name"], ["acc"],
                              baseline="a")
    cell = table.rows[1].cells["acc"]
    assert cell.diff is None and cell.diff_note == "not paired"
    assert any("several runs share federation.seed = 0" in n for n in table.notes)


def test_a_folder_of_runs_expands_and_a_run_named_twice_counts_once(tmp_path):
    fake(tmp_path / "runs" / "x", "a", 0, 0.5)
    fake(tmp_path / "runs" / "y", "b", 0, 0.6)
    selection = stats.select_runs([tmp_path / "runs", tmp_path / "runs" / "x"])
    assert [r.name for r in selection.runs] == ["x", "y"]
    assert any("named twice" in n for n in selection.notes)


def test_a_base_config_with_one_algorithms_keys_gets_a_hint_for_the_grid(tmp_path):
    """A FedProto CONFIG (its lam) swept over algorithm.name: FedAvg refuses lam, and the
    one line says what to do about it."""
    cfg = write_config(tmp_path / "proto.toml",
                       {**TINY, "algorithm": {"name": "fedproto", "lam": 1.0}})
    code, _, stderr = call(["sweep", str(cfg), "--grid", "algorithm.name=fedavg,fedproto",
                            "--out", str(tmp_path / "o")])
    assert code == 2 and len(stderr.strip().splitlines()) == 1, stderr
    assert "unknown key algorithm.lam" in stderr
    assert "must suit every algorithm of the grid" in stderr
