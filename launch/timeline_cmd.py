"""`fedbus timeline RUN`: every client's tasks as bars on a time axis, coloured by what
became of each, from the run's message log; a PNG and a self-contained HTML page.
What the bars and marks mean: docs/PLOTS.md (Timeline) and fedbus.analysis.timeline.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

INSTALL_HINT = "pip install 'fedbus[plot]'"

EXAMPLES = """\
examples:
  fedbus timeline runs/cmp/fedavg-s0       # -> runs/cmp/fedavg-s0/plots/timeline.png, .html
  fedbus timeline runs/cmp/fedavg-s0 --format html --out timelines   # no matplotlib needed

One bar per task the server sent, on one row per client, from when it left to when its
answer arrived (or, unanswered, to when the server stopped waiting: drawn faded and
hatched). Colours: on time; late or stale, folded in; late, not counted; timed out
(async); dropped its task; refused / error; dead (lost with its node). Dotted lines mark
each sync round's first task, solid lines the server's aggregations. In the HTML page,
hover a bar for its client, round, task id, work done and bytes. Read from the message log
(messages.bin, messages.jsonl) and metrics.jsonl: a run recorded with log.messages = true,
the default. Exit 2: no message log, a damaged one, not a run directory, or matplotlib
missing for the PNG."""

FORMATS = ("both", "png", "html")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    p.add_argument("run", metavar="RUN", help="run directory (with its message log)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where timeline.png and timeline.html go (default: RUN/plots)")
    p.add_argument("--format", choices=FORMATS, default="both",
                   help="what to write: both (default), png (needs matplotlib: "
                   f"{INSTALL_HINT}) or html (a self-contained page, inline SVG)")


def main(args: argparse.Namespace) -> int:
    from fedbus.analysis.timeline import NoMessageLog, load_timeline, write_html, write_png
    from fedbus.record.msglog import LogCorrupt

    run = Path(args.run)
    if not run.is_dir():
        print(f"fedbus timeline: {run} is not a directory (give a run directory)",
              file=sys.stderr)
        return 2
    if args.format in ("both", "png"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"fedbus timeline: the PNG needs matplotlib, which is not installed: "
                  f"{INSTALL_HINT} (or --format html, which needs nothing)", file=sys.stderr)
            return 2
    try:
        tl = load_timeline(run)
    except NoMessageLog as err:
        print(f"fedbus timeline: {err}", file=sys.stderr)
        return 2
    except LogCorrupt as err:
        print(f"fedbus timeline: {' '.join(str(err).split())}; `fedbus log {run}` shows the "
              "records before it", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.format in ("both", "png"):
        written.append(write_png(tl, out / "timeline.png"))
    if args.format in ("both", "html"):
        written.append(write_html(tl, out / "timeline.html"))
    counts = ", ".join(f"{n} {fate.replace('_', ' ')}" for fate, n in tl.counts().items() if n)
    print(f"{len(tl.bars)} tasks ({counts or 'none'}), {len(tl.aggregations)} aggregations")
    for path in written:
        print(f"wrote {path}")
    return 0
