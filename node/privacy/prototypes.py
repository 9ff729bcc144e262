"""Optional protection of what prototypes reveal, applied on the client
before an update leaves it (the engine's job, so every algorithm gets it).

* clip_norm > 0: each prototype vector is scaled down to at most this L2 norm,
  bounding any one client's influence on a global prototype.
* noise_sigma > 0: Gaussian noise N(0, sigma^2) is added to every present
  prototype (the Gaussian mechanism on the clipped mean); seeded by the task.
* withhold_counts: per-class sample counts are replaced by 0/1 presence
  flags, so the server learns which classes a client has but not how many
  samples (as FedTGP allows; count-weighted aggregations fall back to
  unweighted means).

What this does not do: it is not a formal (epsilon, delta) guarantee by
itself (sigma must be calibrated to clip_norm, the class sizes and the number
of rounds), it does not hide which classes a client holds, and it does not
protect model weights that weight-sharing algorithms upload beside prototypes.
See SECURITY.md.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

PROTOTYPE_KEYS = ("protos", "protos_before")


def protect(payload: dict[str, Any], privacy: Mapping[str, Any], seed: int) -> dict[str, Any]:
    clip, sigma = float(privacy["clip_norm"]), float(privacy["noise_sigma"])
    if clip <= 0 and sigma <= 0 and not privacy["withhold_counts"]:
        return payload
    out = dict(payload)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x9817]))
    counts = payload.get("counts")
    for key in PROTOTYPE_KEYS:
        protos = payload.get(key)
        if not isinstance(protos, np.ndarray) or protos.dtype.kind != "f":
            continue
        p = np.array(protos, dtype=np.float32, copy=True)
        present = np.linalg.norm(p, axis=-1) > 0  # absent classes travel as zero rows
        if isinstance(counts, np.ndarray) and counts.shape == p.shape[:1]:
            present &= (counts > 0).reshape(counts.shape + (1,) * (p.ndim - 2))
        if clip > 0:
            norms = np.linalg.norm(p, axis=-1, keepdims=True)
            p *= np.minimum(1.0, clip / np.maximum(norms, 1e-12))
        if sigma > 0:
            noise = rng.normal(0.0, sigma, size=p.shape).astype(np.float32)
            p += noise * present[..., None]
        out[key] = p
    if privacy["withhold_counts"] and isinstance(counts, np.ndarray):
        out["counts"] = (counts > 0).astype(counts.dtype)
    return out
