"""Accuracy of every algorithm on the offline MNIST, FedProto's split.

    fedbus bench accuracy --seeds 3 --rounds 15 --out runs/accuracy

The acceptance table of the prototype algorithms: mean +- std over seeds of
the per-client mean test accuracy (the papers' metric), on the 10,000 offline
MNIST digits, 20 clients, FedProto's n-way k-shot split (n = 3, stdev 2,
k = 60 +- 10, what 10,000 digits allow for 20 clients' disjoint shots).

Two blocks:
- homogeneous: every client runs FedProto's CNN ("cnn"); Local, FedAvg,
  FedProx, FedProto, FedAvg-proto (Qiao et al.), MP-FedCL, proto-attention
  (Michieli & Ozay), FedTGP;
- heterogeneous: a model group (default FedTGP's offline example:
  cnn / cnn4 / resnet8 with 64-d features, client i runs group[i % 3]);
  every asked-for algorithm that averages no whole model (the registry's
  needs_same_model): Local, FedProto, FedTGP by default.

FedTGP's Table 2 baselines run when named (--algorithms; their parameters are
FedTGP's appendix settings, the modules' defaults unless noted):

    fedbus bench accuracy --no-homo --group cnn,cnn4,mlp \
        --algorithms local,fd,lg-fedavg,fml,fedkd,fedgh,fedproto,fedtgp

(resnet8 costs ~35x the CNN's step on a CPU: the 3-network group without it keeps
the 24 runs within the hour here.)

Every (algorithm, seed) is a real `fedbus run` (2 client nodes on the CPU).
Hyper-parameters are the offline examples' (examples/*-mnist-offline.toml):
the [algorithm] section of each algorithm's example (lam, mu, k, tau,
server_epochs, ...); local training as FedProto's (1 epoch, batch 8,
SGD lr 0.01, momentum 0.5) for every row, so that the rows differ only in
the algorithm. federation.seed = the seed (partition, sampling,
initialisation and training). Only the final evaluation runs
(eval_every = rounds); no message log, no embeddings. Rounds wait for every
client, but at most --hard-deadline-s (120 s; a normal round takes under a
minute): the server rejects an update whose prototypes hold NaN/Inf and its
client then never answers that round.

Columns: acc = the classifier head, proto_acc = nearest-prototype inference
(each algorithm's own rule; '-' where there is none), client std = the std
over clients of the final accuracy, averaged over seeds (acc / proto_acc).

--out keeps the run directories; a run whose summary.json already holds
every round is reused, so an interrupted benchmark resumes where it stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import tomllib

from fedbus.bench.common import mean_std as _mean_std
from fedbus.bench.common import out_dir, run_or_reuse

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "data" / "mnist-10k.npz"

HOMOGENEOUS = ["local", "fedavg", "fedprox", "fedproto", "fedavg-proto", "mpfedcl",
               "proto-attention", "fedtgp"]
# The baselines of FedTGP's Table 2 and FedProto's Table 1: not run unless --algorithms
# names them (`--algorithms local,fd,lg-fedavg,fml,fedkd,fedgh,fedproto,fedtgp --no-homo`
# is FedTGP's heterogeneous table).
BASELINES = ["fd", "lg-fedavg", "fml", "fedkd", "fedgh", "fedgen", "fedper", "fedrep"]
KNOWN = HOMOGENEOUS + BASELINES
LABELS = {"local": "Local", "fedavg": "FedAvg", "fedprox": "FedProx", "fedproto": "FedProto",
          "fedavg-proto": "FedAvg-proto (Qiao)", "mpfedcl": "MP-FedCL",
          "proto-attention": "Proto-attention", "fedtgp": "FedTGP", "fd": "FedDistill",
          "lg-fedavg": "LG-FedAvg", "fml": "FML", "fedkd": "FedKD", "fedgh": "FedGH",
          "fedgen": "FedGen", "fedper": "FedPer", "fedrep": "FedRep"}


def allows_model_group(name: str) -> bool:
    """Whether an algorithm runs on different networks per client (it averages no whole
    model): the heterogeneous block's members, read from the registry."""
    from fedbus.algorithms import get_algorithm

    return not get_algorithm(name).server.needs_same_model
# the offline examples' [algorithm] sections, should the examples folder be missing
FALLBACK_PARAMS: dict[str, dict[str, Any]] = {
    "fedprox": {"mu": 0.01}, "fedproto": {"lam": 1.0}, "fedavg-proto": {"every_round": True},
    "mpfedcl": {"k": 2, "tau": 0.07, "lr_decay": 0.95},
    "fedtgp": {"lam": 0.1, "server_epochs": 100},
}
DEFAULT_GROUP = ["cnn", "cnn4", "resnet8"]
DEFAULT_FEATURE_DIM = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--rounds", type=int, default=15, help="rounds for every run (default 15)")
    p.add_argument("--algorithms", default=",".join(HOMOGENEOUS),
                   help="comma-separated algorithms (default the prototype methods and "
                   f"their baselines: {','.join(HOMOGENEOUS)}; also {','.join(BASELINES)}); "
                   "the heterogeneous block runs those that allow different models")
    p.add_argument("--hetero", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the heterogeneous-model block (default on)")
    p.add_argument("--homo", action=argparse.BooleanOptionalAction, default=True,
                   help="run the homogeneous block (default on)")
    p.add_argument("--group", default=",".join(DEFAULT_GROUP),
                   help="model group of the heterogeneous block (default cnn,cnn4,resnet8)")
    p.add_argument("--feature-dim", type=int, default=DEFAULT_FEATURE_DIM,
                   help="common prototype dimension of the group (default 64)")
    p.add_argument("--param", action="append", default=[], metavar="ALGO.KEY=VALUE",
                   help="override one [algorithm] option of one algorithm, e.g. "
                   "fedtgp.lam=1.25 (repeatable; the value is read as TOML; the runs' "
                   "names carry the overrides, so they are not mixed with the defaults' runs)")
    p.add_argument("--clients", type=int, default=20, help="clients per run (default 20)")
    p.add_argument("--data", default=str(MNIST),
                   help="the offline MNIST npz (default ../shared/data/mnist-10k.npz)")
    p.add_argument("--nodes", type=int, default=2, help="client-node processes per run (default 2)")
    p.add_argument("--out", default=None,
                   help="folder for the run directories (kept; default a temporary folder)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--hard-deadline-s", type=float, default=120.0,
                   help="federation.hard_deadline_s: a round waiting for an update that "
                   "will never come (e.g. one the server rejected) closes after this long "
                   "(default 120; rounds here take under a minute)")


def example_params(name: str) -> dict[str, Any]:
    """The [algorithm] section of examples/NAME-mnist-offline.toml, less its name."""
    path = REPO / "examples" / f"{name}-mnist-offline.toml"
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return dict(FALLBACK_PARAMS.get(name, {}))
    return {k: v for k, v in raw.get("algorithm", {}).items() if k != "name"}


def parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """["fedtgp.lam=1.25", ...] -> {"fedtgp": {"lam": 1.25}}; ValueError naming the item."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        algo, dot, name = key.strip().rpartition(".")
        if not sep or not dot or not algo or not name:
            raise ValueError(f"--param {item!r}: expected ALGO.KEY=VALUE, e.g. fedtgp.lam=1.25")
        if algo not in KNOWN:
            raise ValueError(f"--param {item!r}: unknown algorithm {algo!r}; choose from "
                             f"{', '.join(KNOWN)}")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()  # a bare word: a string option such as proto_loss=paper
        out.setdefault(algo, {})[name] = value
    return out


def run_name(args: argparse.Namespace, algorithm: str, seed: int,
             group: list[str] | None) -> str:
    """hetero-fedtgp-s0, or e.g. hetero-cnn.cnn4.mlp-d512-fedtgp-lam1.25-s0 off the
    defaults (another group, feature dim or parameters)."""
    block = "homo"
    if group:
        dim = args.feature_dim
        block = "hetero" if group == DEFAULT_GROUP else "hetero-" + ".".join(group)
        block += "" if dim == DEFAULT_FEATURE_DIM else f"-d{dim}"
    extra = "".join(f"-{k}{v}" for k, v in sorted(args.params.get(algorithm, {}).items()))
    return f"{block}-{algorithm}{extra}-s{seed}"


def config(args: argparse.Namespace, algorithm: str, seed: int,
           group: list[str] | None) -> dict[str, dict[str, Any]]:
    model: dict[str, Any] = {"arch": "cnn"}
    if group:
        model = {"group": list(group), "feature_dim": args.feature_dim}
    return {
        "federation": {"clients": args.clients, "rounds": args.rounds, "seed": seed,
                       "eval_every": args.rounds, "start_timeout_s": 600.0,
                       "hard_deadline_s": args.hard_deadline_s},
        "data": {"dataset": f"npz:{args.data}", "partition": "nway-kshot", "ways": 3,
                 "ways_std": 2.0, "shots": 60, "shots_std": 10.0},
        "model": model,
        "algorithm": {"name": algorithm, **example_params(algorithm),
                      **args.params.get(algorithm, {})},
        "train": {"epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.5},
        "launch": {"nodes": args.nodes, "devices": ["cpu"], "threads": 1},
        "log": {"level": "warning", "messages": False, "embeddings": 0},
    }


def one_run(args: argparse.Namespace, out: Path, algorithm: str, seed: int,
            group: list[str] | None) -> dict[str, Any]:
    name = run_name(args, algorithm, seed, group)
    done = run_or_reuse(config(args, algorithm, seed, group), name, out=out,
                        timeout=args.timeout)
    run_dir, summary, wall, note = done.run_dir, done.summary, done.wall_s, done.note
    final = summary.get("final", {})
    by_arch = _by_arch(run_dir, group) if group else {}
    res = {"algorithm": algorithm, "seed": seed, "hetero": bool(group), "run_dir": str(run_dir),
           "wall_s": wall, "note": note, "acc": final.get("acc_mean"),
           "acc_std": final.get("acc_std"), "proto_acc": final.get("proto_acc_mean"),
           "proto_acc_std": final.get("proto_acc_std"), "by_arch": by_arch}
    proto = "" if res["proto_acc"] is None else f" proto_acc {100 * res['proto_acc']:.2f}"
    acc = float("nan") if res["acc"] is None else 100 * res["acc"]
    print(f"  {name}: acc {acc:.2f}{proto} ({wall:.0f} s){'  [' + note + ']' if note else ''}",
          flush=True)
    return res


def _by_arch(run_dir: Path, group: list[str]) -> dict[str, dict[str, float]]:
    """{arch: {"acc": mean over its clients, "proto_acc": ...}} of the final evaluation
    (client i runs group[i % len(group)])."""
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return {}
    last = next((json.loads(x) for x in reversed(lines) if "per_client" in json.loads(x)), {})
    out: dict[str, dict[str, float]] = {}
    for arch in dict.fromkeys(group):
        for key in ("acc", "proto_acc"):
            vals = [float(m[key]) for c, m in last.get("per_client", {}).items()
                    if group[int(c) % len(group)] == arch and m.get(key) is not None
                    and not math.isnan(float(m[key]))]
            if vals:
                out.setdefault(arch, {})[key] = sum(vals) / len(vals)
    return out


def arch_table(results: list[dict[str, Any]], algorithms: list[str],
               group: list[str]) -> list[str]:
    """Per architecture of the group: mean over seeds of its clients' mean accuracy."""
    archs = list(dict.fromkeys(group))
    lines = [f"  {'algorithm':<22}" + "".join(f"{a + ' (acc / proto)':>26}" for a in archs)]
    for algo in algorithms:
        rows = [r for r in results if r["algorithm"] == algo and r["hetero"]]
        if not rows:
            continue
        cells = []
        for a in archs:
            acc, _, _ = _mean_std([r.get("by_arch", {}).get(a, {}).get("acc") for r in rows])
            pro, _, n = _mean_std([r.get("by_arch", {}).get(a, {}).get("proto_acc")
                                   for r in rows])
            cells.append(f"{100 * acc:.2f} / " + (f"{100 * pro:.2f}" if n else "-"))
        lines.append(f"  {LABELS.get(algo, algo):<22}" + "".join(f"{c:>26}" for c in cells))
    return lines


def _cell(values: list[float | None]) -> str:
    m, sd, n = _mean_std(values)
    if n == 0:
        return "-"
    return f"{100 * m:6.2f} ± {100 * sd:5.2f}"


def table(results: list[dict[str, Any]], algorithms: list[str], hetero: bool) -> list[str]:
    lines = [(f"  {'algorithm':<22}{'acc (head)':>16}{'proto_acc':>18}"
              f"{'client std (acc / proto)':>28}")]
    for algo in algorithms:
        rows = [r for r in results if r["algorithm"] == algo and r["hetero"] == hetero]
        if not rows:
            continue
        sa, _, _ = _mean_std([r["acc_std"] for r in rows])
        sp, _, n_p = _mean_std([r["proto_acc_std"] for r in rows])
        std = f"{100 * sa:.2f} / " + (f"{100 * sp:.2f}" if n_p else "-")
        lines.append(f"  {LABELS.get(algo, algo):<22}{_cell([r['acc'] for r in rows]):>16}"
                     f"{_cell([r['proto_acc'] for r in rows]):>18}{std:>28}")
    return lines


def main_args(args: argparse.Namespace) -> int:
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    from fedbus.algorithms import available

    unknown = sorted(set(algorithms) - set(available()))
    if unknown:
        print(f"fedbus bench accuracy: unknown algorithm(s) {', '.join(unknown)}; "
              f"choose from {', '.join(KNOWN)}", file=sys.stderr)
        return 2
    if not Path(args.data).exists():
        print(f"fedbus bench accuracy: {args.data} not found (--data)", file=sys.stderr)
        return 2
    try:
        args.params = parse_params(args.param)
    except ValueError as err:
        print(f"fedbus bench accuracy: {err}", file=sys.stderr)
        return 2
    group = [g.strip() for g in args.group.split(",") if g.strip()]
    hetero_algos = [a for a in algorithms if allows_model_group(a)] if args.hetero else []
    out = out_dir(args.out, "accuracy")
    seeds = list(range(args.seeds))
    plan = ([(a, s, None) for a in (algorithms if args.homo else []) for s in seeds]
            + [(a, s, group) for a in hetero_algos for s in seeds])
    header = (f"fedbus bench accuracy: MNIST ({Path(args.data).name}), {args.clients} clients, "
              f"n-way k-shot (n = 3, stdev 2, k = 60 ± 10), {args.rounds} rounds x 1 epoch, "
              f"seeds {','.join(map(str, seeds))}; run dirs in {out}")
    print(header, flush=True)
    t0 = time.perf_counter()
    results = []
    for i, (algo, seed, grp) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}]", end="", flush=True)
        results.append(one_run(args, out, algo, seed, grp))
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{header}")
    print(f"total {time.perf_counter() - t0:.0f} s; mean ± std over seeds of the per-client "
          "mean accuracy (%)")
    for algo, opts in args.params.items():
        print(f"  {algo} options overridden: "
              + ", ".join(f"{k} = {v!r}" for k, v in sorted(opts.items())))
    if args.homo:
        print("homogeneous models (every client: cnn)")
        print("\n".join(table(results, algorithms, False)))
    if hetero_algos:
        print(f"heterogeneous models (group {' / '.join(group)}, "
              f"feature_dim {args.feature_dim}, client i runs group[i % {len(group)}])")
        print("\n".join(table(results, hetero_algos, True)))
        print("  by architecture (mean over seeds of the mean over that architecture's clients)")
        print("\n".join(arch_table(results, hetero_algos, group)))
    return 0


if __name__ == "__main__":  # python -m fedbus.bench.accuracy
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main_args(parser.parse_args()))
