"""LocalRun: the engine's side of local training (epochs, partial work, budgets, slow devices)."""
import torch

from fedbus.algorithms.core.handlers import ClientContext, LocalRun


def _ctx(n=40, batch=8):
    model = torch.nn.Linear(4, 2)
    x, y = torch.randn(n, 4), torch.arange(n) % 2
    return ClientContext(client=0, model=model, device=torch.device("cpu"), train_x=x,
                         train_y=y, test_x=x, test_y=y, num_classes=2, feature_dim=4,
                         params={}, train={"batch_size": batch, "lr": 0.1, "momentum": 0.0,
                                           "weight_decay": 0.0}, seed=0)


class FakeClock:
    """Advances a fixed amount per reading: a device whose every step costs `step` s."""

    def __init__(self, step):
        self.t, self.step = 0.0, step

    def __call__(self):
        self.t += self.step
        return self.t


def test_full_epochs_visit_every_sample_once_per_epoch_in_seeded_order():
    ctx = _ctx()
    run = LocalRun(ctx, epochs=2, seed=7)
    seen = [y for _, y in run.batches()]
    assert run.work.to_dict() == {"epochs_asked": 2, "epochs_done": 2.0, "steps": 10,
                                  "samples": 80, "stopped": "done"}
    again = [y for _, y in LocalRun(ctx, epochs=2, seed=7).batches()]
    assert all(torch.equal(a, b) for a, b in zip(seen, again))
    other = [y for _, y in LocalRun(ctx, epochs=2, seed=8).batches()]
    assert not all(torch.equal(a, b) for a, b in zip(seen, other))


def test_partial_work_runs_a_fraction_of_the_epochs_but_at_least_one_step():
    run = LocalRun(_ctx(), epochs=2, seed=0, epochs_to_run=0.6)
    assert len(list(run.batches())) == 3  # 0.6 of an epoch of 5 steps
    assert run.work.stopped == "partial" and run.work.fraction == 0.3
    run = LocalRun(_ctx(), epochs=2, seed=0, epochs_to_run=0.0)
    assert len(list(run.batches())) == 1


def test_budget_stops_a_slow_device_where_real_slowness_would():
    # a real device whose steps take 1 s and a simulated one 10x slower with 0.1 s steps
    real = LocalRun(_ctx(), epochs=3, seed=0, budget_s=4.5, clock=FakeClock(1.0))
    simulated = LocalRun(_ctx(), epochs=3, seed=0, budget_s=4.5, slow_factor=10.0,
                         clock=FakeClock(0.1))
    assert len(list(real.batches())) == len(list(simulated.batches())) > 0
    assert real.work.stopped == simulated.work.stopped == "budget"
    assert real.work.steps == simulated.work.steps < 15
    assert simulated.elapsed() > 4.5
