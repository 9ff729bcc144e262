"""The `central` baseline as a real federation (broker, server, two client nodes on
scikit-learn's digits), and FFD (log.ffd_reference) of a real FedAvg run against it:

* central trains one model on every client's training split pooled at the server, the
  clients only evaluate it: it completes, learns well above chance, leaves its model in
  checkpoint.fbk, and `fedbus replay` re-trains it bit for bit;
* a FedAvg run pointing log.ffd_reference at it records, at every evaluation, a finite
  non-negative MMD per client and their mean;
* the central model against itself has FFD 0;
* an algorithm without a global model is refused with one line before anything starts.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import SMALL, fedbus, merged, metrics, run_federation

from fedbus.node.server import read_checkpoint

CENTRAL = merged(SMALL, algorithm={"name": "central"})


@pytest.fixture(scope="module")
def central(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("central")
    run_dir, summary = run_federation(tmp, CENTRAL, name="central")
    return run_dir, summary


def test_central_completes_and_learns_above_chance(central):
    run_dir, summary = central
    recs = metrics(run_dir)
    assert summary["algorithm"] == "central"
    assert summary["rounds_completed"] == SMALL["federation"]["rounds"]
    assert [r["round"] for r in recs] == [0, 1, 2]
    for r in recs:
        # the server trained on the pooled training splits; the clients trained nothing
        assert r["agg"]["steps"] > 0 and r["agg"]["samples"] > 100
        assert math.isfinite(r["agg"]["train_loss"])
        assert r["partial"] == 0 and r["eval_clients"] == SMALL["federation"]["clients"]
    assert recs[-1]["agg"]["train_loss"] < recs[0]["agg"]["train_loss"]
    assert summary["final"]["acc_weighted"] > 0.5  # 10 classes: chance is 0.1
    _raw, state = read_checkpoint(run_dir / "checkpoint.fbk")
    assert state["version"] == 3 and "conv1.weight" in " ".join(state["handler"]["weights"])


def test_central_replays_bit_for_bit(central):
    run_dir, _ = central
    out = fedbus("replay", str(run_dir)).stdout
    assert "replay identical" in out, out


def test_fedavg_records_ffd_against_the_central_run(central, tmp_path):
    ref, _ = central
    cfg = merged(SMALL, log={"ffd_reference": str(ref)})
    run_dir, _ = run_federation(tmp_path, cfg, name="fedavg-ffd")
    recs = [r for r in metrics(run_dir) if "acc_mean" in r]
    assert len(recs) == SMALL["federation"]["rounds"]
    for r in recs:
        per = r["ffd"]
        assert set(per) == {str(c) for c in range(SMALL["federation"]["clients"])}
        assert all(math.isfinite(v) and v >= 0.0 for v in per.values())
        assert r["ffd_mean"] == pytest.approx(np.mean(list(per.values())))
        assert math.isfinite(r["ffd_round_mean"]) and r["ffd_mean"] > 0.0
    assert "ffd_mean" in (run_dir / "metrics.csv").read_text().splitlines()[0]


def test_the_central_model_against_itself_is_zero(central):
    from fedbus.analysis.ffd import FeatureDiscrepancy, load_reference
    from fedbus.node.config import build_config

    ref, _ = central
    raw = json.loads((ref / "config.json").read_text())
    raw["log"]["ffd_reference"] = str(ref)
    cfg = build_config(raw)  # the central run's own config (algorithm central)
    ffd = FeatureDiscrepancy(cfg)
    _, weights = load_reference(cfg)

    class Handler:
        def global_weights(self):
            return weights

    out = ffd.record_metrics(Handler(), {"participants": list(range(6))})
    assert len(out["ffd"]) == SMALL["federation"]["clients"]
    assert max(out["ffd"].values()) < 1e-6 and out["ffd_mean"] < 1e-6


def test_ffd_without_a_global_model_is_a_one_line_config_error(central, tmp_path):
    ref, _ = central
    from fedbus.bench.common import write_toml
    cfg = write_toml(tmp_path / "fp.toml",
                     merged(SMALL, algorithm={"name": "fedproto"},
                            log={"ffd_reference": str(ref)}))
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "fp"), "--quiet", check=False,
                  timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "log.ffd_reference" in lines[0] and "fedproto" in lines[0]
    assert not (tmp_path / "fp" / "metrics.jsonl").exists()
