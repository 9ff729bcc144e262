"""The server's round engine: a deterministic state machine.

Inputs are events (a client joined or left, an update or eval result arrived,
a deadline passed), each stamped with the time the shell saw it. Outputs are
messages to send and metric records to write. Nothing here reads a clock,
touches a socket or draws an unseeded random number, so the same config, seed
and sequence of inputs give the same outputs bit for bit: that is what
`fedbus replay` checks and what `--resume` relies on.

Sync mode: each round samples `fraction` of the live clients (at least
`min_clients`), sends tasks, and closes when every sampled client has
answered or failed, or at the deadline once `min_updates` are in (else at the
hard deadline). Late updates are dropped or folded into the next aggregation
with weight 1/sqrt(1+staleness).

Async mode (FedBuff-style): no rounds; `concurrency` clients are kept busy and
the server aggregates every `buffer` updates. A client whose update waits in
the buffer gets its next task after that aggregation, so one fast client
cannot fill a buffer alone (and buffer = clients reproduces sync FedAvg).
"""
from __future__ import annotations

import heapq
import json
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace as dc_replace
from typing import Any

import numpy as np

from fedbus.algorithms.core.handlers import ClientUpdate, Failure, RoundInfo, ServerHandler, Work
from fedbus.algorithms.core.merge import members_of
from fedbus.node.config import Config
from fedbus.node.validate import Norms, canonical_client, run_norms

SERVER = "server"
# Segmentation runs: at the final evaluation the first MASK_CLIENTS evaluated clients
# are asked for MASK_IMAGES (image, truth, prediction) triples each (ClientHandler.masks;
# classification clients send none), stored in RUN/masks.fbk for `fedbus plot`.
MASK_CLIENTS = 4
MASK_IMAGES = 2

# What a record's `failures` name: why a sampled client's task brought no update this round.
# (A late update that arrives afterwards is folded into a later aggregation, listed in that
# record's `stale`, or discarded, per federation.late.)
FAILURES = {
    "late": "sent no update by the round's deadline (it may still come, late)",
    "timed_out": "sent no update by its task's deadline (async: the task expired; an answer "
                 "after it is refused as unknown)",
    "dropped": "dropped its task (system.drop_prob, drop_clients): it never answers",
    "dead": "lost with its node (left, or purged by the broker)",
    "rejected": "its update was refused (the validator's reason in `refusals`)",
    "error": "its handler failed",
    "secagg": "its masked input was lost with a failed secure aggregation",
}
# What an evaluation record's `eval_missing` names: why a live client has no score in it.
# eval_clients = eval_live - len(eval_missing), always.
EVAL_MISSING = {
    "busy": "still training a late task of an earlier round (sync mode evaluates it later)",
    "dead": "lost with its node during the evaluation",
    "refused": "its result was refused",
    "timed_out": "sent no result by the evaluation's deadline",
}


def unbounded_wait(cfg: Config) -> str | None:
    """One line for the start of a run whose rounds may each wait for federation.
    hard_deadline_s: its sampled clients may never answer (a simulated drop) and it has
    no deadline to close a round without them; None otherwise."""
    fed, sys_cfg = cfg.federation, cfg.system
    if fed.deadline_s > 0 or not (sys_cfg.drop_prob > 0 or sys_cfg.drop_clients):
        return None
    cause = f"system.drop_prob = {sys_cfg.drop_prob:g}" if sys_cfg.drop_prob > 0 else \
        f"system.drop_clients = {list(sys_cfg.drop_clients)}"
    held = "each dropped task holds a round" if fed.mode == "sync" else \
        "each dropped task holds a client's slot"
    return (f"{cause} with federation.deadline_s = 0: {held} until federation.hard_deadline_s "
            f"({fed.hard_deadline_s:g} s); set federation.deadline_s (say 30) to close rounds "
            "without the clients that dropped")


def client_address(client: int) -> str:
    return f"c{client}"


def client_index(address: str) -> int:
    """c<int> -> int, in exactly the spelling client_address writes: "c03" and "c3" must not
    name one client twice (a merged update listing both once crashed the server)."""
    return canonical_client(address)  # (its Rejected is a ValueError)


def staleness_weight(staleness: int) -> float:
    return 1.0 / math.sqrt(1.0 + staleness)


def task_seed(seed: int, client: int, version: int) -> int:
    """Seed of one local run: a function of (run seed, client, version) only, so
    sync and async runs that hand a client the same version train identically.

    It is ``np.random.SeedSequence([seed, client, version]).generate_state(1)[0]``,
    computed here in plain integers when all three fit 32 bits (the server makes one per
    task, and numpy's object costs twice as much); tests pin the two together."""
    if 0 <= seed <= _M32 and 0 <= client <= _M32 and 0 <= version <= _M32:
        return _seed_word((seed, client, version, 0))
    return int(np.random.SeedSequence([seed, client, version]).generate_state(1)[0])


# numpy's SeedSequence (O'Neill's seed_seq), pool size 4, for four 32-bit entropy words:
# the hash constant's sequence does not depend on the data, so its steps are tabulated.
_M32 = 0xFFFFFFFF
_MULT_A, _INIT_B, _MULT_B = 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715


def _hash_steps(n: int) -> list[tuple[int, int]]:
    steps, h = [], 0x43B0D7E5
    for _ in range(n):
        steps.append((h, (h * _MULT_A) & _M32))
        h = (h * _MULT_A) & _M32
    return steps


_STEPS = _hash_steps(16)
_MIX_STEPS = [(s, d, *_STEPS[4 + i]) for i, (s, d) in
              enumerate((s, d) for s in range(4) for d in range(4) if s != d)]
_OUT_MULT = (_INIT_B * _MULT_B) & _M32


def _seed_word(entropy: tuple[int, int, int, int]) -> int:
    pool = []
    for v, (x, m) in zip(entropy, _STEPS):
        v = ((v ^ x) * m) & _M32
        pool.append(v ^ (v >> 16))
    for s, d, x, m in _MIX_STEPS:
        v = ((pool[s] ^ x) * m) & _M32
        r = (_MIX_L * pool[d] - _MIX_R * (v ^ (v >> 16))) & _M32
        pool[d] = r ^ (r >> 16)
    v = ((pool[0] ^ _INIT_B) * _OUT_MULT) & _M32
    return v ^ (v >> 16)


@dataclass
class Out:
    """A message the shell must send."""

    kind: str
    dst: str
    round: int
    body: dict[str, Any]


@dataclass
class Refusal:
    """A message the shell refused (fedbus.node.validate, the engine's header rules): an
    engine event, logged compactly in the message log instead of the message, so a replay
    takes it without the refused bytes. `task`: the live task an update answered (that task
    is over); `tasks`: the [address, task] of a refused merged update's members the sender
    hosts; `eval`: the evaluation a refused result was for (the client drops out of it);
    `answer`: whether an error goes back to the sender."""

    kind: str
    src: str
    reason: str
    round: int = -1
    task: int | None = None
    tasks: list[list[Any]] = field(default_factory=list)
    eval: int | None = None
    answer: bool = True

    def changes_state(self) -> bool:
        return self.task is not None or bool(self.tasks) or self.eval is not None

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "src": self.src, "reason": self.reason[:300],
                "round": self.round, "task": self.task, "tasks": self.tasks,
                "eval": self.eval, "answer": self.answer}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Refusal:
        return cls(str(d["kind"]), str(d["src"]), str(d["reason"]), int(d.get("round", -1)),
                   d.get("task"), [list(t) for t in d.get("tasks") or ()], d.get("eval"),
                   bool(d.get("answer", True)))


@dataclass
class Task:
    id: int
    client: int
    version: int
    round: int  # sync: the round; async: the version it was made from
    sent: float
    deadline: float  # 0 = none
    # system.drop_prob / drop_clients: the engine drew this task's simulated drop, so when
    # the client stays silent its failure is named "dropped", not "late", and its client
    # is free again once its round closes (nothing will ever arrive for the task)
    drops: bool = False


@dataclass
class RoundState:
    round: int
    started: float
    sampled: list[int]
    deadline: float
    hard_deadline: float
    updates: dict[int, ClientUpdate] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # client -> the validator's reason
    # relays' pre-aggregated updates; their members are in `updates` (empty payloads)
    merged: list[ClientUpdate] = field(default_factory=list)
    bytes_up: int = 0
    messages_up: int = 0  # updates and relays' merged updates that reached the server
    bytes_down: int = 0
    params_up: int = 0
    params_down: int = 0
    members: frozenset = frozenset()  # the sampled clients as a set: a per-update check
    secure: Any = None  # fedbus.node.privacy.secure_round.SecureRound under secure aggregation

    def __post_init__(self) -> None:
        self.members = frozenset(self.sampled)

    def count_up(self, nbytes: int, params: int) -> None:
        """An update (or a relay's merged update) of this round reached the server."""
        self.bytes_up += nbytes
        self.messages_up += 1
        self.params_up += params

    def pending(self) -> list[int]:
        return [c for c in self.sampled if c not in self.updates and c not in self.failures]

    def complete(self) -> bool:
        # O(1) on the hot path: a sampled client ends in updates or failures, never both
        return len(self.updates) + len(self.failures) >= len(self.sampled)


@dataclass
class EvalState:
    version: int
    round: int
    started: float
    deadline: float
    expected: set[int]
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    record: dict[str, Any] = field(default_factory=dict)
    live: int = 0  # live clients when it started
    # live clients it has no result from, and why (EVAL_MISSING): with `results`, every
    # live client is accounted for, so an accuracy is never silently a subset's
    missing: dict[int, str] = field(default_factory=dict)

    def lose(self, client: int, why: str) -> None:
        if client in self.expected and client not in self.results:
            self.expected.discard(client)
            self.missing[client] = why


def count_params(payload: Any) -> int:
    """Array elements in a payload: the papers' "# of communicated parameters"."""
    if isinstance(payload, np.ndarray):
        return int(payload.size)
    if isinstance(payload, dict):
        return sum(count_params(v) for v in payload.values())
    if isinstance(payload, (list, tuple)):
        return sum(count_params(v) for v in payload)
    return 0


class Engine:
    """One server's round engine. Call the on_* methods with events; each
    returns the messages to send. Metric records accumulate in `records`
    (the shell drains them)."""

    def __init__(self, cfg: Config, handler: ServerHandler, run_id: str,
                 train_sizes: dict[int, int] | None = None):
        self.cfg = cfg
        self.train_sizes = train_sizes or {}
        self.fed = cfg.federation
        self.handler = handler
        self.run_id = run_id
        self.rng = np.random.default_rng(np.random.SeedSequence([self.fed.seed, 0x5E4E]))
        self.async_mode = self.fed.mode == "async"
        self.rounds = self.fed.rounds
        self.live: set[int] = set()
        self.nodes: dict[str, list[int]] = {}
        self.host: dict[int, str] = {}  # client -> the node hosting it
        # bus.batch = "auto": the nodes whose config acknowledgement said they take batched
        # tasks (PROTOCOL.md §4.3); a round's tasks for such a node leave as one `tasks`
        # message. Never under secure aggregation (each task opens its own secagg session).
        self.batching = cfg.bus.get("batch", "off") == "auto" and \
            not cfg.privacy.secure_aggregation
        self.batch_nodes: set[str] = set()  # nodes that take `tasks` batches
        self.eval_batch_nodes: set[str] = set()  # ... and `evals` batches
        self.version = 0  # aggregations done
        self.next_task_id = 1
        self.next_eval_id = 1
        self.tasks: dict[int, Task] = {}  # outstanding
        # Indexes kept beside `tasks` so no message costs O(outstanding tasks): clients
        # with an outstanding task (and how many), and the task deadlines as a heap whose
        # entries are dropped lazily once their task is gone or its deadline changed.
        self.busy: Counter[int] = Counter()
        self.deadlines: list[tuple[float, int]] = []
        self.round: RoundState | None = None
        self.late: list[ClientUpdate] = []  # folded into the next aggregation
        # [client, round it was late for] of late updates discarded since the last
        # aggregation (federation.late = "drop", or too stale): its record lists them
        self.late_discarded: list[list[int]] = []
        self.buffer: list[ClientUpdate] = []  # async
        self.buffered_clients: set[int] = set()
        self.evals: dict[int, EvalState] = {}
        self.started = False
        self.start_time: float | None = None
        self.done = False
        self.stopped = ""  # why the run ended before its rounds, if it did
        # The seed of the server's DP noise: the run's seed ("seeded", which every node
        # knows), unless the shell sets the run's secret one (privacy.dp_noise = "secret":
        # fedbus.node.privacy.budget.run_noise_seed)
        self.noise_seed = int(self.fed.seed)
        # The key of the secure-aggregation neighbour graphs, the server's secret, which the
        # shell reads from RUN/secagg_key (fedbus.node.privacy.secure_round.run_graph_key);
        # None draws each round's graph from fresh randomness (nothing to replay it from)
        self.secagg_key: bytes | None = None
        # Client-level DP's cohorts: each live client independently with probability
        # federation.fraction (Poisson, what the accountant assumes), drawn from noise_seed
        # (the server's secret under dp_noise = "secret", so no client can tell who took
        # part); made at the first draw, after the shell has set noise_seed, and kept in
        # checkpoints so a resumed run continues the same stream.
        self.poisson = cfg.privacy.dp == "client"
        self.cohort_rng: np.random.Generator | None = None
        # Under secure aggregation: the group test that finds a client whose masked input
        # spoils the sum (fedbus.node.privacy.culprit), drawn from noise_seed as cohort_rng
        self.culprits: Any = None
        self.records: list[dict[str, Any]] = []  # metrics, drained by the shell
        # Labelled units per training sample (1; H * W pixels for segmentation masks): the
        # shell's bound on an update's per-class counts (fedbus.node.validate).
        self.label_pixels = 1
        self.events: list[dict[str, Any]] = []  # notable happenings for the log/progress
        # rejected: updates and merged updates refused; refused: any other message refused
        self.totals = {"bytes_up": 0, "bytes_down": 0, "params_up": 0, "params_down": 0,
                       "rejected": 0, "refused": 0, "late_dropped": 0, "late_folded": 0}
        # What each client's messages can honestly claim, from the server's own partition
        # (build_engine fills them): samples per class of its training set, and the size
        # of its test set; and the norm bounds of every upload (SECURITY.md).
        self.class_samples: dict[int, np.ndarray] = {}
        self._bounds: dict[int, dict[str, Any]] = {}
        self.test_sizes: dict[int, int] = {}
        self.norms = server_norms(cfg, handler)
        # Secure aggregation (fedbus.node.privacy.secure_round): the length of the sum form the
        # clients mask, from the handler's merge rule.
        self.secure = bool(cfg.privacy.secure_aggregation) and not self.async_mode
        self.sum_spec: dict[str, Any] | None = None
        # Differential privacy (fedbus.node.privacy.budget): what the run has spent, and its budget.
        self.ledger = None
        if cfg.privacy.dp != "off":
            from fedbus.node.privacy.budget import PrivacyLedger

            self.ledger = PrivacyLedger(cfg.privacy, cfg.train, self.train_sizes)  # sgd: n
        self.count_epochs = int(handler.count_epochs())
        # async bookkeeping of the current aggregation window
        self.window = RoundState(0, 0.0, [], 0.0, 0.0)
        self.slow = self._pick_slow_clients()
        # Analysis metrics computed by the server itself when an evaluation starts, from
        # the handler (its global state is then exactly the evaluated version) and the
        # record so far; their result joins the record (e.g. fedbus.analysis.ffd). No
        # message depends on them, so a replay need not attach them.
        self.eval_metrics: list[Callable[[ServerHandler, dict[str, Any]], dict[str, Any]]] = []

    def max_samples(self, client: int) -> int:
        """The most samples an update from `client` can honestly claim (0 for a client the
        run does not have)."""
        if self.train_sizes:
            return self.train_sizes.get(client, 0)
        return 1 << 40

    def class_max(self, client: int) -> np.ndarray | None:
        """The client's training samples per class (None: unknown)."""
        return self.class_samples.get(client)

    def test_size(self, client: int) -> int:
        return self.test_sizes.get(client, 1 << 40)

    def on_refused(self, r: Refusal, now: float) -> list[Out]:
        """The shell refused a message: count it; an update's live task, a merged update's
        members' tasks, a result's evaluation go on without it."""
        self.totals["rejected" if r.kind in ("update", "updates", "merged") else "refused"] += 1
        self.events.append({"event": "rejected", "kind": r.kind, "src": r.src,
                            "reason": r.reason})
        out: list[Out] = []
        if r.answer:
            body: dict[str, Any] = {"code": "rejected", "reason": r.reason}
            if r.kind == "update":
                body["task"] = r.task if isinstance(r.task, int) else None
            out.append(Out("error", r.src, r.round, body))
        if r.task is not None:
            out += self.on_task_failed(r.src, r.task, now, reason="rejected", detail=r.reason)
        for address, tid in r.tasks:
            out += self.on_task_failed(address, tid, now, reason="rejected", detail=r.reason)
        if r.eval is not None:
            out += self._eval_dropped(r.eval, r.src, now)
        return out

    def _eval_dropped(self, eid: Any, src: str, now: float) -> list[Out]:
        """A client's result for evaluation eid was refused: the evaluation no longer waits
        for it (it finishes now if that was the last one it waited for)."""
        ev = self.evals.get(eid) if isinstance(eid, int) else None
        try:
            client = client_index(src)
        except ValueError:
            return []
        if ev is None or client not in ev.expected or client in ev.results:
            return []
        ev.lose(client, "refused")
        if len(ev.results) >= len(ev.expected):
            return self._finish_eval(eid, now)
        return []

    def note_sent(self, out: Out, nbytes: int, params: int) -> None:
        """The shell reports what a sent task or eval weighed on the wire."""
        self.totals["bytes_down"] += nbytes
        self.totals["params_down"] += params
        if out.kind == "secagg" and self.round is not None and self.round.secure is not None:
            self.round.secure.bytes_down += nbytes
        if out.kind not in ("task", "tasks"):
            return
        window = self.round if self.round is not None else self.window
        window.bytes_down += nbytes
        window.params_down += params

    # --- simulation of system heterogeneity (seeded, carried in the task) ---

    def _pick_slow_clients(self) -> set[int]:
        sys_cfg = self.cfg.system
        n = round(sys_cfg.slow_fraction * self.fed.clients)
        rng = np.random.default_rng(np.random.SeedSequence([self.fed.seed, 0x510]))
        picked = rng.choice(self.fed.clients, size=n, replace=False)
        return {int(c) for c in picked} | {int(c) for c in sys_cfg.slow_clients}

    def _simulate(self, client: int) -> dict[str, Any]:
        sys_cfg = self.cfg.system
        epochs = self.cfg.train.epochs
        sim: dict[str, Any] = {"slow_factor": sys_cfg.slow_factor if client in self.slow else 1.0,
                               "drop": bool(self.rng.random() < sys_cfg.drop_prob)
                               if sys_cfg.drop_prob > 0 else False,
                               "epochs_to_run": float(epochs)}
        if client in sys_cfg.drop_clients:
            sim["drop"] = True
        if sim["drop"] and sys_cfg.drop_stage != "task":
            sim["drop_stage"] = sys_cfg.drop_stage
        # At fraction 1 every task is partial and no extra number is drawn, so runs made
        # before partial_fraction existed keep their random stream.
        if sys_cfg.partial_work and (sys_cfg.partial_fraction >= 1.0
                                     or self.rng.random() < sys_cfg.partial_fraction):
            sim["epochs_to_run"] = float(self.rng.uniform(0.0, epochs))
        return sim

    # --- membership ---

    def on_join(self, node: str, clients: list[str], now: float) -> list[Out]:
        ids = []
        for address in clients:
            try:
                c = client_index(address)
            except ValueError:
                continue
            if 0 <= c < self.fed.clients:
                ids.append(c)
        # The node's clients count as live once it says it is configured: building
        # data and the first models takes seconds that must not eat a round's deadline.
        # A node that registers again with another client list (a relay whose nodes came
        # or went, fedbus.node.relay) no longer hosts the clients it left out.
        gone = set(self.nodes.get(node, ())) - set(ids)
        finished: list[Out] = []
        if gone:
            self.live.difference_update(gone)
            self._fail_clients(gone, "dead")
            finished = self._finish_answered_evals(now)
        self.nodes[node] = ids
        self.batch_nodes.discard(node)  # until its new acknowledgement says so again
        self.eval_batch_nodes.discard(node)
        for c in gone:
            self.host.pop(c, None)
        self.host.update(dict.fromkeys(ids, node))
        self.events.append({"event": "join", "node": node, "clients": len(ids)})
        return [Out("config", node, -1, {"run": self.run_id, "config": self.cfg.to_dict()}),
                *finished]

    def on_configured(self, node: str, run: str, now: float,
                      batch: Collection[str] = ()) -> list[Out]:
        """A node's acknowledgement of the run's config; `batch`: the batches it said it
        takes ("tasks", "evals"; PROTOCOL.md §4.3)."""
        ids = self.nodes.get(node)
        if ids is None or run != self.run_id:
            return []
        for kind, nodes in (("tasks", self.batch_nodes), ("evals", self.eval_batch_nodes)):
            if self.batching and kind in batch:
                nodes.add(node)
            else:
                nodes.discard(node)
        self.live.update(ids)
        self.events.append({"event": "node_ready", "node": node, "clients": len(ids)})
        return self._progress(now)

    def on_leave(self, node: str, clients: list[str], now: float) -> list[Out]:
        ids = self.nodes.pop(node, None)
        self.batch_nodes.discard(node)
        self.eval_batch_nodes.discard(node)
        if ids is None:
            ids = [client_index(a) for a in clients if a.startswith("c") and a[1:].isdigit()]
        self.live.difference_update(ids)
        for c in ids:
            if self.host.get(c) == node:
                del self.host[c]
        self._fail_clients(set(ids), "dead")
        self.events.append({"event": "leave", "node": node, "clients": len(ids)})
        return self._finish_answered_evals(now) + self._progress(now)

    def _finish_answered_evals(self, now: float) -> list[Out]:
        """Finish each evaluation whose remaining clients have all answered, now that some
        are gone: nothing more can arrive for it before its deadline."""
        out: list[Out] = []
        for eid in [e for e, ev in self.evals.items() if ev.expected <= set(ev.results)]:
            if eid in self.evals:
                out += self._finish_eval(eid, now)
        return out

    def _fail_clients(self, clients: set[int], reason: str) -> None:
        if any(self.busy[c] for c in clients):
            for tid, task in list(self.tasks.items()):
                if task.client in clients:
                    self._drop_task(tid)
                    if self.round is not None and task.round == self.round.round:
                        self.round.failures.setdefault(task.client, reason)
                    elif self.async_mode:
                        self.window.failures.setdefault(task.client, reason)
        for ev in self.evals.values():
            for c in clients:
                ev.lose(c, "dead")

    def _add_task(self, task: Task) -> None:
        self.tasks[task.id] = task
        self.busy[task.client] += 1
        if task.deadline > 0:
            heapq.heappush(self.deadlines, (task.deadline, task.id))

    def _drop_task(self, tid: int) -> Task:
        task = self.tasks.pop(tid)
        left = self.busy[task.client] - 1
        if left:
            self.busy[task.client] = left
        else:
            del self.busy[task.client]
        return task

    def _silence(self, tid: Any) -> str:
        """Why a task's client said nothing by its deadline: it dropped the task (the
        engine drew the simulated drop, Task.drops), or it is late."""
        task = self.tasks.get(tid) if isinstance(tid, int) else None
        return "dropped" if task is not None and task.drops else "late"

    def waiting(self, now: float, most: int = 8) -> dict[str, Any]:
        """For the progress line: the sampled clients the sync round in progress still
        waits for (at most `most`, and how many), and seconds to its deadline and hard
        deadline; {} when no round is waiting."""
        r = self.round
        if r is None or self.async_mode:
            return {}
        pending = r.pending()
        if not pending:
            return {}
        out: dict[str, Any] = {"waiting": pending[:most], "waiting_count": len(pending),
                               "hard_deadline_in_s": round(max(0.0, r.hard_deadline - now), 1)}
        if r.deadline > 0:
            out["deadline_in_s"] = round(max(0.0, r.deadline - now), 1)
        return out

    def _earliest_task_deadline(self) -> float | None:
        heap = self.deadlines
        while heap:
            deadline, tid = heap[0]
            task = self.tasks.get(tid)
            if task is not None and task.deadline == deadline:
                return deadline
            heapq.heappop(heap)  # answered, failed, or its deadline was lifted
        return None

    # --- the flow ---

    def next_deadline(self) -> float | None:
        """The earliest time at which on_tick may change something."""
        first = self._earliest_task_deadline()
        times = [] if first is None else [first]
        if self.round is not None:
            if self.round.deadline > 0:
                times.append(self.round.deadline)
            times.append(self.round.hard_deadline)
            secure = self.round.secure and self.round.secure.next_deadline()
            if secure is not None:
                times.append(secure)
        times += [ev.deadline for ev in self.evals.values()]
        if not self.started and self.start_time is not None:
            times.append(self.start_time + self.fed.get("start_timeout_s", 60.0))
        return min(times) if times else None

    def on_tick(self, now: float) -> list[Out]:
        if self.done:
            return []
        out: list[Out] = []
        for eid, ev in list(self.evals.items()):
            if now >= ev.deadline:
                out += self._finish_eval(eid, now)
        if self.async_mode:
            while (first := self._earliest_task_deadline()) is not None and now >= first:
                task = self._drop_task(heapq.heappop(self.deadlines)[1])
                # the task is gone: an answer after this is refused, so not "late"
                self.window.failures.setdefault(task.client,
                                                "dropped" if task.drops else "timed_out")
            out += self._async_fill(now)
        elif self.round is not None:
            r = self.round
            s = r.secure
            # a secure round unmasking ends on its own deadlines, not the round's
            closing = s is not None and s.closing()
            for step in s.on_tick(now) if s is not None else ():
                out += self._secure_apply(step, now)
            if not closing and ((r.deadline > 0 and now >= r.deadline
                                 and len(r.updates) >= self.fed.min_updates)
                                or now >= r.hard_deadline):
                out += self._close_round(now)
        return out + self._progress(now)

    def _progress(self, now: float) -> list[Out]:
        """Start the run once enough clients are live; keep work flowing."""
        if self.done:
            return []
        if not self.started:
            if self.start_time is None:
                self.start_time = now
            everyone = len(self.live) >= self.fed.clients
            waited = now - self.start_time >= self.fed.get("start_timeout_s", 60.0)
            if not (everyone or (waited and len(self.live) >= self.fed.min_clients)):
                return []
            self.started = True
            self.window.started = now
            warning = unbounded_wait(self.cfg)
            if warning:
                self.events.append({"event": "warning", "message": warning})
        if self.async_mode:
            return self._async_fill(now)
        if self.round is None and not self.evals and self.version < self.rounds:
            return self._start_round(now)
        r = self.round
        if r is not None and r.secure is not None:
            if r.secure.closing():
                return []  # the round ends with the survivors' signatures and reveals
            step = r.secure.advance(now, r.failures)
            if step is not None:
                return self._secure_apply(step, now) + self._progress(now)
        if r is not None and (r.complete() or self._quorum_met(r)):
            return self._close_round(now)
        return []

    def _quorum_met(self, r: RoundState) -> bool:
        """federation.quorum: the round has this many of its sampled clients' updates, so it
        closes on that event rather than on a clock (its other clients are late); not under
        secure aggregation, whose round closes on its own phases."""
        quorum = self.fed.get("quorum", 0)
        return quorum > 0 and r.secure is None and len(r.updates) >= quorum

    def _task_body(self, client: int, round_: int, now: float, deadline: float) -> dict:
        tid = self.next_task_id
        self.next_task_id += 1
        self._add_task(Task(tid, client, self.version, round_, now, deadline))
        info = RoundInfo(self.version, self.rounds)
        sim = self._simulate(client)
        self.tasks[tid].drops = sim["drop"]
        return {"task": tid, "version": self.version, "epochs": self.cfg.train.epochs,
                "budget_s": self.cfg.train.budget_s,
                "seed": task_seed(self.fed.seed, client, self.version),
                "sim": sim,
                "bound": self.client_bound(client),
                "payload": self.handler.make_task(client, info)}

    def client_bound(self, client: int) -> dict[str, Any]:
        """What the client's answer may claim, carried in its task for a relay, which builds
        no data set and checks each member's update before merging it (fedbus.node.relay):
        its training samples, per class where known, and labelled units a sample."""
        bound = self._bounds.get(client)
        if bound is None:  # (a task a client per round: made once)
            per_class = self.class_samples.get(client)
            bound = self._bounds[client] = {
                "samples": self.max_samples(client), "units": self.label_pixels,
                "epochs": self.count_epochs,
                "classes": None if per_class is None else [int(v) for v in per_class]}
        return bound

    def _batched(self, outs: list[Out]) -> list[Out]:
        """The output stage of one call's tasks or evaluations (PROTOCOL.md §4.3): those
        for a node in batch_nodes (eval_batch_nodes) leave as one `tasks` (`evals`)
        message, at the place of its first, each payload object listed once (by identity:
        the same arrays encode to the same bytes); a node's single one stays a `task`
        (`eval`). Every decision (who, budgets, deadlines, seeds) was made per client
        above; this only packs them."""
        takers = {"task": self.batch_nodes, "eval": self.eval_batch_nodes}
        if not self.batch_nodes and not self.eval_batch_nodes:
            return outs
        groups: dict[tuple[str, str], list[int]] = {}
        for i, o in enumerate(outs):
            if o.kind in takers:
                node = self.host.get(client_index(o.dst))
                if node in takers[o.kind]:
                    groups.setdefault((node, o.kind), []).append(i)
        first: dict[int, Out] = {}
        skip: set[int] = set()
        for (node, kind), idx in groups.items():
            if len(idx) < 2:
                continue
            payloads: list[Any] = []
            seen: dict[Any, int] = {}
            members = []
            for i in idx:
                o = outs[i]
                key = _identity(o.body.get("payload"))
                if key not in seen:
                    seen[key] = len(payloads)
                    payloads.append(o.body.get("payload"))
                members.append({**o.body, "to": o.dst, "payload": seen[key]})
            first[idx[0]] = Out(_BATCH_OF[kind], node, outs[idx[0]].round,
                                {"payloads": payloads, "members": members})
            skip.update(idx[1:])
        return [first.get(i, o) for i, o in enumerate(outs) if i not in skip]

    def _sample(self, candidates: list[int], k: int) -> list[int]:
        if self.poisson:
            if self.cohort_rng is None:
                self.cohort_rng = np.random.default_rng(
                    np.random.SeedSequence([self.noise_seed, 0xC0407]))
            coins = self.cohort_rng.random(len(candidates))
            return [int(c) for c, u in zip(candidates, coins) if u < self.fed.fraction]
        k = min(k, len(candidates))
        if k == len(candidates):
            return list(candidates)
        p = None
        if self.fed.sampling == "size":
            # Successive draws without replacement, each proportional to n_k: numpy's
            # weighted choice, as FedProx's code samples (np.random.choice(..., p=p_k)).
            n = np.array([self.train_sizes.get(c, 1) for c in candidates], dtype=np.float64)
            p = n / n.sum()
        return sorted(int(c) for c in self.rng.choice(candidates, size=k, replace=False, p=p))

    def _start_round(self, now: float) -> list[Out]:
        live = sorted(self.live)
        if len(live) < self.fed.min_clients:
            return []
        k = max(self.fed.min_clients, math.ceil(self.fed.fraction * len(live)))
        candidates = live
        if self.ledger is not None:
            candidates = self._within_budget(live)
            if len(candidates) < self.fed.min_clients or \
                    not self.ledger.run_has_budget(self.fed.fraction):
                return self._budget_spent(now)
        if self.secure:  # a search for a spoiler of the sum picks the cohort (culprit.py)
            search = self._culprit_search()
            sampled = search.cohort(search.eligible(candidates), k, self._sample)
        else:
            sampled = self._sample(candidates, k)
        if self.ledger is not None:  # charged as the tasks go out (a dropout pays too)
            if self.ledger.per_client:  # record, sgd
                self.ledger.charge_clients(sampled)
            else:
                self.ledger.charge_round(self.fed.fraction)
        deadline = now + self.fed.deadline_s if self.fed.deadline_s > 0 else 0.0
        hard = now + max(self.fed.hard_deadline_s, self.fed.deadline_s)
        self.round = RoundState(self.version, now, sampled, deadline, hard)
        if not sampled:  # a Poisson cohort of no one: the round is its noise alone
            self.events.append({"event": "round_start", "round": self.version,
                                "sampled": 0, "live": len(live)})
            return self._close_round(now)
        if self.secure:
            self.round.secure = self._secure_round(sampled, now)
        # A relay merges one round's updates once all its tasks are answered, so each task
        # says how many of the round's tasks went to the node hosting its client.
        per_node = Counter(self.host.get(c) for c in sampled)
        out = []
        for c in sampled:
            body = self._task_body(c, self.version, now, deadline)
            body["node_tasks"] = per_node[self.host.get(c)]
            if self.round.secure is not None:
                body["secagg"] = self.round.secure.task_field()
                self.round.secure.task_of[c] = body["task"]
            out.append(Out("task", client_address(c), self.version, body))
        self.events.append({"event": "round_start", "round": self.version,
                            "sampled": len(sampled), "live": len(live)})
        return self._batched(out)

    # --- updates ---

    def on_update(self, src: str, body: dict[str, Any], nbytes: int, now: float) -> list[Out]:
        """An update arrived (already validated by the shell)."""
        client = client_index(src)
        task = self._drop_task(int(body["task"]))
        upd = ClientUpdate(client=client, payload=body["payload"],
                           num_samples=int(body["num_samples"]),
                           work=Work.from_dict(body["work"]), version=task.version)
        params = count_params(body["payload"])
        self.totals["bytes_up"] += nbytes
        self.totals["params_up"] += params
        if self.async_mode:
            return self._async_update(upd, nbytes, params, now)
        r = self.round
        if self.secure:
            return self._secure_input(upd, [client], body, nbytes, task.round, now)
        if r is not None and task.round == r.round and client in r.members:
            r.updates[client] = upd
            r.count_up(nbytes, params)
            return self._progress(now)
        # a straggler from an earlier round: set aside to fold (counted when it is folded,
        # or dropped as too stale, at the next aggregation), unless none is left
        if self.fed.late == "fold" and self.version < self.rounds:
            self.late.append(upd)
            self.events.append({"event": "late_folded", "client": client, "version": task.version})
        else:
            self.totals["late_dropped"] += 1
            self.late_discarded.append([client, task.round])
            self.events.append({"event": "late_dropped", "client": client,
                                "version": task.version})
        return []

    def is_expected_merged(self, node: str, body: dict[str, Any], *, run: str | None = None,
                           round: int | None = None) -> str | None:
        """Why a relay's pre-aggregated update must be rejected, or None: the handler
        declares a merge rule, the run is sync, the sender hosts every member, and each
        member answers an outstanding task of one version and round, once."""
        if self.handler.merge_rule() is None:
            return f"{type(self.handler).__name__} declares no merge rule"
        if self.async_mode:
            return "merged updates are for sync runs (async relays forward updates as they are)"
        if run is not None and run != self.run_id:
            return f"run {run!r} is not this server's run {self.run_id!r}"
        hosted = self.nodes.get(node)
        if hosted is None:
            return f"sender {node!r} is not a client node of this run"
        hosted_set = set(hosted)
        version = body.get("version")
        for m in body.get("members", ()):
            client = client_index(m[0])
            if client not in hosted_set:
                return f"{m[0]} is not hosted by {node!r}"
            task = self.tasks.get(m[1])
            if task is None:
                return f"task {m[1]!r} is not outstanding"
            if task.client != client:
                return f"task {task.id} was sent to c{task.client}, not {m[0]}"
            if task.version != version or (round is not None and task.round != round):
                return f"task {task.id} is not of version {version!r} round {round!r}"
        return None

    def on_merged(self, node: str, body: dict[str, Any], nbytes: int, now: float) -> list[Out]:
        """A relay's pre-aggregated update (already validated): its members answered their
        tasks; the handler aggregates its sum form once (fedbus.algorithms.core.merge)."""
        version = int(body["version"])
        members = []
        task_round = None
        for address, tid, n, work in body["members"]:
            task = self._drop_task(tid)
            task_round = task.round
            members.append(ClientUpdate(client=client_index(address), payload={},
                                        num_samples=int(n), work=Work.from_dict(work),
                                        version=version))
        members.sort(key=lambda u: u.client)
        if self.secure:
            return self._secure_input(members, [u.client for u in members], body, nbytes,
                                      task_round, now)
        entry = ClientUpdate(client=members[0].client, payload=body["payload"],
                             num_samples=sum(u.num_samples for u in members),
                             work=members[0].work, version=version, members=tuple(members))
        params = count_params(body["payload"])
        self.totals["bytes_up"] += nbytes
        self.totals["params_up"] += params
        r = self.round
        if r is not None and task_round == r.round:
            for u in members:
                r.updates[u.client] = u
            r.merged.append(entry)
            r.count_up(nbytes, params)
            return self._progress(now)
        # a relay's group that missed its round: late, as its members would be
        fold = self.fed.late == "fold" and self.version < self.rounds
        if fold:
            self.late.append(entry)
        else:
            self.totals["late_dropped"] += len(members)
            self.late_discarded += [[u.client, task_round] for u in members]
        self.events.append({"event": "late_folded" if fold else "late_dropped",
                            "relay": node, "clients": len(members), "version": version})
        return []

    def on_task_failed(self, src: str, task_id: Any, now: float,
                       reason: str = "error", detail: str = "") -> list[Out]:
        """A client's task ended without a usable update: its handler failed ("error"), or
        its answer failed validation ("rejected"; `detail`: the validator's reason, kept in
        the record's `refusals`). Either way the client is done for this round, so the round
        need not wait for its deadline."""
        task = self.tasks.get(task_id) if isinstance(task_id, int) else None
        if task is None or client_address(task.client) != src:
            return []
        self._drop_task(task_id)
        window = self.round if self.round is not None and task.round == self.round.round \
            else self.window if self.async_mode else None
        if window is not None and task.client not in window.failures:
            window.failures[task.client] = reason
            if detail:
                window.refusals[task.client] = detail[:300]
        self.events.append({"event": "task_failed", "client": task.client, "task": task_id,
                            "reason": reason})
        return self._progress(now)

    def is_expected_update(self, src: str, body: dict[str, Any], *, run: str | None = None,
                           round: int | None = None) -> str | None:
        """Why an update must be rejected before any handler sees it, or None: it must answer
        an outstanding task of this run (its header's run id and round, when given, too) sent
        to this client, once (the task is gone after the first accepted answer)."""
        try:
            client = client_index(src)
        except ValueError:
            return f"sender {src!r} is not a client"
        if run is not None and run != self.run_id:
            return f"run {run!r} is not this server's run {self.run_id!r}"
        task = self.tasks.get(body.get("task")) if isinstance(body.get("task"), int) else None
        if task is None:
            return f"task {body.get('task')!r} is not outstanding"
        if task.client != client:
            return f"task {task.id} was sent to c{task.client}, not {src}"
        if body.get("version") != task.version:
            return f"version {body.get('version')!r} does not match task {task.id}"
        if round is not None and round != task.round:
            return f"round {round} does not match task {task.id} (round {task.round})"
        return None

    def _weighted(self, upd: ClientUpdate) -> ClientUpdate:
        upd.staleness = self.version - upd.version
        upd.weight = staleness_weight(upd.staleness)
        for m in upd.members:
            m.staleness, m.weight = upd.staleness, upd.weight
        return upd

    def _close_round(self, now: float) -> list[Out]:
        r = self.round
        assert r is not None
        if r.secure is not None and r.secure.phase != "done":
            # the inputs in are the survivors: unmask them first (or finish unmasking)
            for c in r.pending():
                r.failures[c] = self._silence(r.secure.task_of.get(c))
            return self._secure_apply(r.secure.close(now), now)
        dropping = {t.client for t in self.tasks.values() if t.round == r.round and t.drops}
        for c in r.pending():
            r.failures[c] = "dropped" if c in dropping else "late"
        for tid, task in list(self.tasks.items()):
            if task.round == r.round:
                if task.drops:  # nothing will ever come: its client is free (and evaluated)
                    self._drop_task(tid)
                else:
                    task.deadline = 0.0  # it may still arrive: then it is late
            elif self.version - task.version > self.fed.max_staleness:
                self._drop_task(tid)  # too stale to ever count
        in_merged = {m.client for e in r.merged for m in e.members}
        if r.secure is not None:  # the one unmasked sum, or nothing if unmasking failed
            fresh = [self._weighted(e) for e in r.secure.entries]
        else:
            fresh = [self._weighted(r.updates[c]) for c in sorted(r.updates)
                     if c not in in_merged]
            fresh += [self._weighted(e) for e in sorted(r.merged, key=lambda e: e.client)]
            if self.ledger is not None and self.ledger.mechanism == "client" and \
                    not self.ledger.distributed:  # (distributed: a cohort of no one, no step)
                fresh = [self._weighted(e) for e in self._dp_sum(fresh)]
        folded = [self._weighted(u) for u in self.late
                  if self.version - u.version <= self.fed.max_staleness]
        self.totals["late_folded"] += len(members_of(folded))
        self.totals["late_dropped"] += len(members_of(self.late)) - len(members_of(folded))
        kept = {id(u) for u in members_of(folded)}
        self.late_discarded += [[u.client, u.version] for u in members_of(self.late)
                                if id(u) not in kept]
        self.late = []
        failures = [Failure(c, r.failures[c]) for c in sorted(r.failures)]
        record = self._aggregate(fresh + folded, failures, r, now)
        folded = members_of(folded)
        record.update(round=r.round, sampled=len(r.sampled), folded=len(folded),
                      stale=[[u.client, u.version, u.staleness, u.weight] for u in folded],
                      merged=len(r.merged))
        if r.secure is not None:
            record["secagg"] = r.secure.record()
            search = self._culprit_search().record()
            if search:
                record["secagg"]["search"] = search
        self.round = None
        return self._after_aggregation(record, now)

    def _aggregate(self, updates: list[ClientUpdate], failures: list[Failure],
                   window: RoundState, now: float) -> dict[str, Any]:
        info = RoundInfo(self.version, self.rounds)
        metrics = self.handler.aggregate(updates, failures, info) or {}
        # Scalars go to "agg"; a dict or list value (e.g. one number per client) to "agg_extra".
        extra = {k: v for k, v in metrics.items() if isinstance(v, (dict, list))}
        # a relay's merged update: its clients; client -1: client-level DP's noise step
        updates = [u for u in members_of(updates) if u.client >= 0]
        self.version += 1
        reasons = [f.reason for f in failures]
        works = [u.work.fraction for u in updates]
        return {"version": self.version, "time": now, "round_s": now - window.started,
                "updates": len(updates), "late": reasons.count("late"),
                "dead": reasons.count("dead"), "failed": len(failures),
                "partial": sum(1 for u in updates if u.work.fraction < 1.0),
                "work_fraction": float(np.mean(works)) if works else 0.0,
                "stale_max": max((u.staleness for u in updates), default=0),
                "bytes_up": window.bytes_up, "messages_up": window.messages_up,
                "bytes_down": window.bytes_down,
                "params_up": window.params_up, "params_down": window.params_down,
                "participants": sorted(u.client for u in updates),
                "partial_clients": sorted(u.client for u in updates if u.work.fraction < 1.0),
                "failures": {str(f.client): f.reason for f in failures},
                **({"refusals": {str(c): why for c, why in sorted(window.refusals.items())}}
                   if window.refusals else {}),
                **({"late_discarded": self._take_discarded()} if self.late_discarded else {}),
                "agg": {k: float(v) for k, v in metrics.items() if k not in extra},
                **({"agg_extra": extra} if extra else {}),
                **({"dp": self.ledger.record()} if self.ledger is not None else {})}

    def _take_discarded(self) -> list[list[int]]:
        out, self.late_discarded = sorted(self.late_discarded), []
        return out

    def _after_aggregation(self, record: dict[str, Any], now: float) -> list[Out]:
        out: list[Out] = []
        if self.version % self.fed.eval_every == 0 or self.version >= self.rounds:
            out += self._start_eval(record, now)
        else:
            self.records.append(record)
        if self.version >= self.rounds and not self.evals:
            out += self._finish(now)
        if self.async_mode:
            return out
        return out + self._progress(now)

    # --- differential privacy (fedbus.node.privacy.budget, fedbus.node.privacy.dp) ---

    def _within_budget(self, live: list[int]) -> list[int]:
        """The live clients whose next release stays within privacy.target_epsilon; the
        others are logged once as spent."""
        ok = []
        for c in live:
            if self.ledger.has_budget(c):
                ok.append(c)
            elif c not in self.ledger.spent:
                self.ledger.spent.add(c)
                self.events.append({"event": "privacy_budget_spent", "client": c,
                                    "epsilon": self.ledger.epsilon_of(c)})
        return ok

    def _budget_spent(self, now: float) -> list[Out]:
        """No round fits the budget any more: the run ends here, with its last version."""
        self.events.append({"event": "privacy_budget_exhausted", "version": self.version,
                            "epsilon": self.ledger.epsilon(),
                            "target_epsilon": self.ledger.target})
        self.rounds = self.version
        self.stopped = "privacy budget"
        return self._finish(now) if not self.evals else []

    def _dp_noised(self, form: dict[str, Any]) -> dict[str, Any]:
        """Client-level DP: N(0, (z C)^2) on the round's sum of clipped deltas, drawn from
        noise_seed and the version (a replay that has the seed draws the same), over the
        fixed denominator q x federation.clients, the expected cohort size (McMahan et al.
        2018's fixed-denominator estimator): the handler steps by sum / mass, and a count
        of the cohort in the denominator would release how many took part, unnoised."""
        from fedbus.node.privacy.dp import gaussian_like

        # 256 bits of the secret per round: one 32-bit word could be searched by a client
        words = np.random.SeedSequence([self.noise_seed, 0xD9, self.version]) \
            .generate_state(4, np.uint64)
        seed = int.from_bytes(words.tobytes(), "little")
        noise = gaussian_like(form["delta_sum"], self.ledger.noise_std(), seed)
        expected = float(self.fed.fraction) * float(self.fed.clients)
        return {**form, "delta_sum": _tree_add(form["delta_sum"], noise),
                "mass": np.full_like(np.asarray(form["mass"], np.float64), expected)}

    def _dp_sum(self, updates: list[ClientUpdate]) -> list[ClientUpdate]:
        """Client-level DP without secure aggregation: the round's clipped deltas summed
        with weight 1 each (a relay's merged sum is one already), noised, as one merged
        update: the handler steps by sum / number of clients."""
        from fedbus.algorithms.core.merge import weighted_sum
        from fedbus.algorithms.core.params import resolved_params

        if not updates:  # no one sampled or answering: the noise alone, as one step
            return self._dp_noise_step()
        from fedbus.node.privacy.dp import delta_norm

        own = [u for u in updates if not u.members]  # (a relay's sum hides its members')
        at_clip = sum(delta_norm(u.payload["delta"]) >= self.ledger.clip * (1 - 1e-5)
                      for u in own)
        self.ledger.note_clipped(at_clip, len(own))
        rule = self.handler.merge_rule()
        params = resolved_params(type(self.handler), self.cfg.algorithm)
        ones = [ClientUpdate(client=u.client, payload=u.payload, num_samples=1, work=u.work,
                             version=u.version, members=u.members, weight=1.0)
                for u in updates]
        total, _ = weighted_sum(ones, rule, params)
        members = tuple(sorted(members_of(updates), key=lambda u: u.client))
        if total is None:
            return self._dp_noise_step()
        return [ClientUpdate(client=members[0].client, payload=self._dp_noised(total),
                             num_samples=sum(u.num_samples for u in members),
                             work=members[0].work, version=self.version, members=members)]

    def _dp_noise_step(self) -> list[ClientUpdate]:
        """A client-level round with no update: the analysed mechanism still releases
        noise / (q x clients), or an empty round would show that no one took part. Handed
        to the handler as the delta of client -1, which no record lists."""
        spec = self.handler.update_spec()["delta"]
        zeros = {"delta_sum": {k: np.zeros(shape, np.float64) for k, (_, shape) in spec.items()},
                 "mass": np.zeros(1)}
        form = self._dp_noised(zeros)
        mass = float(form["mass"][0])
        delta = {k: (v / mass).astype(np.float32) for k, v in form["delta_sum"].items()}
        return [ClientUpdate(client=-1, payload={"delta": delta}, num_samples=1,
                             work=Work(1, 1.0, 0, 0), version=self.version)]

    # --- secure aggregation (fedbus.node.privacy.secure_steps; PROTOCOL.md §12) ---

    def secure_spec(self) -> dict[str, Any]:
        """The sum form the clients mask: the handler's merge rule's spec."""
        if self.sum_spec is None:
            rule = self.handler.merge_rule()
            if rule is None:
                raise ValueError(f"{type(self.handler).__name__} declares no merge rule")
            self.sum_spec = rule.spec(self.handler)
        return self.sum_spec

    def _culprit_search(self) -> Any:
        if self.culprits is None:
            from fedbus.node.privacy.culprit import CulpritSearch

            self.culprits = CulpritSearch(np.random.SeedSequence([self.noise_seed, 0xC1A9]),
                                          min_cohort=self.fed.min_clients)
        return self.culprits

    def _secure_round(self, sampled: list[int], now: float) -> Any:
        from fedbus.node.privacy.secure_steps import SecureRound

        # the graph's randomness is the server's secret (the shell sets secagg_key), never
        # the run's seed, which every node knows
        return SecureRound(run_id=self.run_id, round_=self.version, sampled=sampled,
                           privacy=self.cfg.privacy, spec=self.secure_spec(),
                           graph_key=self.secagg_key, now=now)

    def is_expected_secagg(self, src: str, body: dict[str, Any]) -> str | None:
        """Why a client's secure-aggregation step must be refused, or None: it answers its
        task of the round in progress, in the phase that asks for it, once."""
        from fedbus.node.privacy.secure_round import CLIENT_STEPS

        step = body.get("step")
        if step not in CLIENT_STEPS:
            return f"step {step!r} is not one of {', '.join(CLIENT_STEPS)}"
        s = self.round.secure if self.round is not None else None
        if s is None:
            return "no securely aggregated round is in progress"
        return s.step_problem(src, client_index(src), body, self.tasks)

    def secure_input_problem(self, members: list[int], payload: Any) -> str | None:
        """Why a masked input (one client's, or a relay's sum of several) must be refused,
        or None. An input for a round no longer masking is late, not refused."""
        s = self.round.secure if self.round is not None else None
        return None if s is None else s.input_problem(members, payload)

    def on_secagg(self, src: str, body: dict[str, Any], now: float,
                  nbytes: int = 0) -> list[Out]:
        """A client's step (already judged): keys, shares, a signature or a reveal."""
        r = self.round
        assert r is not None and r.secure is not None
        s, client = r.secure, client_index(src)
        s.bytes_up += nbytes
        self.totals["bytes_up"] += nbytes
        step = s.on_step(client, body, now)
        if step.refused is not None:
            return self.on_refused(Refusal("secagg", src, step.refused, r.round,
                                           task=step.task if step.task in self.tasks else None,
                                           answer=False), now)
        return self._secure_apply(step, now)

    def _secure_apply(self, step: Any, now: float) -> list[Out]:
        """Do what a step of the round's secure part asks (secure_steps.Step)."""
        r = self.round
        s = r.secure
        for c in step.drop:  # it missed a step, so cannot take part: its task ends
            tid = s.task_of.get(c)
            if c not in r.failures:
                r.failures[c] = self._silence(tid)
            if tid in self.tasks:
                self._drop_task(tid)
        if step.event is not None:
            self.events.append(step.event)
        if step.unmasked is not None:
            s.end(now, self._secure_judged(step.unmasked))
        if s.phase == "done":
            return self._secure_done(now)
        out = [Out("secagg", client_address(c), r.round, body) for c, body in step.sends]
        return out + self._progress(now) if step.progress else out

    def _secure_input(self, upd: Any, clients: list[int], body: dict[str, Any], nbytes: int,
                      task_round: int, now: float) -> list[Out]:
        """A masked input (an update, or a relay's merged sum of several) of this round's
        masking phase joins the session; any other is late and dropped (no folding: each
        late input would need an unmasking of its own)."""
        r = self.round
        s = r.secure if r is not None else None
        params = count_params(body["payload"])
        self.totals["bytes_up"] += nbytes
        self.totals["params_up"] += params
        if s is None or not s.on_input(clients, body["payload"], task_round):
            self.totals["late_dropped"] += len(clients)
            self.events.append({"event": "late_dropped", "clients": len(clients),
                                "secagg": True, "version": self.version})
            return []
        members = upd if isinstance(upd, list) else [upd]
        for u in members:
            u.payload = {}
            r.updates[u.client] = u
        if isinstance(upd, list):
            r.merged.append(ClientUpdate(client=clients[0], payload={}, num_samples=0,
                                         work=upd[0].work, version=upd[0].version,
                                         members=tuple(upd)))
        r.count_up(nbytes, params)
        return self._progress(now)

    def _secure_judged(self, form: dict[str, Any]) -> str | None:
        """The unmasked sum, checked as the server checks a relay's merged update, becomes
        the round's one entry for the handler (None), or is refused (why)."""
        from fedbus.node.validate import Rejected, check_merged

        r = self.round
        s = r.secure
        members = sorted((r.updates[c] for c in s.survivors), key=lambda u: u.client)
        body = {"version": self.version, "payload": form,
                "members": [[client_address(u.client), s.task_of[u.client], u.num_samples,
                             u.work.to_dict()] for u in members]}
        try:
            check_merged(body, self.secure_spec(), max_samples=self.max_samples,
                         units=self.label_pixels, num_classes=self.handler.ctx.num_classes,
                         class_samples=self.class_max,  # (distributed DP: noised, bounded
                         norms=self.norms if s.ddp is None else  # by SecureRound instead)
                         dc_replace(self.norms, update=0.0),
                         count_epochs=self.count_epochs)
        except Rejected as err:
            s.spoiled = True  # every share was consistent: an input spoiled the sum
            return f"the unmasked sum is refused: {err}"
        if self.ledger is not None and self.ledger.distributed:
            # the clients' noise is in the sum already (fedbus.node.privacy.ddp): the server
            # adds none; it charges the epsilon of the survivors' noise, and divides by the
            # fixed denominator as under central noise
            self.ledger.charge_distributed(s.ddp, len(s.survivors), self.fed.fraction)
            form = {**form, "mass": np.full_like(np.asarray(form["mass"], np.float64),
                                                 float(self.fed.fraction * self.fed.clients))}
        elif self.ledger is not None and self.ledger.mechanism == "client":
            # after the check, which bounds the clients' sum: the server's own noise and
            # denominator are not theirs to be judged by
            form = self._dp_noised(form)
        s.entries = [ClientUpdate(client=members[0].client, payload=form,
                                  num_samples=sum(u.num_samples for u in members),
                                  work=members[0].work, version=self.version,
                                  members=tuple(members))]
        return None

    def _secure_done(self, now: float) -> list[Out]:
        """The secure part ended; a failure unmasks nothing: the round aggregates no
        update, its survivors count as failed, and the next round goes on."""
        r = self.round
        s = r.secure
        failed = s.result.get("failed")
        if failed is not None:
            for c in s.inputs:
                r.failures[c] = "secagg"
                r.updates.pop(c, None)
            s.entries = []
            self.events.append({"event": "secagg_failed", "round": r.round, "reason": failed})
            if s.spoiled:
                excluded = self._culprit_search().on_failed(r.round, sorted(s.survivors))
                if excluded:
                    self.events.append({
                        "event": "clients excluded", "round": r.round,
                        "clients": [client_address(c) for c in excluded],
                        "reason": self.culprits.excluded[excluded[0]]})
        return self._close_round(now)  # (an input still to come is late: dropped)

    # --- async ---

    def _async_fill(self, now: float) -> list[Out]:
        if self.version >= self.rounds:
            return []
        concurrency = self.fed.concurrency or self.fed.clients
        busy = self.busy
        slots = concurrency - len(busy)
        if slots <= 0:
            return []
        idle = sorted(c for c in self.live if c not in busy and c not in self.buffered_clients)
        out = []
        if slots > 0 and idle:
            deadline = now + self.fed.deadline_s if self.fed.deadline_s > 0 else \
                now + self.fed.hard_deadline_s
            for c in self._sample(idle, slots):
                body = self._task_body(c, self.version, now, deadline)
                out.append(Out("task", client_address(c), self.version, body))
        return self._batched(out)

    def _async_update(self, upd: ClientUpdate, nbytes: int, params: int,
                      now: float) -> list[Out]:
        w = self.window
        w.count_up(nbytes, params)
        if self.version >= self.rounds:
            return []  # the last aggregation is done; the final evaluation is running
        if self.version - upd.version > self.fed.max_staleness:
            self.totals["late_dropped"] += 1
            self.late_discarded.append([upd.client, upd.version])
            return self._async_fill(now)
        self.buffer.append(upd)
        self.buffered_clients.add(upd.client)
        out: list[Out] = []
        buffer_size = self.fed.buffer or self.fed.concurrency or self.fed.clients
        if len(self.buffer) >= buffer_size:
            updates = [self._weighted(u) for u in
                       sorted(self.buffer, key=lambda u: (u.client, u.version))]
            failures = [Failure(c, why) for c, why in sorted(w.failures.items())]
            record = self._aggregate(updates, failures, w, now)
            stale = [u for u in updates if u.staleness > 0]
            record.update(round=self.version - 1, sampled=len(updates) + len(failures),
                          folded=len(stale),
                          stale=[[u.client, u.version, u.staleness, u.weight] for u in stale])
            self.buffer, self.buffered_clients = [], set()
            self.window = RoundState(self.version, now, [], 0.0, 0.0)
            out += self._after_aggregation(record, now)
        return out + self._async_fill(now)

    # --- evaluation ---

    def _start_eval(self, record: dict[str, Any], now: float) -> list[Out]:
        # In sync mode a client still busy with a straggling task would hold the
        # next round back until it finished; it is evaluated another round, and the record
        # names it (a dropped task's client is free: Task.drops).
        busy = () if self.async_mode else self.busy
        live = sorted(self.live)
        drawn = self._eval_sample(live)
        targets = [c for c in drawn if c not in busy]
        missing = {c: "busy" for c in drawn if c in busy}
        eid = self.next_eval_id
        self.next_eval_id += 1
        wait = self.fed.deadline_s * 2 if self.fed.deadline_s > 0 else self.fed.hard_deadline_s
        final = self.version >= self.rounds
        for metric in self.eval_metrics:
            record.update(metric(self.handler, record))
        if len(drawn) < len(live):  # federation.eval_clients: a sample of the live ones
            record["eval_sample_of"] = len(live)
        ev = EvalState(self.version, record["round"], now, now + wait, set(targets),
                       record=record, live=len(drawn), missing=missing)
        self.evals[eid] = ev
        info = RoundInfo(self.version - 1, self.rounds)
        out = []
        embed = set(embedding_clients(targets, self.cfg.log.embedding_clients)) if final \
            else set()
        for i, c in enumerate(targets):
            body = {"eval": eid, "version": self.version,
                    "embed": int(self.cfg.log.embeddings) if c in embed else 0,
                    "payload": self.handler.make_eval(c, info)}
            if final and i < MASK_CLIENTS and self.label_pixels > 1:
                body["masks"] = MASK_IMAGES
            out.append(Out("eval", client_address(c), record["round"], body))
        if not targets:
            out += self._finish_eval(eid, now)
        return self._batched(out)

    def _eval_sample(self, live: list[int]) -> list[int]:
        """The live clients an evaluation asks: all of them, or federation.eval_clients of
        them drawn without replacement from (seed, version), so a replay and a resumed
        server draw the same ones; the record's eval_live then counts the sample and
        eval_sample_of the live clients it was drawn from."""
        n = int(self.fed.get("eval_clients", 0) or 0)
        if not n or len(live) <= n:
            return live
        rng = np.random.default_rng(np.random.SeedSequence([self.fed.seed, 0xE7A1,
                                                            self.version]))
        return sorted(int(c) for c in rng.choice(live, size=n, replace=False))

    def on_eval_result(self, src: str, body: dict[str, Any], now: float) -> list[Out]:
        eid = body.get("eval")
        ev = self.evals.get(eid) if isinstance(eid, int) else None
        client = client_index(src)
        if ev is None or client not in ev.expected:
            return []
        ev.results[client] = body
        if len(ev.results) >= len(ev.expected):
            return self._finish_eval(eid, now)
        return []

    def _finish_eval(self, eid: int, now: float) -> list[Out]:
        ev = self.evals.pop(eid)
        record = dict(ev.record)
        for c in sorted(ev.expected - set(ev.results)):
            ev.lose(c, "timed_out")
        record["eval_clients"] = len(ev.results)
        record["eval_live"] = ev.live
        record["eval_missing"] = {str(c): why for c, why in sorted(ev.missing.items())}
        record.update(summarise_eval({c: r["metrics"] for c, r in ev.results.items()}))
        record["eval_s"] = now - ev.started
        self.records.append(record)
        self.final_embeddings = {c: r["embeddings"] for c, r in ev.results.items()
                                 if r.get("embeddings")}
        self.final_masks = {c: r["masks"] for c, r in ev.results.items()
                            if isinstance(r.get("masks"), dict)}
        out: list[Out] = []
        if self.version >= self.rounds and not self.evals:
            out += self._finish(now)
        elif not self.async_mode:
            out += self._progress(now)
        return out

    def _finish(self, now: float) -> list[Out]:
        if self.done:
            return []
        self.done = True
        self.events.append({"event": "done", "version": self.version})
        return [Out("shutdown", "*", self.version, {"reason": "run complete"})]

    # --- checkpoints ---

    def state_dict(self) -> dict[str, Any]:
        # PCG64's state holds 128-bit integers, which msgpack cannot carry: JSON text can.
        state = {"version": self.version, "rng": json.dumps(self.rng.bit_generator.state),
                 "next_task_id": self.next_task_id, "next_eval_id": self.next_eval_id,
                 "totals": dict(self.totals), "handler": self.handler.state_dict()}
        if self.ledger is not None:
            state["dp"] = self.ledger.state_dict()
        if self.cohort_rng is not None:
            state["cohort_rng"] = json.dumps(self.cohort_rng.bit_generator.state)
        if self.culprits is not None:
            state["culprits"] = self.culprits.state_dict()
        if self.stopped:  # ended before its rounds: a resume must see that it ended
            state["stopped"] = {"reason": self.stopped, "rounds": self.rounds}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.rng.bit_generator.state = json.loads(state["rng"])
        self.next_task_id = int(state["next_task_id"])
        self.next_eval_id = int(state["next_eval_id"])
        self.totals.update(state["totals"])
        self.handler.load_state_dict(state["handler"])
        if self.ledger is not None and "dp" in state:
            self.ledger.load_state_dict(state["dp"])
        if "cohort_rng" in state:
            self.cohort_rng = np.random.default_rng()
            self.cohort_rng.bit_generator.state = json.loads(state["cohort_rng"])
        if "culprits" in state:
            self._culprit_search().load_state_dict(state["culprits"])
        stopped = state.get("stopped")
        if isinstance(stopped, dict):
            self.stopped = str(stopped.get("reason", ""))
            self.rounds = int(stopped.get("rounds", self.rounds))

    def on_resumed(self, now: float) -> list[Out]:
        """After load_state_dict. A checkpoint of the last version is a finished run whose
        server died before it exited: its shutdown went out before that checkpoint, but
        may have been lost with a broker that was down, and a node that missed it still
        waits. The run ends again here and the shutdown goes out again; without this, the
        resumed server waits forever for rounds there are none of."""
        if self.version >= self.rounds and not self.evals:
            return self._finish(now)
        return []


def _identity(value: Any) -> Any:
    """A key equal for two payloads built from the same objects (maps and lists of the
    same arrays and scalars): such payloads encode to the same bytes. Arrays are keyed by
    object identity, so a payload is only ever shared where it is literally the same."""
    if isinstance(value, dict):
        return ("d", tuple((k, _identity(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("l" if isinstance(value, list) else "t", tuple(_identity(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return ("v", type(value).__name__, value)
    return ("o", id(value))


# the batches the server sends (PROTOCOL.md §4.3) -> the kind of message each member stands for
SENT_BATCHES = {"tasks": "task", "evals": "eval"}
_BATCH_OF = {member: batch for batch, member in SENT_BATCHES.items()}

# what the server sends whose weight Engine.note_sent counts (the shell, replay and the chaos
# harness's replay call it for each of these they send or compare)
NOTED_KINDS = frozenset({"task", "tasks", "eval", "evals", "secagg"})


def out_params(out: Out) -> int:
    """The parameters a task (or eval, secagg) message carries, per client: a batch counts
    each member's payload, as its members' own tasks would have."""
    if out.kind in SENT_BATCHES:
        payloads = out.body["payloads"]
        return sum(count_params(payloads[m["payload"]]) for m in out.body["members"])
    return count_params(out.body.get("payload"))


def unbatch_tasks(body: Any, kind: str = "tasks") -> list[tuple[str, dict[str, Any]]]:
    """A `tasks` (or `evals`) body (PROTOCOL.md §4.3) as its members' (address, task or
    eval body), in order, each body as the member's own `task` (`eval`) would have carried
    it. Its maps and lists are each member's own; arrays are shared, read-only. ValueError
    names what is malformed."""
    if not isinstance(body, dict) or not isinstance(body.get("payloads"), list) or \
            not isinstance(body.get("members"), list):
        raise ValueError(f"a {kind} body must be a map with lists payloads and members")  # noqa: TRY004
    payloads = body["payloads"]
    out = []
    for i, m in enumerate(body["members"]):
        ref = m.get("payload") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("to"), str) or \
                isinstance(ref, bool) or not isinstance(ref, int) or \
                not 0 <= ref < len(payloads):
            raise ValueError(f"members[{i}] must be a {SENT_BATCHES.get(kind, kind)} map with "
                             f"'to' (an address) and "
                             f"'payload' (an index into payloads)")
        task = {k: v for k, v in m.items() if k != "to"}
        task["payload"] = _own_containers(payloads[ref])
        out.append((m["to"], task))
    return out


def unbatch_updates(body: Any) -> list[tuple[str, dict[str, Any]]]:
    """An `updates` body (PROTOCOL.md §4.3) as its members' (client address, update body),
    in order, each body as the member's own `update` would have carried it. ValueError
    names what is malformed."""
    members = body.get("members") if isinstance(body, Mapping) else None
    if not isinstance(members, list) or not all(
            isinstance(m, Mapping) and isinstance(m.get("from"), str) for m in members):
        raise ValueError("an updates body must be a map with a list members, each naming "
                         "its client in 'from'")
    return [(m["from"], {k: v for k, v in m.items() if k != "from"}) for m in members]


def _own_containers(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _own_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_own_containers(v) for v in value]
    if isinstance(value, np.ndarray) and value.flags.writeable:
        return value.copy()  # (writable: each member its own, as its own frame would be)
    return value  # read-only (a view of the received frame): the same for every member


def _tree_add(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    return {k: _tree_add(v, b[k]) if isinstance(v, dict) else np.asarray(v) + b[k]
            for k, v in a.items()}


def server_norms(cfg: Config, handler: ServerHandler) -> Norms:
    """The norm bounds the server enforces (config [security]; fedbus.node.validate)."""
    return run_norms(cfg.security, cfg.privacy,
                     int(getattr(handler.ctx, "feature_dim", 0) or 0))


def embedding_clients(targets: list[int], most: int) -> list[int]:
    """The clients of a final evaluation asked for test embeddings (the t-SNE plot's):
    all when `most` is 0 or they are no more, else `most` of them evenly spaced, so a
    federation of thousands does not ship every client's embeddings to the server."""
    if not most or len(targets) <= most:
        return list(targets)
    return [targets[(i * len(targets)) // most] for i in range(most)]


# Client metrics summarised over clients: the head ("acc"), nearest prototype
# ("proto_acc"), the auxiliary model of FML/FedKD ("aux_acc"), FedGH's two headers
# ("local_head_acc", "global_head_acc"), FedHKD's global model ("global_acc"),
# segmentation's mIoU ("miou", "proto_miou").
METRIC_KEYS = ("acc", "proto_acc", "aux_acc", "local_head_acc", "global_head_acc",
               "global_acc", "loss", "miou", "proto_miou")


def summarise_eval(per_client: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Per-client test metrics -> mean and std over clients (the papers'
    metric) and the sample-weighted total (PFLlib's); segmentation's "miou" and
    "proto_miou" (per-client mIoU, weighted by test images) likewise."""
    out: dict[str, Any] = {}
    if not per_client:
        return out
    # in client order, not arrival order: the same results give the same means to the bit
    ordered = [m for _, m in sorted(per_client.items())]
    n = np.array([float(m.get("num_test", 0)) for m in ordered])
    for key in METRIC_KEYS:
        vals = np.array([float(m[key]) if m.get(key) is not None else np.nan
                         for m in ordered])
        ok = ~np.isnan(vals)
        if not ok.any():
            continue
        out[f"{key}_mean"] = float(vals[ok].mean())
        out[f"{key}_std"] = float(vals[ok].std())
        if n[ok].sum() > 0:
            out[f"{key}_weighted"] = float((vals[ok] * n[ok]).sum() / n[ok].sum())
    out["per_client"] = {str(c): {k: m[k] for k in METRIC_KEYS if k != "loss" and k in m}
                         for c, m in sorted(per_client.items())}
    return out
