"""`fedbus sweep`: one `fedbus run` per grid point and seed, several at a time, resumable.

Each run is a normal run directory DIR/NAME, NAME made of the grid values and the seed
(`fedavg-lr=0.01-s1`); DIR/sweep.json lists the grid, the seeds, the base config and
every run with its overrides and status, and `fedbus table DIR` reads it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedbus.analysis.table import SWEEP_FILE, is_run_dir, load_run, metric_value
from fedbus.launch import streams
from fedbus.launch.common import add_config_arguments
from fedbus.launch.run_cmd import SIGNALLED, catch_interrupt, resume_refusal
from fedbus.node.config import ConfigError, load_config
from fedbus.node.lifetime import die_with_parent, fedbus_command

EXAMPLES = """\
examples:
  fedbus sweep examples/fedavg-mnist-offline.toml --seeds 3 \\
      --grid algorithm.name=fedavg,fedproto --out runs/cmp        # 2 x 3 runs
  fedbus sweep --set federation.rounds=5 --grid algorithm.name=fedavg,fedprox \\
      --grid train.lr=0.01,0.05 --seeds 0,1 --out runs/lr          # 2 x 2 x 2 runs
  fedbus sweep --grid 'model.group=["cnn","cnn4"],["cnn"]' --seeds 2 --out runs/g
  fedbus table runs/cmp --baseline fedavg      # then: mean, std, paired difference

The same sweep command again continues it: complete runs are skipped. With a grid over
algorithm.name, the CONFIG's [algorithm] keys must suit every algorithm of the grid:
examples/fedavg-mnist-offline.toml sets algorithm.name alone; fedproto-mnist-offline.toml
also sets lam, FedProto's, which a FedAvg run refuses (give such a key with --grid too).

--seeds N runs federation.seed = 0 .. N-1; a list (0,1,2, or 7, for seed 7 alone) or
a range (3-5) runs those seeds; without --seeds, the config's own seed. Runs are named
VALUE (algorithm.name) or KEY=VALUE (other keys, by their last part) joined by '-', then
s<seed>. A run whose summary.json holds every round is skipped when the sweep is run
again (its config must be the one asked for, else the sweep refuses); an interrupted one
(Ctrl-C) of that config continues from its checkpoint (`fedbus run --resume`); any other
incomplete one is moved aside to NAME.incomplete-K and run again. Each run's output goes to
DIR/sweep-logs/NAME.log. Runs start in this working directory (relative paths mean what
they mean to `fedbus run`) but never import from it, so a folder there named like a
package cannot stand in for fedbus or a plugin."""

# The sections whose keys decide what a run computes: a complete run is reused only when
# they agree ([launch], [log] and [bus] change how it runs, not what it finds).
COMPARED_SECTIONS = ("federation", "data", "model", "algorithm", "train", "system",
                     "privacy")
LOG_DIR = "sweep-logs"


class SweepError(ValueError):
    """A sweep that cannot start (bad --grid, --seeds, a run in the way); one line."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EXAMPLES
    add_config_arguments(p)
    p.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="one axis of the grid: a config key and its values, comma-separated "
                   "(commas inside [...] or quotes belong to a value); repeatable, the runs "
                   "are every combination")
    p.add_argument("--seeds", default=None, metavar="N|S1,S2|A-B",
                   help="federation.seed of each grid point: N = 0..N-1, a list, or a range "
                   "(default: the config's seed)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="the sweep directory: DIR/NAME per run, DIR/sweep.json")
    p.add_argument("--jobs", type=int, default=None, metavar="J",
                   help="runs at a time (default: usable CPUs // (launch.nodes + 1), at "
                   "least 1); each run is pinned to its share of the CPUs")
    p.add_argument("--dry-run", action="store_true",
                   help="print each run's name, overrides and what would happen, then exit")


# --- the plan ----------------------------------------------------------------------------

def split_values(text: str) -> list[str]:
    """Comma-separated values; commas inside brackets, braces or quotes stay in a value."""
    values, current, depth, quote = [], [], 0, ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            values.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    values.append("".join(current).strip())
    return values


def parse_grid(texts: list[str], sets: list[str]) -> dict[str, list[str]]:
    grid: dict[str, list[str]] = {}
    set_keys = {s.split("=", 1)[0].strip() for s in sets}
    for text in texts:
        key, sep, rest = text.partition("=")
        key = key.strip()
        if not sep or "." not in key:
            raise SweepError(f"--grid {text!r}: expected section.key=value1,value2")
        if key == "federation.seed":
            raise SweepError("--grid federation.seed: give seeds with --seeds")
        if key in grid:
            raise SweepError(f"--grid {key} given twice")
        if key in set_keys:
            raise SweepError(f"{key} is both --set and --grid")
        values = split_values(rest)
        if any(v == "" for v in values):
            raise SweepError(f"--grid {text!r}: an empty value")
        if len(set(values)) < len(values):
            raise SweepError(f"--grid {text!r}: a value given twice")
        grid[key] = values
    return grid


def parse_seeds(text: str) -> list[int]:
    text = text.strip()
    try:
        if re.fullmatch(r"\d+", text):
            seeds = list(range(int(text)))
        elif m := re.fullmatch(r"(\d+)\s*-\s*(\d+)", text):
            seeds = list(range(int(m[1]), int(m[2]) + 1))
        else:
            seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) < len(seeds):
        raise SweepError(f"--seeds {text!r}: expected N (seeds 0..N-1, N >= 1), a list "
                         "such as 0,1,2 (7, for seed 7 alone) or a range such as 3-5, "
                         "without repeats")
    return seeds


def slug(text: str) -> str:
    """A value as part of a directory name: letters, digits and _ . + = - kept."""
    return re.sub(r"[^A-Za-z0-9_.+=-]+", "_", text).strip("_")


def part_names(keys: list[str]) -> dict[str, str]:
    """How each grid key appears in a run's name: algorithm.name by its value alone, the
    others by their last part (the whole key where two last parts collide)."""
    leaves = [k.split(".")[-1] for k in keys]
    return {k: "" if k == "algorithm.name" else (leaf if leaves.count(leaf) == 1 else k)
            for k, leaf in zip(keys, leaves)}


def run_name(point: dict[str, str], seed: int, parts: dict[str, str]) -> str:
    pieces = [slug(v) if not parts[k] else f"{parts[k]}={slug(v)}" for k, v in point.items()]
    name = "-".join([*pieces, f"s{seed}"]).lstrip("-.")
    if len(name) > 120:  # filesystems allow 255 bytes; keep names readable and unique
        digest = hashlib.sha1(json.dumps([point, seed]).encode()).hexdigest()[:10]
        name = f"{name[:100]}-{digest}"
    return name


@dataclass
class PlannedRun:
    name: str
    overrides: list[str]  # what this run adds to the base: grid values, then the seed
    seed: int
    config: dict[str, Any]  # resolved
    status: str = "pending"  # pending, running, complete, failed, interrupted
    note: str = ""
    wall_s: float | None = None
    moved_to: str = ""  # where an incomplete earlier attempt was moved
    resume: bool = False  # an interrupted earlier attempt: `fedbus run --resume` goes on


@dataclass
class Plan:
    config_file: str | None
    sets: list[str]
    grid: dict[str, list[str]]
    seeds: list[int]
    base: dict[str, Any]
    runs: list[PlannedRun] = field(default_factory=list)


def _config(config_file: str | None, overrides: list[str], where: str) -> dict[str, Any]:
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as err:
        hint = ""
        if str(err).startswith("unknown key algorithm.") and \
                any(o.startswith("algorithm.name=") for o in overrides):
            # e.g. a FedProto CONFIG's lam, unknown to FedAvg: a grid over algorithms
            # needs a base every one of them takes
            hint = ("; the CONFIG's [algorithm] keys must suit every algorithm of the grid: "
                    "keep one algorithm's own keys out of it (or give them with --grid as "
                    "well), e.g. start from examples/fedavg-mnist-offline.toml")
        raise ConfigError(f"{err}{where}{hint}") from None
    return json.loads(json.dumps(cfg.to_dict()))


def make_plan(config_file: str | None, sets: list[str], grid_texts: list[str],
              seeds_text: str | None) -> Plan:
    """Every run's name and resolved config; ConfigError (naming the key) or SweepError
    before anything starts."""
    grid = parse_grid(grid_texts, sets)
    if seeds_text is not None and any(s.split("=", 1)[0].strip() == "federation.seed"
                                      for s in sets):
        raise SweepError("--set federation.seed and --seeds: give seeds with --seeds only")
    base = _config(config_file, sets, "")
    seeds = (parse_seeds(seeds_text) if seeds_text is not None
             else [int(base["federation"]["seed"])])
    plan = Plan(str(Path(config_file).resolve()) if config_file else None, list(sets), grid,
                seeds, base)
    parts = part_names(list(grid))
    points: list[dict[str, str]] = [{}]
    for key, values in grid.items():
        points = [{**p, key: v} for p in points for v in values]
    names: dict[str, PlannedRun] = {}
    for point in points:
        for seed in seeds:
            overrides = [f"{k}={v}" for k, v in point.items()] + [f"federation.seed={seed}"]
            name = run_name(point, seed, parts)
            if name in names:  # two values that slug alike: tell them apart by a digest
                name += "-" + hashlib.sha1(json.dumps(overrides).encode()).hexdigest()[:8]
            where = f" (in run {name}: --set {' --set '.join(overrides)})"
            names[name] = PlannedRun(name, overrides, seed,
                                     _config(config_file, [*sets, *overrides], where))
    plan.runs = list(names.values())
    return plan


def differs(saved: dict[str, Any], wanted: dict[str, Any]) -> str:
    """"" when a saved config.json computes what `wanted` does, else the first difference.
    A key only one side has is an option added or dropped since: not a difference."""
    for section in COMPARED_SECTIONS:
        old, new = saved.get(section) or {}, wanted.get(section) or {}
        changed = sorted(k for k in set(old) & set(new) if old[k] != new[k])
        if changed:
            k = changed[0]
            return f"{section}.{k} = {old[k]!r} there, {new[k]!r} asked for"
    return ""


def check_existing(plan: Plan, out: Path, previous: dict[str, Any] | None) -> None:
    """Mark the complete runs already in DIR as skipped; SweepError when one holds another
    config (reusing it would be wrong, replacing it would lose it) or DIR holds a sweep of
    another base."""
    if previous and (previous.get("config") != plan.config_file
                     or previous.get("sets") != plan.sets):
        raise SweepError(f"{out} holds a sweep of another base config (CONFIG "
                         f"{previous.get('config')}, --set {previous.get('sets')}); use "
                         "another --out")
    for run in plan.runs:
        path = out / run.name
        if not path.exists():
            continue
        found = load_run(path)
        if not found.complete:
            run.note = found.problem if is_run_dir(path) else "not a run directory"
            if is_run_dir(path) and not differs(found.config, run.config) and \
                    not resume_refusal(path):
                run.resume = True
                run.note = f"{found.problem}: resuming it"
            continue
        why = differs(found.config, run.config)
        if why:
            raise SweepError(f"{path} is a complete run of another config ({why}); use "
                             "another --out, or move it away")
        run.status, run.note = "complete", "complete already"


# --- sweep.json --------------------------------------------------------------------------

def read_sweep(out: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((out / SWEEP_FILE).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise SweepError(f"{out / SWEEP_FILE} unreadable ({err}); move it away") from None
    return value if isinstance(value, dict) else None


def write_sweep(plan: Plan, out: Path, previous: dict[str, Any] | None) -> None:
    """DIR/sweep.json, atomically: this plan, plus the runs and grid values of earlier
    invocations on the same base (a sweep may grow: more seeds, more values)."""
    grid = {k: list(v) for k, v in ((previous or {}).get("grid") or {}).items()}
    for key, values in plan.grid.items():
        grid[key] = grid.get(key, []) + [v for v in values if v not in grid.get(key, [])]
    seeds = sorted(set((previous or {}).get("seeds") or []) | set(plan.seeds))
    runs = [{"name": r.name, "overrides": [*plan.sets, *r.overrides], "seed": r.seed,
             "status": r.status, "note": r.note, "wall_s": r.wall_s,
             **({"moved_incomplete_to": r.moved_to} if r.moved_to else {})}
            for r in plan.runs]
    mine = {r.name for r in plan.runs}
    runs += [dict(r, note=r.get("note") or "from an earlier invocation")
             for r in (previous or {}).get("runs") or [] if r.get("name") not in mine]
    body = {"config": plan.config_file, "sets": plan.sets, "grid": grid, "seeds": seeds,
            "base_config": plan.base, "runs": runs}
    tmp = out / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, out / SWEEP_FILE)


# --- running -------------------------------------------------------------------------

def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no pinning
        return list(range(os.cpu_count() or 1))


def default_jobs(plan: Plan) -> int:
    nodes = max(int(r.config["launch"]["nodes"]) for r in plan.runs)
    return max(1, len(usable_cpus()) // (nodes + 1))


def slot_cpus(slot: int, jobs: int, cpus: list[int]) -> list[int]:
    """The CPUs of job slot `slot`: an equal share, so runs in parallel do not fight
    over cores (a node's automatic torch threads follow its affinity)."""
    if jobs >= len(cpus):
        return [cpus[slot % len(cpus)]]
    share = len(cpus) // jobs
    return cpus[slot * share:(slot + 1) * share]


def move_aside(path: Path) -> Path:
    k = 1
    while path.with_name(f"{path.name}.incomplete-{k}").exists():
        k += 1
    target = path.with_name(f"{path.name}.incomplete-{k}")
    path.rename(target)
    return target


def last_line(log: Path) -> str:
    try:
        lines = [x.strip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no output)"
    return lines[-1][:300] if lines else "(no output)"


@dataclass
class Running:
    run: PlannedRun
    proc: subprocess.Popen
    slot: int
    started: float
    log: Path


def start(run: PlannedRun, plan: Plan, out: Path, slot: int, cpus: list[int]) -> Running:
    logs = out / LOG_DIR
    logs.mkdir(exist_ok=True)
    log = logs / f"{run.name}.log"
    if run.resume:  # its config.json is the one asked for (check_existing)
        argv = ["run", "--resume", str(out / run.name), "--quiet"]
    else:
        argv = ["run", *([plan.config_file] if plan.config_file else []),
                *[a for s in [*plan.sets, *run.overrides] for a in ("--set", s)],
                "--out", str(out / run.name), "--quiet"]
    with open(log, "a") as f:
        f.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} fedbus {' '.join(argv)}\n")

    def prepare() -> None:  # in the child, before exec
        die_with_parent()
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    # this interpreter, without the working directory on sys.path (fedbus_command: -P)
    proc = subprocess.Popen(fedbus_command(*argv), stdin=subprocess.DEVNULL,
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            preexec_fn=prepare)
    run.status = "running"
    return Running(run, proc, slot, time.perf_counter(), log)


def outcome(job: Running, out: Path) -> str:
    """Set the run's status from its exit and its files; the line to print."""
    run, code = job.run, job.proc.returncode
    run.wall_s = round(time.perf_counter() - job.started, 1)
    found = load_run(out / run.name)
    if found.complete:
        run.status = "complete"
        run.note = "" if code == 0 else f"launcher exit {code} after a complete run"
        accs = [f"{m} {100 * v:.2f} %" for m in ("acc", "proto_acc")
                if (v := metric_value(found.summary or {}, m)) is not None]
        return f"  done    {run.name} in {run.wall_s:.1f} s: {', '.join(accs) or 'no accuracy'}"
    run.status = "interrupted" if code in SIGNALLED else "failed"
    run.note = f"exit {code}: {last_line(job.log)}"
    own = out / run.name / "logs"
    label = "STOPPED " if run.status == "interrupted" else "FAILED  "
    return (f"  {label}{run.name} in {run.wall_s:.1f} s, {run.note} (log: {job.log}"
            + (f"; the run's own logs: {own})" if own.is_dir() else ")"))


def execute(plan: Plan, out: Path, jobs: int, previous: dict[str, Any] | None, say) -> int:
    """Run the pending runs, `jobs` at a time; 0, or the number of the signal that
    interrupted it. Ctrl-C (SIGINT) or SIGTERM is a flag checked between polls
    (run_cmd.catch_interrupt: raised inside Popen it could leave a child unwaited for),
    passed on to the running launchers as SIGINT: each stops its run resumable, and the
    same sweep command again resumes it."""
    cpus = usable_cpus()
    queue = [r for r in plan.runs if r.status == "pending"]
    running: list[Running] = []
    total = len(queue)
    interrupted, restore = catch_interrupt()
    try:
        while queue or running:
            if interrupted():
                raise KeyboardInterrupt
            while queue and len(running) < jobs:
                run = queue.pop(0)
                path = out / run.name
                if run.resume:
                    say(f"  {run.name}: {run.note}")
                elif path.exists():
                    if is_run_dir(path) or any(path.iterdir()):
                        run.moved_to = move_aside(path).name
                        say(f"  {run.name}: {run.note}: moved to {run.moved_to}, running "
                            "it again")
                    else:
                        path.rmdir()  # empty: nothing to keep
                free = min(set(range(jobs)) - {j.slot for j in running})
                running.append(start(run, plan, out, free, slot_cpus(free, jobs, cpus)))
                say(f"  start   {run.name} [{total - len(queue)}/{total}]")
                write_sweep(plan, out, previous)
            time.sleep(0.2)
            for job in [j for j in running if j.proc.poll() is not None]:
                running.remove(job)
                say(outcome(job, out))
                write_sweep(plan, out, previous)
    except KeyboardInterrupt:
        for job in running:  # a launcher stops its federation on SIGINT, like Ctrl-C
            job.proc.send_signal(signal.SIGINT)
        for job in running:
            try:
                job.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                job.proc.kill()
                job.proc.wait()
            if load_run(out / job.run.name).complete:  # it finished as we stopped it
                job.run.status, job.run.note = "complete", "finished while interrupted"
            else:
                job.run.status = "interrupted"
                job.run.note = f"stopped by {signal.Signals(interrupted() or 2).name}"
        write_sweep(plan, out, previous)
        return interrupted() or signal.SIGINT
    finally:
        restore()
    return 0


# --- the command ---------------------------------------------------------------------

def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    try:
        plan = make_plan(args.config, args.overrides, args.grid, args.seeds)
        if out.exists() and not out.is_dir():
            raise SweepError(f"--out {out}: not a directory")
        previous = read_sweep(out)
        check_existing(plan, out, previous)
        if args.jobs is not None and args.jobs < 1:
            raise SweepError("--jobs must be at least 1")
    except ConfigError as err:
        print(f"fedbus sweep: config error: {err}", file=sys.stderr)
        return 2
    except SweepError as err:
        print(f"fedbus sweep: {err}", file=sys.stderr)
        return 2
    jobs = args.jobs or default_jobs(plan)
    pending = [r for r in plan.runs if r.status == "pending"]
    points = len(plan.runs) // len(plan.seeds)
    print(f"fedbus sweep: {len(plan.runs)} runs ({points} grid point(s) x "
          f"{len(plan.seeds)} seed(s)) in {out}; {len(pending)} to run, {jobs} at a time",
          flush=True)
    if args.dry_run:
        for run in plan.runs:
            what = run.note if run.status == "complete" or run.resume else (
                f"{run.note}: would move it aside and run" if run.note else "would run")
            print(f"  {run.name}: --set {' --set '.join(run.overrides)}: {what}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    import fcntl  # one sweep at a time per DIR: a second would move the first's runs aside

    lock = open(out / ".sweep.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(f"fedbus sweep: another fedbus sweep is running in {out}", file=sys.stderr)
        return 2
    for run in plan.runs:
        if run.status == "complete":
            print(f"  skip    {run.name}: {run.note}")
    t0 = time.perf_counter()
    write_sweep(plan, out, previous)
    stopped_by = execute(plan, out, jobs, previous, streams.out)
    finished = not stopped_by
    counts = {s: sum(r.status == s for r in plan.runs)
              for s in ("complete", "failed", "interrupted", "pending")}
    skipped = len(plan.runs) - len(pending)
    streams.out(f"fedbus sweep: {counts['complete']} complete ({skipped} skipped), "
                f"{counts['failed']} failed"
                + (f", {counts['interrupted']} interrupted" if counts["interrupted"] or
                   not finished else "")
                + (f", {counts['pending']} not started" if not finished else "")
                + f", in {time.perf_counter() - t0:.1f} s; {out / SWEEP_FILE}")
    if not finished:
        streams.mute_if_broken(sys.stdout)
        streams.tell("fedbus sweep: interrupted; the same command continues it (an "
                     "interrupted run resumes where it stopped)")
        return 128 + stopped_by
    first = next(iter(plan.grid), None)
    hint = f" --baseline {plan.grid[first][0]}" if first and len(plan.seeds) > 1 else ""
    if counts["complete"]:
        streams.out(f"next: fedbus table {out}{hint}   fedbus plot --group-by "
                    f"{first or 'algorithm.name'} {out}")
    return 1 if counts["failed"] or counts["interrupted"] else 0
