"""The server's privacy ledger: what a run with `privacy.dp` has spent, round by round.

The mechanisms and the accountant are fedbus.node.privacy.dp's; this is the engine's bookkeeping
around them, deterministic in the run's events (a replay recomputes it, a resumed run
reloads it):

* record (prototype algorithms): each client releases its own DP prototypes every task it
  answers (the noise is added on the client, before anything leaves it). A client's epsilon
  composes its participations, charged when its task is sent (conservative: a client that
  then drops out is charged all the same) with no amplification by client sampling: the
  server draws the cohort and sees who took part. The run's epsilon is the largest
  client's. `target_epsilon`: a client whose next participation would pass it is no longer
  sampled (logged once, "privacy_budget_spent"); the run stops when fewer than
  `min_clients` have budget left.
* client (weight-sharing algorithms, DP-FedAvg, McMahan et al. 2018): every client's
  delta is clipped on the client; the server sums them with weight 1 each and adds
  N(0, (z C)^2) to the sum (central noise: it protects the clients from whoever sees the
  global models, not from the server, which sees the clipped deltas or, under secure
  aggregation, their exact sum). Each round composes one Poisson-subsampled Gaussian
  mechanism, PoissonSampled(q, Gaussian(z)) with q = federation.fraction, which is how the
  engine draws the cohort under dp = client: each live client independently with
  probability q, from the server's secret seed (RUN/noise_seed, as its noise), so no client
  can tell who took part (fedbus.node.engine.Engine._sample). `target_epsilon`: the run
  stops before a round that would pass it.
* client with privacy.dp_noise = "distributed" (under secure aggregation): the clients add
  Skellam shares of the noise before masking (fedbus.node.privacy.ddp) and the server adds
  none; a round is charged when its sum is unmasked, for the noise its survivors carried
  (the Skellam mechanism's RDP, Poisson-amplified by Zhu and Wang's Theorem 5, composed per
  order here and converted by dp-accounting); a round that unmasks nothing is not charged.
* sgd (weight-sharing algorithms, DP-SGD in local training,
  fedbus.algorithms.core.dp_sgd): each task a client is sent is epochs x ceil(n /
  batch_size) DP-SGD steps, each a Gaussian mechanism of multiplier z Poisson-subsampled
  with q = min(batch_size, n) / n (fedbus.algorithms.core.dp_sgd.task_sampling; n the
  client's training-set size, which the server knows from its partition, `sizes`).
  Charged per client like record level, in full when the task is sent (a client that
  does part of its epochs, or drops out, pays all of them), and composed over its tasks; the
  run's epsilon is the largest client's and `target_epsilon` stops sampling a client as at
  record level.
* record over a DP-SGD extractor (privacy.dp_extractor = "sgd"): each task charges a client
  both its DP-SGD steps (as sgd) and its prototype release (as record), composed together.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


class PrivacyLedger:
    def __init__(self, privacy: Mapping[str, Any], train: Mapping[str, Any] | None = None,
                 sizes: Mapping[int, int] | None = None):
        """`train` (the [train] section) and `sizes` (client -> training-set size, the
        engine's train_sizes, read when a client is charged) are needed by sgd only."""
        from fedbus.node.privacy.dp import Accountant, record_noise_multiplier

        self.mechanism = str(privacy["dp"])
        # record level over an extractor trained by DP-SGD: both releases composed per client
        self.extractor_sgd = self.mechanism == "record" and \
            privacy.get("dp_extractor", "plain") == "sgd"
        self.kind, self.delta = str(privacy["dp_accountant"]), float(privacy["delta"])
        self.clip = float(privacy["dp_clip"])
        self.z = float(privacy["dp_noise_multiplier"])
        self.target = float(privacy["target_epsilon"])
        # the noise multiplier the accountant composes: record-level noise covers a class
        # sum and its count at once (sensitivity sqrt(2) in noise units)
        self.z_accounted = record_noise_multiplier(self.z) if self.mechanism == "record" \
            else self.z
        self.run = Accountant(self.kind, self.delta)  # client-level
        # client level with dp_noise = "distributed" (fedbus.node.privacy.ddp): the clients
        # add Skellam shares; each round is charged when its sum is unmasked, for the noise
        # of the survivors it holds; its RDP composes here (at ddp.ORDERS)
        self.distributed = self.mechanism == "client" and \
            privacy.get("dp_noise") == "distributed"
        self.ddp_rdp: list[float] | None = None
        self.ddp_rounds = 0
        self._ddp_last: dict[str, Any] = {}
        self.participations: dict[int, int] = {}  # record-level: tasks sent per client
        self._eps_by_count: dict[int, float] = {0: 0.0}
        self.spent: set[int] = set()  # clients out of budget (logged once each)
        self._accountant = Accountant
        # sgd: each task's (q, steps) depends on the client's n (fedbus.algorithms.core.dp_sgd)
        self.train = train
        self.sizes = sizes if sizes is not None else {}
        self._eps_sgd: dict[tuple[int, int], float] = {}  # (n, tasks) -> epsilon
        if (self.mechanism == "sgd" or self.extractor_sgd) and train is None:
            raise ValueError(f"privacy.dp = {self.mechanism} with DP-SGD: the ledger needs "
                             "the [train] section (epochs, batch_size)")

    @property
    def per_client(self) -> bool:
        """Whether clients are charged one by one (record, sgd), not the run (client)."""
        return self.mechanism in ("record", "sgd")

    # --- record level: per client ---

    def client_epsilon(self, count: int) -> float:
        """Epsilon of a client after `count` releases (memoised: every client's mechanism
        is the same, so its epsilon depends on its count alone)."""
        eps = self._eps_by_count.get(count)
        if eps is None:
            acc = self._accountant(self.kind, self.delta)
            acc.add(self.z_accounted, 1.0, steps=count)
            eps = self._eps_by_count[count] = acc.epsilon()
        return eps

    def sgd_epsilon(self, n: int, count: int) -> float:
        """Epsilon of a client with n training samples after `count` DP-SGD tasks: count x
        epochs x ceil(n / batch_size) steps of PoissonSampled(min(batch_size, n) / n,
        Gaussian(z)) (memoised on (n, count))."""
        from fedbus.algorithms.core.dp_sgd import task_sampling

        eps = self._eps_sgd.get((n, count))
        if eps is None:
            q, steps = task_sampling(n, int(self.train["batch_size"]), int(self.train["epochs"]))
            acc = self._accountant(self.kind, self.delta)
            acc.add(self.z, q, steps=count * steps)
            if self.extractor_sgd:  # each task also releases the prototypes once
                acc.add(self.z_accounted, 1.0, steps=count)
            eps = self._eps_sgd[(n, count)] = acc.epsilon()
        return eps

    def _size(self, client: int) -> int:
        n = self.sizes.get(client)
        if n is None:
            raise ValueError(f"privacy.dp = sgd: client {client}'s training-set size is "
                             "unknown to the server; its DP-SGD epsilon cannot be accounted")
        return int(n)

    def epsilon_of(self, client: int, count: int | None = None) -> float:
        """A client's epsilon after `count` participations (default: those charged)."""
        count = self.participations.get(client, 0) if count is None else count
        if self.mechanism == "sgd" or self.extractor_sgd:
            return self.sgd_epsilon(self._size(client), count)
        return self.client_epsilon(count)

    def has_budget(self, client: int) -> bool:
        if not self.per_client or self.target <= 0:
            return True
        return self.epsilon_of(client, self.participations.get(client, 0) + 1) <= self.target

    def charge_clients(self, clients: list[int]) -> None:
        for c in clients:
            self.participations[c] = self.participations.get(c, 0) + 1

    # --- client level: the run ---

    def run_has_budget(self, rate: float) -> bool:
        """Whether one more round, each client in it with probability `rate` (Poisson,
        the engine's cohort at client level), stays within target_epsilon."""
        if self.mechanism != "client" or self.target <= 0:
            return True
        return self.run.epsilon_after(self.z, rate) <= self.target

    def charge_round(self, rate: float) -> None:
        """A client-level round whose cohort took each live client independently with
        probability `rate`, drawn from randomness no client knows (Engine._sample)."""
        if not self.distributed:  # (distributed: charged when the sum is unmasked)
            self.run.add(self.z, rate)

    def charge_distributed(self, params: Any, survivors: int, rate: float) -> None:
        """A distributed-DP round's unmasked sum: the Skellam noise of `survivors` clients
        (variance survivors x mu / n_min), its cohort Poisson-sampled at `rate`."""
        from fedbus.node.privacy.ddp import ORDERS, round_rdp

        rdp = round_rdp(params, survivors, rate)
        base = np.zeros(len(ORDERS)) if self.ddp_rdp is None else np.asarray(self.ddp_rdp)
        self.ddp_rdp = [float(v) for v in base + rdp]
        self.ddp_rounds += 1
        self._ddp_last = {"survivors": int(survivors), "n_min": int(params.n_min),
                          "noise_std": params.noise_std(survivors)}

    def note_clipped(self, clipped: int, seen: int) -> None:
        """Client level without secure aggregation: of the `seen` deltas the server summed
        this round, `clipped` were at the clip (it sees them, so the count tells it
        nothing new); the next record() reports them."""
        self._clipped = (int(clipped), int(seen))

    def noise_std(self) -> float:
        """The std of the Gaussian noise the server adds to a client-level round's sum."""
        return self.z * self.clip

    # --- reports ---

    def epsilon(self) -> float:
        if self.mechanism == "record" and not self.extractor_sgd:
            return max((self.client_epsilon(n) for n in set(self.participations.values())),
                       default=0.0)
        if self.per_client:  # sgd, record over a DP-SGD extractor: n differs per client
            return max((self.epsilon_of(c) for c in self.participations), default=0.0)
        if self.distributed:
            from fedbus.node.privacy.ddp import epsilon

            return 0.0 if self.ddp_rdp is None else \
                epsilon(np.asarray(self.ddp_rdp), self.delta)
        return self.run.epsilon()

    def record(self) -> dict[str, Any]:
        out = {"mechanism": self.mechanism, "epsilon": round(self.epsilon(), 6),
               "delta": self.delta, "noise_multiplier": self.z, "clip": self.clip}
        if self.per_client:
            out["max_participations"] = max(self.participations.values(), default=0)
            out["spent_clients"] = len(self.spent)
        if self.target > 0:
            out["target_epsilon"] = self.target
        if self.distributed:
            out["noise"] = "distributed"
            out["rounds"] = self.ddp_rounds
            out.update(self.__dict__.pop("_ddp_last", None) or {})
            self._ddp_last = {}
        clipped = self.__dict__.pop("_clipped", None)
        if clipped is not None:
            out["clipped"], out["deltas"] = clipped
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"run": self.run.state_dict(),
                "participations": [[c, n] for c, n in sorted(self.participations.items())],
                "spent": sorted(self.spent),
                **({"ddp": {"rdp": self.ddp_rdp, "rounds": self.ddp_rounds}}
                   if self.distributed else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.run.load_state_dict(state["run"])
        self.participations = {int(c): int(n) for c, n in state["participations"]}
        self.spent = {int(c) for c in state["spent"]}
        if self.distributed and "ddp" in state:
            rdp = state["ddp"]["rdp"]
            self.ddp_rdp = None if rdp is None else [float(v) for v in rdp]
            self.ddp_rounds = int(state["ddp"]["rounds"])


NOISE_SEED_FILE = "noise_seed"


def run_noise_seed(run_dir: Any, *, create: bool) -> int:
    """The server's secret seed of a run's client-level DP noise and cohorts
    (privacy.dp_noise = "secret"): 128 random bits from the OS (`secrets`, the kernel's
    CSPRNG), written once to RUN/noise_seed (mode 0600) and never sent to any node, so no
    client can recompute the noise added to the global model or who was sampled;
    `fedbus replay` and a resumed run read it back to redo the same noise and cohorts."""
    import os
    import secrets
    from pathlib import Path

    path = Path(run_dir) / NOISE_SEED_FILE
    if path.exists():
        text = path.read_text().strip()
        if not text.isdigit():
            raise ValueError(f"{path} does not hold a seed (digits): {text[:20]!r}")
        return int(text)
    if not create:
        raise FileNotFoundError(f"{path} is missing: the server's DP noise of this run "
                                "cannot be redone without it")
    seed = secrets.randbits(128)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{seed}\n")
    return seed


def uses_secret_server_noise(privacy: Mapping[str, Any]) -> bool:
    # distributed: the clients draw the noise, but the cohort is still the server's secret draw
    return privacy.get("dp") == "client" and \
        privacy.get("dp_noise", "secret") in ("secret", "distributed")

