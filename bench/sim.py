"""`fedbus bench sim`: many seeds of the deterministic simulation of the whole federation.

    fedbus bench sim --seeds 0-299                 # 300 federations, 3 faults each
    fedbus bench sim --seeds 0-99 --faults 6 --rounds 10
    fedbus bench sim --seeds 17-17 --trace         # replay one seed, printing its faults

Each seed is one federation (a broker, a server, client nodes running the no-op algorithm,
or --algorithm fedproto on digits) in one process, on a simulated clock, over a simulated
network that delays, drops, duplicates and reorders frames, under --faults faults drawn
from the seed (node, server and broker kills with restarts, a server killed between its
record and its checkpoint, node stops, link cuts): fedbus.bench.simworld. Every invariant
of fedbus.bench.simcheck is checked on every seed's history. The same seed gives the same
trace (a SHA-256 over every frame delivered and every fault, in order, with its simulated
time), so a violating seed replays bit for bit with the command printed beside it.

Prints seeds per second, faults fired per seed, frames per seed and every violating seed;
exit 1 on a violation, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", default="0-99", metavar="A-B",
                   help="the seeds to run, inclusive (default 0-99); one seed: 17-17 or 17")
    p.add_argument("--faults", type=int, default=3, help="faults drawn per seed (default 3)")
    p.add_argument("--rounds", type=int, default=6, help="rounds per federation (default 6)")
    p.add_argument("--clients", type=int, default=4, help="clients (default 4)")
    p.add_argument("--nodes", type=int, default=2, help="client nodes (default 2)")
    p.add_argument("--relays", type=int, default=0,
                   help="relays, each with its own site broker, the nodes spread below them "
                   "(default 0: the nodes on the server's broker)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="sync rounds (default) or async FedBuff")
    p.add_argument("--batch", choices=("off", "auto"), default=None,
                   help="bus.batch for every seed (default: bus.batch's default)")
    p.add_argument("--algorithm", choices=("noop", "fedproto"), default="noop",
                   help="noop (default) or fedproto (real training on digits, slower)")
    p.add_argument("--plant", default=None, metavar="DEFECT",
                   help="plant a defect in the production code for the run, to see it caught: "
                   "duplicate, dedup-off, record-lost or double-fold (fedbus.bench.simplant)")
    p.add_argument("--trace", action="store_true",
                   help="print each seed's faults as they fire and its trace hash")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")


def parse_seeds(text: str) -> range:
    """"A-B" (inclusive) or "A" -> a range; ValueError with a one-line reason."""
    parts = text.split("-")
    try:
        if len(parts) == 1:
            a = b = int(parts[0])
        elif len(parts) == 2:
            a, b = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--seeds must be A-B or A (non-negative integers), not {text!r}") \
            from None
    if a < 0 or b < a:
        raise ValueError(f"--seeds {text!r}: need 0 <= A <= B")
    return range(a, b + 1)


def replay_command(seed: int, args: argparse.Namespace) -> str:
    extra = "".join(f" --{k} {getattr(args, k)}" for k, d in
                    (("faults", 3), ("rounds", 6), ("clients", 4), ("nodes", 2),
                     ("relays", 0), ("mode", "sync"), ("batch", None), ("plant", None),
                     ("algorithm", "noop")) if getattr(args, k) != d)
    return f"fedbus bench sim --seeds {seed}-{seed}{extra} --trace"


def run_seed(seed: int, args: argparse.Namespace, say=None):
    from fedbus.bench.simworld import World

    world = World(seed, faults=args.faults, rounds=args.rounds, clients=args.clients,
                  nodes=args.nodes, relays=args.relays, algorithm=args.algorithm,
                  mode=args.mode, batch=args.batch, record=say)
    try:
        return world.run()
    finally:
        world.close()


def main_args(args: argparse.Namespace) -> int:
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as err:
        print(f"fedbus bench sim: {err}", file=sys.stderr)
        return 2
    for key, low in (("faults", 0), ("rounds", 1), ("clients", 1), ("nodes", 1)):
        if getattr(args, key) < low:
            print(f"fedbus bench sim: --{key} must be at least {low}", file=sys.stderr)
            return 2
    from fedbus.bench.simplant import PLANTS, planted

    if args.plant is not None and args.plant not in PLANTS:
        print(f"fedbus bench sim: --plant {args.plant!r} is not one of {', '.join(PLANTS)}",
              file=sys.stderr)
        return 2
    if not 0 <= args.relays <= args.nodes:
        print("fedbus bench sim: --relays must lie in 0..--nodes", file=sys.stderr)
        return 2
    if args.nodes > args.clients:
        print("fedbus bench sim: --nodes must not exceed --clients", file=sys.stderr)
        return 2
    from fedbus.broker.log import configure_logging

    configure_logging(level="error")
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results, bad = [], []
    started, cpu = time.perf_counter(), time.process_time()
    try:
        with planted(args.plant):
            for seed in seeds:
                if args.trace:
                    print(f"seed {seed}:")
                res = run_seed(seed, args, say=print if args.trace else None)
                results.append(res)
                if args.trace:
                    for f in res.faults:
                        if f.fired_at < 0:
                            print(f"  (not fired: {f.kind} {f.target} after version "
                                  f"{f.at_version}: {f.note or 'the run ended first'})")
                    print(f"  trace {res.trace}  rounds {res.rounds_done}  frames {res.frames}  "
                          f"simulated {res.sim_s:.1f} s")
                if res.violations:
                    bad.append(res)
                    print(f"seed {seed}: {len(res.violations)} violation(s), trace "
                          f"{res.trace[:16]}")
                    for v in res.violations[:10]:
                        print(f"  {v}")
                    print(f"  replay: {replay_command(seed, args)}")
    finally:
        torch.set_num_threads(threads)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    n = len(results)
    fired = sum(r.faults_fired for r in results)
    print(f"seeds {seeds.start}-{seeds.stop - 1}: {n} run, {n - len(bad)} clean, {len(bad)} "
          f"violating; {n / wall:.1f} seeds/s ({wall:.1f} s; {cpu / max(n, 1):.3f} CPU s a seed)")
    print(f"faults fired per seed {fired / max(n, 1):.2f} (of {args.faults} drawn), frames "
          f"per seed {sum(r.frames for r in results) / max(n, 1):.0f}, dropped "
          f"{sum(r.dropped for r in results)}, duplicated {sum(r.duplicated for r in results)}, "
          f"simulated {sum(r.sim_s for r in results):.0f} s")
    by_invariant: dict[str, list[int]] = {}
    for r in bad:
        for name in sorted({v.invariant for v in r.violations}):
            by_invariant.setdefault(name, []).append(r.seed)
    for name, hit in sorted(by_invariant.items()):
        print(f"violated {name}: seeds {hit[:20]}" + (" ..." if len(hit) > 20 else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "seeds": [seeds.start, seeds.stop - 1], "faults": args.faults,
            "rounds": args.rounds, "seeds_per_s": n / wall, "wall_s": wall, "cpu_s": cpu,
            "faults_fired_per_seed": fired / max(n, 1),
            "results": [{"seed": r.seed, "trace": r.trace, "faults": r.faults_fired,
                         "frames": r.frames, "rounds": r.rounds_done,
                         "violations": [str(v) for v in r.violations]} for r in results]},
            indent=2))
    return 1 if bad else 0
