"""`fedbus bench authors`: its export is fedbus's partition and start, seeded, in the layout
the patched authors' code reads; its fedbus side runs a real federation on digits and prints
the side-by-side table. The authors' code itself is not needed (nor run) here."""
from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from fedbus.bench import authors


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    authors.add_arguments(p)
    return p.parse_args(["--data", "digits", "--clients", "3", "--rounds", "2", *argv])


@pytest.mark.parametrize("method", authors.METHODS)
def test_export_holds_fedbus_partition_start_and_batch_seeds(tmp_path, method):
    from fedbus.algorithms.fednh import initial_prototypes
    from fedbus.node.client_host import node_threads
    from fedbus.node.config import build_config
    from fedbus.node.engine import task_seed
    from fedbus.node.setup import federated_data, make_model

    cfg = authors.sections(_args("--method", method, "--seed", "3"))
    assert cfg["algorithm"] == {"name": method, **authors.CODE_OPTIONS[method]}
    manifest = authors.export(cfg, tmp_path / "a")
    conf = build_config(cfg)
    data = federated_data(conf)
    got_manifest, arrays = authors.read_export(tmp_path / "a")
    assert got_manifest == manifest and len(arrays) == 3
    for i, got in enumerate(arrays):
        d = data.client(i)
        for key in ("train_x", "train_y", "test_x", "test_y"):
            assert np.array_equal(got[key], getattr(d, key))
        assert got["train_x"].dtype == np.float32 and got["train_y"].dtype == np.int64
    # every sample once: the partition covers the data set
    assert sum(len(a["train_y"]) + len(a["test_y"]) for a in arrays) == 1797
    with np.load(tmp_path / "a" / "init.npz") as z:
        init = {k: z[k] for k in z.files}
    state = make_model(conf, 0, data).state_dict()
    for k, v in state.items():
        assert np.array_equal(init[k], v.numpy())
    if method == "fednh":
        want = initial_prototypes(10, state["fc1.0.weight"].shape[0], "orthogonal", 3)
        assert np.array_equal(init["fednh.prototype"], want)
        assert manifest["params"]["init"] == "orthogonal"
    else:
        assert "fednh.prototype" not in init
        assert manifest["params"]["partition"] == "last"
        assert manifest["params"]["align_loss"] == "mean"
    assert manifest["task_seeds"] == [[task_seed(3, i, r) for i in range(3)] for r in range(2)]
    assert manifest["torch_threads"] == node_threads(conf) >= 1

    # seeded: the same seed exports the same arrays, another seed another partition
    again = authors.export(cfg, tmp_path / "b")
    _, arrays_b = authors.read_export(tmp_path / "b")
    assert again == manifest
    assert all(np.array_equal(a["train_y"], b["train_y"]) for a, b in zip(arrays, arrays_b))
    other = authors.export(authors.sections(_args("--method", method, "--seed", "4")),
                           tmp_path / "c")
    _, arrays_c = authors.read_export(tmp_path / "c")
    assert other["task_seeds"] != manifest["task_seeds"]
    assert any(len(a["train_y"]) != len(c["train_y"]) or
               not np.array_equal(a["train_y"], c["train_y"])
               for a, c in zip(arrays, arrays_c))


def test_export_prints_the_drivers_command(tmp_path, capsys):
    assert authors.main_args(_args("--method", "fpl", "--export", str(tmp_path / "x"))) == 0
    out = capsys.readouterr().out
    assert "fedbus_driver.py" in out and str(tmp_path / "x") in out
    assert (tmp_path / "x" / "manifest.json").is_file()


def test_fedbus_side_runs_and_prints_the_table_beside_a_reference(tmp_path, capsys):
    reference = tmp_path / "rounds.jsonl"
    reference.write_text("\n".join(json.dumps({"round": r, "acc": 0.25 + 0.5 * r,
                                               "train_s": 1.0, "eval_s": 0.5,
                                               "seconds": 2.0 + r})
                                   for r in (1, 0)) + "\n")  # any order
    out_json = tmp_path / "cmp.json"
    args = _args("--method", "fednh", "--clients", "2", "--out", str(tmp_path / "runs"),
                 "--json", str(out_json), "--reference", str(reference))
    assert authors.main_args(args) == 0
    printed = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    fb = res["fedbus"]
    assert len(fb["acc_weighted"]) == 2 and fb["failed"] == [0, 0]
    assert all(0.0 <= a <= 1.0 for a in fb["acc_weighted"] + fb["acc_mean"])
    assert res["authors"]["acc"] == [0.25, 0.75] and res["authors"]["seconds"] == [2.0, 3.0]
    rows = [line.split() for line in printed.splitlines()
            if line.split() and line.split()[0] in ("0", "1")]
    assert len(rows) == 2
    for r, row in enumerate(rows):
        fedbus_acc, ref_acc, diff = (float(v) for v in row[1:4])
        assert fedbus_acc == pytest.approx(fb["acc_weighted"][r], abs=5e-5)
        assert ref_acc == pytest.approx(0.25 + 0.5 * r)
        assert diff == pytest.approx(fb["acc_weighted"][r] - (0.25 + 0.5 * r), abs=1e-4)
        assert float(row[5]) == pytest.approx(2.0 + r)
    assert "fedbus - authors over 2 rounds" in printed
    # the comparison alone, from the saved fedbus side, prints the same table
    again = _args("--method", "fednh", "--clients", "2", "--fedbus-json", str(out_json),
                  "--reference", str(reference))
    assert authors.main_args(again) == 0
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("      ")] == \
        [ln for ln in printed.splitlines() if ln.startswith("      ")]


def test_fpl_fedbus_side_alone_prints_its_rounds(tmp_path, capsys):
    args = _args("--method", "fpl", "--clients", "2", "--out", str(tmp_path / "runs"))
    assert authors.main_args(args) == 0
    printed = capsys.readouterr().out
    assert "acc_mean" in printed and "partition = 'last'" in printed
    assert sum(1 for line in printed.splitlines()
               if line.split() and line.split()[0] in ("0", "1")) == 2


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    assert authors.main_args(_args("--clients", "0")) == 2
    assert "federation.clients" in capsys.readouterr().out
    missing = tmp_path / "none.jsonl"
    assert authors.main_args(_args("--reference", str(missing))) == 2
    assert "not a rounds.jsonl" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert authors.main_args(_args("--reference", str(empty))) == 2
    assert "no rounds" in capsys.readouterr().out
