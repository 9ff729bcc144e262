"""FFD's mathematics (fedbus.analysis.ffd): the biased RBF MMD of Gretton et al. against a
hand computation, the median heuristic, eq. 17, and the per-client metric the server
adds to an evaluation record, on tiny arrays and networks, with no broker. The real
federations (a `central` run as the reference, a FedAvg run recording FFD) are in
tests/test_central.py."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fedbus.analysis.ffd import ffd_gain, median_bandwidth, mmd_rbf


def k(a, b, sigma):
    return math.exp(-sum((p - q) ** 2 for p, q in zip(a, b)) / (2 * sigma * sigma))


def test_mmd_matches_a_hand_computation():
    x = [[0.0, 0.0], [1.0, 0.0]]
    y = [[0.0, 2.0]]
    s = 1.5
    kxx = (k(x[0], x[0], s) + k(x[0], x[1], s) + k(x[1], x[0], s) + k(x[1], x[1], s)) / 4
    kyy = k(y[0], y[0], s)
    kxy = (k(x[0], y[0], s) + k(x[1], y[0], s)) / 2
    want = math.sqrt(kxx + kyy - 2 * kxy)
    assert mmd_rbf(np.array(x), np.array(y), sigma=s) == pytest.approx(want, rel=1e-12)


def test_median_heuristic_by_hand():
    x = np.array([[0.0], [1.0]])
    y = np.array([[3.0]])
    # pooled {0, 1, 3}: distances 1, 3, 2 -> median 2
    assert median_bandwidth(x, y) == pytest.approx(2.0)
    s = 2.0
    kxx = (2 + 2 * k([0], [1], s)) / 4
    kxy = (k([0], [3], s) + k([1], [3], s)) / 2
    assert mmd_rbf(x, y) == pytest.approx(math.sqrt(kxx + 1 - 2 * kxy), rel=1e-12)
    # all points equal: the median is 0 and the bandwidth falls back to 1
    assert median_bandwidth(np.zeros((2, 3)), np.zeros((2, 3))) == 1.0


def test_mmd_is_zero_for_identical_sets_and_grows_with_a_shift():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 8))
    assert mmd_rbf(x, x.copy()) == pytest.approx(0.0, abs=1e-7)
    near, far = mmd_rbf(x, x + 0.1), mmd_rbf(x, x + 3.0, sigma=median_bandwidth(x, x + 0.1))
    assert 0.0 < near < far <= math.sqrt(2.0)
    assert math.isnan(mmd_rbf(np.zeros((0, 8)), x))


def test_eq17_relative_gain():
    assert ffd_gain(0.5, 0.4) == pytest.approx(20.0)
    assert ffd_gain(0.5, 0.6) == pytest.approx(-20.0)


class _Handler:
    def __init__(self, weights):
        self.weights = weights

    def global_weights(self):
        return self.weights


def test_record_metrics_on_a_hand_made_reference(tmp_path):
    """A reference run directory written by hand (config.json + checkpoint.fbk, as the
    server writes them): its own weights give 0 on every client, other weights > 0,
    and ffd_round_mean averages over the record's participants only."""
    from fedbus.algorithms.core.handlers import model_weights
    from fedbus.analysis.ffd import FeatureDiscrepancy
    from fedbus.broker.wire import encode_body
    from fedbus.node.config import build_config
    from fedbus.node.setup import make_model

    data = {"dataset": "digits", "partition": "iid"}
    ref = build_config({"federation": {"clients": 3, "seed": 4}, "data": data,
                        "model": {"arch": "mlp"}, "algorithm": {"name": "central"}})
    ref_weights = model_weights(make_model(ref, 0))
    run_dir = tmp_path / "ref"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(ref.to_dict()))
    (run_dir / "checkpoint.fbk").write_bytes(encode_body({"version": 1, "handler":
                                                          {"weights": ref_weights}}))
    cfg = build_config({"federation": {"clients": 3, "seed": 4}, "data": data,
                        "model": {"arch": "mlp"}, "algorithm": {"name": "fedavg"},
                        "log": {"ffd_reference": str(run_dir), "ffd_samples": 40}})
    ffd = FeatureDiscrepancy(cfg)
    assert ffd.notes == []
    assert all(len(x) == 40 for x in ffd.inputs.values())
    same = ffd.record_metrics(_Handler(ref_weights), {"participants": [0, 2]})
    assert set(same["ffd"]) == {"0", "1", "2"}
    assert max(same["ffd"].values()) < 1e-6 and same["ffd_mean"] < 1e-6
    other = {k: v + 0.05 * np.sign(v) if v.dtype.kind == "f" else v
             for k, v in ref_weights.items()}
    out = ffd.record_metrics(_Handler(other), {"participants": [0, 2]})
    vals = out["ffd"]
    assert all(v > 1e-3 and math.isfinite(v) for v in vals.values())
    assert out["ffd_mean"] == pytest.approx(np.mean(list(vals.values())))
    assert out["ffd_std"] == pytest.approx(np.std(list(vals.values())))
    assert out["ffd_round_mean"] == pytest.approx((vals["0"] + vals["2"]) / 2)


def test_config_errors_are_one_line(tmp_path):
    from fedbus.analysis.ffd import check_reference
    from fedbus.node.config import ConfigError, build_config

    def cfg(algorithm, ref):
        return build_config({"algorithm": {"name": algorithm},
                             "log": {"ffd_reference": str(ref)}})

    with pytest.raises(ConfigError, match=r"^log.ffd_reference = .*keeps none$"):
        check_reference(cfg("fedproto", tmp_path))
    with pytest.raises(ConfigError, match=r"^log.ffd_reference = .*no such run directory$"):
        check_reference(cfg("fedavg", tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"no config.json there"):
        check_reference(cfg("fedavg", tmp_path))
