"""`fedbus bench shamir`: the secret sharing alone, prime-field numpy (node/privacy/shamir)
beside pycryptodome's GF(2^128) Shamir, measured in the same run (the floor here is the
reference, and the figure is a ratio to it, as elsewhere in bench/).

For each threshold t (holders n = t / (1 - dropout), as secure aggregation sizes them):
  split    one client's two seeds (b_seed, s_seed) into n shares each
  combine  the server's rebuilding of S seeds from t shares each: pycryptodome combines one
           seed at a time; the numpy path is one product per set of holders (S seeds sharing
           their holders, as with no holder dropout; `--patterns` spreads them over that
           many holder sets)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--thresholds", default="7,22,50",
                   help="thresholds t to measure, comma-separated (default 7,22,50)")
    p.add_argument("--dropout", type=float, default=0.3,
                   help="holders n = ceil(t / (1 - dropout)) (default 0.3, secagg_dropout's)")
    p.add_argument("--seeds", type=int, default=1000,
                   help="seeds the server rebuilds in one round (default 1000: survivors)")
    p.add_argument("--patterns", type=int, default=1,
                   help="distinct holder sets among those seeds (default 1)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(t: int, n: int, seeds: int, patterns: int, repeats: int) -> dict[str, Any]:
    from Crypto.Protocol.SecretSharing import Shamir

    from fedbus.node.privacy import shamir

    holders = list(range(n))
    two = [os.urandom(16), os.urandom(16)]
    split_np = _best(lambda: shamir.split(two, t, holders), repeats)
    split_ref = _best(lambda: [Shamir.split(t, n, s) for s in two], max(1, repeats // 2))
    # the server: `seeds` secrets, in `patterns` groups by holder set
    secrets = [os.urandom(16) for _ in range(seeds)]
    per = -(-seeds // patterns)
    groups = [secrets[i:i + per] for i in range(0, seeds, per)]
    shared = [(g, shamir.split(g, t, holders)) for g in groups]
    picks = [holders[j:j + t] if j + t <= n else holders[-t:] for j in range(len(shared))]

    def combine_np():
        for (g, sh), pick in zip(shared, picks):
            idx = [holders.index(h) for h in pick]
            shamir.lagrange_at_zero.cache_clear()  # each pattern pays for its weights
            assert shamir.combine(pick, sh[idx]) == g

    combine_np_s = _best(combine_np, repeats)
    ref_shares = Shamir.split(t, n, secrets[0])
    one_ref = _best(lambda: Shamir.combine(ref_shares[:t]), max(1, repeats // 2))
    combine_ref_s = one_ref * seeds  # one combine per seed, each the same work
    return {"t": t, "n": n, "seeds": seeds, "patterns": len(shared),
            "split_ms": split_np * 1e3, "split_ref_ms": split_ref * 1e3,
            "combine_ms": combine_np_s * 1e3, "combine_ref_ms": combine_ref_s * 1e3,
            "combine_ref_one_ms": one_ref * 1e3}


def main_args(args: argparse.Namespace) -> int:
    import importlib.util
    import math
    import sys

    if importlib.util.find_spec("Crypto") is None:
        # secure aggregation no longer needs it; only this comparison does
        print("fedbus bench shamir: the pycryptodome reference is not installed: "
              "pip install 'fedbus[bench]'", file=sys.stderr)
        return 2
    try:
        ts = [int(x) for x in args.thresholds.split(",") if x.strip()]
    except ValueError:
        print(f"fedbus bench shamir: --thresholds must be integers, not {args.thresholds!r}",
              file=sys.stderr)
        return 2
    if not ts or min(ts) < 1 or not 0 <= args.dropout < 1 or args.seeds < 1 or \
            not 1 <= args.patterns <= args.seeds:
        print("fedbus bench shamir: need thresholds >= 1, 0 <= --dropout < 1, --seeds >= 1 "
              "and 1 <= --patterns <= --seeds", file=sys.stderr)
        return 2
    rows = []
    print(f"fedbus bench shamir: {args.seeds} seeds rebuilt a round in {args.patterns} holder "
          "set(s); pycryptodome (GF(2^128), one secret a call) measured beside, same run")
    print(f"  {'t':>4} {'n':>4}  {'split 2 seeds':>14} {'pycryptodome':>13} {'ratio':>7}   "
          f"{'combine all':>12} {'pycryptodome':>13} {'ratio':>7}")
    for t in ts:
        n = math.ceil(t / (1 - args.dropout))
        r = measure(t, n, args.seeds, args.patterns, args.repeats)
        rows.append(r)
        print(f"  {t:4d} {n:4d}  {r['split_ms']:11.3f} ms {r['split_ref_ms']:10.2f} ms "
              f"{r['split_ref_ms'] / r['split_ms']:6.0f}x   {r['combine_ms']:9.2f} ms "
              f"{r['combine_ref_ms']:10.0f} ms {r['combine_ref_ms'] / r['combine_ms']:6.0f}x")
    print("  (ratio: pycryptodome's time over the numpy path's; the pycryptodome combine is "
          "one measured combine times the seeds)")
    if args.json:
        print(json.dumps(rows))
    return 0
