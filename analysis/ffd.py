"""Federated feature discrepancy (FFD): how far the features of a run's global model lie
from those of a centrally trained model, on each client's data.

Michieli & Ozay, "Prototype Guided Federated Learning of Visual Feature
Representations", arXiv:2105.08982, Sec. 5.1, eq. 16-17. P_k^t is the distribution of
the features the federated model M_A (global weights W^t) gives on client k's data, Q
that of a model M_C trained centrally on the same data set, and

    MMD_A^t   = 1/|K^t| sum_{k in K^t} MMD(P_k^t, Q)                          (eq. 16)
    FFD(A, B) = (MMD_B^T - MMD_A^T) / MMD_B^T x 100   (%, B the baseline, FedAvg)  (eq. 17)

MMD is Gretton et al.'s maximum mean discrepancy ([15]: JMLR 13, 2012), here its biased
estimate (their eq. 3), non-negative and exactly 0 for two identical feature sets:

    MMD_b(X, Y) = [ 1/m^2 sum_ij k(x_i, x_j) - 2/(mn) sum_ij k(x_i, y_j)
                    + 1/n^2 sum_ij k(y_i, y_j) ]^(1/2)

Where the paper is silent, our choices:
* kernel: Gaussian RBF k(x, y) = exp(-||x - y||^2 / (2 sigma^2)) with Gretton et al.'s
  median heuristic, sigma = the median distance between the points of the pooled sample
  X u Y (sigma = 1 if that median is 0);
* Q on client k is M_C's features on the same inputs as P_k^t (both networks see client
  k's samples), so each client gets its own MMD(P_k^t, Q_k);
* the data: the client's training split (S_k of the paper's Sec. 2), or its test split
  with log.ffd_split = "test"; at most log.ffd_samples samples per client, a fixed
  random subset (seeded by federation.seed and the client);
* features: model.features(x), the encoder output E (prototype space), in eval mode.

What each evaluated record gets (the reference run is log.ffd_reference): ffd =
{client: MMD(P_k^t, Q_k)} for every client of the federation (the server has all the
data, sampled or not), ffd_mean / ffd_std over them, and ffd_round_mean over the clients
whose updates the evaluated aggregation used (K^t: eq. 16 as printed). `fedbus plot`
draws ffd_mean per round and eq. 17 between runs (FFD % against the first run given).

**A simulation metric**: the server builds every client's data (and the reference
model), which a real deployment cannot do; it costs the server one forward pass of both
models over the clients' samples per evaluation (the reference's features are computed
once). Only for algorithms that keep one global model of the reference's architecture
(ServerHandler.global_weights: fedavg, fedprox, fedatt, proto-attention, fedavg-proto,
mpfedcl, central); anything else is a one-line config error.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedbus.node.config import Config, ConfigError, build_config

if TYPE_CHECKING:
    import torch

KEY = "log.ffd_reference"


# --- the mathematics ---------------------------------------------------------------------

def _sq_dists(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(d, 0.0)


def median_bandwidth(x: np.ndarray, y: np.ndarray) -> float:
    """Gretton et al.'s median heuristic: the median distance between distinct points
    (pairs i < j) of the pooled sample; 1.0 if it is 0."""
    z = np.concatenate([np.asarray(x, np.float64), np.asarray(y, np.float64)])
    if len(z) < 2:
        return 1.0
    d = np.sqrt(_sq_dists(z, z)[np.triu_indices(len(z), k=1)])
    med = float(np.median(d))
    return med if med > 0 else 1.0


def mmd_rbf(x: np.ndarray, y: np.ndarray, sigma: float | None = None) -> float:
    """Biased MMD estimate (Gretton et al. 2012, eq. 3) between samples x [m, D] and
    y [n, D] under the RBF kernel of bandwidth sigma (None: the median heuristic)."""
    if not len(x) or not len(y):
        return float("nan")
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    s = median_bandwidth(x, y) if sigma is None else float(sigma)
    k = lambda a, b: np.exp(-_sq_dists(a, b) / (2.0 * s * s))
    mmd2 = k(x, x).mean() + k(y, y).mean() - 2.0 * k(x, y).mean()
    return float(np.sqrt(max(mmd2, 0.0)))


def ffd_gain(mmd_baseline: float, mmd_method: float) -> float:
    """Eq. 17: FFD(A, B) in %, the relative gain of A's MMD over the baseline B's."""
    return (mmd_baseline - mmd_method) / mmd_baseline * 100.0


def features(model: torch.nn.Module, x: torch.Tensor, batch: int = 512) -> np.ndarray:
    """model.features(x) in eval mode, float64 [n, D] (torch is imported here, so that
    `fedbus plot`, which uses ffd_gain, does not load it)."""
    import torch

    was = model.training
    model.eval()
    with torch.no_grad():
        out = [model.features(x[i:i + batch]).double() for i in range(0, len(x), batch)]
    model.train(was)
    return torch.cat(out).numpy() if out else np.zeros((0, 0))


# --- the reference run --------------------------------------------------------------------

def _err(cfg: Config, why: str) -> ConfigError:
    return ConfigError(f"{KEY} = {cfg.log.ffd_reference!r}: {why}")


def load_reference(cfg: Config) -> tuple[Config, dict[str, np.ndarray]]:
    """(the reference run's config, its global model's weights from checkpoint.fbk)."""
    from fedbus.node.server import CheckpointError, read_checkpoint

    run = Path(cfg.log.ffd_reference)
    if not run.is_dir():
        raise _err(cfg, "no such run directory")
    try:
        ref_cfg = build_config(json.loads((run / "config.json").read_text()))
        if not (run / "checkpoint.fbk").is_file():
            raise FileNotFoundError(2, "no file", str(run / "checkpoint.fbk"))
        _raw, state = read_checkpoint(run / "checkpoint.fbk", keys=("handler",))
    except FileNotFoundError as err:
        raise _err(cfg, f"no {Path(err.filename).name} there (a finished run, e.g. of "
                        "algorithm.name = central)") from None
    except (ValueError, ConfigError, CheckpointError) as err:
        raise _err(cfg, f"unreadable run ({' '.join(str(err).split())})") from None
    weights = (state.get("handler") or {}).get("weights") if isinstance(state, dict) else None
    if not isinstance(weights, dict):
        raise _err(cfg, f"its algorithm ({ref_cfg.algorithm.name}) keeps no global model; "
                        "use a run of algorithm.name = central")
    return ref_cfg, weights


def check_reference(cfg: Config) -> tuple[Config, dict[str, np.ndarray], list[str]]:
    """Raise ConfigError (one line) unless FFD can be computed for this run: an
    algorithm with one global model, a reference run with one of the same architecture
    on the same data set. Returns (reference config, its weights, warnings)."""
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.handlers import ServerHandler
    from fedbus.models import arch_for_client, feature_dim_for

    name = cfg.algorithm.name
    server = get_algorithm(name).server
    if server.global_weights is ServerHandler.global_weights or not server.needs_same_model:
        raise _err(cfg, f"FFD needs an algorithm with one global model (fedavg, fedprox, "
                        f"fedatt, proto-attention, fedavg-proto, mpfedcl, central); "
                        f"algorithm.name = {name!r} keeps none")
    ref_cfg, weights = load_reference(cfg)
    if ref_cfg.data.dataset != cfg.data.dataset:
        raise _err(cfg, f"the reference ran data.dataset = {ref_cfg.data.dataset!r}, this run "
                        f"{cfg.data.dataset!r}")
    mine = (arch_for_client(cfg.model, 0), feature_dim_for(cfg.model))
    theirs = (arch_for_client(ref_cfg.model, 0), feature_dim_for(ref_cfg.model))
    if mine != theirs:
        raise _err(cfg, f"the reference's model (arch, feature_dim) is {theirs}, this run's "
                        f"{mine}: FFD compares one architecture")
    notes = []
    same = lambda c: (dict(c.data), c.federation.clients, c.federation.seed)
    if same(ref_cfg) != same(cfg):
        notes.append("the reference run's [data], federation.clients or seed differ from this "
                     "run's: its model was trained on another split of the data set")
    return ref_cfg, weights, notes


class FeatureDiscrepancy:
    """The FFD of one run against its log.ffd_reference, as Engine.eval_metrics wants it."""

    def __init__(self, cfg: Config):
        from fedbus.algorithms.core.handlers import load_weights
        from fedbus.node.setup import federated_data, make_model

        self.cfg = cfg
        self.ref_cfg, ref_weights, self.notes = check_reference(cfg)
        data = federated_data(cfg)
        self.model = make_model(cfg, 0, data)
        self.reference = make_model(cfg, 0, data)
        try:
            load_weights(self.reference, ref_weights)
        except (ValueError, RuntimeError) as err:
            raise _err(cfg, f"its weights do not fit this run's model ({err})"[:300]) from None
        import torch

        split, cap, seed = cfg.log.ffd_split, int(cfg.log.ffd_samples), cfg.federation.seed
        self.inputs: dict[int, torch.Tensor] = {}
        for k in range(cfg.federation.clients):
            part = data.client(k)
            x = part.train_x if split == "train" else part.test_x
            if cap and len(x) > cap:
                rng = np.random.default_rng(np.random.SeedSequence([seed, 0xFFD, k]))
                x = x[np.sort(rng.choice(len(x), cap, replace=False))]
            self.inputs[k] = torch.as_tensor(np.asarray(x), dtype=torch.float32)
        self._ref_features: dict[int, np.ndarray] = {}

    def per_client(self, weights: Mapping[str, Any]) -> dict[int, float]:
        """{client: MMD(P_k, Q_k)} with `weights` loaded into the run's model (clients
        with no samples in the split are left out)."""
        from fedbus.algorithms.core.handlers import load_weights

        load_weights(self.model, weights)
        out = {}
        for k, x in self.inputs.items():
            if not len(x):
                continue
            if k not in self._ref_features:
                self._ref_features[k] = features(self.reference, x)
            out[k] = mmd_rbf(features(self.model, x), self._ref_features[k])
        return out

    def record_metrics(self, handler: Any, record: Mapping[str, Any]) -> dict[str, Any]:
        weights = handler.global_weights()
        if weights is None:
            return {}
        per = self.per_client(weights)
        vals = np.array(list(per.values()), dtype=np.float64)
        out: dict[str, Any] = {"ffd": {str(k): v for k, v in per.items()}}
        if len(vals):
            out.update(ffd_mean=float(vals.mean()), ffd_std=float(vals.std()))
        took = [per[c] for c in sorted(set(record.get("participants") or [])) if c in per]
        if took:
            out["ffd_round_mean"] = float(np.mean(took))
        return out
