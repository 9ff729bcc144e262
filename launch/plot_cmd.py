"""`fedbus plot RUN [RUN ...]`: PNG figures of one run, or several overlaid.

    fedbus plot runs/exp1                          # -> runs/exp1/plots/*.png
    fedbus plot runs/a runs/b --label FedProto --label FedAvg --out figs/
    fedbus plot --group-by algorithm.name runs/cmp   # a sweep: mean and min-max band per group

Needs matplotlib (`pip install 'fedbus[plot]'`). What each figure shows:
docs/PLOTS.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

INSTALL_HINT = "pip install 'fedbus[plot]'"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directory (several: overlaid)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the PNGs go (default: RUN/plots for one run or one sweep "
                   "directory with --group-by, ./plots-compare for several)")
    p.add_argument("--label", action="append", default=[], metavar="NAME",
                   help="legend name of the next RUN, in order (repeatable; default: the "
                   "run directory's name and its algorithm)")
    p.add_argument("--group-by", action="append", default=[], metavar="SECTION.KEY",
                   help="one mean accuracy curve per value of this config key (repeatable), "
                   "shaded from the group's lowest to its highest run; RUN may then also be "
                   "a sweep directory or a folder of runs (as for `fedbus table`)")
    p.add_argument("--no-tsne", dest="tsne", action="store_false",
                   help="skip the t-SNE of embeddings (the slowest figure)")
    p.add_argument("--tsne-points", type=int, default=2000, metavar="N",
                   help="at most N embeddings in the t-SNE, sampled at random (default 2000)")


def main(args: argparse.Namespace) -> int:
    from fedbus.analysis import plots

    if args.group_by:
        return main_grouped(args)
    if len(args.label) > len(args.runs):
        print(f"fedbus plot: {len(args.label)} --label for {len(args.runs)} run(s)",
              file=sys.stderr)
        return 2
    runs = []
    for i, path in enumerate(args.runs):
        try:
            runs.append(plots.load_run(path, args.label[i] if i < len(args.label) else None))
        except plots.NotARunDir as err:
            print(f"fedbus plot: {err}", file=sys.stderr)
            return 2
    if not args.label:
        plots.disambiguate(runs)
    if not plots.have_matplotlib():
        print(f"fedbus plot: matplotlib is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    if args.tsne_points < 10:
        print("fedbus plot: --tsne-points must be at least 10", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    elif len(runs) == 1:
        out = runs[0].path / "plots"
    else:
        out = Path("plots-compare")
    report = plots.plot_runs(runs, out, tsne=args.tsne, tsne_points=args.tsne_points)
    return say(report)


def main_grouped(args: argparse.Namespace) -> int:
    """--group-by: the accuracy figures, one mean curve and band per group."""
    from fedbus.analysis import plots
    from fedbus.analysis.table import SWEEP_FILE, TableError

    if args.label:
        print("fedbus plot: --label names runs; with --group-by a group is named by its "
              "values", file=sys.stderr)
        return 2
    try:
        groups, notes = plots.load_groups(args.runs, args.group_by)
    except (plots.NotARunDir, TableError) as err:
        print(f"fedbus plot: {err}", file=sys.stderr)
        return 2
    if not plots.have_matplotlib():
        print(f"fedbus plot: matplotlib is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    one_sweep = len(args.runs) == 1 and (Path(args.runs[0]) / SWEEP_FILE).is_file()
    out = Path(args.out) if args.out else (
        Path(args.runs[0]) / "plots" if one_sweep else Path("plots-compare"))
    return say(plots.plot_groups(groups, out, args.group_by))


def say(report) -> int:
    """Print what a plotting Report wrote, noted and skipped; 1 when it wrote nothing."""
    for path in report.written:
        print(f"wrote {path}")
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    for why in report.skipped:
        print(f"skipped {why}", file=sys.stderr)
    if not report.written:
        print("fedbus plot: nothing to plot (no rounds recorded, no embeddings)",
              file=sys.stderr)
        return 1
    return 0
