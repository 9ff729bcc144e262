"""`fedbus bench segmentation` with partial work (Michieli & Ozay's Fig. 5 cells): real
federations on a few tiny generated shapes-seg images, FedAvg dropping the partial updates
that proto-attention aggregates, and the seed-by-seed paired line below the table."""
from __future__ import annotations

import argparse
import json

from fedbus.bench import reproduce, segmentation


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    segmentation.add_arguments(p)
    return p.parse_args(["--clients", "3", "--images", "120", "--image-size", "32",
                         "--nodes", "1", *argv])


def test_partial_work_runs_drop_for_fedavg_and_pair_the_seeds(tmp_path, capsys):
    args = _args("--seeds", "2", "--rounds", "2", "--alpha", "0.1", "--partial", "0.8",
                 "--out", str(tmp_path), "--json", str(tmp_path / "verdicts.json"))
    assert segmentation.main_args(args) == 0
    out = capsys.readouterr().out
    assert "partial work δ = 80 %" in out
    assert "Proto-attention − FedAvg: " in out and "over 2 seeds" in out
    runs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert [r.name for r in runs] == [segmentation.run_name(args, a, s)
                                      for a in ("fedavg", "proto-attention") for s in (0, 1)]
    assert all("-d0.8-" in r.name for r in runs)
    for run in runs:
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        partial = sum(len(r["partial_clients"]) for r in records)
        failed = sum(r["agg"]["failures"] for r in records)
        assert partial > 0, run.name  # 80 % of tasks ran partial work
        if "fedavg" in run.name:  # the paper's FedAvg: a partial update is a failure
            assert failed == partial, (run.name, records)
        else:  # proto-attention aggregates partial work (its toleration)
            assert failed == 0 and all(r["agg"]["updates"] == 3 for r in records)
    results = json.loads((tmp_path / "segmentation.json").read_text())
    assert len(results) == 4 and all(0.0 < r["miou"] <= 1.0 for r in results)
    # the paired verdict, in the shape `bench reproduce verdicts` merges into its one table
    doc = json.loads((tmp_path / "verdicts.json").read_text())
    (pair,) = doc["ordering"]["ours"]["paired"]
    miou = {(r["algorithm"], r["seed"]): 100 * r["miou"] for r in results}
    diffs = [miou["proto-attention", s] - miou["fedavg", s] for s in (0, 1)]
    assert pair["hi"] == "Proto-attention, mIoU" and pair["lo"] == "FedAvg, mIoU"
    assert pair["seeds"] == 2 and abs(pair["mean"] - sum(diffs) / 2) < 1e-9
    assert pair["low"] <= pair["mean"] <= pair["high"]
    expected = "holds" if pair["low"] > 0 else "fails" if pair["high"] < 0 else "unresolved"
    assert pair["verdict"] == expected
    lines = reproduce.verdict_table([doc])
    assert lines[2].startswith("| Proto-attention, mIoU > FedAvg, mIoU | `segmentation` "
                               "(alpha 0.1, δ = 80 %, 2 rounds) | ")
    assert lines[2].endswith(f"| 2 | {expected} |")


def test_without_partial_work_the_configs_and_names_are_unchanged_and_bad_shares_refused():
    args = _args()
    cfg = segmentation.sections(args, "fedavg", 0)
    assert "system" not in cfg and cfg["algorithm"] == {"name": "fedavg"}
    # the name runs had before --partial existed, so --out reuses them
    assert segmentation.run_name(args, "fedavg", 0) == \
        "seg-fedavg-deeplab-c3-a0.5-n120-s32-r20-e1-seed0"
    args = _args("--partial", "0.5")
    assert segmentation.sections(args, "fedavg", 0)["algorithm"] == {"name": "fedavg",
                                                                    "partial": "drop"}
    assert segmentation.sections(args, "proto-attention", 0)["system"] == {
        "partial_work": True, "partial_fraction": 0.5}
    assert segmentation.main_args(_args("--partial", "1.5")) == 2


def test_tolerate_makes_fedavg_keep_partial_updates_under_its_own_run_name():
    drop, tol = _args("--partial", "0.8"), _args("--partial", "0.8", "--tolerate")
    assert segmentation.sections(tol, "fedavg", 1)["algorithm"] == {"name": "fedavg"}
    assert segmentation.sections(tol, "fedavg", 1)["system"] == \
        segmentation.sections(drop, "fedavg", 1)["system"]
    assert segmentation.run_name(tol, "fedavg", 1) != segmentation.run_name(drop, "fedavg", 1)
    # proto-attention tolerates by design: its runs are shared by both invocations
    assert segmentation.run_name(tol, "proto-attention", 1) == \
        segmentation.run_name(drop, "proto-attention", 1)
    assert segmentation.sections(tol, "proto-attention", 1) == \
        segmentation.sections(drop, "proto-attention", 1)
    doc = segmentation.verdict_doc(tol, [], ["fedavg", "proto-attention"])
    assert "FedAvg tolerating partial work" in doc["overrides"]
    assert segmentation.main_args(_args("--tolerate")) == 2
