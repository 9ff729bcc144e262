"""`fedbus bench startup`: how long the default federation takes to start, run
one round and stop, against one bare `import torch` measured in the same run.

    fedbus bench startup                       # 3 runs of `fedbus run --set federation.rounds=1`
    fedbus bench startup --python /other/venv/bin/python    # another install, same machine

Each phase is read off the run's own logs (the server's JSON lines), measured
from the moment the launcher process is started:
    first task    the server starts round 0 (its tasks go out)
    first agg     round 0 is aggregated
    total         the launcher has exited (every process stopped)
    stop          total minus the last aggregation: writing the results and
                  stopping every process
Figures are medians over --repeat runs, beside the median of --repeat bare
`python -c "import torch"` runs; the target is total <= 2.5x one import. Each is also
printed beside the raw-zmq floor of the first run's round of messages, measured in the
same invocation (by this interpreter's pyzmq), and its ratio (--json: `floor_ms`, and
each phase's `ratio`): start-up dwarfs it, but a ratio that grows is fedbus.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from fedbus.bench.common import Floor, floor_table, run_floor


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement (default 3)")
    p.add_argument("--python", default=sys.executable,
                   help="interpreter whose fedbus is measured (default: this one)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="extra config override, e.g. launch.start=exec (repeatable)")
    p.add_argument("--out", default=None, help="keep the run directories here (default: a "
                   "temporary folder)")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


def time_torch_import(python: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([python, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def server_events(run_dir: Path) -> dict[str, list[float]]:
    """event name -> unix times, from the server's JSON-lines log."""
    events: dict[str, list[float]] = {}
    for line in (run_dir / "logs" / "server.jsonl").read_text().splitlines():
        rec = json.loads(line)
        events.setdefault(rec["event"], []).append(_stamp(rec["timestamp"]))
    return events


def time_run(python: str, run_dir: Path, overrides: list[str]) -> dict[str, float]:
    sets = [x for o in ["federation.rounds=1", *overrides] for x in ("--set", o)]
    t0 = time.time()
    proc = subprocess.run([python, "-m", "fedbus.launch", "run", *sets, "--out", str(run_dir),
                           "--quiet"], capture_output=True, text=True, check=False)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"fedbus run exited {proc.returncode}: {proc.stderr.strip()}")
    ev = server_events(run_dir)
    return {"first task": ev["round_start"][0] - t0, "first agg": ev["round"][0] - t0,
            "total": end - t0, "stop": end - ev["round"][-1]}


def main_args(args: argparse.Namespace) -> int:
    if args.repeat < 1:
        print("fedbus bench startup: --repeat must be >= 1", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedbus-startup-"))
    imports = [time_torch_import(args.python) for _ in range(args.repeat)]
    runs = []
    for i in range(args.repeat):
        try:
            runs.append(time_run(args.python, out / f"run-{i}", args.overrides))
        except RuntimeError as err:
            print(f"fedbus bench startup: {err}", file=sys.stderr)
            return 1
    torch_s = statistics.median(imports)
    print(f"interpreter: {args.python}   runs: {args.repeat}   "
          f"overrides: {' '.join(args.overrides) or '-'}")
    print(f"{'bare import torch':<18}{torch_s:8.2f} s   "
          f"(runs: {', '.join(f'{x:.2f}' for x in imports)})")
    for phase in PHASES:
        values = [r[phase] for r in runs]
        med = statistics.median(values)
        print(f"{phase:<18}{med:8.2f} s   {med / torch_s:5.2f}x import   "
              f"(runs: {', '.join(f'{x:.2f}' for x in values)})")
    ratio = statistics.median(r["total"] for r in runs) / torch_s
    print(f"total / import torch = {ratio:.2f} (target <= 2.5)")
    floor = run_floor_of(out / "run-0")
    phases = {phase: statistics.median(r[phase] for r in runs) * 1000 for phase in PHASES}
    print("\n".join(floor_table([(phase, ms, floor.ms) for phase, ms in phases.items()],
                                floor)))
    if args.json:
        print(json.dumps({"import_torch_ms": torch_s * 1000, "floor_ms": floor.ms,
                          "phases": {p: {"ms": ms, **floor.figures(ms)}
                                     for p, ms in phases.items()}}))
    return 0


PHASES = ("first task", "first agg", "total", "stop")


def run_floor_of(run_dir: Path) -> Floor:
    """The floor of one round of the run in RUN_DIR, over its node processes."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    nodes = json.loads((run_dir / "config.json").read_text()).get("launch", {}).get("nodes", 1)
    return run_floor(summary, records, max(1, int(nodes or 1)))
