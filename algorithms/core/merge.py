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

A run's options may choose an aggregation that is no sum: under `algorithm.robust`
(fedbus.algorithms.core.robust: a median, a trimmed mean or Krum needs every update apart)
`merge_rule(params)` is None for the run, so relays forward updates as they are and the
server refuses merged ones; the class's MERGE still says how its default aggregation merges.

`lift` returns None for an update the rule will not merge (FedAvg's "drop" of partial
work: the server must see it to count it as a failure); the relay forwards it as it is.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedbus.algorithms.core.handlers import ClientUpdate, Work


class MergeRule:
    """What a handler's MERGE declares. `params` is the [algorithm] section (the relay has
    the run's config, not the handler: it holds no data and builds no model)."""

    name = "merge"

    def lift(self, payload: Mapping[str, Any], num_samples: int, work: Work,
             params: Mapping[str, Any], client: int = -1) -> dict[str, Any] | None:
        """One client's update in sum form; None = not merged (sent up as it is)."""
        raise NotImplementedError

    def add(self, into: dict[str, Any] | None, part: Mapping[str, Any]) -> dict[str, Any]:
        """into + part (into is changed and returned; None starts a sum)."""
        if into is None:
            return _copy(part)
        return _add(into, part)

    def spec(self, handler: Any) -> dict[str, Any]:
        """The sum form's arrays, as ServerHandler.update_spec() writes them."""
        raise NotImplementedError

    def scaled(self, form: Mapping[str, Any], w: float) -> dict[str, Any]:
        """w x a sum form (the server's staleness weight of a whole merged update)."""
        return _scaled(form, w)

    def form_of(self, payload: Mapping[str, Any]) -> Mapping[str, Any]:
        """The part of a merged payload this rule sums (a richer rule's payload may carry
        more: MP-FedCL's pool rides beside FedAvg's sums)."""
        return payload

    def check(self, payload: Mapping[str, Any], members: list) -> str | None:
        """Why a merged payload does not fit its members (beyond its spec), or None."""
        return None

    def grows_by(self, form: Mapping[str, Any]) -> int:
        """Bytes a sum form gains when `form` is added: 0 for a sum (its shapes are fixed);
        a rule that carries its members' arrays along (DeltaSumsAndPool) says how many."""
        return 0


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
            v = np.asarray(v, dtype=np.float64)
            if v.shape != into[k].shape:  # never broadcast: a wrong shape is not merged
                raise ValueError(f"sum forms differ in {k!r}: {v.shape} against "
                                 f"{into[k].shape}")
            into[k] = into[k] + v
    return into


def weighted_sum(updates: list[ClientUpdate], rule: MergeRule,
                 params: Mapping[str, Any]) -> tuple[dict[str, Any] | None, list[ClientUpdate]]:
    """sum_e w_e * form_e over an aggregation's updates: a merged update's payload is its
    sum form already, a single one is lifted. Returns the sum (None if nothing lifted) and
    the single updates the rule refused (to be handled as the flat path does)."""
    total: dict[str, Any] | None = None
    refused = []
    for u in updates:
        form = rule.form_of(u.payload) if u.members else \
            rule.lift(u.payload, u.num_samples, u.work, params, u.client)
        if form is None:
            refused.append(u)
            continue
        total = rule.add(total, rule.scaled(form, float(u.weight)))
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

    def lift(self, payload, num_samples, work, params, client=-1):
        counts = np.asarray(payload["counts"], dtype=np.float64)
        protos = np.asarray(payload["protos"], dtype=np.float64)
        if counts.ndim != 1 or protos.ndim != 2 or protos.shape[0] != counts.shape[0]:
            raise ValueError(f"protos {protos.shape} do not pair with counts {counts.shape}")
        by_count = params.get(self.by_count_param) == self.by_count_value
        a = np.where(counts > 0, counts if by_count else 1.0, 0.0)
        return {"sums": a[:, None] * protos, "mass": a}

    def spec(self, handler):
        c, d = handler.ctx.num_classes, handler.ctx.feature_dim
        return {"sums": ("float64", (c, d)), "mass": ("float64", (c,))}


class DeltaSums(MergeRule):
    """FedAvg's server step (McMahan et al., Algorithm 1) in sum form: "delta_sum"[name] =
    sum_i n_i delta_i and "mass" = [sum_i n_i] (n_i the client's samples); the server steps
    by sum / mass. With params["partial"] == "drop" a partial update is not merged."""

    name = "delta-sums"

    def lift(self, payload, num_samples, work, params, client=-1):
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

    def form_of(self, payload):
        return {"delta_sum": payload["delta_sum"], "mass": payload["mass"]}


class DeltaSumsAndPool(DeltaSums):
    """MP-FedCL (Qiao et al.): FedAvg's half summed as DeltaSums, and the clients'
    prototypes carried whole beside it ("pool": protos [M, C, k, D], mask [M, C, k],
    counts [M, C], clients [M]), because the server's pool is no sum: eq. 8 keeps every
    client's prototypes and eq. 10 pads each client's short classes with the mean over
    all of them. The server rebuilds the per-client lists, so its pool is the flat one."""

    name = "delta-sums+pool"

    def lift(self, payload, num_samples, work, params, client=-1):
        form = super().lift(payload, num_samples, work, params, client)
        if form is None:
            return None
        form["pool"] = {"protos": np.asarray(payload["protos"], dtype=np.float32)[None],
                        "mask": np.asarray(payload["mask"], dtype=bool)[None],
                        "counts": np.asarray(payload["counts"], dtype=np.int64)[None],
                        "clients": np.array([client], dtype=np.int64)}
        return form

    def add(self, into, part):
        pool = part["pool"]
        sums = super().add(None if into is None else {k: into[k] for k in ("delta_sum", "mass")},
                           {k: part[k] for k in ("delta_sum", "mass")})
        sums["pool"] = dict(pool) if into is None else {
            k: np.concatenate([into["pool"][k], pool[k]]) for k in pool}
        return sums

    def scaled(self, form, w):
        return {**_scaled(self.form_of(form), w), "pool": form["pool"]}

    def grows_by(self, form):
        return form_nbytes(form["pool"])

    def spec(self, handler):
        c, k, d = handler.ctx.num_classes, int(handler.param("k")), handler.ctx.feature_dim
        return {**super().spec(handler), "pool": {
            "protos": ("float32", (None, c, k, d)), "mask": ("bool", (None, c, k)),
            "counts": ("int64", (None, c)), "clients": ("int64", (None,))}}

    def check(self, payload, members):
        clients = [int(c) for c in payload["pool"]["clients"]]
        if sorted(clients) != sorted(int(m[0][1:]) for m in members):
            return "the pool's clients are not the members"
        if any(len(payload["pool"][k]) != len(clients) for k in ("protos", "mask", "counts")):
            return "the pool's arrays do not have one row per member"
        return None


class ArraySums(MergeRule):
    """The no-op algorithm's "state" array summed, with the number of updates: what
    `fedbus bench rounds --relays` merges."""

    name = "array-sums"

    def lift(self, payload, num_samples, work, params, client=-1):
        return {"state": np.asarray(payload["state"], dtype=np.float64), "mass": np.ones(1)}

    def spec(self, handler):
        _, shape = handler.update_spec()["state"]
        return {"state": ("float64", shape), "mass": ("float64", (1,))}


def form_nbytes(tree: Mapping[str, Any]) -> int:
    """Bytes of a sum form's arrays."""
    return sum(form_nbytes(v) if isinstance(v, Mapping) else np.asarray(v).nbytes
               for v in tree.values())


def members_of(updates: list[ClientUpdate]) -> list[ClientUpdate]:
    """One entry per client: a merged update stands for its members."""
    out: list[ClientUpdate] = []
    for u in updates:
        out.extend(u.members or (u,))
    return out


class LogitSums(PrototypeSums):
    """FD's server step (Jeong et al.; fedbus.algorithms.fd) in sum form, which folds like
    FedProto's: a client's per-class mean output vectors "logits" [C, C] with "counts" [C]
    give "sums"[k] = sum_i a_ik z_ik and "mass"[k] = sum_i a_ik, a_ik = counts_ik when
    params["aggregate"] is "weighted", else [counts_ik > 0]; the server's vector of class
    k is sums / mass. The sum form is PrototypeSums' (the server's checks of "sums" and a
    per-class "mass" apply to it alike)."""

    name = "logit-sums"

    def lift(self, payload, num_samples, work, params, client=-1):
        return super().lift({"protos": payload["logits"], "counts": payload["counts"]},
                            num_samples, work, params, client)

    def spec(self, handler):
        c = handler.ctx.num_classes
        return {"sums": ("float64", (c, c)), "mass": ("float64", (c,))}


class _PrototypeHalf(PrototypeSums):
    """The prototype half of DeltaAndPrototypeSums: a merged payload's "proto_sums", or a
    single update's protos and counts lifted as PrototypeSums does."""

    def form_of(self, payload):
        return payload["proto_sums"]


class DeltaAndPrototypeSums(DeltaSums):
    """FedAvg-proto (Qiao et al.): eq. 1's weights as DeltaSums ("delta_sum", "mass") and eq.
    3's prototypes as PrototypeSums beside them ("proto_sums": {"sums" [C, D], "mass" [C]},
    by class counts when params["aggregate"] is "weighted"). Every update must carry its
    prototypes (a fixed-shape sum form: its handler merges only where every round's
    updates do); one without them is not merged (lift raises, so a relay forwards it)."""

    name = "delta-sums+prototype-sums"
    #: the prototype half alone (the server folds it beside DeltaSums' weights)
    protos = _PrototypeHalf()

    def lift(self, payload, num_samples, work, params, client=-1):
        if "protos" not in payload or "counts" not in payload:
            raise ValueError("an update without prototypes has no prototype sums")
        form = super().lift(payload, num_samples, work, params, client)
        if form is None:
            return None
        form["proto_sums"] = self.protos.lift(payload, num_samples, work, params, client)
        return form

    def spec(self, handler):
        return {**super().spec(handler), "proto_sums": self.protos.spec(handler)}

    def form_of(self, payload):
        return {"delta_sum": payload["delta_sum"], "mass": payload["mass"],
                "proto_sums": payload["proto_sums"]}

    def check(self, payload, members):
        # the server's check of "mass" covers the weights' half; the prototypes' per-class
        # mass is a sum of counts (weighted) or of indicators (mean) over the members
        mass = np.asarray(payload["proto_sums"]["mass"], dtype=np.float64)
        limit = max(sum(int(m[2]) for m in members), len(members))
        if mass.size and float(mass.min()) < 0:
            return "the prototypes' mass is negative"
        if mass.size and float(mass.max()) > limit * (1 + 1e-9):
            return (f"the prototypes' mass {float(mass.max()):.6g} is more than the members' "
                    f"samples allow ({limit})")
        return None
