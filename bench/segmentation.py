"""Federated semantic segmentation on the generated shapes-seg set, over seeds.

    fedbus bench segmentation --seeds 3 --out runs/segmentation

FedAvg against proto-attention (Michieli & Ozay, who first federate a segmentation
model: Pascal VOC 2012 with DeepLab-V3+, Sec. 5.2), here offline: shapes-seg (2,000 RGB
64x64 images of five textured shape classes on smooth backgrounds, docs/DATA.md), a
small DeepLab-V3+ ("deeplab" = deeplab:resnet8, fedbus.models.segnet), 10 clients split
by a Dirichlet (alpha 0.5) over each image's dominant object class, every client in every
round, 20 rounds of 1 local epoch (SGD lr 0.05, momentum 0.9, batch 16: the settings of
examples/segmentation-shapes.toml). federation.seed = the seed (data generation,
partition, initialisation and training).

Columns (final evaluation, mean +- std over seeds of the mean over clients): mIoU and
pixel accuracy of the global model's head on each client's test split (background
included in the mIoU), and for proto-attention the same for nearest-prototype inference
per feature pixel ("proto"). Every (algorithm, seed) is a real `fedbus run`; --out keeps
the run directories and a complete run there is reused (fedbus.bench.common.run_or_reuse).
Time: a round of the defaults takes ~20 s on two shared CPU cores (FedAvg; proto-attention
adds two prototype passes over the training data), so the default 2 x 3 runs take
roughly 45-60 minutes.

Michieli & Ozay's Fig. 5 varies both the label skew (alpha in {0.01, 0.1, 1}) and the
share δ of clients doing partial work (0, 50, 80 %): `--alpha 0.1 --partial 0.5` is one of
its cells (system.partial_work with partial_fraction δ: a partial client runs F' ~ U[0, F]
epochs; FedAvg drops partial updates as the paper's FedAvg does, algorithm.partial =
"drop", and proto-attention aggregates them, its toleration; `--tolerate` makes FedAvg
aggregate them too, Table 3's "FedAvg + toleration"). Below the table, each other
algorithm against the first one (FedAvg by default), seed by seed: the mean paired
difference in mIoU and its 95 % t interval (a seed fixes the data, partition and initial
model for every algorithm). `--json PATH` writes those verdicts in `bench reproduce
--json`'s shape, so `fedbus bench reproduce verdicts --from PATH` puts them in the one table
beside the recipes'.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from fedbus.bench.common import mean_std, out_dir, run_or_reuse

ALGORITHMS = ["fedavg", "proto-attention"]
LABELS = {"fedavg": "FedAvg", "proto-attention": "Proto-attention", "fedproto": "FedProto",
          "fedavg-proto": "FedAvg-proto (Qiao)", "fedtgp": "FedTGP", "local": "Local"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    p.add_argument("--rounds", type=int, default=20, help="rounds for every run (default 20)")
    p.add_argument("--algorithms", default=",".join(ALGORITHMS),
                   help=f"comma-separated algorithms (default {','.join(ALGORITHMS)})")
    p.add_argument("--clients", type=int, default=10, help="clients per run (default 10)")
    p.add_argument("--alpha", type=float, default=0.5,
                   help="Dirichlet concentration over dominant classes (default 0.5)")
    p.add_argument("--images", type=int, default=2000,
                   help="shapes-seg images generated (default 2000)")
    p.add_argument("--image-size", type=int, default=64, help="image side (default 64)")
    p.add_argument("--arch", default="deeplab",
                   help="deeplab (= deeplab:resnet8) or deeplab:mobilenetv2")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round (default 1)")
    p.add_argument("--partial", type=float, default=0.0, metavar="DELTA",
                   help="share of tasks run as partial work, F' ~ U[0, F] epochs (Michieli & "
                        "Ozay's δ; default 0: none); FedAvg then drops partial updates")
    p.add_argument("--tolerate", action="store_true",
                   help="with --partial: FedAvg aggregates partial updates too (Table 3's "
                        "'FedAvg + toleration') instead of dropping them")
    p.add_argument("--nodes", type=int, default=2, help="client-node processes (default 2)")
    p.add_argument("--out", default=None,
                   help="folder for the run directories (kept; default a temporary folder)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the paired mIoU verdicts as a table that `fedbus bench "
                        "reproduce verdicts --from PATH` merges with the recipes'")


def sections(args: argparse.Namespace, algorithm: str, seed: int) -> dict[str, dict[str, Any]]:
    """One run's config, as examples/segmentation-shapes.toml with the bench's settings."""
    cfg: dict[str, dict[str, Any]] = {
        "federation": {"clients": args.clients, "rounds": args.rounds, "seed": seed,
                       "eval_every": args.rounds, "start_timeout_s": 120.0},
        "data": {"dataset": "shapes-seg", "partition": "dirichlet", "alpha": args.alpha,
                 "min_samples": max(1, min(40, args.images // (4 * args.clients))),
                 "image_size": args.image_size, "domain_samples": args.images},
        "model": {"arch": args.arch},
        "algorithm": {"name": algorithm},
        "train": {"epochs": args.epochs, "batch_size": 16, "lr": 0.05, "momentum": 0.9},
        "log": {"messages": False, "embeddings": 0},
        "launch": {"nodes": args.nodes},
    }
    if args.partial > 0:
        cfg["system"] = {"partial_work": True, "partial_fraction": args.partial}
        if algorithm == "fedavg" and not args.tolerate:  # the paper's FedAvg drops them
            cfg["algorithm"]["partial"] = "drop"
    return cfg


def run_name(args: argparse.Namespace, algorithm: str, seed: int) -> str:
    partial = f"-d{args.partial:g}" if args.partial > 0 else ""
    if partial and args.tolerate and algorithm == "fedavg":
        partial += "-tolerate"
    return (f"seg-{algorithm}-{args.arch.replace(':', '_')}-c{args.clients}-a{args.alpha:g}"
            f"-n{args.images}-s{args.image_size}-r{args.rounds}-e{args.epochs}{partial}"
            f"-seed{seed}")


def _cell(values: list[float | None]) -> str:
    m, sd, n = mean_std(values)
    return "-" if n == 0 else f"{100 * m:6.2f} ± {100 * sd:5.2f}"


def table(results: list[dict[str, Any]], algorithms: list[str]) -> list[str]:
    keys = (("miou", "mIoU"), ("acc", "pixel acc"), ("proto_miou", "proto mIoU"),
            ("proto_acc", "proto pixel acc"))
    lines = [f"  {'algorithm':<20}" + "".join(f"{name:>18}" for _, name in keys) + f"{'n':>4}"]
    for algo in algorithms:
        rows = [r for r in results if r["algorithm"] == algo]
        if rows:
            lines.append(f"  {LABELS.get(algo, algo):<20}"
                         + "".join(f"{_cell([r.get(k) for r in rows]):>18}" for k, _ in keys)
                         + f"{len(rows):>4}")
    return lines


def _by_seed(results: list[dict[str, Any]], algo: str, key: str = "miou") -> dict[int, float]:
    """seed -> `key` of `algo`'s runs that have it."""
    return {r["seed"]: r[key] for r in results
            if r["algorithm"] == algo and r.get(key) is not None}


def paired_lines(results: list[dict[str, Any]], algorithms: list[str],
                 key: str = "miou") -> list[str]:
    """Each algorithm after the first against the first, seed by seed (mean difference of
    `key` in points and its 95 % t interval)."""
    from fedbus.analysis.table import paired_difference

    base = algorithms[0]
    lines = []
    for algo in algorithms[1:]:
        d = paired_difference(_by_seed(results, algo, key), _by_seed(results, base, key))
        name = f"{LABELS.get(algo, algo)} − {LABELS.get(base, base)}"
        if d is None:
            lines.append(f"  {name}: no seed has both")
        elif d.low is None:
            lines.append(f"  {name}: {100 * d.mean:+.2f} (one seed, no interval)")
        else:
            lines.append(f"  {name}: {100 * d.mean:+.2f} [{100 * d.low:+.2f}, "
                         f"{100 * d.high:+.2f}] over {d.pairs} seeds")
    return lines


def verdict_doc(args: argparse.Namespace, results: list[dict[str, Any]],
                algorithms: list[str]) -> dict[str, Any]:
    """The paper's ordering (Fig. 5: each other algorithm above the first, FedAvg) judged
    on mIoU seed by seed, in the shape `fedbus bench reproduce --json` writes, so that
    `fedbus bench reproduce verdicts` puts these pairs in the one table (its "recipe"
    column names this bench and the settings that differ from its defaults)."""
    from fedbus.bench.reproduce import paired_verdict

    seeds = sorted({r["seed"] for r in results})
    values = {}
    for algo in algorithms:
        miou = _by_seed(results, algo)
        values[f"{LABELS.get(algo, algo)}, mIoU"] = [
            100 * miou[s] if s in miou else None for s in seeds]
    base = f"{LABELS.get(algorithms[0], algorithms[0])}, mIoU"
    order = [f"{label} > {base}" for label in list(values)[1:]]
    paired = paired_verdict(order, values, seeds)[2]
    settings = [f"alpha {args.alpha:g}", f"δ = {100 * args.partial:g} %"]
    if args.tolerate and args.partial > 0:
        settings.append("FedAvg tolerating partial work")
    if args.rounds != 20:
        settings.append(f"{args.rounds} rounds")
    if args.arch != "deeplab":
        settings.append(args.arch)
    return {"recipe": "segmentation", "overrides": settings, "seeds": seeds,
            "results": results, "ordering": {"ours": {"paired": paired}}}


def main_args(args: argparse.Namespace) -> int:
    from fedbus.algorithms import available

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = sorted(set(algorithms) - set(available()))
    if unknown or not algorithms:
        print(f"fedbus bench segmentation: unknown algorithm(s) {', '.join(unknown) or '-'}; "
              f"choose from {', '.join(sorted(available()))}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.rounds < 1 or args.clients < 1 or args.images < args.clients:
        print("fedbus bench segmentation: need --seeds, --rounds, --clients >= 1 and "
              "--images >= --clients", file=sys.stderr)
        return 2
    if not 0.0 <= args.partial <= 1.0:
        print(f"fedbus bench segmentation: --partial is a share in [0, 1], not {args.partial:g}",
              file=sys.stderr)
        return 2
    if args.tolerate and args.partial == 0:
        print("fedbus bench segmentation: --tolerate needs --partial (with no partial work "
              "there is nothing to tolerate)", file=sys.stderr)
        return 2
    out = out_dir(args.out, "segmentation")
    seeds = list(range(args.seeds))
    print(f"fedbus bench segmentation: shapes-seg ({args.images} images, {args.image_size} px), "
          f"{args.arch}, {args.clients} clients, dirichlet alpha {args.alpha:g}, "
          f"{args.rounds} rounds x {args.epochs} epoch(s), partial work δ = "
          f"{100 * args.partial:g} %, seeds {','.join(map(str, seeds))}; "
          f"run dirs in {out}", flush=True)
    results = []
    for algo in algorithms:
        for seed in seeds:
            name = run_name(args, algo, seed)
            try:
                outcome = run_or_reuse(sections(args, algo, seed), name, out=out,
                                       timeout=args.timeout)
            except (RuntimeError, TimeoutError) as err:
                print(f"  {algo} seed {seed}: failed ({err})", flush=True)
                continue
            final = outcome.summary.get("final", {})
            row = {"algorithm": algo, "seed": seed,
                   **{k: final.get(f"{k}_mean") for k in ("miou", "acc", "proto_miou",
                                                          "proto_acc")}}
            results.append(row)
            took = "reused" if math.isnan(outcome.wall_s) else f"{outcome.wall_s:.0f} s"
            note = outcome.note if outcome.note not in ("", "reused") else ""
            shown = ", ".join(f"{k} {100 * v:.2f}" for k, v in row.items()
                              if k not in ("algorithm", "seed") and v is not None)
            print(f"  {algo} seed {seed}: {shown} ({took}{'; ' + note if note else ''})",
                  flush=True)
    print()
    print("final evaluation, % (mean ± std over seeds of the mean over clients):")
    for line in table(results, algorithms):
        print(line)
    if len(algorithms) > 1:
        print(f"\nmIoU, paired by seed against {LABELS.get(algorithms[0], algorithms[0])} "
              "(mean difference, points, and 95 % t interval):")
        for line in paired_lines(results, algorithms):
            print(line)
    (out / "segmentation.json").write_text(json.dumps(results, indent=2))
    if args.json and results:
        doc = verdict_doc(args, results, algorithms)
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0 if results else 1
