"""Pre-aggregation at a relay: how a handler's updates merge before they reach the server.

A regional relay (fedbus.node.relay) serves many clients and sends the server one update
per round instead of one per client, for algorithms whose server step is a weighted sum.
A handler declares it with a `MergeRule` in its class's `MERGE` attribute (read through
`ServerHandler.merge_rule()`, so a subclass with its own aggregation does not inherit it).

The rule maps one client's update to its *sum form* (`lift`), adds sum forms (`add`), and
says what a sum form looks like on the wire (`spec`). Sum forms are float64 and carry no
staleness weight: a relay merges only updates made from the same global version (one
sync round's tasks), which the server weighs alike, so the server multiplies a merged
update's sum form by that one weight and adds it to the lifted single updates. With
every weight alike the result equals the flat federation's up to float64 rounding.

`lift` returns None for an update the rule will not merge (FedAvg's "drop" of partial
work: the server must see it to count it as a failure); the relay forwards it as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedbus.algorithms.base import ClientUpdate, Work


class MergeRule:
    """What a handler's MERGE declares. `params` is the [algorithm] section (the relay has
    the run's config, not the handler: it holds no data and builds no model)."""

    name = "merge"

    def lift(self, payload: Mapping[str, Any], num_samples: int, work: Work,
             params: Mapping[str, Any]) -> dict[str, Any] | None:
        raise NotImplementedError

    def add(self, into: dict[str, Any] | None, part: Mapping[str, Any]) -> dict[str, Any]:
        """into + part (into is changed and returned; None starts a sum)."""
        if into is None:
            return _copy(part)
        return _add(into, part)

    def spec(self, handler: Any) -> dict[str, Any]:
        """The sum form's arrays, as ServerHandler.update_spec() writes them."""
        raise NotImplementedError


def _copy(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _copy(v) if isinstance(v, Mapping) else
            np.array(v, dtype=np.float64, copy=True) for k, v in tree.items()}


def _add(into: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    if set(into) != set(part):
        raise ValueError(f"sum forms differ: {sorted(set(into) ^ set(part))[:3]}")
    for k, v in part.items():
        if isinstance(v, Mapping):
            _add(into[k], v)
        else:
            into[k] = into[k] + np.asarray(v, dtype=np.float64)
    return into


def weighted_sum(updates: list[ClientUpdate], rule: MergeRule,
                 params: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[ClientUpdate]]:
    """sum_e w_e * form_e over an aggregation's updates: a merged update's payload is its
    sum form already, a single one is lifted. Returns the sum (None if nothing lifted) and
    the single updates the rule refused (to be handled as the flat path does)."""
    total: dict[str, Any] | None = None
    refused = []
    for u in updates:
        form = u.payload if u.members else rule.lift(u.payload, u.num_samples, u.work, params)
        if form is None:
            refused.append(u)
            continue
        total = rule.add(total, _scaled(form, float(u.weight)))
    return total, refused


def _scaled(tree: Mapping[str, Any], w: float) -> dict[str, Any]:
    return {k: _scaled(v, w) if isinstance(v, Mapping) else np.asarray(v, dtype=np.float64) * w
            for k, v in tree.items()}


class PrototypeSums(MergeRule):
    """FedProto's server step (Tan et al., eq. 6) in sum form: per class k,
    "sums"[k] = sum_i a_ik p_ik and "mass"[k] = sum_i a_ik, with a_ik = |D_i,k| (the
    class count) when params["aggregate"] is "weighted", else [|D_i,k| > 0] (the plain
    mean over the clients that have k). The server's prototype is sums / mass."""

    name = "prototype-sums"

    def __init__(self, by_count_param: str = "aggregate", by_count_value: str = "weighted"):
        self.by_count_param, self.by_count_value = by_count_param, by_count_value

    def lift(self, payload, num_samples, work, params):
        counts = np.asarray(payload["counts"], dtype=np.float64)
        by_count = params.get(self.by_count_param) == self.by_count_value
        a = np.where(counts > 0, counts if by_count else 1.0, 0.0)
        return {"sums": a[:, None] * np.asarray(payload["protos"], dtype=np.float64),
                "mass": a}

    def spec(self, handler):
        c, d = handler.ctx.num_classes, handler.ctx.feature_dim
        return {"sums": ("float64", (c, d)), "mass": ("float64", (c,))}


class DeltaSums(MergeRule):
    """FedAvg's server step (McMahan et al., Algorithm 1) in sum form: "delta_sum"[name] =
    sum_i n_i delta_i and "mass" = [sum_i n_i] (n_i the client's samples); the server steps
    by sum / mass. With params["partial"] == "drop" a partial update is not merged."""

    name = "delta-sums"

    def lift(self, payload, num_samples, work, params):
        if params.get("partial") == "drop" and work.fraction < 1.0:
            return None
        n = float(num_samples)
        return {"delta_sum": {k: np.asarray(v, dtype=np.float64) * n
                              for k, v in payload["delta"].items()},
                "mass": np.array([n])}  # [1], not 0-d: the wire sends 0-d as a number

    def spec(self, handler):
        spec = handler.update_spec()["delta"]
        return {"delta_sum": {k: ("float64", shape) for k, (_, shape) in spec.items()},
                "mass": ("float64", (1,))}


class ArraySums(MergeRule):
    """The no-op algorithm's "state" array summed, with the number of updates: what
    `fedbus bench rounds --relays` merges."""

    name = "array-sums"

    def lift(self, payload, num_samples, work, params):
        return {"state": np.asarray(payload["state"], dtype=np.float64), "mass": np.ones(1)}

    def spec(self, handler):
        _, shape = handler.update_spec()["state"]
        return {"state": ("float64", shape), "mass": ("float64", (1,))}


def members_of(updates: list[ClientUpdate]) -> list[ClientUpdate]:
    """One entry per client: a merged update stands for its members."""
    out: list[ClientUpdate] = []
    for u in updates:
        out.extend(u.members or (u,))
    return out
