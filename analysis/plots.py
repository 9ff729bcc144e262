"""Figures of one or more run directories (what `fedbus plot` draws).

    accuracy-round.png   test accuracy against round, runs overlaid (or, by group, one
                         mean curve and min-max band per group: plot_groups)
    accuracy-time.png    the same against wall-clock seconds
    bytes.png            bytes up/down per round, and cumulative traffic
    participation*.png   client x round grid: trained / partial / late / dropped ...
    amm.png              aggregate mean margin per round (when recorded: proto-attention)
    attention*.png       client x round heatmap of attention (proto-attention, fedatt)
    ffd.png              feature discrepancy to a central model (log.ffd_reference)
    tsne*.png            t-SNE of final test embeddings with the global prototypes
    masks*.png           segmentation: test images | ground truth | predicted mask

Everything reads the files a run leaves (see fedbus.record.rundir); a file that
is missing (a crashed run) only skips the figures that need it. matplotlib is
imported lazily, and only through its object API on the Agg canvas (no pyplot,
no global backend switch), so plotting from a library or a test is safe.
"""
from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedbus.record import DamagedFile
from fedbus.record.rundir import read_metrics

RUN_FILES = ("config.json", "metrics.jsonl", "summary.json")
DPI = 110

# accuracy metrics drawn, with their legend names and line styles (segmentation runs
# record pixel accuracy as acc/proto_acc and add the mean IoU)
ACC_METRICS = (("acc", "head", "-", "o"), ("proto_acc", "nearest prototype", "--", "s"),
               ("miou", "head mIoU", "-.", "^"), ("proto_miou", "nearest prototype mIoU", ":",
                                                  "v"))
_SINGLE_RUN_COLOUR = {"proto_acc": "C1", "miou": "C2", "proto_miou": "C3"}


class NotARunDir(ValueError):
    pass


@dataclass
class RunData:
    path: Path
    label: str
    config: dict[str, Any]
    summary: dict[str, Any] | None
    records: list[dict[str, Any]]
    embeddings: Path | None
    notes: list[str] = field(default_factory=list)
    masks: Path | None = None  # masks.fbk of a segmentation run

    @property
    def algorithm(self) -> str | None:
        if self.summary and self.summary.get("algorithm"):
            return str(self.summary["algorithm"])
        name = self.config.get("algorithm", {}).get("name")
        return str(name) if name else None


@dataclass
class Report:
    written: list[Path] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# --- loading -------------------------------------------------------------------

def is_run_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and any((p / name).is_file() for name in RUN_FILES)


def _read_json(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        notes.append(f"{path.name} unreadable ({err.__class__.__name__})")
        return None
    return value if isinstance(value, dict) else None


def load_run(path: str | Path, label: str | None = None) -> RunData:
    p = Path(path)
    if not p.is_dir():
        raise NotARunDir(f"{p}: no such directory")
    if not is_run_dir(p):
        raise NotARunDir(f"{p}: not a run directory (none of {', '.join(RUN_FILES)})")
    notes: list[str] = []
    config = _read_json(p / "config.json", notes) or {}
    summary = _read_json(p / "summary.json", notes)
    try:
        records = _dedupe(read_metrics(p))
    except DamagedFile as err:  # one line from `fedbus plot`, like a missing run
        raise NotARunDir(str(err)) from None
    emb = p / "embeddings.fbk"
    run = RunData(p, "", config, summary, records, emb if emb.is_file() else None, notes)
    masks = p / "masks.fbk"
    run.masks = masks if masks.is_file() else None
    run.label = label or default_label(run)
    return run


def _dedupe(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per round, the last written (a resumed run may repeat one),
    in round order; records without a round are dropped."""
    by_round: dict[int, dict[str, Any]] = {}
    for rec in records:
        if isinstance(rec, dict) and isinstance(rec.get("round"), int):
            by_round[rec["round"]] = rec
    return [by_round[r] for r in sorted(by_round)]


def default_label(run: RunData) -> str:
    name = run.path.resolve().name
    return f"{name} ({run.algorithm})" if run.algorithm else name


def disambiguate(runs: list[RunData]) -> None:
    """Runs whose default labels collide get their parent folder prefixed."""
    counts = Counter(r.label for r in runs)
    for r in runs:
        if counts[r.label] > 1:
            r.label = f"{r.path.resolve().parent.name}/{r.label}"


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.") or "run"


# --- matplotlib plumbing -----------------------------------------------------------

def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path, report: Report) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    report.written.append(path)


def _run_colours(n: int) -> list:
    from matplotlib import colormaps
    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _class_colours(n: int) -> list:
    from matplotlib import colormaps
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    cmap = colormaps["turbo"]
    return [cmap(i / max(n - 1, 1)) for i in range(n)]


def human_bytes(x: float, _pos: Any = None) -> str:
    """Decimal units (1 kB = 1000 B), so axis ticks fall on round numbers."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(x) < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.4g} {unit}"
        x /= 1000.0
    return f"{x:.4g} TB"  # unreachable


def _log_minor_label(x: float, _pos: Any = None) -> str:
    """Label the 2x and 5x minor ticks of a log axis (the decades are major)."""
    if x <= 0:
        return ""
    lead = x / 10 ** math.floor(math.log10(x) + 1e-9)
    return human_bytes(x) if round(lead) in (2, 5) and abs(lead - round(lead)) < 1e-6 else ""


# --- accuracy --------------------------------------------------------------------

def plot_accuracy(runs: list[RunData], axis: str, path: Path, report: Report) -> None:
    """axis: "round" or "time" (wall seconds since the server started)."""
    xkey = "round" if axis == "round" else "wall_s"
    fig = _figure(9.0, 5.2)
    ax = fig.add_subplot()
    drawn = 0
    colours = _run_colours(len(runs))
    single = len(runs) == 1
    for run, colour in zip(runs, colours):
        for key, name, style, marker in ACC_METRICS:
            pts = [r for r in run.records
                   if _num(r.get(f"{key}_mean")) is not None and _num(r.get(xkey)) is not None]
            if not pts:
                continue
            x = np.array([float(r[xkey]) for r in pts])
            y = np.array([float(r[f"{key}_mean"]) for r in pts])
            sd = np.array([_num(r.get(f"{key}_std")) or 0.0 for r in pts])
            label = name if single else f"{run.label}: {name}"
            kw = {"marker": marker, "markersize": 4} if len(pts) <= 60 else {}
            c = colour if not single or key == "acc" else _SINGLE_RUN_COLOUR[key]
            ax.plot(x, y, style, color=c, label=label, linewidth=1.8, **kw)
            ax.fill_between(x, np.clip(y - sd, 0, None), np.clip(y + sd, None, 1.0),
                            color=c, alpha=0.15, linewidth=0)
            drawn += 1
    what = "round" if axis == "round" else "wall time"
    if not drawn:
        report.skipped.append(f"{path.name}: no evaluated rounds in any run")
        return
    for run in runs:
        if not any(_num(r.get("acc_mean")) is not None or _num(r.get("proto_acc_mean"))
                   is not None for r in run.records):
            report.skipped.append(f"{path.name}: {run.label} has no evaluated rounds")
    _accuracy_axes(ax, axis, "wall time since the server started (s)")
    title = f"Test accuracy against {what}"
    if single:
        title = f"{runs[0].label}: test accuracy against {what}"
    ax.set_title(title + "\n(shaded: ± std over clients)", fontsize=11)
    if drawn <= 4:
        ax.legend(loc="best", fontsize=9)
    else:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    _save(fig, path, report)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


# --- accuracy by group -------------------------------------------------------------------

@dataclass
class Curve:
    """One metric of one group: the mean over its runs at each round every run evaluated,
    and the min and max over them (the band)."""
    rounds: np.ndarray
    x: np.ndarray  # rounds, or the runs' mean wall_s at those rounds
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    partial_rounds: list[int]  # evaluated in some of the group's runs only: not drawn


def group_curve(runs: list[RunData], key: str, axis: str = "round") -> Curve | None:
    """`key`_mean of each run by round; None when no run of the group records it."""
    per_run = []
    for run in runs:
        points = {int(r["round"]): (float(r[f"{key}_mean"]), _num(r.get("wall_s")))
                  for r in run.records if _num(r.get(f"{key}_mean")) is not None}
        per_run.append(points)
    if not any(per_run):
        return None
    everywhere = sorted(set.intersection(*(set(p) for p in per_run)))
    partial = sorted(set().union(*(set(p) for p in per_run)) - set(everywhere))
    values = np.array([[p[r][0] for r in everywhere] for p in per_run]).reshape(
        len(per_run), len(everywhere))
    rounds = np.array(everywhere, dtype=float)
    x = rounds
    if axis == "time":
        times = np.array([[p[r][1] if p[r][1] is not None else np.nan for r in everywhere]
                          for p in per_run]).reshape(len(per_run), len(everywhere))
        x = times.mean(axis=0)
    return Curve(rounds, x, values.mean(axis=0), values.min(axis=0), values.max(axis=0),
                 partial)


def plot_group_accuracy(groups: dict[str, list[RunData]], axis: str, path: Path,
                        report: Report, keys: list[str] | None = None) -> None:
    """One mean curve per group and metric, shaded between the group's lowest and highest
    run (min-max: with a few seeds a std band would claim more than the runs show)."""
    from matplotlib.patches import Patch
    fig = _figure(9.0, 5.2)
    ax = fig.add_subplot()
    drawn = 0
    for (name, runs), colour in zip(groups.items(), _run_colours(len(groups))):
        for key, what, style, marker in ACC_METRICS:
            curve = group_curve(runs, key, axis)
            if curve is None:
                continue
            if curve.partial_rounds:
                report.notes.append(
                    f"{path.name}: {name}: {key} at round(s) "
                    f"{', '.join(map(str, curve.partial_rounds))} is in only some of its "
                    f"{len(runs)} runs, not drawn")
            keep = np.isfinite(curve.x)
            if not keep.any():
                continue
            kw = {"marker": marker, "markersize": 4} if keep.sum() <= 60 else {}
            ax.plot(curve.x[keep], curve.mean[keep], style, color=colour, linewidth=1.8,
                    label=f"{name} ({len(runs)} runs): {what}", **kw)
            ax.fill_between(curve.x[keep], curve.low[keep], curve.high[keep], color=colour,
                            alpha=0.15, linewidth=0)
            drawn += 1
    if not drawn:
        report.skipped.append(f"{path.name}: no evaluated rounds in any group")
        return
    _accuracy_axes(ax, axis, "wall time since the server started (s; mean over the group's "
                   "runs)")
    ax.set_title(f"Test accuracy against {'round' if axis == 'round' else 'wall time'}, "
                 "by group\n(line: mean over the group's runs; shaded: min-max over them)",
                 fontsize=11)
    handles, _ = ax.get_legend_handles_labels()
    handles.append(Patch(color="grey", alpha=0.3, label="shaded: min-max over the runs"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
              title=", ".join(keys) if keys else None, title_fontsize=8)
    _save(fig, path, report)


def load_groups(paths: list[str | Path], keys: list[str]
                ) -> tuple[dict[str, list[RunData]], list[str]]:
    """The runs named (run, sweep or folder of run directories, as `fedbus table` reads
    them) by their values of the config `keys`, and notes on the runs that are incomplete
    (drawn as far as they go) or absent. TableError: a key no run has."""
    from fedbus.analysis.table import check_key, group_runs, select_runs

    selection = select_runs(paths)
    notes = list(selection.notes)
    present = [r for r in selection.runs if is_run_dir(r.path)]
    notes += [f"{r.path}: {r.problem}, not drawn" for r in selection.runs if r not in present]
    notes += [f"{r.path}: {r.problem}, drawn as far as it goes" for r in present
              if not r.complete]
    if not present:
        raise NotARunDir("no run directory among " + ", ".join(map(str, paths)))
    for key in keys:
        check_key(present, key, "--group-by")
    groups = {", ".join(values): [load_run(r.path) for r in members]
              for values, members in group_runs(present, keys).items()}
    return groups, notes


def plot_groups(groups: dict[str, list[RunData]], out: Path,
                keys: list[str] | None = None) -> Report:
    """`fedbus plot --group-by`: the accuracy figures with one mean curve and band per
    group (named by its values of `keys`, the legend's title). Per-run figures
    (participation, t-SNE, ...) are one run's: not drawn here."""
    report = Report()
    for runs in groups.values():
        for run in runs:
            for note in run.notes:
                report.skipped.append(f"{run.label}: {note}")
            if not run.records:
                report.skipped.append(f"{run.label}: metrics.jsonl missing or empty "
                                      "(no round was recorded)")
    plot_group_accuracy(groups, "round", out / "accuracy-round.png", report, keys)
    plot_group_accuracy(groups, "time", out / "accuracy-time.png", report, keys)
    report.notes.append("per-run figures (participation, t-SNE, bytes, ...) are not drawn "
                        "with --group-by: plot a run on its own for them")
    return report


# --- bytes -------------------------------------------------------------------------

def plot_bytes(runs: list[RunData], path: Path, report: Report) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    series = []
    for run in runs:
        recs = [r for r in run.records if "bytes_up" in r or "bytes_down" in r]
        if not recs:
            if run.records:  # else already said by plot_runs
                report.skipped.append(f"{path.name}: {run.label} has no traffic recorded")
            continue
        x = np.array([r["round"] for r in recs], dtype=float)
        up = np.array([float(r.get("bytes_up") or 0) for r in recs])
        down = np.array([float(r.get("bytes_down") or 0) for r in recs])
        series.append((run, x, up, down))
    if not series:
        report.skipped.append(f"{path.name}: no rounds recorded in any run")
        return
    fig = _figure(12.0, 5.0)
    ax1, ax2 = fig.subplots(1, 2)
    colours = _run_colours(len(runs))
    colour_of = {id(r): c for r, c in zip(runs, colours)}
    single = len(series) == 1
    positive = np.concatenate([np.concatenate([u, d]) for _, _, u, d in series])
    positive = positive[positive > 0]
    from matplotlib.lines import Line2D
    for run, x, up, down in series:
        c = colour_of[id(run)]
        kw = {"marker": "o", "markersize": 3} if len(x) <= 60 else {}
        ax1.plot(x, up, "-", color="C0" if single else c, **kw)
        ax1.plot(x, down, "--", color="C3" if single else c, **kw)
        ax2.plot(x, np.cumsum(up + down), "-", color=c, label=run.label, linewidth=1.8)
    if single:
        handles = [Line2D([], [], color="C0", linestyle="-", label="up (client → server)"),
                   Line2D([], [], color="C3", linestyle="--", label="down (server → client)")]
    else:  # colour: the run (as on the right); line style: the direction
        handles = [Line2D([], [], color="black", linestyle="-", label="up (client → server)"),
                   Line2D([], [], color="black", linestyle="--",
                          label="down (server → client)")]
    logscale = len(positive) and positive.max() / positive.min() > 50
    if logscale:
        ax1.set_yscale("log")
        ax1.yaxis.set_minor_formatter(FuncFormatter(_log_minor_label))
    fmt = FuncFormatter(human_bytes)
    for ax in (ax1, ax2):
        ax.yaxis.set_major_formatter(fmt)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.grid(True, alpha=0.3)
    if not logscale:  # from 0, with room above the highest line
        ax1.set_ylim(0, max(float(positive.max()) if len(positive) else 1.0, 1.0) * 1.1)
    ax1.set_ylabel("bytes per round (all clients)" + (", log scale" if logscale else ""))
    ax1.set_title("Traffic per round", fontsize=11)
    ax2.set_ylabel("cumulative bytes (up + down)")
    ax2.set_ylim(bottom=0)
    ax2.set_title("Cumulative traffic", fontsize=11)
    ax1.legend(handles=handles, fontsize=8, loc="best")
    ax2.legend(fontsize=8, loc="upper left")
    if single:
        fig.suptitle(series[0][0].label, fontsize=12)
    _save(fig, path, report)


# --- participation -----------------------------------------------------------------

# code, legend name, colour
STATUSES = (
    (0, "not sampled", "#eeeeee"),
    (1, "trained", "#1b7837"),
    (2, "partial work", "#a6dba0"),
    (3, "late update folded in", "#4393c3"),
    (4, "late (no update by the deadline)", "#f4a442"),
    (5, "dropped its task", "#d6301f"),
    (6, "dead (lost with its node)", "#3a3a3a"),
    (7, "refused / error", "#8c6bb1"),
    (8, "timed out (async: its task expired)", "#fdd49e"),
)
# a record's failure codes (fedbus.node.engine.FAILURES); a failed secure aggregation's
# inputs ("secagg") count with the refused
FAILURE_CODE = {"late": 4, "timed_out": 8, "dropped": 5, "dead": 6, "rejected": 7, "error": 7, "secagg": 7}


def participation_matrix(records: list[dict[str, Any]], clients: int | None
                         ) -> tuple[np.ndarray, list[int]]:
    """[clients, rounds] status codes (see STATUSES) and the rounds (columns)."""
    seen = 0
    for rec in records:
        ids = list(rec.get("participants") or []) + [int(c) for c in (rec.get("failures") or {})
                                                      if str(c).lstrip("-").isdigit()]
        if ids:
            seen = max(seen, max(int(c) for c in ids) + 1)
    n = max(int(clients or 0), seen)
    rounds = [int(r["round"]) for r in records]
    grid = np.zeros((n, len(rounds)), dtype=np.int8)
    for j, rec in enumerate(records):
        # one cell, one status: a fresh update > a failure of this round's task >
        # a late update from an earlier round folded in here
        stale = Counter(int(s[0]) for s in (rec.get("stale") or [])
                        if isinstance(s, (list, tuple)) and s)
        partial = {int(c) for c in rec.get("partial_clients") or []}
        fresh: dict[int, int] = {}
        for c, k in Counter(int(c) for c in rec.get("participants") or []).items():
            if not 0 <= c < n:
                continue
            if k > stale.get(c, 0) or c in partial:
                fresh[c] = 2 if c in partial else 1
            else:
                grid[c, j] = 3
        for c, why in (rec.get("failures") or {}).items():
            if str(c).lstrip("-").isdigit() and 0 <= int(c) < n:
                grid[int(c), j] = FAILURE_CODE.get(str(why), 7)
        for c, code in fresh.items():
            grid[c, j] = code
    return grid, rounds


def plot_participation(run: RunData, path: Path, report: Report) -> None:
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    if not run.records:
        report.skipped.append(f"{path.name}: {run.label} has no rounds recorded")
        return
    clients = run.config.get("federation", {}).get("clients")
    grid, rounds = participation_matrix(run.records, clients if isinstance(clients, int)
                                        else None)
    n, r = grid.shape
    if n == 0:
        report.skipped.append(f"{path.name}: {run.label} has no clients")
        return
    width = min(max(4.0 + 0.3 * r, 8.0), 16.0)
    height = min(max(2.2 + 0.28 * n, 4.0), 12.0)
    fig = _figure(width, height)
    ax = fig.add_subplot()
    cmap = ListedColormap([c for _, _, c in STATUSES])
    ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(STATUSES) - 0.5, aspect="auto",
              interpolation="nearest", origin="upper",
              extent=(rounds[0] - 0.5, rounds[-1] + 0.5, n - 0.5, -0.5))
    if n <= 60 and r <= 120:
        ax.set_xticks(np.arange(rounds[0] - 0.5, rounds[-1] + 0.5, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, n, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=1.0)
        ax.tick_params(which="minor", length=0)
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(r, 20)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n, 25)))
    ax.set_xlabel("round")
    ax.set_ylabel("client")
    present = set(np.unique(grid).tolist())
    handles = [Patch(facecolor=c, edgecolor="#999999", label=name)
               for code, name, c in STATUSES if code in present]
    fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 4),
               fontsize=9, frameon=False)
    trained = np.isin(grid, (1, 2, 3)).sum()
    ax.set_title(f"{run.label}: participation ({n} clients × {r} rounds, "
                 f"{trained} updates aggregated)", fontsize=11)
    _save(fig, path, report)


# --- t-SNE of embeddings -------------------------------------------------------------

def load_embeddings(path: Path) -> dict[str, Any]:
    from fedbus.broker.wire import decode_body
    raw = path.read_bytes()
    body = decode_body(raw, max_frame=max(len(raw), 1))
    if not isinstance(body, dict):
        raise TypeError("embeddings.fbk does not hold a map")
    return body


def tsne_inputs(body: dict[str, Any], max_points: int, seed: int = 0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, list[str]]:
    """(h [n, D], y [n], protos [p, D], proto classes [p], clients used, notes)."""
    notes: list[str] = []
    protos = body.get("protos")
    pv = np.zeros((0, 0), np.float32)
    pc = np.zeros(0, np.int64)
    if protos is not None:
        p = np.asarray(protos, dtype=np.float64)
        if p.ndim in (2, 3) and p.size:
            classes = np.arange(p.shape[0])
            if p.ndim == 3:  # [C, K, D]: a pool of prototypes per class
                classes = np.repeat(classes, p.shape[1])
            p = p.reshape(-1, p.shape[-1])
            ok = np.isfinite(p).all(axis=1)
            mask = body.get("mask")
            if mask is not None:
                m = np.asarray(mask, dtype=bool).reshape(-1)
                ok &= m if m.shape == ok.shape else True
            else:
                ok &= np.abs(p).sum(axis=1) > 0
            pv, pc = p[ok], classes[ok]
        else:
            notes.append(f"prototypes of shape {p.shape} not understood")
    dim = pv.shape[1] if len(pv) else None
    hs, ys, used = [], [], 0
    clients = body.get("clients") or {}
    for cid in sorted(clients, key=lambda c: (len(str(c)), str(c))):
        entry = clients[cid]
        if not isinstance(entry, dict) or entry.get("h") is None or entry.get("y") is None:
            continue
        h = np.asarray(entry["h"], dtype=np.float64)
        y = np.asarray(entry["y"]).reshape(-1).astype(np.int64)
        if h.ndim != 2 or len(h) != len(y) or not len(h):
            continue
        if dim is None:
            dim = h.shape[1]
        if h.shape[1] != dim:
            notes.append(f"client {cid}: embedding dim {h.shape[1]} != {dim}, left out")
            continue
        ok = np.isfinite(h).all(axis=1)
        hs.append(h[ok])
        ys.append(y[ok])
        used += 1
    if not hs:
        return np.zeros((0, dim or 0)), np.zeros(0, np.int64), pv, pc, 0, notes
    h, y = np.concatenate(hs), np.concatenate(ys)
    if len(h) > max_points:
        pick = np.sort(np.random.default_rng(seed).choice(len(h), max_points, replace=False))
        notes.append(f"{len(h)} embeddings, a random {max_points} shown")
        h, y = h[pick], y[pick]
    return h, y, pv, pc, used, notes


def plot_tsne(run: RunData, path: Path, report: Report, *, max_points: int = 2000) -> None:
    if run.embeddings is None:
        rounds = run.config.get("federation", {}).get("rounds")
        done = (run.summary or {}).get("rounds_completed")
        if run.summary is None or (isinstance(rounds, int) and isinstance(done, int)
                                   and done < rounds):
            why = "the run did not finish"
        else:
            why = "log.embeddings = 0, or no client answered the final evaluation"
        report.skipped.append(f"{path.name}: {run.label} has no embeddings.fbk ({why})")
        return
    try:
        body = load_embeddings(run.embeddings)
    except (OSError, ValueError, TypeError) as err:  # WireError is a ValueError
        report.skipped.append(f"{path.name}: {run.embeddings} unreadable ({err})")
        return
    h, y, pv, pc, used, notes = tsne_inputs(body, max_points)
    for note in notes:
        report.notes.append(f"{path.name}: {run.label}: {note}")
    n = len(h) + len(pv)
    if len(h) < 5 or n < 6:
        report.skipped.append(f"{path.name}: {run.label}: too few embeddings ({len(h)}) "
                              "for a t-SNE")
        return
    from sklearn.manifold import TSNE
    x = np.concatenate([h, pv]) if len(pv) else h
    # one scale for embeddings and prototypes alike, as t-SNE sees distances
    x = (x - x.mean(axis=0)) / (x.std() + 1e-12)
    z = TSNE(n_components=2, perplexity=float(min(30, n - 1)), init="pca",
             learning_rate="auto", random_state=0).fit_transform(x.astype(np.float32))
    zh, zp = z[:len(h)], z[len(h):]
    num_classes = int(max(y.max(initial=-1), pc.max(initial=-1)) + 1)
    colours = _class_colours(num_classes)
    fig = _figure(9.0, 7.2)
    ax = fig.add_subplot()
    from matplotlib.lines import Line2D
    handles = []
    for c in range(num_classes):
        sel = y == c
        if sel.any():
            ax.scatter(zh[sel, 0], zh[sel, 1], s=14, color=colours[c], alpha=0.65,
                       linewidths=0)
        psel = pc == c
        if psel.any():
            ax.scatter(zp[psel, 0], zp[psel, 1], s=380, marker="*", color=colours[c],
                       edgecolors="black", linewidths=1.3, zorder=3)
        if sel.any() or psel.any():
            handles.append(Line2D([], [], marker="o", linestyle="", color=colours[c],
                                  markersize=7, label=f"class {c}"))
    if len(pv):
        handles.append(Line2D([], [], marker="*", linestyle="", color="#bbbbbb",
                              markeredgecolor="black", markersize=15,
                              label="global prototype"))
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("t-SNE 1")
    ax.set_ylabel("t-SNE 2")
    protos = f"{len(pv)} global prototypes (stars)" if len(pv) else "no global prototypes"
    ax.set_title(f"{run.label}: t-SNE of {len(h)} test embeddings from {used} clients,\n"
                 f"{protos}; colour = class", fontsize=11)
    if len(handles) <= 21:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9,
                  frameon=False)
    _save(fig, path, report)


# --- segmentation masks ----------------------------------------------------------------

def class_palette(n: int = 256) -> np.ndarray:
    """uint8 [n, 3]: Pascal VOC's colour map (class 0 black, 1 dark red, 2 dark green,
    ...; the bit-interleaving rule of the VOC devkit), so a class keeps its colour in
    every figure; index 255 (ignored pixels) is drawn white."""
    pal = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        pal[i] = (r, g, b)
    if n > 255:
        pal[255] = (255, 255, 255)
    return pal


def mask_rows(body: dict[str, Any], max_rows: int = 8
              ) -> tuple[list[tuple[str, np.ndarray, np.ndarray, np.ndarray]], list[str]]:
    """(client, image uint8 [H, W, 3], truth [H, W], prediction [H, W]) rows of a
    masks.fbk body, clients in id order; malformed entries are left out with a note."""
    rows, notes = [], []
    clients = body.get("clients") or {}
    for cid in sorted(clients, key=lambda c: (len(str(c)), str(c))):
        e = clients[cid]
        try:
            img, truth, pred = (np.asarray(e[k]) for k in ("image", "truth", "pred"))
        except (KeyError, TypeError):
            notes.append(f"client {cid}: masks entry not understood, left out")
            continue
        if img.ndim != 4 or truth.shape != pred.shape or truth.shape != img.shape[:3]:
            notes.append(f"client {cid}: mask shapes {img.shape}, {truth.shape}, "
                         f"{pred.shape} do not match, left out")
            continue
        for i in range(len(img)):
            rows.append((str(cid), img[i], truth[i], pred[i]))
    if len(rows) > max_rows:
        notes.append(f"{len(rows)} images, the first {max_rows} shown")
        rows = rows[:max_rows]
    return rows, notes


def plot_masks(run: RunData, path: Path, report: Report) -> None:
    """A grid of final test images, one a row: image | ground truth | prediction (the
    model each algorithm scores, ClientHandler.masks), classes in class_palette's
    colours; written for segmentation runs only (they leave masks.fbk)."""
    if run.masks is None:
        return
    try:
        body = load_embeddings(run.masks)  # the same wire-encoded map
    except (OSError, ValueError, TypeError) as err:
        report.skipped.append(f"{path.name}: {run.masks} unreadable ({err})")
        return
    rows, notes = mask_rows(body)
    for note in notes:
        report.notes.append(f"{path.name}: {run.label}: {note}")
    if not rows:
        report.skipped.append(f"{path.name}: {run.label}: masks.fbk holds no image")
        return
    pal = class_palette()
    names = (run.config.get("data") or {}).get("dataset", "")
    fig = _figure(7.2, 2.3 * len(rows) + 1.0)
    axes = np.atleast_2d(fig.subplots(len(rows), 3))
    for r, (cid, img, truth, pred) in enumerate(rows):
        for c, (what, pic) in enumerate((("image", img), ("ground truth", pal[truth]),
                                         ("prediction", pal[pred]))):
            ax = axes[r, c]
            ax.imshow(pic, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title(what, fontsize=10)
            if c == 0:
                ax.set_ylabel(f"client {cid}", fontsize=9)
    classes = sorted({int(v) for _, _, t, p in rows for v in np.unique(np.r_[t.ravel(),
                                                                              p.ravel()])
                      if v != 255})
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=pal[k] / 255.0, label=f"class {k}") for k in classes],
               loc="outside lower center", ncol=min(len(classes), 7), fontsize=8,
               frameon=False)
    fig.suptitle(f"{run.label}: final predictions{f' ({names})' if names else ''}",
                 fontsize=11)
    _save(fig, path, report)


# --- Michieli & Ozay's analysis: AMM, attention, FFD ----------------------------------

def _agg_points(run: RunData, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, values) of the scalar agg.<key> of each record that has it."""
    pts = [(r["round"], _num((r.get("agg") or {}).get(key))) for r in run.records]
    pts = [(x, y) for x, y in pts if y is not None]
    return (np.array([p[0] for p in pts], dtype=float), np.array([p[1] for p in pts]))


def _note_missing(runs: list[RunData], have: list[RunData], path: Path, what: str,
                  report: Report) -> None:
    for run in runs:
        if run not in have:
            report.notes.append(f"{path.name}: {run.label} records no {what}, not drawn")


def plot_amm(runs: list[RunData], path: Path, report: Report) -> None:
    """agg.amm (eq. 15 as printed) and agg.amm_dist per round, runs overlaid; written
    only when some run records them (proto-attention does)."""
    from matplotlib.ticker import MaxNLocator
    have = [r for r in runs if len(_agg_points(r, "amm")[0])]
    if not have:
        return
    _note_missing(runs, have, path, "agg.amm", report)
    dist = any(len(_agg_points(r, "amm_dist")[0]) for r in have)
    fig = _figure(12.0 if dist else 8.0, 4.8)
    axes = fig.subplots(1, 2 if dist else 1)
    axes = list(np.atleast_1d(axes))
    colours = _run_colours(len(runs))
    colour_of = {id(r): c for r, c in zip(runs, colours)}
    panels = [("amm", "AMM μ̄[t] (eq. 15 as printed)", "aggregate mean margin, eq. 15")]
    if dist:
        panels.append(("amm_dist", "mean d⁻ − d⁺ (amm_dist)",
                       "un-normalised margin (our reading of Table 4)"))
    for ax, (key, ylabel, title) in zip(axes, panels):
        for run in have:
            x, y = _agg_points(run, key)
            if len(x):
                kw = {"marker": "o", "markersize": 3} if len(x) <= 60 else {}
                ax.plot(x, y, "-", color=colour_of[id(run)], label=run.label, linewidth=1.8,
                        **kw)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    fig.suptitle("Prototype margins of the aggregate (Michieli & Ozay)", fontsize=12)
    _save(fig, path, report)


def attention_matrix(records: list[dict[str, Any]], clients: int | None
                     ) -> tuple[np.ndarray, list[int]]:
    """[clients, rounds] attention a^t[k] from agg_extra.attention (NaN: the client's
    update was not in that aggregation, or the round recorded none), and the rounds
    (columns): every round from the first to the last that records attention."""
    rows = [r for r in records if isinstance((r.get("agg_extra") or {}).get("attention"), dict)]
    if not rows:
        return np.zeros((0, 0)), []
    seen = [int(c) for r in rows for c in r["agg_extra"]["attention"] if str(c).isdigit()]
    n = max(int(clients or 0), max(seen, default=-1) + 1)
    first, last = min(r["round"] for r in rows), max(r["round"] for r in rows)
    grid = np.full((n, last - first + 1), np.nan)
    for rec in rows:
        for c, a in rec["agg_extra"]["attention"].items():
            if str(c).isdigit() and _num(a) is not None:
                grid[int(c), rec["round"] - first] = float(a)
    return grid, list(range(first, last + 1))


def plot_attention(run: RunData, path: Path, report: Report) -> None:
    """Heatmap of each client's attention per aggregation (agg_extra.attention, recorded
    by proto-attention and fedatt); written only when the run records it."""
    clients = run.config.get("federation", {}).get("clients")
    grid, rounds = attention_matrix(run.records, clients if isinstance(clients, int) else None)
    if not rounds or not np.isfinite(grid).any():
        return
    from matplotlib import colormaps
    from matplotlib.ticker import MaxNLocator
    n, r = grid.shape
    fig = _figure(min(max(5.0 + 0.3 * r, 8.0), 16.0), min(max(2.4 + 0.28 * n, 4.0), 12.0))
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="#e6e6e6")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, aspect="auto",
                   interpolation="nearest", origin="upper",
                   extent=(rounds[0] - 0.5, rounds[-1] + 0.5, n - 0.5, -0.5))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(r, 20)))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(n, 25)))
    ax.set_xlabel("round")
    ax.set_ylabel("client")
    fig.colorbar(im, ax=ax, label="attention a[k] (sums to 1 per aggregation)")
    ax.set_title(f"{run.label}: attention per client and aggregation\n"
                 "(grey: not in that aggregation)", fontsize=11)
    _save(fig, path, report)


def _ffd_points(run: RunData) -> list[dict[str, Any]]:
    return [r for r in run.records if _num(r.get("ffd_mean")) is not None]


def plot_ffd(runs: list[RunData], path: Path, report: Report) -> None:
    """FFD (eq. 16: mean over clients of the MMD against the reference run's features)
    per round, runs overlaid; right: eq. 17's FFD % of each run against the first one
    (several runs), or the per-client MMD of the last evaluation (one run)."""
    from matplotlib.ticker import MaxNLocator

    from fedbus.analysis.ffd import ffd_gain
    have = [r for r in runs if _ffd_points(r)]
    if not have:
        return
    _note_missing(runs, have, path, "ffd (log.ffd_reference unset)", report)
    fig = _figure(13.0, 5.0)
    ax1, ax2 = fig.subplots(1, 2)
    colours = _run_colours(len(runs))
    colour_of = {id(r): c for r, c in zip(runs, colours)}
    for run in have:
        pts = _ffd_points(run)
        x = np.array([float(r["round"]) for r in pts])
        y = np.array([float(r["ffd_mean"]) for r in pts])
        sd = np.array([_num(r.get("ffd_std")) or 0.0 for r in pts])
        kw = {"marker": "o", "markersize": 3} if len(x) <= 60 else {}
        c = colour_of[id(run)]
        ax1.plot(x, y, "-", color=c, label=run.label, linewidth=1.8, **kw)
        ax1.fill_between(x, np.clip(y - sd, 0, None), y + sd, color=c, alpha=0.15,
                         linewidth=0)
    ax1.set_xlabel("round")
    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_ylabel("MMD to the reference's features (mean over clients)")
    ax1.set_ylim(bottom=0)
    ax1.set_title("Feature discrepancy per round (eq. 16; shaded: ± std over clients)",
                  fontsize=10)
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize=8, loc="best")
    if len(have) > 1:
        base = have[0]
        b = float(_ffd_points(base)[-1]["ffd_mean"])
        others = have[1:]
        gains = [ffd_gain(b, float(_ffd_points(r)[-1]["ffd_mean"])) if b > 0 else np.nan
                 for r in others]
        ax2.bar(range(len(others)), np.nan_to_num(gains), width=0.6,
                color=[colour_of[id(r)] for r in others])
        ax2.set_xlim(-0.7, max(len(others), 2) - 0.3)
        ax2.set_xticks(range(len(others)))
        ax2.set_xticklabels([r.label for r in others], rotation=20, ha="right", fontsize=8)
        ax2.axhline(0.0, color="black", linewidth=0.8)
        for i, g in enumerate(gains):
            ax2.annotate(f"{g:+.1f} %" if np.isfinite(g) else "n/a", (i, np.nan_to_num(g)),
                         ha="center", va="bottom" if np.nan_to_num(g) >= 0 else "top",
                         fontsize=9)
        ax2.set_ylabel("FFD (%)")
        ax2.set_title(f"FFD against {base.label} at the last evaluation\n"
                      "(eq. 17; higher = features closer to the reference)", fontsize=10)
    else:
        last = _ffd_points(have[0])[-1]
        per = {int(k): _num(v) for k, v in (last.get("ffd") or {}).items()
               if str(k).isdigit() and _num(v) is not None}
        ks = sorted(per)
        ax2.bar(ks, [per[k] for k in ks], color=colour_of[id(have[0])])
        ax2.set_xlabel("client")
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(max(len(ks), 1), 25)))
        ax2.set_ylabel("MMD to the reference's features")
        ax2.set_title(f"Per client, round {last['round']} (the last evaluation)", fontsize=10)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle("Federated feature discrepancy against the reference (central) model",
                 fontsize=12)
    _save(fig, path, report)


# --- all of them ------------------------------------------------------------------

def plot_runs(runs: list[RunData], out: Path, *, tsne: bool = True,
              tsne_points: int = 2000) -> Report:
    report = Report()
    for run in runs:
        for note in run.notes:
            report.skipped.append(f"{run.label}: {note}")
        if not run.records:
            report.skipped.append(f"{run.label}: metrics.jsonl missing or empty "
                                  "(no round was recorded)")
    plot_accuracy(runs, "round", out / "accuracy-round.png", report)
    plot_accuracy(runs, "time", out / "accuracy-time.png", report)
    plot_bytes(runs, out / "bytes.png", report)
    plot_amm(runs, out / "amm.png", report)
    plot_ffd(runs, out / "ffd.png", report)
    names: set[str] = set()
    for run in runs:
        suffix = ""
        if len(runs) > 1:
            suffix = "-" + slug(run.label)
            while suffix in names:
                suffix += "_"
            names.add(suffix)
        plot_participation(run, out / f"participation{suffix}.png", report)
        plot_attention(run, out / f"attention{suffix}.png", report)
        plot_masks(run, out / f"masks{suffix}.png", report)
        if tsne:
            plot_tsne(run, out / f"tsne{suffix}.png", report, max_points=tsne_points)
    return report


def _accuracy_axes(ax: Any, axis: str, time_label: str) -> None:
    """The accuracy figures' axes: rounds (0-based) or wall time across, accuracy in %
    up, clipped to [0, 102 %]."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    ax.set_xlabel("round (0-based, as in metrics.jsonl)" if axis == "round" else time_label)
    if axis == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy (mean over clients)")
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    lo, hi = ax.get_ylim()
    ax.set_ylim(max(lo, 0.0), min(hi, 1.02))
    ax.grid(True, alpha=0.3)
