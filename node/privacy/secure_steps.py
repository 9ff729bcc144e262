"""The server's steps of one securely aggregated round (PROTOCOL.md §12): a sub-state machine
the engine (fedbus.node.engine) drives with events, around a secagg.ServerSession.

Phases: keys -> shares -> masking -> [consistency] -> unmask -> done (consistency: signed
rounds only, each survivor signing the survivor set). Each event returns a `Step`: the
"secagg" messages to send and what the engine must do about them. The engine keeps the
round's lifecycle (sampling, tasks, failures, updates, records) and hands in what only it
knows (the clients that failed, the live tasks, the time); this machine keeps the phases,
their deadlines and the secure steps' counters. Like the engine it reads no clock and
touches no socket, so a replay of the message log redoes it.
"""
from __future__ import annotations

from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedbus.node.validate import canonical_client

#: the phases in which the round's own deadlines no longer close it: it ends with the
#: survivors' signatures and reveals, or this machine's deadline for them
CLOSING = ("consistency", "unmask")


@dataclass
class Step:
    """What one event of a secure round asks of the engine, in this order: refuse the
    step, end the tasks of clients that missed one, log an event, then either judge the
    unmasked sum and end the round (`unmasked`), end it unmasking nothing (the machine is
    `done` with `failed`), or send `sends` and, on `progress`, see whether the round moves
    on (`SecureRound.advance`)."""

    refused: str | None = None  # the client's step is refused, why
    task: int | None = None  # with `refused`: the client's task, which ends if still live
    drop: list[int] = field(default_factory=list)  # sent nothing in time: their tasks end
    event: dict[str, Any] | None = None
    sends: list[tuple[int, dict[str, Any]]] = field(default_factory=list)  # (client, body)
    progress: bool = False
    unmasked: dict[str, Any] | None = None  # the survivors' sum form, to be judged
    failed: str | None = None  # why the secure part failed (the round then closes)


def address(client: int) -> str:
    return f"c{client}"


def by_client(mapping: Any) -> dict[int, Any]:
    """A wire map keyed by client address as one keyed by client id (TypeError on no map,
    ValueError on a key that is no client address)."""
    if not isinstance(mapping, dict):
        raise TypeError(f"expected a map of client addresses, got {type(mapping).__name__}")
    return {canonical_client(k): v for k, v in mapping.items()}


class SecureRound:
    """The server's state of one securely aggregated round: its phase, its deadline, who
    sent each step, the ServerSession. Deterministic in its inputs, the server's secret
    graph key included (secure_round.run_graph_key); without a key (an engine with no run
    directory) each round's graph is drawn from fresh OS randomness."""

    def __init__(self, *, run_id: str, round_: int, sampled: list[int], privacy: Mapping,
                 spec: Mapping[str, Any], graph_key: bytes | None, now: float):
        from fedbus.node.privacy import secagg
        from fedbus.node.privacy.secure_round import spec_length
        from fedbus.node.validate import secure_proto_clip

        self.round = round_
        self.sampled = list(sampled)
        self.context = f"fedbus-secagg/{run_id}/{round_}"
        self.ring = secagg.RingParams.for_cohort(float(privacy["secagg_range"]),
                                                 int(privacy["secagg_frac_bits"]),
                                                 len(sampled))
        self.spec = spec
        self.length = spec_length(spec)
        # distributed DP (privacy.dp_noise = "distributed", fedbus.node.privacy.ddp): the
        # clients mask rotated, scaled, noised integers of a power-of-two length in a ring
        # sized for them; the unmasked sum is decoded back to the sum form here
        self.ddp = None
        if privacy.get("dp") == "client" and privacy.get("dp_noise") == "distributed":
            from fedbus.node.privacy.ddp import DDPParams

            self.ddp = DDPParams.for_round(privacy, self.length, len(sampled))
            self.ring = self.ddp.ring()
            self.length = self.ddp.dim
        self.timeout = float(privacy["secagg_timeout_s"])
        self.session = secagg.ServerSession(
            sampled, self.context.encode(),
            neighbours=secagg.neighbour_count(len(sampled), int(privacy["secagg_neighbours"])),
            dropout=float(privacy["secagg_dropout"]), ring=self.ring, graph_key=graph_key)
        self.clip = secure_proto_clip(privacy)
        self.phase = "keys"
        self.deadline = now + self.timeout  # of the current phase (keys, shares, CLOSING)
        self.keys: set[int] = set()
        self.sharers: set[int] = set()
        self.inputs: set[int] = set()
        self.survivors: set[int] = set()
        self.revealed: set[int] = set()
        self.signed: set[int] = set()  # survivors that signed the survivor set
        self.asks: dict[int, dict] = {}  # the unmask requests, held while survivors sign
        self.task_of: dict[int, int] = {}  # client -> its task of this round
        self.bytes_up = self.bytes_down = 0  # of the steps (the masked inputs are updates)
        self.entries: list[Any] = []  # the engine's unmasked sum as one merged update
        self.unmask_started = 0.0
        self.result: dict[str, Any] = {}
        # the sum failed with every share consistent: an input spoiled it (the engine's
        # spoiler search, fedbus.node.privacy.culprit, then narrows to the survivors)
        self.spoiled = False

    # --- what the engine asks ---

    def task_field(self) -> dict[str, Any]:
        """What a task carries for the client's ClientSession and its masking."""
        field = {"context": self.context, "ring": self.ring.to_dict(), "length": self.length}
        if self.clip > 0:
            field["clip"] = self.clip
        if self.ddp is not None:
            field["ddp"] = self.ddp.to_dict()
        return field

    def closing(self) -> bool:
        return self.phase in CLOSING

    def next_deadline(self) -> float | None:
        return self.deadline if self.phase in ("keys", "shares", *CLOSING) else None

    def step_problem(self, src: str, client: int, body: Mapping[str, Any],
                     live_tasks: Container[int]) -> str | None:
        """Why client's step (one of secure_round.CLIENT_STEPS) must be refused, or None: it
        answers its task of this round, in the phase that asks for it, once."""
        step = body.get("step")
        tid = self.task_of.get(client)
        if body.get("task") != tid or tid is None:
            return f"task {body.get('task')!r} is not {src}'s task of round {self.round}"
        if step == "keys":
            if self.phase != "keys" or client in self.keys:
                return "keys come once, before the round's peers are fixed"
            if tid not in live_tasks:
                return f"{src}'s task is over"
        elif step == "shares":
            if self.phase != "shares" or client not in self.keys or client in self.sharers:
                return "shares come once, from a client sent its peers, before masking"
        elif step == "signed":
            if self.phase != "consistency" or client not in self.survivors or \
                    client in self.signed:
                return "a survivor-set signature comes once, from a survivor asked to sign"
        elif self.phase != "unmask" or client not in self.survivors or client in self.revealed:
            return "a reveal comes once, from a survivor asked to unmask"
        return None

    def input_problem(self, members: list[int], payload: Any) -> str | None:
        """Why a masked input (one client's, or a relay's sum of several) must be refused,
        or None. An input for a round no longer masking is late, not refused."""
        if self.phase in ("unmask", "done"):
            return None  # late: the engine drops it
        if self.phase != "masking":
            return "a masked input comes after the server's masking step"
        if not isinstance(payload, dict) or set(payload) != {"masked"}:
            return "a masked update's payload is {masked: uint8 [L, B]}"
        packed = payload["masked"]
        width = self.ring.ring_bits // 8
        if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or \
                packed.shape != (self.length, width):
            return f"masked must be uint8 [{self.length}, {width}]"
        for c in members:
            if c not in self.sharers:
                return f"c{c} sent no shares this round"
            if c in self.inputs:
                return f"c{c}'s masked input came already"
        return None

    # --- events ---

    def on_step(self, client: int, body: Mapping[str, Any], now: float) -> Step:
        """A client's step, already judged (step_problem): keys, shares, signed, reveal."""
        from fedbus.node.privacy.secagg import SecAggError

        step = body["step"]
        try:
            if step == "keys":
                self.session.add_keys(client, body.get("c_pk"), body.get("s_pk"),
                                      body.get("sig"))
                self.keys.add(client)
                return Step(progress=True)
            if step == "shares":
                self.session.add_shares(client, by_client(body.get("shares")))
                self.sharers.add(client)
                return Step(progress=True)
            if step == "signed":
                if body.get("sig") is not None:  # (an unsigned client answers with none)
                    self.session.add_survivor_signature(client, body.get("sig"))
                self.signed.add(client)
                return self._reveal_asks(now) if self.signed >= self.survivors else Step()
            self.session.add_reveal(client, by_client(body.get("b")), by_client(body.get("s")))
            self.revealed.add(client)
        except (SecAggError, ValueError, TypeError) as err:
            # a bad key or share ends the client's task; a bad signature or reveal is only
            # refused (the round already counts its input)
            tid = self.task_of.get(client) if step not in ("signed", "reveal") else None
            return Step(refused=f"{step}: {err}", task=tid)
        return self._finish(now) if self.revealed >= self.survivors else Step()

    def advance(self, now: float, failed: Container[int]) -> Step | None:
        """The engine's round moved on (`failed`: the sampled clients whose tasks failed):
        the next phase's step once every client the phase waits for answered or failed."""
        if self.phase == "keys" and all(c in self.keys or c in failed for c in self.sampled):
            return self._peers(now)
        if self.phase == "shares" and all(c in self.sharers or c in failed for c in self.keys):
            return self._masking(now)
        return None

    def on_input(self, clients: list[int], payload: Mapping[str, Any], round_: int) -> bool:
        """A masked input (input_problem passed) of round round_: False when it is late
        (another round's, or this one's masking is over), else it joins the sum."""
        if round_ != self.round or self.phase != "masking":
            return False
        self.session.add_input(clients, payload["masked"])
        self.inputs.update(clients)
        return True

    def on_tick(self, now: float) -> list[Step]:
        """The steps of the phases whose deadline passed by now."""
        steps = []
        if self.phase == "keys" and now >= self.deadline:
            steps.append(self._peers(now))
        if self.phase == "shares" and now >= self.deadline:
            steps.append(self._masking(now))
        if self.phase == "consistency" and now >= self.deadline:
            steps.append(self._reveal_asks(now))
        if self.phase == "unmask" and now >= self.deadline:
            steps.append(self._finish(now))
        return steps

    def close(self, now: float) -> Step:
        """The engine's round closes (all answered or failed, or its deadline): the inputs
        in are the survivors; ask them to unmask (or, already unmasking, finish)."""
        return self._finish(now) if self.phase == "unmask" else self._unmask(now)

    def end(self, now: float, failed: str | None = None) -> None:
        """The secure part is over: the sum was unmasked (and the engine took it) or, with
        `failed`, nothing is."""
        self.phase = "done"
        self.result = {"failed": failed} if failed is not None else \
            {"reveal_s": round(now - self.unmask_started, 6)}

    # --- the phases ---

    def _fail(self, now: float, why: str, drop: list[int] | None = None) -> Step:
        self.end(now, why)
        return Step(drop=drop or [], failed=why)

    def _peers(self, now: float) -> Step:
        """Keys are in (or their time is up): fix the neighbour graph, send each its peers.
        A sampled client that sent no keys cannot take part: its task ends."""
        from fedbus.node.privacy.secagg import SecAggError, active_threshold

        self.phase, self.deadline = "shares", now + self.timeout
        drop = [c for c in self.sampled if c not in self.keys]
        try:
            peers = self.session.fix_graph() if self.keys else {}
        except SecAggError as err:
            return self._fail(now, f"no neighbour graph: {err}", drop)
        if not peers:
            return self._fail(now, "no client sent its keys", drop)
        first = peers[min(peers)]
        holders, t = len(first["peers"]), int(first["t"])
        if self.session.signed() and t < active_threshold(holders):
            # every signing client would refuse it (threshold-too-low): say so now
            return self._fail(now, (
                f"threshold {t} of {holders} holders is below {active_threshold(holders)}, "
                "which signing clients require: set privacy.secagg_dropout below 1/3"), drop)
        sends = []
        for c in sorted(peers):
            m = peers[c]
            sends.append((c, {"step": "peers", "task": self.task_of[c], "t": int(m["t"]),
                              "ring": m["ring"],
                              "peers": {address(v): list(pk) for v, pk in m["peers"].items()}}))
        return Step(drop=drop, sends=sends)

    def _masking(self, now: float) -> Step:
        """Shares are in (or their time is up): tell each client that sent shares which of
        its peers did, the peers whose pairwise masks its input carries (Bonawitz et al.'s
        U2): a client that sent keys but no shares cannot spoil the round."""
        from fedbus.node.privacy.secagg import SecAggError

        self.phase = "masking"
        drop = [c for c in sorted(self.keys) if c not in self.sharers]
        try:
            lists = self.session.close_shares() if self.sharers else {}
        except SecAggError as err:
            return self._fail(now, str(err), drop)
        if not lists:
            return self._fail(now, "no client sent its shares", drop)
        return Step(drop=drop, sends=[
            (c, {"step": "masking", "task": self.task_of[c],
                 "sharers": [address(v) for v in lists[c]]}) for c in sorted(lists)])

    def _unmask(self, now: float) -> Step:
        """The inputs in are the survivors: ask each to unmask (signed keys: to sign the
        survivor set first)."""
        from fedbus.node.privacy.secagg import SecAggError

        self.phase = "unmask"
        self.survivors = set(self.inputs)
        self.unmask_started = now
        self.deadline = now + self.timeout
        if len(self.survivors) < 2:  # the "sum" of one input is that input
            return self._fail(now, f"{len(self.survivors)} masked input(s) arrived: a sum "
                              "needs two at least")
        try:
            self.asks = self.session.unmask_requests()
        except SecAggError as err:
            return self._fail(now, str(err))
        event = {"event": "secagg_unmask", "round": self.round,
                 "survivors": len(self.survivors), "dropped": len(self.sharers - self.inputs)}
        if not self.session.signed():
            step = self._reveal_asks(now)
            step.event = event
            return step
        # signed keys: the consistency check first (each survivor signs the survivor set;
        # its holders reveal only on t signatures of the same set)
        self.phase = "consistency"
        everyone = [address(v) for v in self.session.survivor_set()]
        return Step(event=event, sends=[
            (c, {"step": "survivors", "task": self.task_of[c], "survivors": everyone})
            for c in sorted(self.asks)])

    def _reveal_asks(self, now: float) -> Step:
        """Ask each survivor to reveal: with signed keys once every survivor signed the
        survivor set or its time is up (each request carries its holders' signatures; a
        client short of t of them refuses, and the reveals missing fail the round)."""
        self.phase = "unmask"
        self.deadline = now + self.timeout
        signed = self.session.signed()
        sends = []
        for c in sorted(self.asks):
            m = self.asks[c]
            body = {"step": "unmask", "task": self.task_of[c],
                    "survivors": [address(v) for v in m["survivors"]],
                    "dropped": [address(v) for v in m["dropped"]],
                    "ciphertexts": {address(v): ct for v, ct in m["ciphertexts"].items()}}
            if signed:
                body["signatures"] = {address(v): sig for v, sig in
                                      self.session.signatures_for(c).items()}
            sends.append((c, body))
        return Step(sends=sends)

    def _finish(self, now: float) -> Step:
        """Every survivor revealed, or the time is up: unmask the sum, for the engine to
        judge as it judges a relay's merged update (then it calls `end`)."""
        from fedbus.node.privacy.secagg import SecAggError, SpoiledSum
        from fedbus.node.privacy.secure_round import unflatten

        try:
            summed = self.session.unmask()
            if self.ddp is not None:  # noised integers -> the noised sum form
                from fedbus.node.privacy.ddp import server_decode, sum_norm_bound

                summed = server_decode(summed, self.ddp, self.context.encode())
                bound = sum_norm_bound(self.ddp, len(self.inputs))
                if float(np.linalg.norm(summed)) > bound:  # (the engine's norm check is off)
                    self.spoiled = True
                    return self._fail(now, f"the unmasked noised sum is longer than the "
                                      f"{bound:.6g} its survivors' inputs and noise allow")
                form = unflatten(summed, self.spec)
                if "mass" in form:  # the clients left it out: weight 1 each survivor
                    form["mass"] = np.full(np.shape(form["mass"]), float(len(self.inputs)))
                return Step(unmasked=form)
            return Step(unmasked=unflatten(summed, self.spec))
        except (SecAggError, ValueError) as err:
            self.spoiled = isinstance(err, SpoiledSum)
            return self._fail(now, str(err))

    # --- the record ---

    def signatures_for(self, client: int) -> dict[int, bytes]:
        """The survivor-set signatures the client's unmask request carries (none unsigned)."""
        return self.session.signatures_for(client) if self.session.signed() else {}

    def ddp_record(self) -> dict[str, Any]:
        """Distributed DP's part of the record: the mechanism's parameters and the noise
        the survivors' sum carries (std per value, in the sum form's units)."""
        from fedbus.node.privacy.ddp import quantisation_bound

        p, s = self.ddp, len(self.survivors)
        return {"length": p.length, "cohort": p.cohort, "n_min": p.n_min, "dim": p.dim,
                "scale": p.scale, "delta2": p.delta2,
                "noise_std": p.noise_std(s) if s else 0.0,
                "target_std": p.noise_std(p.n_min),
                "quant_bound": quantisation_bound(p, s)}

    def record(self) -> dict[str, Any]:
        """The round record's "secagg" entry."""
        stats = self.session.stats()
        return {"survivors": len(self.survivors), "dropped": len(self.sharers - self.inputs),
                "keys": len(self.keys), "t": stats.get("t"),
                "neighbours": stats.get("neighbours"), "ring_bits": self.ring.ring_bits,
                "frac_bits": self.ring.frac_bits,
                "quant_bound": float(stats.get("quant_bound", 0.0)),
                **({"ddp": self.ddp_record()} if self.ddp is not None else {}),
                "bytes_up": self.bytes_up, "bytes_down": self.bytes_down,
                **({"excluded": stats["excluded"]} if stats.get("excluded") else {}),
                **({"blamed": {f"c{c}": why for c, why in stats["blamed"].items()}}
                   if stats.get("blamed") else {}),
                **({"inconsistent": stats["unattributed"]}
                   if stats.get("unattributed") else {}),
                **self.result}
