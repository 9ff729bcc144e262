"""Finding the client whose masked input spoils securely aggregated rounds (issue 42 Why 7).

Under secure aggregation the server sees only each round's sum. A client that masks random
bytes, or a value outside the ring, makes the unmasked sum fall out of bounds while every
revealed share is consistent: the round fails, and no single input may be looked at. Left
alone, such a client fails every round it is sampled in. The engine therefore runs an
adaptive group test across the following rounds (binary splitting; Hwang 1972), with
sub-cohorts that never fall below the run's minimum cohort:

* candidates: at first, the survivors of the failed round; they include a client that
  spoiled it.
* While the candidates can be split, each round's cohort is a random part of them of at
  least the minimum cohort and about half their number (drawn from the server's secret
  randomness, so a client cannot tell a test from an ordinary round); every other client
  sits the round out. A failed round's survivors, a part of the candidates, include a
  spoiler, so they become the candidates: the candidates always hold a spoiler, however
  many there are and whatever they do in between. A clean round teaches nothing (a spoiler
  may behave while tested) and the next draws another part.
* Candidates no more than the minimum cohort (no part of them is both a lawful cohort and
  smaller): all of them are excluded from sampling for the rest of the run, and named in
  the record and the log. A spoiler is among them; up to min_cohort - 1 honest clients may
  be too, the price of never summing fewer inputs than a plain secure round may.

What it costs: a client that spoils every round it is in is excluded after about
2 log2(n / m) rounds, half of them failed (n: the failed round's survivors, m: the minimum
cohort), during which the clients outside the candidates do not train. A per-client
validity proof (Bell et al. 2023, ACORN) would name the spoiler alone and let the others
train; it is not built.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["CulpritSearch"]


class CulpritSearch:
    """The group test's state: candidates, the part tested this round, who was excluded.

    min_cohort: the fewest inputs a round may sum (the run's min_clients, at least 2)."""

    def __init__(self, seed: int | np.random.SeedSequence, min_cohort: int):
        self.rng = np.random.default_rng(seed)
        self.min_cohort = max(2, int(min_cohort))
        self.candidates: set[int] | None = None  # None: no search under way
        self.tested: set[int] = set()  # the part this round's cohort is drawn from
        self.failed_rounds: list[int] = []  # rounds of the search under way
        self.excluded: dict[int, str] = {}  # client -> why

    @property
    def searching(self) -> bool:
        return self.candidates is not None

    def eligible(self, live: Iterable[int]) -> list[int]:
        """The live clients sampling may draw from: the excluded never again."""
        return [c for c in live if c not in self.excluded]

    def cohort(self, candidates: list[int], k: int,
               sample: Callable[[list[int], int], list[int]]) -> list[int]:
        """This round's cohort from the sampling candidates. Outside a search: sample(
        candidates, k). In one: a random part of the search's candidates that are live
        (CulpritSearch's docstring), each kept as sample keeps its candidates."""
        self.tested = set()
        if self.candidates is None:
            return sample(candidates, k)
        pool = sorted(c for c in candidates if c in self.candidates)
        part = max(self.min_cohort, len(pool) // 2)
        if part >= len(pool):  # candidates left the run: the live ones cannot be split
            if len(pool) < self.min_cohort:  # nor summed: the search ends unfinished (a
                self.candidates, self.failed_rounds = None, []  # returning spoiler
                return sample(candidates, k)  # starts another)
            return sample(pool, len(pool))
        self.tested = {int(c) for c in self.rng.choice(pool, size=part, replace=False)}
        return sample(sorted(self.tested), part)

    def on_failed(self, round_: int, survivors: Iterable[int]) -> list[int]:
        """A round whose unmasked sum was out of bounds with every share consistent; the
        clients excluded now (the search's last candidates), else []."""
        alive = {int(c) for c in survivors}
        if self.candidates is None or not alive <= self.candidates:
            self.candidates, self.failed_rounds = alive, []  # a new search
        else:
            self.candidates = alive
        self.failed_rounds.append(int(round_))
        if len(self.candidates) > self.min_cohort:
            return []
        culprits = sorted(self.candidates)
        why = ("secure aggregation: a masked input among these clients spoiled the sum of "
               f"rounds {', '.join(map(str, self.failed_rounds))}, each a part of the last "
               f"({len(culprits)} clients: the minimum cohort cannot be split)")
        for c in culprits:
            self.excluded[c] = why
        self.candidates, self.tested, self.failed_rounds = None, set(), []
        return culprits

    def record(self) -> dict[str, Any]:
        """The round record's view ("secagg" -> "search"), {} when idle and none excluded."""
        out: dict[str, Any] = {}
        if self.candidates is not None:
            out["candidates"] = len(self.candidates)
            out["tested"] = len(self.tested)
        if self.excluded:  # (why: the engine's "clients excluded" event)
            out["excluded"] = [f"c{c}" for c in sorted(self.excluded)]
        return out

    def state_dict(self) -> dict[str, Any]:
        # (PCG64's state holds 128-bit integers, which msgpack cannot carry: JSON text can)
        return {"rng": json.dumps(self.rng.bit_generator.state),
                "candidates": None if self.candidates is None else sorted(self.candidates),
                "failed_rounds": list(self.failed_rounds),
                "excluded": {str(c): why for c, why in self.excluded.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = json.loads(state["rng"])
        cand = state.get("candidates")
        self.candidates = None if cand is None else {int(c) for c in cand}
        self.failed_rounds = [int(r) for r in state.get("failed_rounds", [])]
        self.excluded = {int(c): str(why) for c, why in state.get("excluded", {}).items()}
