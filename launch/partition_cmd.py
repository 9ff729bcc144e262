"""`fedbus partition CONFIG.toml [--set section.key=value ...] (--out PATH.json | --show [--png PATH])`

Builds the partition a run of CONFIG would use (dataset, [data] scheme, federation.clients,
federation.seed) and either writes it as a partition file, the JSON that
``partition = "file:PATH.json"`` reads back (and other frameworks can read:
{"num_clients": N, "clients": [{"train": [...], "test": [...]}, ...]}), or prints a
per-client class-count table and, when matplotlib is installed, writes a heat-map PNG.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="run configuration (TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override a config key (repeatable)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", metavar="PATH.json", help="write the partition file")
    mode.add_argument("--show", action="store_true",
                      help="print per-client class counts (and write a heat-map PNG)")
    parser.add_argument("--png", metavar="PATH",
                        help="with --show: heat-map file (default partition.png)")


def class_count_table(counts, test_counts=None) -> str:
    """Text table: one row per client, one column per class, then train/test totals."""
    import numpy as np

    counts = np.asarray(counts)
    n_clients, n_classes = counts.shape
    w = max(4, len(str(int(counts.max(initial=0)))) + 1)
    head = f"{'client':>6} |" + "".join(f"{c:>{w}}" for c in range(n_classes)) + " |" + \
        f"{'train':>7}" + (f"{'test':>7}" if test_counts is not None else "") + f"{'classes':>8}"
    lines = [head, "-" * len(head)]
    for i in range(n_clients):
        row = f"{i:>6} |" + "".join(f"{int(v):>{w}}" if v else f"{'.':>{w}}" for v in counts[i])
        row += f" |{int(counts[i].sum()):>7}"
        if test_counts is not None:
            row += f"{int(np.asarray(test_counts)[i].sum()):>7}"
        lines.append(row + f"{int((counts[i] > 0).sum()):>8}")
    total = counts.sum(0)
    lines.append("-" * len(head))
    lines.append(f"{'all':>6} |" + "".join(f"{int(v):>{w}}" for v in total) +
                 f" |{int(total.sum()):>7}" +
                 (f"{int(np.asarray(test_counts).sum()):>7}" if test_counts is not None else ""))
    return "\n".join(lines)


def write_heatmap(counts, path: str | Path, title: str = "") -> bool:
    """Write a clients x classes heat-map PNG; False (nothing written) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    import numpy as np

    counts = np.asarray(counts)
    n_clients, n_classes = counts.shape
    fig, ax = plt.subplots(figsize=(min(2 + 0.45 * n_classes, 20),
                                    min(1.5 + 0.3 * n_clients, 30)))
    im = ax.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    if n_classes <= 30:
        ax.set_xticks(range(n_classes))
    if n_clients <= 40:
        ax.set_yticks(range(n_clients))
    ax.set_title(title or "train samples per class")
    fig.colorbar(im, ax=ax, label="train samples")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_partition(data_cfg: Mapping[str, Any], num_clients: int, seed: int, *,
                  out: str | None = None, show: bool = False, png: str | None = None,
                  stream: TextIO | None = None) -> int:
    """The command's work, without config loading (so it can be used and tested directly)."""
    from fedbus.node.data import FederatedData, save_partition

    stream = stream or sys.stdout
    fd = FederatedData(data_cfg, num_clients, seed)
    scheme = fd.config["partition"]
    if out:
        save_partition(fd.parts, out, meta={"dataset": fd.dataset.name, "partition": scheme,
                                            "seed": fd.seed, "size": len(fd.dataset)})
        print(f"wrote {out}: {fd.num_clients} clients, {fd.dataset.name} "
              f"({len(fd.dataset)} samples), partition {scheme}, seed {fd.seed}", file=stream)
    if show:
        counts = fd.class_counts()
        print(f"{fd.dataset.name}: {len(fd.dataset)} samples, {fd.num_classes} classes, "
              f"in_shape {list(fd.in_shape)}; partition {scheme}, {fd.num_clients} clients, "
              f"seed {fd.seed}", file=stream)
        print(class_count_table(counts, fd.class_counts("test")), file=stream)
        target = png or "partition.png"
        if write_heatmap(counts, target, f"{fd.dataset.name} / {scheme} / seed {fd.seed}"):
            print(f"heat-map: {target}", file=stream)
        else:
            print("heat-map skipped: matplotlib is not installed (pip install 'fedbus[plot]')",
                  file=stream)
    return 0


def main(args: argparse.Namespace) -> int:
    from fedbus.node.config import load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as err:  # ConfigError is a ValueError
        print(f"fedbus partition: {err}", file=sys.stderr)
        return 2
    try:
        return run_partition(cfg.data, cfg.federation.clients, cfg.federation.seed,
                             out=args.out, show=args.show, png=args.png)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"fedbus partition: {err}", file=sys.stderr)
        return 1
