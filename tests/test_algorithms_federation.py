"""Every registered algorithm completes a small federation of real processes
(broker, server, two client nodes) on scikit-learn's digits, in the engine's
modes that stress a handler:

(a) sync rounds with partial participation, a deadline and a straggler whose
    late update is folded into a later round with its staleness weight;
(b) async buffered aggregation (concurrency < clients, buffer 2) with a slow
    client, so updates arrive out of order and some are stale.

The algorithms that allow different models per client (HETEROGENEOUS) run
(a) with a model group. Two runs per algorithm keep the file
within a few minutes on two cores; the mathematics of each algorithm is
tested in tests/test_algo_*.py, the engine's modes in tests/test_federation.py.
"""
from __future__ import annotations

import math

import pytest
from helpers import SMALL, merged, run_async_with_slow_client, run_with_folded_straggler

ALGORITHMS = ["local", "fedavg", "fedprox", "fedproto", "fedavg-proto", "mpfedcl",
              "proto-attention", "fedtgp"]
# (the baselines of the papers' tables run the same two tests in
# tests/test_baselines_federation.py, a file of its own so that the test command's
# `-n 2 --dist loadfile` runs the two halves on different workers)
# No whole-model averaging: these run (a) with a model group (LG-FedAvg, FedGH and FedGen
# share only the head, FML and FedKD only their auxiliary model).
HETEROGENEOUS = {"local", "fedproto", "fedtgp", "fd", "lg-fedavg", "fml", "fedkd", "fedgh",
                 "fedgen"}
PROTO_METRIC = {"fedproto", "fedavg-proto", "mpfedcl", "proto-attention", "fedtgp"}
# MP-FedCL's sync run trains k = 1 (SP-FedCL: class means, no k-means); the async run
# below trains the default k = 2.
SYNC_PARAMS = {"mpfedcl": {"k": 1}}
# FedAvg-proto uploads prototypes in the last round only; in async mode the last
# buffer may hold only updates made from earlier versions, so ask every round.
ASYNC_PARAMS = {"fedavg-proto": {"every_round": True}}


def _final_accuracy(summary: dict) -> float:
    final = summary["final"]
    values = [final.get(key) for key in ("acc_mean", "proto_acc_mean")]
    values = [v for v in values if v is not None and not math.isnan(v)]
    assert values, final
    return max(values)


def _straggler_config(algorithm: str) -> dict:
    # 5 of the 6 clients are sampled per round; federation.seed 1 samples the straggler
    # (helpers.SLOW) in every one, and at least one of its node's two others
    # (helpers.straggler: its update of each round is folded into the next)
    cfg = merged(SMALL, federation={"rounds": 4, "fraction": 0.75, "eval_every": 4},
                 algorithm={"name": algorithm, **SYNC_PARAMS.get(algorithm, {})},
                 train={"epochs": 2})
    if algorithm in HETEROGENEOUS:
        cfg["model"] = {"group": ["cnn", "mlp"], "feature_dim": 32}
    return cfg


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_sync_partial_participation_with_a_folded_straggler(tmp_path, algorithm):
    check_sync_with_a_folded_straggler(tmp_path, algorithm)


def check_sync_with_a_folded_straggler(tmp_path, algorithm: str) -> dict:
    """The sync run's checks; returns its summary."""
    _, summary, recs = run_with_folded_straggler(tmp_path, _straggler_config(algorithm))
    assert all(r["sampled"] == 5 for r in recs), [r["sampled"] for r in recs]
    # every round aggregated something the algorithm could use
    assert all(r["agg"].get("updates", r["updates"]) == r["updates"] for r in recs)
    final = summary["final"]
    assert ("proto_acc_mean" in final) == (algorithm in PROTO_METRIC), final
    assert _final_accuracy(summary) > 0.2  # chance is 0.1
    return summary


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_async_buffered_with_a_slow_client(tmp_path, algorithm):
    sections = merged(SMALL, federation={"rounds": 4, "eval_every": 4},
                      algorithm={"name": algorithm, **ASYNC_PARAMS.get(algorithm, {})})
    _, summary, _ = run_async_with_slow_client(tmp_path, sections, concurrency=4)
    final = summary["final"]
    assert final["acc_mean"] is not None and 0.0 <= final["acc_mean"] <= 1.0, final
    if algorithm in PROTO_METRIC:
        assert "proto_acc_mean" in final and 0.0 <= final["proto_acc_mean"] <= 1.0, final
    # 4 aggregations of 2 one-epoch updates each: reported, not necessarily learnt
