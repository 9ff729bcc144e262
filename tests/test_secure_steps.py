"""The server's secure-aggregation steps alone (fedbus.node.privacy.secure_steps.SecureRound),
driven event by event on a simulated clock, without an engine or processes: the real
client side (SecureClient with the no-op algorithm's ArraySums rule, the real X25519,
AES-GCM, Shamir and Ed25519 of fedbus.node.privacy) answers every message the machine asks
to send, and this file plays the engine's part (which tasks are live, which clients
failed). A whole round unmasks the plain sum; a client dropping at each phase, a phase's
deadline passing and a refused step each do what PROTOCOL.md §12 says."""
from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fedbus.algorithms.core.merge import ArraySums
from fedbus.node.config import build_config
from fedbus.node.privacy.identity import Identity
from fedbus.node.privacy.secure_round import CLIENT_STEPS, SecureClient
from fedbus.node.privacy.secure_steps import SecureRound, Step

N = 5  # a complete graph: 5 holders a secret, threshold t = 4
L = 8
SPEC = {"state": ("float64", (L,)), "mass": ("float64", (1,))}
TIMEOUT = 10.0
WORK = {"epochs_asked": 1, "epochs_done": 1.0, "steps": 1, "samples": 1}


def address(c: int) -> str:
    return f"c{c}"


class Harness:
    """One round: the machine, the clients, and the engine's bookkeeping it leans on (live
    tasks, failed clients). `apply` takes a Step as the engine does; `sent` holds the
    messages the machine asked to send, by step name and client, and `steps` every Step."""

    def __init__(self, *, signed: bool = False, now: float = 0.0, **privacy):
        self.privacy = build_config({"privacy": {"secure_aggregation": True,
                                                 "secagg_timeout_s": TIMEOUT,
                                                 **privacy}}).privacy
        self.s = SecureRound(run_id="run", round_=3, sampled=list(range(N)),
                             privacy=self.privacy, spec=SPEC, graph_key=bytes(32), now=now)
        identity = None
        if signed:
            node = Ed25519PrivateKey.generate()
            identity = Identity.from_keys(node, {c: node.public_key() for c in range(N)})
        self.client = SecureClient(ArraySums(), {}, identity=identity)
        self.tasks = {c: 100 + c for c in range(N)}
        self.live = set(self.tasks.values())
        self.failed: set[int] = set()
        self.sent: dict[str, dict[int, dict]] = {}
        self.steps: list[Step] = []
        self.inputs = {c: np.random.default_rng([7, c]).uniform(-3, 3, L) for c in range(N)}
        for c, tid in self.tasks.items():
            self.s.task_of[c] = tid

    def apply(self, step: Step | None) -> Step | None:
        if step is None:
            return None
        self.steps.append(step)
        for c in step.drop:
            self.failed.add(c)
            self.live.discard(self.tasks[c])
        for c, body in step.sends:
            self.sent.setdefault(body["step"], {})[c] = body
        return step

    def advance(self, now: float) -> Step | None:
        return self.apply(self.s.advance(now, self.failed))

    def tick(self, now: float) -> list[Step]:
        return [self.apply(step) for step in self.s.on_tick(now)]

    def step(self, c: int, body: dict, now: float) -> Step:
        """A client's step: judged, then taken; a taken keys or shares step moves the round
        on as the engine's _progress does."""
        assert body["step"] in CLIENT_STEPS
        why = self.s.step_problem(address(c), c, body, self.live)
        assert why is None, why
        step = self.apply(self.s.on_step(c, body, now))
        if step.progress:
            self.advance(now)
        return step

    # --- the client side, one phase at a time ---

    def keys(self, clients, now: float) -> None:
        for c in clients:
            body = {"task": self.tasks[c], "secagg": self.s.task_field()}
            self.step(c, self.client.begin(address(c), body), now)

    def shares(self, clients, now: float) -> None:
        for c in clients:
            self.step(c, self.client.on_peers(address(c), self.sent["peers"][c]), now)

    def masked_inputs(self, clients, now: float) -> None:
        for c in clients:
            update = {"task": self.tasks[c], "version": 0, "num_samples": 1, "work": WORK,
                      "payload": {"state": self.inputs[c]}}
            assert self.client.ready(address(c), update) is None  # held for its sharers
            masked = self.client.on_masking(address(c), self.sent["masking"][c])
            assert self.s.input_problem([c], masked["payload"]) is None
            assert self.s.on_input([c], masked["payload"], 3)

    def signatures(self, clients, now: float) -> None:
        for c in clients:
            self.step(c, self.client.on_survivors(address(c), self.sent["survivors"][c]), now)

    def reveals(self, clients, now: float) -> Step | None:
        last = None
        for c in clients:
            last = self.step(c, self.client.on_unmask(address(c), self.sent["unmask"][c]), now)
        return last

    def through_masking(self, clients=range(N), now: float = 1.0) -> None:
        self.keys(clients, now)
        self.shares([c for c in clients if c in self.sent["peers"]], now)


def plain_sum(h: Harness, clients) -> np.ndarray:
    return np.sum([h.inputs[c] for c in clients], axis=0)


def assert_unmasked(step: Step, h: Harness, clients) -> None:
    """The unmasked sum form is the plain sum of `clients`' inputs (within the fixed-point
    quantisation bound) and their count as mass."""
    assert step.unmasked is not None and step.failed is None
    bound = h.s.record()["quant_bound"]
    assert bound > 0
    np.testing.assert_allclose(step.unmasked["state"], plain_sum(h, clients), rtol=0,
                               atol=bound)
    assert step.unmasked["mass"][0] == pytest.approx(len(clients), abs=bound)


@pytest.mark.parametrize("signed", [False, True])
def test_a_whole_round_unmasks_the_plain_sum(signed):
    h = Harness(signed=signed)
    assert h.s.next_deadline() == TIMEOUT and h.s.phase == "keys"
    h.keys(range(N), 1.0)
    assert h.s.phase == "shares" and h.s.next_deadline() == 1.0 + TIMEOUT
    assert sorted(h.sent["peers"]) == list(range(N))
    assert all(body["t"] == 4 and len(body["peers"]) == N for body in h.sent["peers"].values())
    h.shares(range(N), 2.0)
    assert h.s.phase == "masking" and h.s.next_deadline() is None
    assert all(sorted(b["sharers"]) == sorted(address(v) for v in range(N) if v != c)
               for c, b in h.sent["masking"].items())
    h.masked_inputs(range(N), 3.0)
    close = h.apply(h.s.close(4.0))
    assert close.event == {"event": "secagg_unmask", "round": 3, "survivors": N,
                           "dropped": 0}
    if signed:  # the consistency check comes first: every survivor signs the survivor set
        assert h.s.phase == "consistency" and "unmask" not in h.sent
        assert all(b["survivors"] == [address(v) for v in range(N)]
                   for b in h.sent["survivors"].values())
        h.signatures(range(N), 5.0)
        assert all(len(b["signatures"]) == N for b in h.sent["unmask"].values())
    assert h.s.phase == "unmask" and h.s.closing()
    last = h.reveals(range(N), 6.0)
    assert_unmasked(last, h, range(N))
    h.s.end(6.0)
    rec = h.s.record()
    assert h.s.phase == "done" and rec["reveal_s"] == pytest.approx(2.0)
    assert (rec["survivors"], rec["dropped"], rec["keys"], rec["t"]) == (N, 0, N, 4)
    assert not h.failed and all(not s.drop and s.failed is None for s in h.steps)


def test_a_client_without_keys_is_dropped_when_the_keys_deadline_passes():
    h = Harness()
    h.keys([0, 1, 2, 4], 1.0)  # c3 stays silent
    assert "peers" not in h.sent
    assert h.tick(TIMEOUT - 0.01) == []  # the phase waits for its deadline...
    (peers,) = h.tick(TIMEOUT)  # ...then goes on without c3, whose task ends
    assert peers.drop == [3] and h.failed == {3} and 103 not in h.live
    assert sorted(h.sent["peers"]) == [0, 1, 2, 4]
    h.shares([0, 1, 2, 4], TIMEOUT + 1)
    h.masked_inputs([0, 1, 2, 4], TIMEOUT + 2)
    h.apply(h.s.close(TIMEOUT + 3))
    assert_unmasked(h.reveals([0, 1, 2, 4], TIMEOUT + 4), h, [0, 1, 2, 4])
    assert h.s.record()["keys"] == 4


def test_a_client_the_engine_failed_is_not_waited_for():
    """A client whose task failed (its node died) holds no phase: the next step goes out
    as soon as the others answered, long before the deadline."""
    h = Harness()
    h.failed.add(1)
    h.keys([0, 2, 3, 4], 1.0)
    assert h.s.phase == "shares" and sorted(h.sent["peers"]) == [0, 2, 3, 4]
    assert h.steps[-1].drop == [1]


def test_a_client_without_shares_is_dropped_when_the_shares_deadline_passes():
    h = Harness()
    h.keys(range(N), 1.0)
    h.shares([0, 1, 3, 4], 2.0)  # c2 sent keys, never shares
    assert h.s.phase == "shares" and h.tick(1.0 + TIMEOUT - 0.01) == []
    (masking,) = h.tick(1.0 + TIMEOUT)
    assert masking.drop == [2] and h.failed == {2}
    # the others mask only with the peers that sent shares
    assert all(address(2) not in b["sharers"] for b in h.sent["masking"].values())
    assert sorted(h.sent["masking"]) == [0, 1, 3, 4]
    h.masked_inputs([0, 1, 3, 4], 12.0)
    h.apply(h.s.close(13.0))
    assert_unmasked(h.reveals([0, 1, 3, 4], 14.0), h, [0, 1, 3, 4])


def test_a_client_that_drops_after_its_shares_has_its_masks_removed():
    """c4 sent keys and shares (the others mask with it), then no input: at the close its
    holders reveal its key shares and its pairwise masks leave the sum."""
    h = Harness()
    h.through_masking()
    h.masked_inputs([0, 1, 2, 3], 3.0)
    close = h.apply(h.s.close(4.0))
    assert close.event["dropped"] == 1 and close.drop == []  # (its task is the engine's)
    assert all(b["dropped"] == [address(4)] for b in h.sent["unmask"].values())
    assert 4 not in h.sent["unmask"]
    assert_unmasked(h.reveals([0, 1, 2, 3], 5.0), h, [0, 1, 2, 3])
    assert h.s.record()["dropped"] == 1


def test_a_survivor_that_never_reveals_is_recovered_at_the_reveal_deadline():
    """One of five holders silent: the other four are t, enough for every secret; its own
    input is in the sum (it survived), unmasked with its peers' shares of its seed."""
    h = Harness()
    h.through_masking()
    h.masked_inputs(range(N), 3.0)
    h.apply(h.s.close(4.0))
    assert h.reveals([0, 1, 2, 4], 5.0).unmasked is None  # waits for c3
    assert h.s.next_deadline() == 4.0 + TIMEOUT and h.tick(4.0 + TIMEOUT - 0.01) == []
    (finish,) = h.tick(4.0 + TIMEOUT)
    assert_unmasked(finish, h, range(N))


def test_too_few_reveals_by_the_deadline_fail_the_round_saying_why():
    h = Harness()
    h.through_masking()
    h.masked_inputs(range(N), 3.0)
    h.apply(h.s.close(4.0))
    h.reveals([0, 1, 2], 5.0)  # 3 of 5 holders: fewer than t = 4
    (finish,) = h.tick(4.0 + TIMEOUT)
    assert finish.unmasked is None and finish.failed.startswith("cannot unmask:")
    assert "of t=4 shares" in finish.failed
    assert h.s.phase == "done" and h.s.record()["failed"] == finish.failed
    assert h.s.on_tick(1e9) == [] and h.s.next_deadline() is None


def test_no_keys_by_the_deadline_fail_the_round_and_end_every_task():
    h = Harness()
    (peers,) = h.tick(TIMEOUT)
    assert peers.failed == "no client sent its keys" and peers.drop == list(range(N))
    assert h.s.phase == "done" and not h.sent


def test_one_masked_input_is_no_sum():
    h = Harness()
    h.through_masking()
    h.masked_inputs([2], 3.0)
    close = h.s.close(4.0)
    assert close.failed == "1 masked input(s) arrived: a sum needs two at least"
    assert close.event is None and not close.sends and h.s.phase == "done"


def test_signing_clients_cannot_use_a_threshold_below_two_thirds():
    """Signed keys and secagg_dropout = 0.45 (t = 3 of 5 holders, below floor(2 x 5/3) + 1
    = 4): every signing client would refuse it, so the peers step fails the round at once."""
    h = Harness(signed=True, secagg_dropout=0.45)
    h.keys(range(N), 1.0)
    assert "peers" not in h.sent and h.s.phase == "done"
    assert h.steps[-1].failed == ("threshold 3 of 5 holders is below 4, which signing "
                                  "clients require: set privacy.secagg_dropout below 1/3")


def test_a_bad_step_is_refused_naming_the_client_and_its_task():
    h = Harness()
    h.keys([0, 1, 2], 1.0)
    # keys repeating another client's: refused, the sender's task ends (task 103)
    copied = {**h.client.begin(address(3), {"task": 103, "secagg": h.s.task_field()}),
              "s_pk": h.client.sessions[address(1)]["session"].public_keys()["s_pk"]}
    assert h.s.step_problem(address(3), 3, copied, h.live) is None  # (in turn: the session
    refused = h.s.on_step(3, copied, 1.0)  # judges the keys themselves)
    assert refused.refused == ("keys: client 3's keys are refused: it repeats a key client 1 "
                               "sent") and refused.task == 103
    assert not refused.sends and not refused.progress and 3 not in h.s.keys
    # out of turn, twice or for another task: judged before the session sees it
    keys0 = h.client.begin(address(0), {"task": 100, "secagg": h.s.task_field()})
    assert h.s.step_problem(address(0), 0, keys0, h.live) == \
        "keys come once, before the round's peers are fixed"
    assert h.s.step_problem(address(4), 4, {"step": "keys", "task": 100}, h.live) == \
        "task 100 is not c4's task of round 3"
    h.live.discard(104)
    assert h.s.step_problem(address(4), 4, {"step": "keys", "task": 104}, h.live) == \
        "c4's task is over"
    assert h.s.step_problem(address(0), 0, {"step": "shares", "task": 100}, h.live) == \
        "shares come once, from a client sent its peers, before masking"
    assert h.s.input_problem([0], {"masked": np.zeros((L + 2, 8), np.uint8)}) == \
        "a masked input comes after the server's masking step"


def test_a_bad_reveal_is_refused_without_ending_the_clients_task():
    h = Harness()
    h.through_masking()
    h.masked_inputs(range(N), 3.0)
    h.apply(h.s.close(4.0))
    reveal = h.client.on_unmask(address(0), h.sent["unmask"][0])
    reveal["b"] = {**reveal["b"], "c1": b"\x00" * 3}  # a share of the wrong size
    refused = h.s.on_step(0, reveal, 5.0)
    assert refused.refused.startswith("reveal: ") and "client 0" in refused.refused
    assert refused.task is None and 0 not in h.s.revealed


def test_a_masked_input_is_judged_and_a_late_one_is_not_taken():
    h = Harness()
    h.keys(range(N), 1.0)
    h.shares([0, 1, 2, 3], 2.0)
    h.tick(1.0 + TIMEOUT)  # c4 sent no shares
    width = h.s.ring.ring_bits // 8
    assert h.s.input_problem([4], {"masked": np.zeros((L, width), np.uint8)}) == \
        f"masked must be uint8 [{L + 1}, {width}]"
    assert h.s.input_problem([4], {"masked": np.zeros((L + 1, width), np.int8)}) == \
        f"masked must be uint8 [{L + 1}, {width}]"
    assert h.s.input_problem([4], {"masked": np.zeros((L + 1, width), np.uint8), "x": 1}) == \
        "a masked update's payload is {masked: uint8 [L, B]}"
    assert h.s.input_problem([4], {"masked": "x"}) == f"masked must be uint8 [{L + 1}, {width}]"
    h.masked_inputs([0, 1, 2], 12.0)
    assert h.s.input_problem([0], {"masked": np.zeros((L + 1, width), np.uint8)}) == \
        "c0's masked input came already"
    packed = {"masked": np.zeros((L + 1, width), np.uint8)}
    assert h.s.input_problem([4], packed) == "c4 sent no shares this round"
    assert not h.s.on_input([3], packed, 2)  # another round's: late
    h.masked_inputs([3], 12.0)
    h.apply(h.s.close(13.0))
    assert h.s.input_problem([3], packed) is None  # late, not refused: the engine drops it
    assert not h.s.on_input([3], packed, 3)
    assert_unmasked(h.reveals([0, 1, 2, 3], 14.0), h, [0, 1, 2, 3])
