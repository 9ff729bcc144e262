"""`fedbus bench train`: its single-process reference loop (both styles) and its side-by-side
comparison with a real `fedbus run`, on a tiny federation (digits, 2 clients). No timing
is asserted: the figures are the benchmark's to print."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np

from fedbus.bench import train


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    return p.parse_args(["--data", "digits", "--clients", "2", *argv])


def _finite_fraction(v) -> bool:
    return v is not None and not math.isnan(v) and 0.0 <= v <= 1.0


def test_reference_styles_train_the_same_partition_to_finite_accuracies():
    cfg = train.sections(_args("--rounds", "2"))
    rows = {}
    for style in train.STYLES:
        ref = train.Reference(cfg, style)
        rows[style] = ref.run(2)
        sizes = (ref.train_sizes, ref.test_sizes)
        assert sum(sizes[0]) + sum(sizes[1]) == 1797  # every digit, once
        for r in rows[style]:
            assert _finite_fraction(r["acc"]) and _finite_fraction(r["proto_acc"])
            assert r["round_s"] >= r["train_s"] > 0
        assert sorted(ref.global_protos) == list(range(10))
    # Round 0 has no global prototype yet: the same batches through the same networks,
    # whether a DataLoader or an index gathers them, give the same head.
    assert rows["htfllib"][0]["acc"] == rows["lean"][0]["acc"]
    assert abs(rows["htfllib"][1]["proto_acc"] - rows["lean"][1]["proto_acc"]) < 0.05


def test_the_comparison_runs_fedbus_and_the_reference_on_one_partition(tmp_path):
    out = tmp_path / "json"
    args = _args("--rounds", "1", "--nodes", "2", "--reference", "lean", "--threads", "1",
                 "--out", str(tmp_path / "runs"), "--json", str(out))
    assert train.main_args(args) == 0
    res = json.loads(out.read_text())
    fb, ref = res["fedbus"], res["reference"]["lean"]
    # the sizes fedbus's clients reported (from the server's message log) are the reference's
    assert res["same_partition"] is True
    assert fb["train_sizes"] == ref["train_sizes"] and len(fb["train_sizes"]) == 2
    assert _finite_fraction(fb["acc"][0]) and _finite_fraction(fb["proto_acc"][0])
    assert _finite_fraction(ref["acc"][0]) and _finite_fraction(ref["proto_acc"][0])
    # the same computation on both sides (one thread each; the order of float sums may
    # still differ between the two programs)
    assert abs(fb["acc"][0] - ref["acc"][0]) < 0.05
    assert fb["median_s"] > 0 and ref["median_s"] > 0
    assert res["ratio"]["lean"]["median"] == fb["median_s"] / ref["median_s"]


def test_htfllib_export_holds_each_clients_arrays_in_its_layout(tmp_path):
    from fedbus.node.config import build_config
    from fedbus.node.setup import federated_data

    cfg = train.sections(_args())
    assert train.export_htfllib(cfg, tmp_path) == 2
    data = federated_data(build_config(cfg))
    for i in range(2):
        d = data.client(i)
        for split, x, y in (("train", d.train_x, d.train_y), ("test", d.test_x, d.test_y)):
            # HtFLlib's utils/data_utils.py read_data
            with open(tmp_path / split / f"{i}.npz", "rb") as f:
                got = np.load(f, allow_pickle=True)["data"].tolist()
            assert np.array_equal(got["x"], x) and np.array_equal(got["y"], y)
            assert got["x"].dtype == np.float32 and got["y"].dtype == np.int64


# The node-side speed-ups the benchmark measures must not change a single bit of what a
# client computes: FedProto's evaluation now takes one feature pass instead of two.

def _digits_client():
    import torch

    from fedbus.node.config import build_config
    from fedbus.node.setup import federated_data, make_model

    cfg = build_config(train.sections(_args("--arch", "cnn4")))
    data = federated_data(cfg)
    d = data.client(0)
    model = make_model(cfg, 0, data)
    x = torch.from_numpy(np.ascontiguousarray(d.test_x, np.float32))
    y = torch.from_numpy(np.ascontiguousarray(d.test_y, np.int64))
    # a few steps so that the head's scores are not those of the initial weights
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for i in range(0, 200, 20):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[i:i + 20]), y[i:i + 20]).backward()
        opt.step()
    return model, x, y


def test_one_pass_evaluation_equals_the_head_and_prototype_passes_bit_for_bit():
    import torch

    from fedbus.algorithms.core.metrics import head_metrics
    from fedbus.algorithms.core.protos import (
        class_means,
        embeddings,
        head_and_prototype_metrics,
        prototype_metrics,
    )

    model, x, y = _digits_client()
    protos, counts = class_means(embeddings(model, x), y, 10)
    for allowed in (counts > 0, torch.arange(10) < 3, None):
        for batch in (512, 7):  # one batch, and several with a ragged last one
            want = head_metrics(model, x, y, batch)
            want.update(prototype_metrics(model, x, y, protos, allowed, batch))
            got = head_and_prototype_metrics(model, x, y, protos, allowed, batch)
            assert got == want and list(got) == list(want)
            assert model.training  # left in train mode, as the two functions leave it
    nothing = torch.zeros(10, dtype=torch.bool)
    got = head_and_prototype_metrics(model, x, y, protos, nothing)
    assert math.isnan(got["proto_acc"]) and got["acc"] == head_metrics(model, x, y)["acc"]


def test_one_pass_evaluation_runs_a_network_whose_forward_is_its_own():
    """A network whose forward is not head(features(x)) is scored by model(x), as
    head_metrics scores it, not by a head applied to its features."""
    import torch

    from fedbus.algorithms.core.metrics import head_metrics
    from fedbus.algorithms.core.protos import head_and_prototype_metrics, prototype_metrics

    model, x, y = _digits_client()

    class Shifted(type(model)):
        def forward(self, inp):
            return super().forward(inp) + torch.arange(10.0)

    model.__class__ = Shifted
    protos = torch.randn(10, model.feature_dim)
    want = head_metrics(model, x, y)
    want.update(prototype_metrics(model, x, y, protos))
    assert head_and_prototype_metrics(model, x, y, protos) == want


def test_head_loss_sum_is_the_python_float_sum_of_the_batch_sums():
    import torch
    import torch.nn.functional as F

    from fedbus.algorithms.core.metrics import head_metrics

    model, x, y = _digits_client()
    model.eval()
    with torch.no_grad():
        total, correct = 0.0, 0
        for i in range(0, len(y), 13):
            logits = model(x[i:i + 13])
            total += F.cross_entropy(logits, y[i:i + 13], reduction="sum").item()
            correct += (logits.argmax(1) == y[i:i + 13]).sum().item()
    got = head_metrics(model, x, y, batch=13)
    assert got == {"acc": correct / len(y), "loss": total / len(y), "num_test": len(y)}
