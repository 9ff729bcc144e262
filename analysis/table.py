"""Statistics across run directories: what `fedbus table` prints and `fedbus plot
--group-by` groups by.

A run is complete when its summary.json holds every round its config.json asked for (or
its privacy budget ended it on purpose); anything else is listed with the reason, never
dropped in silence. Runs are grouped by the values of config keys (dotted: algorithm.name);
each group gets n, mean and sample std (n - 1) of each metric, and, against a baseline
group, the paired difference over runs that share a pairing key (federation.seed) with
its 95 % Student t interval. Everything here reads files and computes: no processes,
nothing to draw, no third-party statistics package (the t quantile is computed here).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

SWEEP_FILE = "sweep.json"
PAIR_KEY = "federation.seed"
CONFIDENCE = 0.95
# the metrics a table shows when none is named, those some run has
DEFAULT_METRICS = ("acc", "proto_acc", "miou", "proto_miou", "aux_acc")
MISSING = "(missing)"


class TableError(ValueError):
    """A request that cannot be answered (a key no run has, no runs); one line."""


# --- runs ----------------------------------------------------------------------------

@dataclass
class Run:
    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    problem: str = ""  # why the run is not complete ("" when it is)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        return not self.problem


def _read_json(path: Path) -> tuple[dict[str, Any] | None, str]:
    """(the file's object, "") or (None, why not)."""
    if not path.is_file():
        return None, f"no {path.name}"
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return None, f"{path.name} unreadable ({err.__class__.__name__})"
    if not isinstance(value, dict):
        return None, f"{path.name} is not a JSON object"
    return value, ""


def load_run(path: str | Path) -> Run:
    """A run directory with why it is incomplete, if it is. summary.json is written only
    when the server finishes, so its absence means the run was stopped or still runs."""
    path = Path(path)
    config, config_problem = _read_json(path / "config.json")
    summary, summary_problem = _read_json(path / "summary.json")
    run = Run(path, config or {}, summary)
    if config_problem:
        run.problem = config_problem
    elif summary_problem:
        run.problem = ("unfinished: no summary.json (stopped, or still running)"
                       if summary_problem == "no summary.json" else summary_problem)
    else:
        run.problem = short_of_rounds(config or {}, summary or {})
    return run


def short_of_rounds(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """"" when the summary holds every round the config asked for, else how many it holds
    (a count, not a round number). A run its privacy budget stopped early is complete."""
    wanted = (config.get("federation") or {}).get("rounds")
    done = summary.get("rounds_completed")
    if not isinstance(wanted, int) or not isinstance(done, int):
        return "summary.json or config.json lacks the round count"
    if done >= wanted or (summary.get("privacy") or {}).get("stopped"):
        return ""
    return f"{done} of {wanted} rounds completed"


def is_run_dir(path: Path) -> bool:
    return (path / "config.json").is_file() or (path / "summary.json").is_file()


@dataclass
class Selection:
    runs: list[Run]
    grid_keys: list[str]  # the grid keys of the sweeps given, in order (default grouping)
    notes: list[str] = field(default_factory=list)


def select_runs(paths: Iterable[str | Path]) -> Selection:
    """The runs named: a run directory is itself; a sweep directory (sweep.json) is every
    run it lists, run or not yet; a folder of run directories is each of them."""
    runs: list[Run] = []
    grid_keys: list[str] = []
    notes: list[str] = []
    for given in paths:
        path = Path(given)
        if not path.is_dir():
            raise TableError(f"{path}: no such directory")
        sweep_file = path / SWEEP_FILE
        if sweep_file.is_file():
            sweep, problem = _read_json(sweep_file)
            if sweep is None:
                raise TableError(f"{sweep_file}: {problem}")
            for key in sweep.get("grid") or {}:
                if key not in grid_keys:
                    grid_keys.append(key)
            for entry in sweep.get("runs") or []:
                run = load_run(path / str(entry.get("name")))
                if run.problem and not run.path.exists():
                    run.problem = f"not run (sweep status: {entry.get('status', 'unknown')})"
                runs.append(run)
        elif is_run_dir(path):
            runs.append(load_run(path))
        else:
            inside = sorted(p for p in path.iterdir() if p.is_dir() and is_run_dir(p))
            if not inside:
                raise TableError(f"{path}: not a run directory, a sweep ({SWEEP_FILE}) or a "
                                 "folder of run directories")
            runs.extend(load_run(p) for p in inside)
    seen: set[Path] = set()
    unique = []
    for run in runs:
        key = run.path.resolve()
        if key in seen:
            notes.append(f"{run.path}: named twice, counted once")
            continue
        seen.add(key)
        unique.append(run)
    return Selection(unique, grid_keys, notes)


# --- config keys and metrics ------------------------------------------------------------

def config_value(config: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key (algorithm.name) in a resolved config."""
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def value_label(value: Any) -> str:
    """How a config value is shown and matched: strings bare, the rest as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def check_key(runs: list[Run], key: str, option: str) -> None:
    """TableError naming the key unless some run's config.json has it."""
    if "." not in key:
        raise TableError(f"{option} {key}: expected a dotted config key such as "
                         "algorithm.name or federation.seed")
    if any(config_value(r.config, key)[0] for r in runs):
        return
    section = key.split(".", 1)[0]
    known = sorted({k for r in runs for k in (r.config.get(section) or {})})
    where = (f"[{section}] keys are {', '.join(known)}" if known else
             f"sections are {', '.join(sorted({s for r in runs for s in r.config}))}")
    raise TableError(f"{option} {key}: no run's config.json has it; {where}")


def metric_value(summary: dict[str, Any], name: str) -> float | None:
    """A metric of summary.json: a top-level number (wall_s, bytes_up), a dotted path
    (best.acc, final.acc_weighted), or a bare name read as final.NAME, then final.NAME_mean
    (acc is final.acc_mean); a path's last part also tries NAME_mean (best.acc)."""
    parts = name.split(".")
    candidates = [parts] if len(parts) > 1 else [parts, ["final", name]]
    for path in candidates:
        for last in (path[-1], f"{path[-1]}_mean"):
            found, value = config_value(summary, ".".join([*path[:-1], last]))
            if found and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value) if math.isfinite(value) else None
    return None


def default_metrics(runs: list[Run]) -> list[str]:
    return [m for m in DEFAULT_METRICS
            if any(r.summary and metric_value(r.summary, m) is not None for r in runs)]


# --- statistics -----------------------------------------------------------------------

def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1); std is None for one value."""
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def incomplete_beta(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b)
                     + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = p, by bisection on t_cdf (1e-12 relative)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Paired:
    """The mean of per-pair differences (group minus baseline) with its t interval;
    low/high are None with fewer than two pairs (no spread to estimate)."""
    pairs: int
    mean: float
    std: float | None
    low: float | None
    high: float | None


def paired_difference(values: dict[str, float], baseline: dict[str, float],
                      confidence: float = CONFIDENCE) -> Paired | None:
    """Over the pairing values both sides have: mean d and the Student t interval
    mean ± t_{(1+confidence)/2, n-1} * sd / sqrt(n). None when no pair is shared."""
    shared = [k for k in values if k in baseline]
    if not shared:
        return None
    diffs = [values[k] - baseline[k] for k in shared]
    mean, std = mean_std(diffs)
    assert mean is not None
    if std is None:
        return Paired(1, mean, None, None, None)
    half = t_quantile(0.5 + confidence / 2.0, len(diffs) - 1) * std / math.sqrt(len(diffs))
    return Paired(len(diffs), mean, std, mean - half, mean + half)


# --- the table ------------------------------------------------------------------------

@dataclass
class Cell:
    """One metric of one group."""
    n: int
    mean: float | None
    std: float | None
    minimum: float | None
    maximum: float | None
    diff: Paired | None = None
    diff_note: str = ""  # why there is no difference ("baseline" for the baseline itself)


@dataclass
class Row:
    values: tuple[str, ...]  # the group's value of each group-by key
    runs: list[Run]
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class Table:
    group_by: list[str]
    metrics: list[str]
    pair_by: str
    baseline: str | None
    rows: list[Row]
    excluded: list[tuple[Run, str]]  # incomplete runs, with why
    missing: list[tuple[Run, str]]  # complete runs without a metric: (run, metric)
    notes: list[str]


def _sort_key(label: str) -> tuple:
    try:
        return (0, float(label), label)
    except ValueError:
        return (1, 0.0, label)


def group_runs(runs: list[Run], keys: list[str]) -> dict[tuple[str, ...], list[Run]]:
    """Runs by their values of `keys`, groups in value order (numbers numerically)."""
    groups: dict[tuple[str, ...], list[Run]] = {}
    for run in runs:
        values = []
        for key in keys:
            found, value = config_value(run.config, key)
            values.append(value_label(value) if found else MISSING)
        groups.setdefault(tuple(values), []).append(run)
    return {k: groups[k] for k in sorted(groups, key=lambda v: [_sort_key(x) for x in v])}


def _by_pair(runs: list[Run], metric: str, pair_by: str
             ) -> tuple[dict[str, float], list[str]]:
    """{pairing value: metric} and the pairing values several runs share."""
    out: dict[str, float] = {}
    repeated: list[str] = []
    for run in runs:
        value = metric_value(run.summary or {}, metric)
        found, pair = config_value(run.config, pair_by)
        if value is None or not found:
            continue
        label = value_label(pair)
        if label in out:
            repeated.append(label)
        out[label] = value
    return out, repeated


def build_table(runs: list[Run], group_by: list[str], metrics: list[str], *,
                pair_by: str = PAIR_KEY, baseline: str | None = None) -> Table:
    """The table of the complete runs grouped by `group_by`; a baseline is a value of the
    first group-by key, and each group is compared with the group that has it there and
    the same values of the other keys."""
    if not runs:
        raise TableError("no runs given")
    complete = [r for r in runs if r.complete]
    excluded = [(r, r.problem) for r in runs if not r.complete]
    if not complete:
        raise TableError(f"none of the {len(runs)} run(s) is complete: "
                         + "; ".join(f"{r.path}: {why}" for r, why in excluded[:5]))
    for key in group_by:
        check_key(runs, key, "--group-by")
    if pair_by in group_by:
        raise TableError(f"--pair-by {pair_by} is also a --group-by key: runs are paired "
                         "across groups by it")
    metrics = metrics or default_metrics(complete)
    if not metrics:
        raise TableError("no run's summary.json has an accuracy; name a metric with --metric "
                         "(e.g. wall_s, bytes_up, final.loss_mean)")
    for metric in metrics:
        if not any(metric_value(r.summary or {}, metric) is not None for r in complete):
            raise TableError(f"--metric {metric}: no complete run's summary.json has it "
                             "(names: acc, proto_acc, best.acc, final.acc_weighted, wall_s, "
                             "bytes_up, ...)")
    if baseline is not None:
        check_key(complete, pair_by, "--pair-by")
    groups = group_runs(complete, group_by)
    if baseline is not None and not any(v[0] == baseline for v in groups):
        raise TableError(f"--baseline {baseline}: no group has {group_by[0]} = {baseline}; "
                         f"values: {', '.join(sorted({v[0] for v in groups}))}")
    rows = [Row(values, members) for values, members in groups.items()]
    notes: list[str] = []
    missing = [(r, m) for m in metrics for r in complete
               if metric_value(r.summary or {}, m) is None]
    for row in rows:
        for metric in metrics:
            vals = [v for v in (metric_value(r.summary or {}, metric) for r in row.runs)
                    if v is not None]
            mean, std = mean_std(vals)
            row.cells[metric] = Cell(len(vals), mean, std, min(vals, default=None),
                                     max(vals, default=None))
    if baseline is not None:
        _compare(rows, metrics, pair_by, baseline, group_by, notes)
    return Table(group_by, metrics, pair_by, baseline, rows, excluded, missing, notes)


def _compare(rows: list[Row], metrics: list[str], pair_by: str, baseline: str,
             group_by: list[str], notes: list[str]) -> None:
    by_values = {row.values: row for row in rows}
    for row in rows:
        base = by_values.get((baseline, *row.values[1:]))
        for metric in metrics:
            cell = row.cells[metric]
            if base is row:
                cell.diff_note = "baseline"
                continue
            if base is None:
                cell.diff_note = "no baseline group"
                continue
            mine, mine_repeated = _by_pair(row.runs, metric, pair_by)
            theirs, theirs_repeated = _by_pair(base.runs, metric, pair_by)
            if mine_repeated or theirs_repeated:
                cell.diff_note = "not paired"
                notes.append(f"{label(row.values, group_by)}: several runs share {pair_by} = "
                             f"{', '.join(sorted(set(mine_repeated + theirs_repeated)))} "
                             f"(here or in the baseline): no paired {metric}; group by the "
                             "key that differs")
                continue
            cell.diff = paired_difference(mine, theirs)
            if cell.diff is None:
                cell.diff_note = (f"no {metric} in baseline" if not theirs else
                                  "-" if not mine else f"no shared {pair_by}")
            unpaired = sorted(set(mine) ^ set(theirs), key=_sort_key)
            if unpaired and cell.diff is not None:
                notes.append(f"{label(row.values, group_by)} vs {baseline}, {metric}: "
                             f"{pair_by} = {', '.join(unpaired)} in one side only, unpaired")


def label(values: tuple[str, ...], keys: list[str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(keys, values))
