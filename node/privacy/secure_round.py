"""Secure aggregation inside the engine's sync rounds (`privacy.secure_aggregation`).

fedbus.node.privacy.secagg holds the cryptography (SecAgg+: keys, shares, masks, unmasking),
fedbus.node.privacy.secure_steps the server's steps of one round; this module holds the
client's side (SecureClient), the run's checks and graph key, and the one sum form a client
masks. The server learns only the sum, over the round's surviving clients, of the sum form
its algorithm declares (fedbus.algorithms.core.merge: prototype sums and class masses for
FedProto, logit sums for FD, sample-weighted weight deltas and the sample total for
FedAvg/FedProx and FedPer/FedRep's shared part, both for fedavg-proto with every_round),
the sum a relay pre-adds in the clear when secure aggregation is off.

A round, message by message (kind "secagg", its body's "step"; PROTOCOL.md §12):

1. task (server -> client) carries "secagg": {context, ring, length}; the client answers
   at once with step "keys" (two X25519 public keys), then trains.
2. When every sampled client sent keys, failed, or `secagg_timeout_s` passed, the server
   fixes the SecAgg+ neighbour graph over the key senders and sends each step "peers".
3. The client answers "shares" (its mask seeds' Shamir shares, encrypted to each peer).
   When every peered client sent shares (or the time is up), the server sends each
   "masking": which of its peers sent shares (their pairwise masks are the ones its input
   may carry). The client, once trained, sends an ordinary "update" whose payload is
   {"masked": uint8 [L, B]}: its sum form, flattened, fixed-point encoded and masked.
   Relays add masked vectors mod 2^bits.
4. When the round closes (every client answered or failed, or the deadline), the inputs
   that arrived are the survivors. Where the clients signed their keys (a signing identity,
   fedbus.node.privacy.identity), each survivor is first sent "survivors" (the round's whole
   survivor set) and answers "signed" (its signature over it: the consistency check); when
   every survivor signed, or `secagg_timeout_s` passed, each is sent "unmask" (who survived,
   who dropped, the share ciphertexts addressed to it and, when signed, its holders'
   signatures on the survivor set) and answers "reveal".
5. When every survivor revealed, or `secagg_timeout_s` passed, the server reconstructs the
   survivors' self masks and the dropped clients' pairwise masks, and the decoded sum goes
   to the handler as one merged update of the survivors. If a secret lacks its threshold of
   shares, nothing is unmasked: the round ends with no updates and a record saying why.

What stays in the clear: who took part, each client's sample total and work report (the
update's header fields, as the server's validation and records need them), timing. A late
masked input is dropped (federation.late = fold is refused): folding it would need an
unmasking of its own.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from fedbus.broker.log import get_logger

log = get_logger("fedbus.secure_round")

#: the steps of kind "secagg" a client sends, and those the server sends
CLIENT_STEPS = ("keys", "shares", "signed", "reveal")
SERVER_STEPS = ("peers", "masking", "survivors", "unmask")

#: algorithms whose server step needs each client's update on its own: one line each
NEEDS_EACH_UPDATE = {
    "mpfedcl": "MP-FedCL's server keeps every client's prototypes in its pool (eq. 8)",
    "proto-attention": "proto-attention weighs each client's prototypes by attention",
    "fedtgp": "FedTGP's server trains its generator on each client's prototypes",
    "fedgh": "FedGH's server trains the global head on each client's prototypes",
}


def flatten(form: Mapping[str, Any]) -> np.ndarray:
    """A sum form as one float64 vector, its arrays in sorted-key order (nested maps too):
    the order `unflatten` reads back with the server's spec."""
    parts = []
    for key in sorted(form):
        v = form[key]
        parts.append(flatten(v) if isinstance(v, Mapping) else
                     np.asarray(v, dtype=np.float64).reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0)


def spec_length(spec: Mapping[str, Any]) -> int:
    """Elements of a sum form of this spec (rule.spec: name -> (dtype, shape) or a map)."""
    total = 0
    for v in spec.values():
        if isinstance(v, Mapping):
            total += spec_length(v)
        else:
            shape = v[1]
            if any(d is None for d in shape):
                raise ValueError(f"a secure sum needs fixed shapes, got {shape}")
            total += int(np.prod(shape, dtype=np.int64))
    return total


def unflatten(vector: np.ndarray, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of flatten, shaped by the spec."""
    out, at = _unflatten(np.asarray(vector, dtype=np.float64), spec, 0)
    if at != len(vector):
        raise ValueError(f"a sum of {len(vector)} values does not fit a spec of {at}")
    return out


def _unflatten(vector: np.ndarray, spec: Mapping[str, Any], at: int) -> tuple[dict, int]:
    out: dict[str, Any] = {}
    for key in sorted(spec):
        v = spec[key]
        if isinstance(v, Mapping):
            out[key], at = _unflatten(vector, v, at)
        else:
            shape = tuple(int(d) for d in v[1])
            n = int(np.prod(shape, dtype=np.int64))
            out[key] = vector[at:at + n].reshape(shape)
            at += n
    return out, at


def secagg_refusal(cfg: Any) -> str | None:
    """One line on why this run cannot use secure aggregation, or None (also when it is
    off). Checked at preflight and when the server starts."""
    from fedbus.algorithms import get_algorithm
    from fedbus.algorithms.core.merge import DeltaSumsAndPool
    from fedbus.algorithms.core.params import resolved_params

    if not cfg.privacy.secure_aggregation:
        return None
    name = cfg.algorithm.name
    if cfg.federation.mode != "sync":
        return ("privacy.secure_aggregation: async runs aggregate a buffer of updates made "
                "from different versions, each weighed by its staleness; secure aggregation "
                "sums one round's cohort (set federation.mode = sync)")
    if cfg.federation.late == "fold":
        return ("privacy.secure_aggregation: federation.late = fold needs each late update "
                "unmasked on its own; secure aggregation drops late updates (set late = drop)")
    fed = cfg.federation
    cohort = max(fed.min_clients, math.ceil(fed.fraction * fed.clients))
    if min(cohort, fed.clients) < 2:
        return (f"privacy.secure_aggregation: a round's cohort of {min(cohort, fed.clients)} "
                "client would reveal its input as the sum (raise federation.fraction or "
                "min_clients)")
    if name in NEEDS_EACH_UPDATE:
        return f"privacy.secure_aggregation: {NEEDS_EACH_UPDATE[name]}, not only their sum"
    server_cls = get_algorithm(name).server
    params = resolved_params(server_cls, dict(cfg.algorithm))
    rule = server_cls.merge_rule(params)
    if isinstance(rule, DeltaSumsAndPool):
        return (f"privacy.secure_aggregation: {name}'s server needs each client's prototypes "
                "beside the summed weights")
    if rule is None:
        if server_cls.__dict__.get("MERGE") is None:
            why = "it declares no sum its server step is made of (ServerHandler.MERGE)"
        elif params.get("robust", "none") != "none":
            why = "its robust rule (algorithm.robust) needs every update apart"
        else:
            why = ("with these [algorithm] options its server step is no fixed-shape sum "
                   f"({server_cls.__name__}.merges; e.g. fedavg-proto needs every_round = "
                   "true)")
        return f"privacy.secure_aggregation: {name} cannot aggregate a sum only: {why}"
    return None


GRAPH_KEY_FILE = "secagg_key"


def run_graph_key(run_dir: Any, *, create: bool) -> bytes:
    """The server's secret key of a run's neighbour graphs (privacy.secure_aggregation):
    32 random bytes from the OS, written once to RUN/secagg_key (mode 0600) and never sent
    to any node. Each round's graph is drawn from a key derived from it and the round's
    context, so it is fresh per round and no client can compute it (Bell et al.'s bound on
    colluding neighbours assumes a graph drawn independently of the colluders), while
    `fedbus replay` and a resumed run, which read the file back, redraw the same graphs."""
    import os
    import secrets
    from pathlib import Path

    path = Path(run_dir) / GRAPH_KEY_FILE
    if path.exists():
        text = path.read_text().strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ValueError(f"{path} does not hold a 32-byte key in hex: {text[:20]!r}")
        return key
    if not create:
        raise FileNotFoundError(f"{path} is missing: the run's secure-aggregation graphs "
                                "cannot be redrawn without it")
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


class SecureClient:
    """A client node's side: one secagg.ClientSession per client address with a task of a
    securely aggregated round. The node calls `begin` on the task (its answer, the keys,
    goes out before training), `ready` when the update is trained (None while the peers
    are not known: the update waits), `on_peers` and `on_unmask` on the server's steps."""

    def __init__(self, rule: Any, params: Mapping[str, Any], *, unit_weight: bool = False,
                 identity: Any = None, privacy: Mapping[str, Any] | None = None):
        # unit_weight: client-level DP sums clipped deltas with weight 1 each
        # identity: fedbus.node.privacy.identity.Identity (signed keys and the consistency
        # check against a lying server), or None (honest-but-curious server only)
        # privacy: the node's [privacy] section: under dp_noise = "distributed" a task's
        # noise parameters are checked against it (fedbus.node.privacy.ddp.DDPParams.check)
        self.rule, self.params, self.unit_weight = rule, params, unit_weight
        self.identity = identity
        self.privacy = privacy
        self.sessions: dict[str, dict[str, Any]] = {}

    def begin(self, address: str, body: Mapping[str, Any]) -> dict[str, Any]:
        from fedbus.node.privacy import secagg

        field = body["secagg"]
        session = secagg.ClientSession(int(address[1:]), str(field["context"]).encode(),
                                       identity=self.identity)
        clip = field.get("clip", 0.0)
        ddp = None
        if "ddp" in field:  # distributed DP: this client adds its share of the noise
            from fedbus.node.privacy.ddp import DDPParams

            ddp = DDPParams.from_dict(field["ddp"])
            if self.privacy is not None:
                ddp.check(self.privacy)
        elif self.privacy is not None and self.privacy.get("dp_noise") == "distributed":
            raise ValueError("privacy.dp_noise = distributed: the server's task asks for no "
                             "noise from this client; refused")
        self.sessions[address] = {"session": session, "task": body["task"], "ddp": ddp,
                                  "context": str(field["context"]).encode(),
                                  "client": int(address[1:]),
                                  "length": int(field["length"]), "sharers": None,
                                  "update": None,
                                  "clip": float(clip) if isinstance(clip, (int, float)) else 0.0}
        keys = session.public_keys()
        return {"step": "keys", "task": body["task"], **keys}

    def ready(self, address: str, update: dict[str, Any]) -> dict[str, Any] | None:
        """The trained update -> the masked update to send, or None (held for the peers)."""
        state = self.sessions.get(address)
        if state is None or state["task"] != update.get("task"):
            return update  # (no secure round for it)
        state["update"] = update
        return self._masked(state) if state["sharers"] is not None else None

    def on_peers(self, address: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The server's peers -> the shares step."""
        from fedbus.node.privacy import secagg

        state = self._state(address, body)
        peers = {int(a[1:]): tuple(bytes(k) for k in pk) for a, pk in body["peers"].items()}
        cts = state["session"].on_peers(peers, int(body["t"]),
                                        secagg.RingParams.from_dict(body["ring"]))
        for v, why in state["session"].refused_peers().items():
            named = why.split(":", 1)[0]
            log.warning("secure aggregation: peer refused", client=address, peer=f"c{v}",
                        reason=named if named in secagg.REASONS else why, why=why,
                        task=state["task"])
        return {"step": "shares", "task": state["task"],
                "shares": {f"c{v}": ct for v, ct in cts.items()}}

    def on_masking(self, address: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
        """The server's list of peers that sent shares -> the masked update, if trained
        (else it is masked when `ready`)."""
        state = self._state(address, body)
        # checked now, not when trained: a round it must abort ends at once
        state["sharers"] = state["session"].check_share_senders(
            [int(a[1:]) for a in body["sharers"]])
        return self._masked(state) if state["update"] is not None else None

    def on_survivors(self, address: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The server's survivor set -> the signed step (the consistency check)."""
        state = self._state(address, body)
        if self.identity is None:  # a mixed run: nothing to sign with, nothing to check
            return {"step": "signed", "task": state["task"], "sig": None}
        with _logged_refusal(address, state["task"], "survivors"):
            sig = state["session"].sign_survivors([int(a[1:]) for a in body["survivors"]])
        return {"step": "signed", "task": state["task"], "sig": sig}

    def on_unmask(self, address: str, body: Mapping[str, Any]) -> dict[str, Any]:
        state = self._state(address, body)
        sigs = body.get("signatures")
        with _logged_refusal(address, state["task"], "unmask"):
            reveal = state["session"].on_unmask(
                [int(a[1:]) for a in body["survivors"]], [int(a[1:]) for a in body["dropped"]],
                {int(a[1:]): bytes(ct) for a, ct in body["ciphertexts"].items()},
                {int(a[1:]): sig for a, sig in sigs.items()}
                if isinstance(sigs, Mapping) else None)
        del self.sessions[address]  # the round is over for this client
        return {"step": "reveal", "task": state["task"],
                "b": {f"c{v}": s for v, s in reveal["b"].items()},
                "s": {f"c{v}": s for v, s in reveal["s"].items()}}

    def _state(self, address: str, body: Mapping[str, Any]) -> dict[str, Any]:
        state = self.sessions.get(address)
        if state is None or state["task"] != body.get("task"):
            raise ValueError(f"{address} has no secure round for task {body.get('task')!r}")
        return state

    def _masked(self, state: dict[str, Any]) -> dict[str, Any]:
        from fedbus.algorithms.core.handlers import Work

        update = state.pop("update")
        state["update"] = None
        payload = clip_prototypes(update["payload"], state["clip"])
        form = self.rule.lift(payload,
                              1 if self.unit_weight else int(update["num_samples"]),
                              Work.from_dict(update["work"]), self.params, state["client"])
        ddp = state["ddp"]
        length = ddp.length if ddp is not None else state["length"]
        if ddp is not None and form is not None and "mass" in form:
            # the mass (weight 1 each) is the survivors' count, which the server knows: it
            # is left out of the noised vector, whose norm is then the clipped delta's
            form = {**form, "mass": np.zeros_like(np.asarray(form["mass"], np.float64))}
        # a rule that keeps an update apart (FedAvg's dropped partial work) adds nothing
        vector = flatten(form) if form is not None else np.zeros(length)
        if len(vector) != length:
            raise ValueError(f"the sum form has {len(vector)} values, the round {length}")
        if ddp is not None:  # clip, rotate, round, add the noise share: then mask
            from fedbus.node.privacy.ddp import client_encode

            noised = client_encode(vector, ddp, state["context"])
            packed, clipped = state["session"].mask(noised, state["sharers"], integers=True)
        else:
            packed, clipped = state["session"].mask(vector, state["sharers"])
        if clipped:  # logged here, never sent: how many of a client's values hit the ring's
            # range says something of its input that the masked sum is meant to hide
            log.warning("secure aggregation: values clipped to privacy.secagg_range",
                        client=state["client"], values=int(clipped))
        return {**update, "payload": {"masked": packed}}


@contextmanager
def _logged_refusal(address: str, task: Any, step: str) -> Iterator[None]:
    """Logs a client's named refusal (secagg.Refused) on its node, then lets it propagate."""
    from fedbus.node.privacy.secagg import Refused

    try:
        yield
    except Refused as err:
        log.warning("secure aggregation: server's request refused", client=address,
                    step=step, reason=err.reason, why=str(err), task=task)
        raise


def clip_prototypes(payload: Any, clip: float) -> Any:
    """The payload with each prototype row (validate.PROTOTYPE_KEYS, last axis) scaled to
    L2 norm at most `clip` (0: as it is): under secure aggregation the server bounds only
    the round's sum by mass x this clip (validate.secure_proto_clip), so an honest client
    must stay within it."""
    from fedbus.node.validate import PROTOTYPE_KEYS

    if clip <= 0 or not isinstance(payload, Mapping):
        return payload
    out = dict(payload)
    for key in PROTOTYPE_KEYS:
        rows = out.get(key)
        if isinstance(rows, np.ndarray) and rows.dtype.kind == "f" and rows.ndim >= 1 \
                and rows.size:
            norms = np.linalg.norm(rows.astype(np.float64), axis=-1, keepdims=True)
            scale = np.minimum(1.0, clip / np.maximum(norms, 1e-300))
            # float32 rounding may lengthen a row by 2^-24 relative: the server allows 1e-4
            out[key] = (rows * scale).astype(rows.dtype)
    return out


class MaskedSums:
    """A relay's merge under secure aggregation: masked inputs added in the ring, so the
    relay learns nothing and the server unmasks the sum of its members with the rest
    (the masks cancel in the total, wherever it was added). A MergeRule in shape."""

    name = "masked-sums"

    def lift(self, payload: Mapping[str, Any], num_samples: int, work: Any,
             params: Mapping[str, Any], client: int = -1) -> dict[str, Any] | None:
        packed = payload.get("masked") if isinstance(payload, Mapping) else None
        if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or \
                packed.ndim != 2 or packed.shape[1] not in (4, 5, 6, 7, 8):
            raise ValueError("a masked update's payload is {masked: uint8 [L, B]}")
        return {"masked": packed}

    def add(self, into: dict[str, Any] | None, part: Mapping[str, Any]) -> dict[str, Any]:
        from fedbus.node.privacy.secagg import add_packed

        if into is not None and into["masked"].shape != part["masked"].shape:
            raise ValueError(f"masked inputs differ in shape: {into['masked'].shape} "
                             f"against {part['masked'].shape}")
        bits = part["masked"].shape[1] * 8
        return {"masked": add_packed(None if into is None else into["masked"],
                                     part["masked"], bits)}

    def grows_by(self, form: Mapping[str, Any]) -> int:
        return 0


def privacy_refusal(cfg: Any) -> str | None:
    """One line on why the run's [privacy] options cannot be used, or None: secure
    aggregation's conditions (secagg_refusal), its ring (range x cohort x 2^frac_bits must
    fit 64 bits), and the DP mechanism's (fedbus.node.privacy.dp.dp_refusal)."""
    privacy = cfg.privacy
    for wanted, modules in ((privacy.secure_aggregation, ("cryptography",)),
                            (privacy.dp != "off", ("dp_accounting",))):
        for module in modules if wanted else ():
            try:
                __import__(module)
            except ImportError:
                return (f"[privacy] needs the {module} package, which is not installed: "
                        "pip install 'fedbus[privacy]'")
    reason = secagg_refusal(cfg)
    if reason is not None:
        return reason
    if privacy.secure_aggregation:
        from fedbus.node.privacy.secagg import RingParams, SecAggError

        try:
            RingParams.for_cohort(float(privacy.secagg_range), int(privacy.secagg_frac_bits),
                                  int(cfg.federation.clients))
        except SecAggError as err:
            return (f"privacy.secagg_range = {privacy.secagg_range} with secagg_frac_bits = "
                    f"{privacy.secagg_frac_bits}: {err}")
    if privacy.dp != "off":
        from fedbus.algorithms import get_algorithm
        from fedbus.node.privacy.dp import dp_refusal

        reason = dp_refusal(get_algorithm(cfg.algorithm.name).server, privacy.dp)
        if reason is None and cfg.federation.mode != "sync":
            reason = (f"privacy.dp = {privacy.dp}: the accountant composes sync rounds; "
                      "set federation.mode = sync")
        if reason is None and cfg.federation.late == "fold":
            reason = (f"privacy.dp = {privacy.dp}: a late update folded into a later round "
                      "would escape that round's noise and accounting (set federation.late "
                      "= drop)")
        if reason is None and (privacy.clip_norm > 0 or privacy.noise_sigma > 0):
            reason = ("privacy.dp replaces the unaccounted clip_norm / noise_sigma: set "
                      "those to 0")
        return reason
    return None
