"""`fedbus plot`: the figures are real PNGs (size, not blank), several runs
overlay, and a partial run (crashed: torn metrics, no summary, no embeddings)
still gets the figures it can have.

One real federation (FedProto on digits) is made once for the module. A run
written by hand in the server's exact format adds what a short healthy run
cannot show: every participation status, and an MP-FedCL prototype pool [C, K, D]."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from fedbus.broker.wire import encode_body
from fedbus.launch.cli import main as fedbus

# --- a run directory written by hand, in the exact format the server writes --------

def fake_run(path: Path, *, algorithm: str = "fedproto", clients: int = 8, rounds: int = 6,
             seed: int = 0, finished: bool = True, pool: bool = False,
             analysis: bool = False) -> Path:
    """config.json, metrics.jsonl (every status of the participation grid occurs),
    summary.json and embeddings.fbk, as fedbus.node.server writes them. analysis: the
    records also carry Michieli & Ozay's metrics (agg.amm, agg.amm_dist,
    agg_extra.attention, as proto-attention writes them, and ffd* from
    log.ffd_reference)."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    (path / "logs").mkdir()
    config = {"federation": {"clients": clients, "rounds": rounds, "mode": "sync",
                             "eval_every": 1, "seed": seed},
              "data": {"dataset": "digits"}, "model": {"arch": "cnn"},
              "algorithm": {"name": algorithm}, "log": {"embeddings": 40}}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    start, t, records = 1_700_000_000.0, 0.0, []
    reasons = ["late", "dropped", "dead", "rejected", "error"]
    late_prev: list[int] = []
    per_update = 4000 if algorithm == "fedproto" else 250_000  # prototypes vs weights
    for r in range(rounds):
        sampled = sorted(rng.choice(clients, size=clients - 2, replace=False).tolist())
        failures = {}
        if r > 0:
            failures[str(sampled[0])] = reasons[(r - 1) % len(reasons)]
        if r == 1:  # an async task that expired, beside the late one
            failures[str(sampled[-1])] = "timed_out"
        fresh = [c for c in sampled if str(c) not in failures]
        partial = fresh[:1] if r % 2 else []
        stale = [[c, r - 1, 1, 0.5] for c in late_prev if c not in fresh]
        late_prev = [int(c) for c, why in failures.items() if why == "late"]
        round_s = float(rng.uniform(1.0, 3.0))
        t += round_s
        acc = min(0.3 + 0.1 * r + rng.normal(0, 0.02), 0.99)
        per_client = {str(c): {"acc": float(np.clip(acc + rng.normal(0, 0.05), 0, 1)),
                               "proto_acc": float(np.clip(acc + 0.05 + rng.normal(0, 0.05),
                                                          0, 1))}
                      for c in range(clients)}
        accs = np.array([v["acc"] for v in per_client.values()])
        paccs = np.array([v["proto_acc"] for v in per_client.values()])
        rec = {"round": r, "version": r + 1, "time": start + t, "wall_s": round(t, 3),
               "round_s": round_s, "updates": len(fresh) + len(stale),
               "sampled": len(sampled), "late": list(failures.values()).count("late"),
               "dead": list(failures.values()).count("dead"), "failed": len(failures),
               "partial": len(partial), "work_fraction": 0.9, "stale_max": 1 if stale else 0,
               "bytes_up": per_update * len(fresh), "bytes_down": 6000 * len(sampled),
               "params_up": 500 * len(fresh), "params_down": 700 * len(sampled),
               "participants": sorted(fresh + [s[0] for s in stale]),
               "partial_clients": partial, "failures": failures,
               "folded": len(stale), "stale": stale, "agg": {"classes": 10.0},
               "eval_clients": clients, "eval_s": 0.2,
               "acc_mean": float(accs.mean()), "acc_std": float(accs.std()),
               "acc_weighted": float(accs.mean()), "proto_acc_mean": float(paccs.mean()),
               "proto_acc_std": float(paccs.std()), "proto_acc_weighted": float(paccs.mean()),
               "loss_mean": 1.0 / (r + 1), "loss_std": 0.1, "per_client": per_client}
        if analysis:
            took = rec["participants"]
            att = rng.dirichlet(np.ones(len(took)))
            rec["agg"].update(amm=0.9, amm_dist=0.5 + 0.3 * r)
            rec["agg_extra"] = {"attention": {str(c): float(a) for c, a in zip(took, att)}}
            ffd = {str(c): float(0.8 - 0.05 * r + rng.uniform(0, 0.1)) for c in range(clients)}
            rec.update(ffd=ffd, ffd_mean=float(np.mean(list(ffd.values()))),
                       ffd_std=float(np.std(list(ffd.values()))),
                       ffd_round_mean=float(np.mean([ffd[str(c)] for c in took])))
        records.append(rec)
    with open(path / "metrics.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec, sort_keys=True) + "\n")
        if not finished:
            f.write('{"round": 99, "vers')  # a torn last line after a crash
    if not finished:
        return path
    summary = {"algorithm": algorithm, "rounds_completed": rounds,
               "final": {"acc_mean": records[-1]["acc_mean"]}, "best": {},
               "bytes_up": sum(r["bytes_up"] for r in records),
               "bytes_down": sum(r["bytes_down"] for r in records), "wall_s": t}
    (path / "summary.json").write_text(json.dumps(summary, indent=2))
    # embeddings: 10 classes in 16-D, clustered around class centres
    centres = rng.normal(0, 4, size=(10, 16)).astype(np.float32)
    emb = {}
    for c in range(clients):
        y = rng.integers(0, 10, size=40)
        emb[str(c)] = {"h": (centres[y] + rng.normal(0, 2.5, (40, 16))).astype(np.float32),
                       "y": y.astype(np.int64)}
    if pool:
        protos = (centres[:, None, :] + rng.normal(0, 0.5, (10, 3, 16))).astype(np.float32)
        mask = np.ones((10, 3), bool)
        mask[:, 2] = False
    else:
        protos, mask = centres.copy(), np.ones(10, bool)
        protos[9], mask[9] = 0.0, False  # a class no client had
    (path / "embeddings.fbk").write_bytes(encode_body({"clients": emb, "protos": protos,
                                                       "mask": mask}))
    return path


# --- PNG checks -------------------------------------------------------------------

def read_png(path: Path) -> np.ndarray:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    import matplotlib.image as mpimg
    return mpimg.imread(str(path))


def assert_real_png(path: Path, min_width: int = 600, min_height: int = 300) -> None:
    img = read_png(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4), img.shape
    h, w = img.shape[:2]
    assert w >= min_width and h >= min_height, f"{path.name}: {w}x{h}"
    rgb = img[..., :3].astype(np.float64)
    assert rgb.std() > 0.02, f"{path.name} is nearly uniform"
    background = rgb[0, 0]
    differs = np.abs(rgb - background).max(axis=2) > 0.05
    assert differs.mean() > 0.01, f"{path.name}: only {differs.mean():.2%} of pixels drawn"
    # some colour, not just black text on white
    spread = rgb.max(axis=2) - rgb.min(axis=2)
    assert (spread > 0.2).mean() > 0.001, f"{path.name} has no coloured marks"


ONE_RUN = ["accuracy-round.png", "accuracy-time.png", "bytes.png", "participation.png",
           "tsne.png"]


# --- a real run -------------------------------------------------------------------

@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """One real federation (FedProto on digits, 3 rounds, 6 clients), made once."""
    import subprocess
    out = tmp_path_factory.mktemp("plot") / "run"
    cmd = [sys.executable, "-m", "fedbus.launch", "run", "--set", "federation.rounds=3",
           "--set", "federation.clients=6", "--set", "log.embeddings=50",
           "--out", str(out), "--quiet"]
    proc = subprocess.run(cmd, check=False, cwd=out.parent, capture_output=True, text=True,
                          timeout=240)
    if proc.returncode != 0 or not (out / "embeddings.fbk").exists():
        pytest.fail(f"the real run failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out


def copy_run(real_run: Path, dst: Path) -> Path:
    shutil.copytree(real_run, dst, ignore=shutil.ignore_patterns("plots"))
    return dst


def test_plot_a_real_run(real_run, tmp_path, capsys):
    run = copy_run(real_run, tmp_path / "exp1")
    assert fedbus(["plot", str(run)]) == 0  # default --out: RUN/plots
    out = capsys.readouterr().out
    assert sorted(p.name for p in (run / "plots").iterdir()) == sorted(ONE_RUN)
    for name in ONE_RUN:
        assert_real_png(run / "plots" / name)
        assert f"wrote {run / 'plots' / name}" in out


def test_several_runs_are_overlaid_with_labels(real_run, tmp_path, monkeypatch):
    a = copy_run(real_run, tmp_path / "a")
    b = fake_run(tmp_path / "b", algorithm="mpfedcl", seed=2, pool=True)
    monkeypatch.chdir(tmp_path)  # default --out for several runs: ./plots-compare
    assert fedbus(["plot", str(a), str(b), "--label", "FedProto", "--label", "MP FedCL",
                   "--tsne-points", "150"]) == 0
    out = tmp_path / "plots-compare"
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["accuracy-round.png", "accuracy-time.png", "bytes.png",
                            "participation-FedProto.png", "participation-MP-FedCL.png",
                            "tsne-FedProto.png", "tsne-MP-FedCL.png"])
    for name in names:
        assert_real_png(out / name)


def test_default_labels_are_the_directory_and_the_algorithm(real_run, tmp_path, monkeypatch):
    crashed = copy_run(real_run, tmp_path / "crashed")
    (crashed / "summary.json").unlink()  # the algorithm then comes from config.json
    (crashed / "embeddings.fbk").unlink()
    monkeypatch.chdir(tmp_path)
    assert fedbus(["plot", str(real_run), str(crashed), "--no-tsne"]) == 0
    names = sorted(p.name for p in (tmp_path / "plots-compare").iterdir())
    assert "participation-crashed-fedproto.png" in names
    assert f"participation-{real_run.name}-fedproto.png" in names


def test_a_crashed_run_gets_what_it_can(real_run, tmp_path, capsys):
    run = copy_run(real_run, tmp_path / "crashed")
    (run / "summary.json").unlink()
    (run / "embeddings.fbk").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "version": 4, "acc_m')  # a torn last line
    assert fedbus(["plot", str(run), "--out", str(tmp_path / "figs")]) == 0
    err = capsys.readouterr().err
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["accuracy-round.png", "accuracy-time.png", "bytes.png",
                     "participation.png"]
    assert "skipped tsne.png" in err and "embeddings.fbk" in err
    assert "did not finish" in err
    for name in names:
        assert_real_png(tmp_path / "figs" / name)


def test_a_damaged_embeddings_file_is_skipped_not_fatal(real_run, tmp_path, capsys):
    run = copy_run(real_run, tmp_path / "damaged")
    raw = (run / "embeddings.fbk").read_bytes()
    (run / "embeddings.fbk").write_bytes(raw[: len(raw) // 2])
    assert fedbus(["plot", str(run), "--out", str(tmp_path / "figs")]) == 0
    assert "embeddings.fbk unreadable" in capsys.readouterr().err
    assert not (tmp_path / "figs" / "tsne.png").exists()
    assert_real_png(tmp_path / "figs" / "participation.png")


# --- hand-written run directories and records ----------------------------------------

def test_every_participation_status_is_drawn(tmp_path):
    from fedbus.analysis.plots import STATUSES, load_run, participation_matrix
    run = fake_run(tmp_path / "statuses")  # late, timed out, dropped, dead, rejected, ...
    grid, _ = participation_matrix(load_run(run).records, clients=8)
    assert set(np.unique(grid).tolist()) == {code for code, _, _ in STATUSES}
    assert fedbus(["plot", str(run), "--no-tsne"]) == 0
    assert_real_png(run / "plots" / "participation.png")


def test_participation_grid_statuses(tmp_path):
    from fedbus.analysis.plots import participation_matrix
    recs = [{"round": 0, "participants": [0, 1, 2], "partial_clients": [1],
             "failures": {"3": "late", "4": "dead"}, "stale": []},
            {"round": 1, "participants": [0, 3, 6], "partial_clients": [],
             "failures": {"1": "dropped", "2": "rejected", "5": "error", "6": "late"},
             "stale": [[3, 0, 1, 0.5], [6, 0, 1, 0.5]]},
            {"round": 2, "participants": [4, 4], "partial_clients": [],  # fresh + folded
             "failures": {"9": "dead"}, "stale": [[4, 1, 1, 0.5]]}]  # 9: found, not listed
    grid, rounds = participation_matrix(recs, clients=7)
    assert rounds == [0, 1, 2]
    assert grid.shape == (10, 3)  # clients seen beyond federation.clients get rows
    assert grid[:, 0].tolist() == [1, 2, 1, 4, 6, 0, 0, 0, 0, 0]
    # client 6: failed this round's task while its earlier update was folded in
    assert grid[:, 1].tolist() == [1, 5, 7, 3, 0, 7, 4, 0, 0, 0]
    assert grid[:, 2].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 6]


def test_not_a_run_directory_exits_2(tmp_path, capsys):
    assert fedbus(["plot", str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert fedbus(["plot", str(tmp_path / "empty")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_a_run_with_no_rounds_writes_nothing_and_says_so(tmp_path, capsys):
    run = tmp_path / "early"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"federation": {"clients": 4},
                                                 "algorithm": {"name": "fedproto"}}))
    assert fedbus(["plot", str(run)]) == 1
    assert "nothing to plot" in capsys.readouterr().err


def test_without_matplotlib_exits_2_with_the_install_hint(tmp_path, monkeypatch, capsys):
    run = fake_run(tmp_path / "r")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert fedbus(["plot", str(run)]) == 2
    assert "pip install 'fedbus[plot]'" in capsys.readouterr().err
    assert not (run / "plots").exists()




# --- Michieli & Ozay's analysis: AMM, attention, FFD ------------------------------------

ANALYSIS = ["amm.png", "attention.png", "ffd.png"]


def test_analysis_figures_are_drawn_when_recorded(tmp_path, capsys):
    run = fake_run(tmp_path / "pa", algorithm="proto-attention", analysis=True)
    assert fedbus(["plot", str(run), "--no-tsne"]) == 0
    names = sorted(p.name for p in (run / "plots").iterdir())
    assert names == sorted(["accuracy-round.png", "accuracy-time.png", "bytes.png",
                            "participation.png", *ANALYSIS])
    for name in ANALYSIS:
        assert_real_png(run / "plots" / name)
    assert "amm.png" not in capsys.readouterr().err


def test_analysis_figures_with_several_runs(tmp_path, monkeypatch, capsys):
    base = fake_run(tmp_path / "avg", algorithm="fedavg", seed=1, analysis=True)
    pa = fake_run(tmp_path / "pa", algorithm="proto-attention", seed=2, analysis=True)
    plain = fake_run(tmp_path / "plain", algorithm="fedproto", seed=3)  # none of them
    monkeypatch.chdir(tmp_path)
    assert fedbus(["plot", str(base), str(pa), str(plain), "--no-tsne",
                   "--label", "FedAvg", "--label", "ProtoAtt", "--label", "FedProto"]) == 0
    out = tmp_path / "plots-compare"
    names = {p.name for p in out.iterdir()}
    assert {"amm.png", "ffd.png", "attention-FedAvg.png", "attention-ProtoAtt.png"} <= names
    assert "attention-FedProto.png" not in names
    for name in ("amm.png", "ffd.png", "attention-ProtoAtt.png"):
        assert_real_png(out / name)
    err = capsys.readouterr().err
    assert "ffd.png: FedProto records no ffd" in err


def test_attention_matrix():
    from fedbus.analysis.plots import attention_matrix
    recs = [{"round": 0, "agg_extra": {"attention": {"0": 0.25, "2": 0.75}}},
            {"round": 1, "agg": {}},  # an aggregation without attention: a grey column
            {"round": 2, "agg_extra": {"attention": {"1": 1.0}}}]
    grid, rounds = attention_matrix(recs, clients=4)
    assert rounds == [0, 1, 2] and grid.shape == (4, 3)
    assert grid[0, 0] == 0.25 and grid[2, 0] == 0.75 and grid[1, 2] == 1.0
    assert np.isnan(grid[:, 1]).all() and np.isnan(grid[3]).all()
    assert attention_matrix([{"round": 0}], clients=4)[1] == []


# --- --group-by: one mean curve and band per group ------------------------------------

def accs(run: Path, key: str = "acc_mean") -> dict[int, float]:
    return {r["round"]: r[key] for r in map(json.loads, (run / "metrics.jsonl").open())}


def test_group_by_draws_the_mean_and_min_max_of_each_group(tmp_path, capsys):
    from fedbus.analysis.plots import group_curve, load_groups
    runs = [fake_run(tmp_path / f"{alg}-s{s}", algorithm=alg, seed=s, rounds=4 + s)
            for alg in ("fedavg", "fedproto") for s in (0, 1)]
    groups, notes = load_groups(runs, ["algorithm.name"])
    assert list(groups) == ["fedavg", "fedproto"] and not notes
    curve = group_curve(groups["fedproto"], "proto_acc")
    a, b = accs(runs[2], "proto_acc_mean"), accs(runs[3], "proto_acc_mean")
    assert curve.rounds.tolist() == [0, 1, 2, 3]  # round 4: seed 1's run only
    assert curve.partial_rounds == [4]
    assert curve.mean.tolist() == pytest.approx([(a[r] + b[r]) / 2 for r in range(4)])
    assert curve.low.tolist() == pytest.approx([min(a[r], b[r]) for r in range(4)])
    assert curve.high.tolist() == pytest.approx([max(a[r], b[r]) for r in range(4)])
    out = tmp_path / "figs"
    assert fedbus(["plot", "--group-by", "algorithm.name", *map(str, runs),
                   "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["accuracy-round.png",
                                                     "accuracy-time.png"]
    for name in ("accuracy-round.png", "accuracy-time.png"):
        assert_real_png(out / name)
    err = capsys.readouterr().err
    assert "fedproto: proto_acc at round(s) 4 is in only some of its 2 runs" in err


def test_group_by_reads_a_sweep_directory_and_lists_its_missing_runs(tmp_path, capsys):
    sweep = tmp_path / "cmp"
    for alg in ("fedavg", "fedproto"):
        fake_run(sweep / f"{alg}-s0", algorithm=alg)
    fake_run(sweep / "fedproto-s1", algorithm="fedproto", seed=1, finished=False)
    names = ["fedavg-s0", "fedproto-s0", "fedproto-s1", "fedavg-s1"]  # the last never ran
    (sweep / "sweep.json").write_text(json.dumps({
        "grid": {"algorithm.name": ["fedavg", "fedproto"]},
        "runs": [{"name": n, "status": "failed" if n == "fedavg-s1" else "complete"}
                 for n in names]}))
    assert fedbus(["plot", "--group-by", "algorithm.name", str(sweep)]) == 0
    assert sorted(p.name for p in (sweep / "plots").iterdir()) == ["accuracy-round.png",
                                                                   "accuracy-time.png"]
    err = capsys.readouterr().err
    assert "fedavg-s1: not run (sweep status: failed), not drawn" in err
    assert "fedproto-s1: unfinished: no summary.json (stopped, or still running), drawn " \
        "as far as it goes" in err


def test_group_by_refuses_labels_and_unknown_keys(tmp_path, capsys):
    run = fake_run(tmp_path / "r")
    assert fedbus(["plot", "--group-by", "algorithm.name", "--label", "x", str(run)]) == 2
    assert "--label names runs" in capsys.readouterr().err
    assert fedbus(["plot", "--group-by", "algorithm.nme", str(run)]) == 2
    assert "--group-by algorithm.nme: no run's config.json has it" in capsys.readouterr().err
