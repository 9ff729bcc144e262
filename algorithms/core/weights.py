"""Weight averaging shared by the weight-sharing algorithms (FedAvg server rule).

Updates carry "delta" = client weights minus the global weights they were sent,
so an update made from an older global version still applies cleanly. The
server applies

    global += sum_i c_i * delta_i / sum_i c_i

with c_i = w_i * n_i for FedAvg (w_i the engine's staleness weight, n_i the
client's sample count); other algorithms pass their own coefficients (e.g. an
attention weight times w_i). With fresh updates from one version and c_i = n_i
this is plain FedAvg, sum_i n_i theta_i / sum_i n_i, up to float rounding: the
sums run in float64 and are cast back to each weight's dtype once, so the
result does not depend on the order of the updates beyond float64 rounding.
Integer buffers (BatchNorm's num_batches_tracked) are averaged the same way and
rounded to the nearest integer.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch


def weights_spec(weights: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a weight dict, the form update_spec() uses."""
    return {k: (np.asarray(v).dtype.name, tuple(np.asarray(v).shape)) for k, v in weights.items()}


def model_spec(model: torch.nn.Module) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (dtype, shape)} of a model's state dict as it travels on the wire."""
    return {k: (str(v.dtype).replace("torch.", ""), tuple(v.shape))
            for k, v in model.state_dict().items()}


def weighted_delta_sum(deltas: Sequence[Mapping[str, Any]],
                       coefs: Sequence[float]) -> tuple[dict[str, np.ndarray], float]:
    """sum_i c_i * delta_i per weight name (float64) and sum_i c_i."""
    if len(deltas) != len(coefs):
        raise ValueError("one coefficient per delta")
    total = float(sum(float(c) for c in coefs))
    acc: dict[str, np.ndarray] = {}
    for delta, c in zip(deltas, coefs):
        for k, v in delta.items():
            term = np.asarray(v, dtype=np.float64) * float(c)
            acc[k] = term if k not in acc else acc[k] + term
    return acc, total


def apply_delta(global_weights: Mapping[str, Any], step: Mapping[str, np.ndarray]
                ) -> dict[str, np.ndarray]:
    """global + step, cast back to each weight's dtype (integers rounded).
    Names absent from `step` are copied unchanged."""
    out = {}
    for k, g in global_weights.items():
        g = np.asarray(g)
        if k not in step:
            out[k] = g.copy()
            continue
        new = g.astype(np.float64) + step[k]
        if np.issubdtype(g.dtype, np.integer):
            new = np.rint(new)
        elif g.dtype == np.bool_:
            new = new > 0.5
        out[k] = new.astype(g.dtype)
    return out


def average_deltas(global_weights: Mapping[str, Any], deltas: Sequence[Mapping[str, Any]],
                   coefs: Sequence[float]) -> dict[str, np.ndarray]:
    """New global weights: global + sum_i c_i delta_i / sum_i c_i.

    No deltas, or coefficients summing to 0, returns an unchanged copy."""
    acc, total = weighted_delta_sum(deltas, coefs)
    if not deltas or total <= 0.0:
        return {k: np.asarray(v).copy() for k, v in global_weights.items()}
    return apply_delta(global_weights, {k: v / total for k, v in acc.items()})


def fedavg_coefs(updates: Sequence[Any]) -> list[float]:
    """c_i = w_i * n_i for a list of ClientUpdate (staleness weight x samples)."""
    return [float(u.weight) * float(u.num_samples) for u in updates]
