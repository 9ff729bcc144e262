"""privacy.dp = "sgd": DP-SGD in local training with Opacus (fedbus.algorithms.core.dp_sgd).

One step is a plain SGD step when the clip never binds and the noise is nil; per-sample
gradients are Opacus's and match a manual per-sample computation; a small clip bounds one
sample's effect; the noise has std lr z C / b per coordinate; FedProx's proximal term
survives; Poisson batches are seeded by the task; the hooks leave the model as it was. The
server composes each client's tasks as dp-accounting does (a real run reports that epsilon
and replays identically), and algorithms whose upload is no weight delta are refused at
preflight with one line."""
from __future__ import annotations

import copy
import math

import dp_accounting
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedbus.algorithms import get_algorithm
from fedbus.algorithms.core.dp_sgd import DPSGD, model_refusal, task_sampling
from fedbus.algorithms.core.handlers import ClientContext, LocalRun
from fedbus.models.registry import build_model
from fedbus.node.client_host import dp_release
from fedbus.node.config import build_config
from fedbus.node.privacy.budget import PrivacyLedger
from fedbus.node.privacy.dp import RDP_ORDERS, dp_levels, dp_refusal
from fedbus.node.server import build_engine
from tests.helpers import (SMALL, fedbus, logged_messages, merged, metrics, run_federation,
                           write_config)

OPACUS_ATTRS = ("grad_sample", "summed_grad", "_forward_counter", "_current_grad_sample")


def _model(arch: str = "mlp", seed: int = 0) -> torch.nn.Module:
    shape = (1, 8, 8) if arch.startswith("cnn") else (10,)
    return build_model(arch, in_shape=shape, num_classes=3, seed=seed)


def _data(n: int, arch: str = "mlp", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, 8, 8) if arch.startswith("cnn") else (10,)
    return torch.randn(n, *shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def _loss(model):
    return lambda x, y: F.cross_entropy(model.head(model.features(x)), y)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _dp_step(model, x, y, *, lr=0.1, clip=1e4, z=0.0, b=None, seed=0, loss=None,
             secure_mode=False):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with DPSGD(model, opt, clip=clip, noise_multiplier=z, expected_batch_size=b or len(x),
               generator=torch.Generator().manual_seed(seed), secure_mode=secure_mode) as dp:
        dp.step(loss or _loss(model), x, y)
        return [p.grad_sample.detach().clone() for p in model.parameters()]


def _manual_per_sample(model, x, y) -> list[torch.Tensor]:
    """Each sample's gradient by its own backward pass (the test's reference only)."""
    rows = []
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        _loss(model)(x[i:i + 1], y[i:i + 1]).backward()
        rows.append([p.grad.detach().clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return [torch.stack(col) for col in zip(*rows)]


# --- one step --------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["mlp", "cnn4"])  # cnn4: in-place ReLUs inside Sequentials
def test_an_unclipped_noiseless_step_is_the_plain_sgd_step(arch):
    x, y = _data(12, arch)
    plain, private = _model(arch), _model(arch)
    keys = list(private.state_dict())
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _loss(plain)(x, y).backward()
    opt.step()
    _dp_step(private, x, y, clip=1e4, z=1e-9)
    torch.testing.assert_close(_flat(private), _flat(plain), atol=1e-6, rtol=1e-5)
    # the hooks came off and left nothing behind; the keys (the pool's) are the same
    assert list(private.state_dict()) == keys
    assert not any(hasattr(p, a) for p in private.parameters() for a in OPACUS_ATTRS)
    assert all(m.inplace for m in private.modules() if hasattr(m, "inplace"))
    assert not private._forward_hooks and not any(m._forward_hooks or m._backward_hooks
                                                  for m in private.modules())


def test_per_sample_gradients_are_recorded_through_features_and_head_and_clipped():
    x, y = _data(6)
    model = _model()
    start = _flat(model)
    want = _manual_per_sample(model, x, y)
    clip, lr = 0.05, 0.5
    got = _dp_step(model, x, y, lr=lr, clip=clip, z=0.0)
    for g, w in zip(got, want):  # Opacus's hooks saw model.features and model.head
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    flat = torch.cat([w.reshape(len(x), -1) for w in want], dim=1).double()
    norms = flat.norm(dim=1)
    assert (norms > 4 * clip).all()  # every sample's gradient is clipped here
    clipped = flat * (clip / (norms + 1e-6)).clamp(max=1.0)[:, None]
    expected = start.double() - lr * clipped.sum(0) / len(x)
    torch.testing.assert_close(_flat(model).double(), expected, atol=1e-6, rtol=1e-5)


def test_a_small_clip_bounds_one_samples_step():
    x, y = _data(1)
    x = x * 1000.0  # a huge loss and gradient
    plain, private = _model(), _model()
    start = _flat(private)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    _loss(plain)(x, y).backward()
    opt.step()
    assert (_flat(plain) - start).norm() > 100 * 0.1 * 0.5  # unclipped, it moves far
    _dp_step(private, x, y, lr=0.1, clip=0.5, z=1e-9)
    moved = (_flat(private) - start).norm()
    assert 0.1 * 0.5 * 0.99 < moved <= 0.1 * 0.5 * (1 + 1e-4)


def test_the_noise_has_std_lr_z_clip_over_the_expected_batch():
    model = _model()
    start = _flat(model)
    lr, z, clip, b = 0.1, 2.0, 0.7, 8
    x, y = _data(0)  # an empty Poisson batch: the step is the noise alone
    _dp_step(model, x, y, lr=lr, clip=clip, z=z, b=b, seed=3)
    step = _flat(model) - start
    assert step.numel() > 40_000
    assert float(step.std()) == pytest.approx(lr * z * clip / b, rel=0.03)
    assert abs(float(step.mean())) < 0.05 * lr * z * clip / b
    again = _model()
    _dp_step(again, x, y, lr=lr, clip=clip, z=z, b=b, seed=3)  # the same seed, the same noise
    assert torch.equal(_flat(again), _flat(model))
    # with data, the noise comes on top of the clipped mean at the same scale
    x, y = _data(8)
    noisy, quiet = _model(), _model()
    _dp_step(noisy, x, y, lr=lr, clip=clip, z=z, b=b, seed=4)
    _dp_step(quiet, x, y, lr=lr, clip=clip, z=0.0, b=b)
    assert float((_flat(noisy) - _flat(quiet)).std()) == pytest.approx(lr * z * clip / b,
                                                                       rel=0.03)


def test_secret_noise_sums_four_gaussians_at_the_same_scale():
    """Under dp_noise = "secret" DP-SGD runs Opacus's secure_mode: each noise value is four
    Gaussians summed and halved (Holohan and Braghin 2021 s5.1), so no single Gaussian's
    low bits show in a step; the scale is unchanged and it is not the plain draw."""
    from scipy import stats

    lr, z, clip, b = 0.1, 2.0, 0.7, 8
    x, y = _data(0)
    plain, secure = _model(), _model()
    start = _flat(plain)
    _dp_step(plain, x, y, lr=lr, clip=clip, z=z, b=b, seed=3)
    _dp_step(secure, x, y, lr=lr, clip=clip, z=z, b=b, seed=3, secure_mode=True)
    step = (_flat(secure) - start).double().numpy()
    sigma = lr * z * clip / b
    assert stats.kstest(step / sigma, "norm").pvalue > 1e-3
    assert not torch.equal(_flat(plain), _flat(secure))
    # exactly Opacus's secure draw, parameter by parameter: one value thrown away, then
    # four Gaussians of the parameter's shape summed and halved
    g, want = torch.Generator().manual_seed(3), []
    for p in _model().parameters():
        torch.normal(0.0, z * clip, size=(1, 1), generator=g)
        four = sum(torch.normal(0.0, z * clip, size=p.shape, generator=g) for _ in range(4))
        want.append((-lr * four / 2 / b).reshape(-1))
    assert np.allclose(step, torch.cat(want).double().numpy(), rtol=1e-4, atol=1e-7)


def test_a_secret_noise_task_trains_in_secure_mode(monkeypatch):
    from fedbus.algorithms.core import dp_sgd

    modes = []
    real = dp_sgd.DPSGD.__init__

    def spy(self, *args, **kwargs):
        modes.append(kwargs.get("secure_mode", False))
        real(self, *args, **kwargs)

    monkeypatch.setattr(dp_sgd.DPSGD, "__init__", spy)
    _task(7, secret=True)
    _task(7)  # seeded noise: replayable, so the plain draw
    assert modes == [True, False]


def _ctx(model, x, y, *, batch=8, algorithm=None, dp="sgd", z=1.0, clip=1.0, secret=False):
    return ClientContext(client=0, model=model, device=torch.device("cpu"), train_x=x,
                         train_y=y, test_x=x, test_y=y, num_classes=3, feature_dim=200,
                         params=algorithm or {}, seed=0,
                         train={"batch_size": batch, "lr": 0.1, "momentum": 0.0,
                                "weight_decay": 0.0, "epochs": 1},
                         extra={"privacy": {"dp": dp, "dp_clip": clip,
                                            "dp_noise_multiplier": z,
                                            "dp_noise": "secret" if secret else "seeded"}})


def test_fedprox_keeps_its_proximal_term_under_dp_sgd():
    x, y = _data(10)
    handler = get_algorithm("fedprox").client(_ctx(_model(), x, y, algorithm={"mu": 5.0}))
    model = handler.ctx.model
    handler.begin_local({})  # the anchor w_t: the weights now
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)  # away from the anchor: the proximal gradient is mu (w - w_t)
    start = copy.deepcopy(model.state_dict())

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handler.batch_loss(x, y).backward()
    opt.step()
    plain = _flat(model)
    model.load_state_dict(start)
    model.zero_grad(set_to_none=True)
    _dp_step(model, x, y, clip=1e4, z=1e-9, loss=handler.batch_loss)
    torch.testing.assert_close(_flat(model), plain, atol=1e-6, rtol=1e-5)
    # without the proximal term the step would differ by lr mu 0.05 per coordinate
    model.load_state_dict(start)
    _dp_step(model, x, y, clip=1e4, z=1e-9)
    assert float((_flat(model) - plain).abs().max()) > 0.1 * 5.0 * 0.05 * 0.9


# --- a task: the hook in LocalClient.run_local ----------------------------------------------

def _task(seed: int, *, secret=False, n=50, batch=8, epochs=2, arch="mlp"):
    x, y = _data(n, arch)
    handler = get_algorithm("fedavg").client(_ctx(_model(arch), x, y, batch=batch,
                                                  secret=secret))
    seen = []
    batch_loss = handler.batch_loss
    handler.batch_loss = lambda xb, yb: (seen.append(len(yb)), batch_loss(xb, yb))[1]
    run = LocalRun(handler.ctx, epochs=epochs, seed=seed)
    loss = handler.run_local(run)
    return handler, run, loss, seen


def test_a_task_takes_poisson_batches_seeded_by_the_task():
    handler, run, loss, seen = _task(7)
    q, steps = task_sampling(50, 8, 2)
    assert (q, steps) == (8 / 50, 14) and run.work.steps == steps
    # one loss call per step (the first also probes for parameter-only terms, empty)
    assert seen[0] == 0
    sizes = seen[1:]
    # Poisson (each sample with probability 8 / 50): sizes vary around 8, unlike LocalRun's
    # fixed minibatches of 8 and the epoch's remainder of 2
    assert len(sizes) == steps and len(set(sizes) - {8, 2}) >= 2 and 5 < np.mean(sizes) < 11
    assert run.work.samples == sum(sizes) and math.isfinite(loss)
    again = _task(7)[0]
    assert torch.equal(_flat(again.ctx.model), _flat(handler.ctx.model))
    assert not torch.equal(_flat(_task(8)[0].ctx.model), _flat(handler.ctx.model))
    secret = [_flat(_task(7, secret=True)[0].ctx.model) for _ in range(2)]
    assert not torch.equal(secret[0], secret[1])  # OS entropy: not the task seed's draws
    # the handler is left as the node's pool keeps it
    assert not any(hasattr(p, a) for p in handler.ctx.model.parameters() for a in OPACUS_ATTRS)
    state = handler.state_dict()
    other = get_algorithm("fedavg").client(_ctx(_model(seed=5), *_data(50)))
    other.load_state_dict(state)
    assert torch.equal(_flat(other.ctx.model), _flat(handler.ctx.model))


def test_a_client_without_samples_takes_no_step_and_batchnorm_is_refused():
    handler, run, loss, _ = _task(1, n=0)
    assert run.work.steps == 0 and math.isnan(loss)
    assert task_sampling(0, 8, 3) == (1.0, 0)
    assert task_sampling(5, 8, 3) == (1.0, 3)
    why = model_refusal(build_model("resnet8", in_shape=(3, 16, 16), num_classes=3))
    assert why is not None and "\n" not in why and why.startswith("privacy.dp = sgd")
    assert model_refusal(_model("cnn")) is None


def test_the_client_does_not_clip_the_delta_again():
    x, y = _data(4)
    handler = get_algorithm("fedavg").client(_ctx(_model(), x, y, clip=1e-3))
    payload = {"delta": {"w": np.full(100, 10.0, dtype=np.float32)}}
    out = dp_release(handler, payload, handler.ctx.extra["privacy"], 0)
    assert out["delta"]["w"] is payload["delta"]["w"]


# --- accounting -------------------------------------------------------------------------------

def _library_epsilon(z: float, n: int, batch: int, epochs: int, tasks: int,
                     delta: float = 1e-5) -> float:
    """dp-accounting itself: `tasks` x epochs x ceil(n / batch) steps of
    PoissonSampled(batch / n, Gaussian(z))."""
    if tasks == 0:
        return 0.0
    acc = dp_accounting.rdp.RdpAccountant(orders=list(RDP_ORDERS))
    q = min(batch, n) / n
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, tasks * epochs * math.ceil(n / batch))
    return acc.get_epsilon(delta)


def test_the_ledger_composes_each_clients_tasks_and_stops_at_the_target():
    privacy = {"dp": "sgd", "dp_accountant": "rdp", "delta": 1e-5, "dp_clip": 1.0,
               "dp_noise_multiplier": 1.2, "target_epsilon": 0.0}
    train = {"batch_size": 10, "epochs": 2}
    sizes = {0: 40, 1: 95}
    ledger = PrivacyLedger(privacy, train, sizes)
    assert ledger.per_client and ledger.epsilon() == 0.0
    ledger.charge_clients([0, 1])
    ledger.charge_clients([1])
    assert ledger.epsilon_of(0) == pytest.approx(_library_epsilon(1.2, 40, 10, 2, 1), rel=1e-9)
    assert ledger.epsilon_of(1) == pytest.approx(_library_epsilon(1.2, 95, 10, 2, 2), rel=1e-9)
    assert ledger.epsilon() == max(ledger.epsilon_of(0), ledger.epsilon_of(1))
    record = ledger.record()
    assert record["mechanism"] == "sgd" and record["max_participations"] == 2
    target = (_library_epsilon(1.2, 40, 10, 2, 2) + _library_epsilon(1.2, 40, 10, 2, 3)) / 2
    ledger = PrivacyLedger({**privacy, "target_epsilon": target}, train, sizes)
    ledger.charge_clients([0, 1])
    assert ledger.has_budget(0)  # a second task fits the target, a third would not
    ledger.charge_clients([0])
    assert not ledger.has_budget(0) and ledger.epsilon_of(0) <= target
    with pytest.raises(ValueError, match="size"):
        ledger.epsilon_of(7)


def test_a_federation_with_dp_sgd_reports_the_libraries_epsilon_and_replays(tmp_path):
    z, rounds = 1.1, 2
    sections = merged(SMALL, federation={"clients": 4, "rounds": rounds},
                      privacy={"dp": "sgd", "dp_clip": 1.0, "dp_noise_multiplier": z})
    sizes = build_engine(build_config(sections), "sizes").train_sizes
    run, summary = run_federation(tmp_path, sections)
    records = metrics(run)
    assert [rec["participants"] for rec in records] == [[0, 1, 2, 3]] * rounds
    batch, epochs = SMALL["train"]["batch_size"], SMALL["train"]["epochs"]
    want = [max(_library_epsilon(z, sizes[c], batch, epochs, r + 1) for c in range(4))
            for r in range(rounds)]
    got = [rec["dp"]["epsilon"] for rec in records]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert all(rec["dp"]["mechanism"] == "sgd" for rec in records)
    assert summary["privacy"]["epsilon"] == pytest.approx(want[-1], rel=1e-5)
    # the clients trained on Poisson batches: the samples they drew are not n x epochs
    works = [(m.body["num_samples"], m.body["work"])
             for m in logged_messages(run, "update", "in")]
    assert len(works) == 4 * rounds
    assert any(w["samples"] != n * epochs for n, w in works)
    assert all(w["steps"] == epochs * math.ceil(n / batch) for n, w in works)
    out = fedbus("replay", str(run), timeout=240)
    assert "replay identical" in out.stdout, out.stdout + out.stderr


# --- who admits it --------------------------------------------------------------------------

def test_sgd_comes_with_client_level_and_is_refused_elsewhere():
    for name in ("fedavg", "fedprox"):
        assert "sgd" in dp_levels(get_algorithm(name).server)
        assert dp_refusal(name, "sgd") is None
        assert dp_refusal(name, "sgd", {"robust": "median"}) is None  # post-processing
    for name in ("fedproto", "local", "fedavg-proto", "fedper"):
        why = dp_refusal(name, "sgd")
        assert why.startswith(f"privacy.dp = sgd: {name} cannot") and "\n" not in why
        assert why.endswith("algorithms that admit it: fedavg, fedprox")


def test_preflight_refuses_dp_sgd_for_fedproto_in_one_line(tmp_path):
    cfg = write_config(tmp_path / "c.toml", merged(SMALL, algorithm={"name": "fedproto"},
                                                   privacy={"dp": "sgd"}))
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"), check=False, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "fedproto cannot" in ln]
    assert len(lines) == 1 and "privacy.dp = sgd" in lines[0], proc.stderr
