"""Differential privacy in runs (`privacy.dp`): the epsilon a run reports is the accountant
library's for the same noise, sampling and rounds; a budget stops participation with a
logged event; client-level DP steps by the mean of clipped deltas plus noise of the stated
scale, with or without secure aggregation; unsupported algorithms are refused at
preflight with one line."""
from __future__ import annotations

import dp_accounting
import numpy as np
import pytest

from fedbus.node.config import build_config
from fedbus.node.engine import client_address
from fedbus.node.privacy.dp import RDP_ORDERS
from fedbus.node.server import build_engine, dispatch
from tests.helpers import SMALL, fedbus, merged, metrics, run_federation, write_config
from tests.test_secure_aggregation import WORK, _msg, secure_round

RUN = "r"


def _library_epsilon(z: float, q: float, rounds: int, delta: float) -> float:
    """dp-accounting itself, composed here: what the run must report."""
    acc = dp_accounting.rdp.RdpAccountant(orders=RDP_ORDERS)
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, rounds)
    return acc.get_epsilon(delta)


def test_a_record_level_run_reports_the_libraries_epsilon_and_replays(tmp_path):
    z, rounds = 1.5, 3
    # train.epochs = 0: an extractor never trained on the clients' data, which record
    # level needs unless it trains by DP-SGD (tests/test_dp_claims.py)
    sections = merged(SMALL, algorithm={"name": "fedproto"},
                      federation={"clients": 4, "rounds": rounds}, train={"epochs": 0},
                      privacy={"dp": "record", "dp_clip": 5.0, "dp_noise_multiplier": z})
    run, summary = run_federation(tmp_path, sections)
    # every client released its prototypes every round: z / sqrt(2) composed `rounds` times
    want = [_library_epsilon(z / np.sqrt(2), 1.0, r + 1, 1e-5) for r in range(rounds)]
    got = [rec["dp"]["epsilon"] for rec in metrics(run)]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert summary["privacy"]["epsilon"] == pytest.approx(want[-1], rel=1e-5)
    assert summary["privacy"]["mechanism"] == "record" and summary["privacy"]["stopped"] is None
    assert all(rec["participants"] == [0, 1, 2, 3] for rec in metrics(run))
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr


def test_a_spent_budget_stops_the_run_with_a_logged_event(tmp_path):
    z = 1.5
    target = float(_library_epsilon(z / np.sqrt(2), 1.0, 2, 1e-5) +
                   _library_epsilon(z / np.sqrt(2), 1.0, 3, 1e-5)) / 2  # two rounds fit
    sections = merged(SMALL, algorithm={"name": "fedproto"},
                      federation={"clients": 4, "rounds": 6}, train={"epochs": 0},
                      privacy={"dp": "record", "dp_clip": 5.0, "dp_noise_multiplier": z,
                               "target_epsilon": target})
    run, summary = run_federation(tmp_path, sections)
    assert summary["rounds_completed"] == 2
    assert summary["privacy"]["stopped"] == "privacy budget"
    assert summary["privacy"]["epsilon"] <= target
    log = "".join(p.read_text() for p in (run / "logs").glob("server*"))
    assert "privacy_budget_exhausted" in log and "privacy_budget_spent" in log


@pytest.mark.parametrize("name,level,words", [
    ("fedavg", "record", "fedavg cannot"),
    ("fedproto", "client", "fedproto cannot"),
    ("mpfedcl", "record", "mpfedcl cannot"),
])
def test_dp_refuses_an_algorithm_it_cannot_serve_at_preflight(tmp_path, name, level, words):
    cfg = write_config(tmp_path / "c.toml", merged(SMALL, algorithm={"name": name},
                                                   privacy={"dp": level}))
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"), check=False, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if words in ln]
    assert len(lines) == 1 and f"privacy.dp = {level}" in lines[0], proc.stderr


# --- client-level DP in the engine, scripted ---

def _fedavg_engine(secure: bool, z: float, **federation):
    cfg = build_config({
        "federation": {"clients": 4, "rounds": 2, "seed": 5, **federation},
        "data": {"dataset": "digits", "partition": "iid"}, "model": {"arch": "mlp"},
        "algorithm": {"name": "fedavg"},
        "privacy": {"dp": "client", "dp_clip": 1.0, "dp_noise_multiplier": z,
                    "secure_aggregation": secure}})
    engine = build_engine(cfg, RUN)
    engine.on_join("n", [client_address(c) for c in range(4)], 0.0)
    return cfg, engine, engine.on_configured("n", RUN, 0.0)


def _big_delta(engine, client):
    """A delta far longer than the clip (norm ~ 50): the client's clip_update bounds it."""
    from fedbus.node.privacy.dp import clip_update

    rng = np.random.default_rng(client)
    spec = engine.handler.update_spec()["delta"]
    raw = {k: rng.normal(0, 1.0, size=shape).astype(np.float32)
           for k, (_, shape) in spec.items()}
    scale = 50.0 / np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in raw.values()))
    raw = {k: v * np.float32(scale) for k, v in raw.items()}
    return clip_update(raw, 1.0)[0]


def _weights(engine):
    return {k: np.asarray(v, dtype=np.float64)
            for k, v in engine.handler.state_dict()["weights"].items()}


def _plain_dp_round(engine, tasks):
    for t in tasks:
        c = int(t.dst[1:])
        body = {"task": t.body["task"], "version": 0, "num_samples": 10 + c, "work": WORK,
                "payload": {"delta": _big_delta(engine, c)}}
        dispatch(engine, _msg("update", t.dst, body, t.round), 1.0)


def test_client_level_dp_steps_by_the_mean_clipped_delta_plus_noise_of_z_c_over_n():
    # z tiny: the step is the unweighted mean of the clipped deltas (each of norm C = 1)
    cfg, quiet, tasks = _fedavg_engine(False, 1e-6)
    before = _weights(quiet)
    _plain_dp_round(quiet, tasks)
    mean = {k: sum(_big_delta(quiet, c)[k].astype(np.float64) for c in range(4)) / 4
            for k in before}
    step = {k: _weights(quiet)[k] - before[k] for k in before}
    for k in before:
        np.testing.assert_allclose(step[k], mean[k], rtol=0, atol=5e-6, err_msg=k)  # 20 sd
    # z = 2: what is left over is N(0, (z C / n)^2) per coordinate
    _, noisy, tasks = _fedavg_engine(False, 2.0)
    _plain_dp_round(noisy, tasks)
    left = np.concatenate([(_weights(noisy)[k] - before[k] - mean[k]).ravel() for k in before])
    assert left.size > 1000 and abs(left.std() - 2.0 / 4) < 0.02 and abs(left.mean()) < 0.02
    rec = noisy.records[-1] if noisy.records else noisy.evals[max(noisy.evals)].record
    assert rec["dp"]["epsilon"] == pytest.approx(_library_epsilon(2.0, 1.0, 1, 1e-5), rel=1e-6)


def test_client_level_dp_under_secure_aggregation_gives_the_plain_dp_state():
    _, plain, p_tasks = _fedavg_engine(False, 1.0)
    cfg, secure, s_tasks = _fedavg_engine(True, 1.0)
    before = _weights(plain)
    _plain_dp_round(plain, p_tasks)
    # the secure clients lift their clipped deltas with weight 1, as the plain server does
    secure_round(secure, cfg, s_tasks, update=lambda engine, task, client: {
        "task": task.body["task"], "version": 0, "num_samples": 10 + client, "work": WORK,
        "payload": {"delta": _big_delta(engine, client)}})
    rec = secure.records[-1] if secure.records else secure.evals[max(secure.evals)].record
    assert rec["secagg"].get("failed") is None and rec["dp"]["mechanism"] == "client"
    got, want = _weights(secure), _weights(plain)
    moved = max(np.abs(want[k] - before[k]).max() for k in want)
    assert moved > 0.1  # the same noise (seeded by the run and version) moved both far
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=rec["secagg"]["quant_bound"], err_msg=k)


def test_client_level_epsilon_composes_the_subsampled_rounds_as_the_library_does():
    # each client in a round with q = 1/2, a budget that fits exactly two rounds
    z, q = 1.2, 0.5
    two, three = (_library_epsilon(z, q, r, 1e-5) for r in (2, 3))
    _, engine, tasks = _fedavg_engine(False, z, fraction=0.5, rounds=6,
                                      eval_every=100)
    engine.ledger.target = float(two + three) / 2
    # each client in with probability q (Poisson, the server's secret draw): a cohort of
    # any size, an empty one's round closed as it started
    for _ in range(6):
        if engine.done:
            break
        outs = []
        for t in [t for t in tasks if t.kind == "task"]:
            c = int(t.dst[1:])
            body = {"task": t.body["task"], "version": t.body["version"],
                    "num_samples": 10 + c, "work": WORK,
                    "payload": {"delta": _big_delta(engine, c)}}
            outs += dispatch(engine, _msg("update", t.dst, body, t.round), 1.0)
        tasks = outs
    seen = [rec["dp"]["epsilon"] for rec in engine.records]
    np.testing.assert_allclose(seen, [_library_epsilon(z, q, 1, 1e-5), two], rtol=1e-6)
    # the third round would pass the budget: the run ended after two, saying why
    assert engine.done and engine.stopped == "privacy budget" and engine.version == 2
    assert any(e["event"] == "privacy_budget_exhausted" for e in engine.events)



def test_secret_noise_is_not_the_seeds_and_the_servers_seed_stays_in_the_run_dir(tmp_path):
    import os
    import stat

    sections = merged(SMALL, algorithm={"name": "fedavg"},
                      federation={"clients": 4, "rounds": 2},
                      privacy={"dp": "client", "dp_clip": 1.0, "dp_noise_multiplier": 1.0})
    run, _ = run_federation(tmp_path, sections)
    seed_file = run / "noise_seed"
    seed = seed_file.read_text().strip()
    assert seed.isdigit() and stat.S_IMODE(os.stat(seed_file).st_mode) == 0o600
    # never sent: not in the config every node gets, nor in any logged message
    assert seed not in (run / "config.json").read_text()
    assert seed.encode() not in (run / "messages.bin").read_bytes()
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr
    seed_file.unlink()  # without it the server's noise cannot be redone: said, not guessed
    out = fedbus("replay", str(run), timeout=240, check=False)
    assert out.returncode != 0 and "noise_seed is missing" in out.stdout + out.stderr


def test_record_level_noise_is_drawn_from_the_os_unless_seeded():
    import types

    import torch
    from sklearn.datasets import load_digits

    from fedbus.node.client_host import dp_release

    digits = load_digits()
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.features = torch.nn.Linear(64, 16)  # what dp_prototypes reads of a model
    ctx = types.SimpleNamespace(model=model, num_classes=10,
                                train_x=torch.as_tensor(digits.data[:300], dtype=torch.float32),
                                train_y=torch.as_tensor(digits.target[:300]))
    handler = types.SimpleNamespace(ctx=ctx)
    privacy = {"dp": "record", "dp_clip": 1.0, "dp_noise_multiplier": 1.0}
    out = {mode: [dp_release(handler, {}, {**privacy, "dp_noise": mode}, 7)["protos"]
                  for _ in range(2)] for mode in ("secret", "seeded")}
    assert np.array_equal(*out["seeded"])  # the task seed's draws: reproducible
    assert not np.array_equal(*out["secret"])  # the OS's: not the seed's, not each other
    assert not np.array_equal(out["secret"][0], out["seeded"][0])
