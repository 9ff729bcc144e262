"""`fedbus table RUN...`: one table across run directories, grouped by config keys.

For each group: n, mean and std of each final metric (summary.json), and with
--baseline the paired difference against the baseline group with its 95 % interval
(fedbus.analysis.table computes them; this module reads arguments and writes text,
CSV and Markdown). Incomplete runs, and runs without a metric, are listed below it.
"""
from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

from fedbus.analysis.table import (PAIR_KEY, Cell, Table, TableError, build_table,
                                   select_runs)

EXAMPLES = """\
examples:
  fedbus table runs/cmp                                   # a sweep: grouped by its grid
  fedbus table runs/cmp --baseline fedavg                 # + paired difference, 95 % CI
  fedbus table runs/cmp/fedavg-s0 runs/cmp/fedavg-s1 runs/cmp/fedproto-s0 \\
      runs/cmp/fedproto-s1 --group-by algorithm.name      # chosen runs, seeds 0 and 1
  fedbus table runs/lr --group-by algorithm.name --group-by train.lr --baseline fedavg \\
      --metric acc --metric best.acc --metric wall_s --csv lr.csv --markdown lr.md

RUN is a run directory, a sweep directory (its sweep.json lists its runs) or a folder
of run directories. Groups: --group-by keys (default: the sweeps' grid keys, else
algorithm.name). Metrics (default: acc, proto_acc where present) name summary.json
values: a bare name is final.NAME or final.NAME_mean (acc = final.acc_mean), a dotted
one a path (best.acc, final.acc_weighted), top-level ones as they are (wall_s,
bytes_up, rounds_completed). std is the sample std over runs (n - 1). --baseline V
compares each group with the one whose first --group-by value is V (other keys equal):
the mean of the per-seed differences (runs paired by --pair-by) and its 95 % Student t
interval, in percentage points for accuracies. A run that is incomplete (no
summary.json, fewer rounds than configured) or lacks a metric is listed, not counted."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="run directory, sweep directory, or folder of run directories")
    p.add_argument("--group-by", action="append", default=[], metavar="SECTION.KEY",
                   help="config key whose values make the groups (repeatable)")
    p.add_argument("--metric", action="append", default=[], metavar="NAME",
                   help="summary.json metric (repeatable; default: acc, proto_acc)")
    p.add_argument("--pair-by", default=PAIR_KEY, metavar="SECTION.KEY",
                   help=f"config key pairing runs across groups (default {PAIR_KEY})")
    p.add_argument("--baseline", default=None, metavar="VALUE",
                   help="value of the first --group-by key that the others are compared "
                   "with (paired difference, 95 %% CI)")
    p.add_argument("--csv", default=None, metavar="PATH",
                   help="also write the table as CSV (one line per group and metric)")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="also write the table as Markdown, with its notes")


def main(args: argparse.Namespace) -> int:
    try:
        selection = select_runs(args.runs)
        group_by = args.group_by or selection.grid_keys or ["algorithm.name"]
        table = build_table(selection.runs, group_by, args.metric, pair_by=args.pair_by,
                            baseline=args.baseline)
    except TableError as err:
        print(f"fedbus table: {err}", file=sys.stderr)
        return 2
    table.notes[:0] = selection.notes
    print_table(table)
    for path, text in ((args.csv, csv_text), (args.markdown, markdown)):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(text(table))
            print(f"wrote {path}")
    return 0


def print_table(table: Table) -> None:
    from rich.console import Console
    from rich.table import Table as RichTable

    shown = RichTable(title=f"{sum(len(r.runs) for r in table.rows)} complete run(s) by "
                      f"{', '.join(table.group_by)}", caption=caption(table))
    for i, name in enumerate(headers(table)):
        shown.add_column(name, justify="left" if i < len(table.group_by) else "right",
                         no_wrap=True)
    for cells in text_rows(table):
        shown.add_row(*cells)
    console = Console(file=sys.stdout)
    if not console.is_terminal:  # a file or a pipe: no terminal width to fit, keep rows whole
        console = Console(file=sys.stdout, width=250)
    console.print(shown)
    for line in footnotes(table):
        console.print(line, highlight=False, markup=False)


def is_fraction_metric(name: str) -> bool:
    """Accuracies and IoUs are fractions shown in per cent."""
    leaf = name.split(".")[-1]
    return ("acc" in leaf or "miou" in leaf) and not leaf.endswith("_round")


# --- text, CSV and Markdown -------------------------------------------------------------

def format_number(value: float | None, metric: str, *, signed: bool = False) -> str:
    if value is None:
        return "-"
    if is_fraction_metric(metric):
        return f"{100 * value:+.2f}" if signed else f"{100 * value:.2f}"
    return f"{value:+.4g}" if signed else f"{value:.4g}"


def format_cell(cell: Cell, metric: str) -> str:
    if cell.n == 0:
        return "-"
    mean = format_number(cell.mean, metric)
    return mean if cell.std is None else f"{mean} ± {format_number(cell.std, metric)}"


def format_diff(cell: Cell, metric: str) -> str:
    d = cell.diff
    if d is None:
        return cell.diff_note or "-"
    text = format_number(d.mean, metric, signed=True)
    if d.low is None:
        return f"{text} (1 pair, no interval)"
    pairs = f" ({d.pairs} pairs)" if d.pairs < cell.n else ""
    return (f"{text} [{format_number(d.low, metric, signed=True)}, "
            f"{format_number(d.high, metric, signed=True)}]{pairs}")


def headers(table: Table) -> list[str]:
    """The column names of the text and Markdown forms."""
    out = [*table.group_by, "n"]
    for metric in table.metrics:
        out.append(f"{metric} (%)" if is_fraction_metric(metric) else metric)
        if table.baseline is not None:
            out.append(f"Δ {metric} (pp)" if is_fraction_metric(metric) else f"Δ {metric}")
    return out


def caption(table: Table) -> str:
    """How to read the cells: one line."""
    text = "mean ± std over runs (sample std, n - 1)"
    if table.baseline is not None:
        text += (f"; Δ: mean [95 % Student t interval] of the per-{table.pair_by} "
                 f"differences to {table.group_by[0]} = {table.baseline}"
                 + (" (pp: percentage points)" if any(map(is_fraction_metric, table.metrics))
                    else ""))
    return text


def text_rows(table: Table) -> list[list[str]]:
    out = []
    for row in table.rows:
        cells = [*row.values, str(len(row.runs))]
        for metric in table.metrics:
            cell = row.cells[metric]
            shown = format_cell(cell, metric)
            if 0 < cell.n < len(row.runs):
                shown += f" (n={cell.n})"
            cells.append(shown)
            if table.baseline is not None:
                cells.append(format_diff(cell, metric))
        out.append(cells)
    return out


def footnotes(table: Table) -> list[str]:
    """What the table leaves out and why, and how to read it: one line each."""
    lines = [f"not in the table: {run.path} ({why})" for run, why in table.excluded]
    for metric in table.metrics:
        lacking = [str(run.path) for run, m in table.missing if m == metric]
        if lacking:
            lines.append(f"no {metric} in the summary.json of {len(lacking)} run(s): "
                         + ", ".join(lacking))
    lines += table.notes
    return lines


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def _csv_number(value: float | None) -> str:
    return "" if value is None else repr(value)


def markdown(table: Table) -> str:
    head = headers(table)
    lines = ["| " + " | ".join(_md_escape(h) for h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_md_escape(c) for c in cells) + " |"
              for cells in text_rows(table)]
    notes = [caption(table), *footnotes(table)]
    return "\n".join(lines) + "\n\n" + "".join(f"- {n}\n" for n in notes)


CSV_COLUMNS = ("metric", "n", "mean", "std", "min", "max", "diff", "diff_std", "diff_low",
               "diff_high", "pairs", "runs")


def csv_text(table: Table) -> str:
    """One line per group and metric (long form), numbers unrounded and as stored (accuracy
    as a fraction); diff columns empty without a baseline."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*table.group_by, *CSV_COLUMNS])
    for row in table.rows:
        for metric in table.metrics:
            c = row.cells[metric]
            d = c.diff
            diff = [d.mean, d.std, d.low, d.high] if d else [None] * 4
            writer.writerow([*row.values, metric, c.n,
                             *map(_csv_number, [c.mean, c.std, c.minimum, c.maximum, *diff]),
                             d.pairs if d else "", " ".join(r.name for r in row.runs)])
    return buf.getvalue()
