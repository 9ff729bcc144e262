"""One reproduction per paper: named recipes, each rerun with one command.

    fedbus bench reproduce list                                   # the recipes and their settings
    fedbus bench reproduce tan-table1 --out runs/repro            # 3 seeds, the recipe's rounds
    fedbus bench reproduce michieli-mnist --out runs/repro --json docs/michieli-mnist.json
    fedbus bench reproduce fedtgp-hetero --scale smoke            # 1 seed, 2 rounds, few clients

A recipe is data, in bench/recipes/<paper>.toml (one file per paper, read into RECIPES
by load_recipes below): the paper's setting in words, the config sections every run
shares, its rows (label, algorithm and [algorithm] options, the sections a row changes,
the metric, the paper's numbers with the table and row they come from), the expected
ordering, the differences the paper states, and every change of scale from the paper's
setting to this offline 2-core machine. Each (row, seed) is a real `fedbus run`
(bench/common.run: broker, server, client nodes on the CPU); a row whose `mean_of` names
other rows is derived, per seed, as their mean.

Output, per recipe: row | metric | rounds | the paper's number(s) | ours, mean +- std
over seeds of the run's metric (%) | the per-seed values; then the ordering verdict
for ours and for the paper's own numbers (holds, or which pair fails), the stated
differences beside ours, and the scale changes. --json PATH saves the same as JSON.

Scales: "full" (default) is the recipe as written, sized to finish in well under an
hour on 2 cores with 3 seeds (docs/REPRODUCE.md gives the time of each); "smoke" is 1
seed, 2 rounds, 1 local epoch and the recipe's few-clients overrides: a check that
the recipe runs, not a result. --rounds R sets every run's rounds; --set
SECTION.KEY=VALUE changes every run (e.g. --set model.group='["cnn","resnet8"]').

--out keeps the run directories, named ALGORITHM-DIGEST-sSEED where DIGEST hashes the
run's settings (all but the seed): a run whose summary.json holds every round is
reused, so an interrupted recipe resumes where it stopped, and recipes sharing runs
(michieli-mnist and michieli-partial) share them when given the same --out.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomllib

from fedbus.bench.common import mean_std, run_or_reuse
from fedbus.node.config import ConfigError, _parse_override, build_config

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "data" / "mnist-10k.npz"
SCALES = ("full", "smoke")
SUBSET_SEED = 0  # the fixed draw of a recipe's MNIST subset (like a downloaded file)


@dataclass(frozen=True)
class P:
    """One number of a paper (%), with where it stands."""
    value: float
    std: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Row:
    label: str
    algorithm: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)  # [algorithm] options
    set: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # section -> keys
    metric: str = ""  # a metrics.jsonl key; "" = the recipe's
    paper: tuple[P | None, ...] = ()  # one per paper column; None = not in the paper
    mean_of: tuple[str, ...] = ()  # derived: per seed, the mean of these rows


@dataclass(frozen=True)
class Gap:
    """A difference the paper states in words: value = row a - row b (points)."""
    a: str
    b: str
    value: float
    source: str


@dataclass(frozen=True)
class Recipe:
    name: str
    title: str
    paper_setting: str
    base: Mapping[str, Mapping[str, Any]]
    rows: tuple[Row, ...]
    paper_columns: tuple[str, ...]
    metric: str
    order: tuple[str, ...]  # chains "A > B > C": every neighbour pair must hold
    scale_changes: tuple[str, ...]
    at: str = "final"  # the "final" evaluation, or the "best" over evaluations
    eval_every: int = 1  # with at = "best": evaluate every this many rounds (and the last)
    gaps: tuple[Gap, ...] = ()
    subset: int = 0  # MNIST digits drawn (seed 0) from --data; 0 = all
    smoke: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# --- the recipes: bench/recipes/<paper>.toml --------------------------------------------

PAPERS = ("tan", "qiao", "mpfedcl", "michieli", "fedtgp", "fpl", "fednh", "fedhkd", "fedpac",
          "fedpcl")  # their order in `list` and --help


def _build(cls: type, table: Any, where: str, **convert: Callable[[Any, str], Any]) -> Any:
    """cls(**table), the keys named in convert converted by it first; a key that is not a
    field of cls or a missing one is a ValueError naming where (not a table: TypeError)."""
    names = [f.name for f in fields(cls)]
    if not isinstance(table, dict):
        raise TypeError(f"{where}: expected a table with keys {', '.join(names)}")
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; keys are {', '.join(names)}")
    kwargs = {k: convert[k](v, where) if k in convert else v for k, v in table.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required key is missing
        raise ValueError(f"{where}: {e}") from None


def _named(table: Any, key: str, i: int) -> str:
    """How an error names the i-th table of a list: by its `key` (label, name) if it has one."""
    return repr(table[key]) if isinstance(table, dict) and key in table else f"#{i + 1}"


def _strings(value: Any, where: str) -> tuple[str, ...]:
    return tuple(value)


def _paper(value: Any, where: str) -> tuple[P | None, ...]:
    return tuple(_build(P, p, f"{where}, paper") if p else None for p in value)  # {} = none


def _rows(value: Any, where: str) -> tuple[Row, ...]:
    return tuple(_build(Row, r, f"{where}, row {_named(r, 'label', i)}", paper=_paper,
                        mean_of=_strings) for i, r in enumerate(value))


def _gaps(value: Any, where: str) -> tuple[Gap, ...]:
    return tuple(_build(Gap, g, f"{where}, gap #{i + 1}") for i, g in enumerate(value))


def read_recipes(text: str, where: str) -> list[Recipe]:
    """The recipes of one TOML file: a [[recipe]] table each, whose keys are Recipe's fields:
    base and smoke as [recipe.base.SECTION] / [recipe.smoke.SECTION] tables, rows as
    [[recipe.rows]] (Row's fields; `paper` a list of P tables, {} where a column has no
    number) and gaps as [[recipe.gaps]] (Gap's fields); the lists become tuples."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{where}: {e}") from None
    if set(doc) - {"recipe"}:
        raise ValueError(f"{where}: unknown table {min(set(doc) - {'recipe'})!r}; a recipe "
                         "file holds [[recipe]] tables")
    return [_build(Recipe, r, f"{where}, recipe {_named(r, 'name', i)}", rows=_rows, gaps=_gaps,
                   paper_columns=_strings, order=_strings, scale_changes=_strings,
                   notes=_strings) for i, r in enumerate(doc.get("recipe", []))]


def load_recipes(folder: Traversable | Path | None = None) -> dict[str, Recipe]:
    """name -> Recipe from every *.toml in folder (default the package's recipes/): the
    files of PAPERS in that order, then any other in name order; a recipe named twice is an
    error."""
    folder = folder if folder is not None else resources.files("fedbus.bench") / "recipes"
    files = {f.name[:-len(".toml")]: f for f in folder.iterdir() if f.name.endswith(".toml")}
    out: dict[str, Recipe] = {}
    for paper in sorted(files, key=lambda p: (PAPERS.index(p) if p in PAPERS
                                              else len(PAPERS), p)):
        for recipe in read_recipes(files[paper].read_text(encoding="utf-8"),
                                   f"recipes/{paper}.toml"):
            if recipe.name in out:
                raise ValueError(f"recipes/{paper}.toml: recipe {recipe.name!r} is also "
                                 "defined before it")
            out[recipe.name] = recipe
    return out


RECIPES: dict[str, Recipe] = load_recipes()


# --- from a recipe to runs --------------------------------------------------------------

def merge(base: Mapping[str, Mapping[str, Any]],
          *overs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Section-wise update: later mappings win key by key."""
    out = {name: dict(copy.deepcopy(table)) for name, table in base.items()}
    for over in overs:
        for name, table in over.items():
            out.setdefault(name, {}).update(copy.deepcopy(dict(table)))
    return out


def sections(recipe: Recipe, row: Row, seed: int, *, scale: str = "full",
             rounds: int | None = None, extra: Mapping[str, Mapping[str, Any]] | None = None,
             data: str | Path = MNIST) -> dict[str, dict[str, Any]]:
    """The config of one (row, seed): the recipe's base, the row's changes, the scale's,
    --rounds and --set; `data` replaces "{mnist}" (the recipe's subset file when it has
    one). The launch and log sections are the benchmark's (CPU, quiet, no message log)."""
    if row.mean_of:
        raise ValueError(f"row {row.label!r} is derived (mean_of); it has no run")
    smoke = {}
    if scale == "smoke":
        smoke = merge({"federation": {"rounds": 2}, "train": {"epochs": 1}}, recipe.smoke)
    cfg = merge(recipe.base, row.set, smoke, {"federation": {"rounds": rounds}}
                if rounds else {}, extra or {})
    cfg["algorithm"] = {"name": row.algorithm, **row.params, **cfg.get("algorithm", {})}
    ds = cfg.get("data", {}).get("dataset", "")
    if "{mnist}" in ds:
        cfg["data"]["dataset"] = ds.replace("{mnist}", str(Path(data).resolve()))
    fed = cfg["federation"]
    fed.setdefault("rounds", 10)
    fed["seed"] = seed
    if "eval_every" not in (extra or {}).get("federation", {}):  # --set may ask for more
        fed["eval_every"] = recipe.eval_every if recipe.at == "best" else fed["rounds"]
    fed.setdefault("start_timeout_s", 600.0)
    fed.setdefault("hard_deadline_s", 120.0)
    cfg.setdefault("launch", {}).update({"devices": ["cpu"], "threads": 1})
    cfg["launch"].setdefault("nodes", 2)
    cfg["log"] = {"level": "warning", "messages": False, "embeddings": 0}
    return cfg


def run_name(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """ALGORITHM-DIGEST-sSEED; DIGEST hashes every setting but the seed, the launch and log
    sections and the federation's timeouts, so equal runs of two recipes share a name."""
    keep = {name: dict(table) for name, table in cfg.items() if name not in ("launch", "log")}
    keep["federation"] = {k: v for k, v in keep["federation"].items()
                          if k not in ("seed", "start_timeout_s", "hard_deadline_s")}
    digest = hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode())
    return f"{cfg['algorithm']['name']}-{digest.hexdigest()[:10]}-s{cfg['federation']['seed']}"


def metric_value(records: list[Mapping[str, Any]], key: str, at: str = "final") -> float | None:
    """The metric (%) of a run's metrics.jsonl records: the last evaluation's, or the best
    over evaluations; None when no evaluation has it."""
    vals = [float(r[key]) for r in records if r.get(key) is not None
            and not math.isnan(float(r[key]))]
    if not vals:
        return None
    return 100.0 * (max(vals) if at == "best" else vals[-1])


def _records(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(x) for x in lines if x.strip()]


def make_subset(source: Path, n: int, out: Path) -> Path:
    """OUT/data/STEM-N.npz: n samples of the npz at source drawn with seed 0 (written once)."""
    import numpy as np

    path = out / "data" / f"{source.stem}-{n}.npz"
    if not path.exists():
        with np.load(source, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
        if n > len(y):
            raise ValueError(f"subset of {n} samples from {source}, which has {len(y)}")
        idx = np.sort(np.random.default_rng(SUBSET_SEED).permutation(len(y))[:n])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, x=x[idx], y=y[idx])
        tmp.replace(path)
    return path


# --- the table and the verdicts ---------------------------------------------------------

def order_pairs(order: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """["A > B > C", "A > D"] -> [(A, B), (B, C), (A, D)]."""
    pairs = []
    for chain in order:
        labels = [x.strip() for x in chain.split(">")]
        pairs += list(itertools.pairwise(labels))
    return pairs


def judge(pairs: list[tuple[str, str, float | None, float | None]]) -> tuple[str, list[str]]:
    """(verdict, reasons) of "hi > lo" pairs with their values: "does not hold" (the failing
    pairs named) when any judged pair fails, "holds" when every judged pair holds, "not
    judged" when none could be; a pair with a missing value is named and left out."""
    failed, missing, judged = [], [], 0
    for hi, lo, a, b in pairs:
        if a is None or b is None or math.isnan(a) or math.isnan(b):
            missing.append(f"not judged: {hi} or {lo} has no number")
            continue
        judged += 1
        if not a > b:
            failed.append(f"{hi} ({a:.2f}) is not above {lo} ({b:.2f})")
    if failed:
        return "does not hold", failed + missing
    return ("holds" if judged else "not judged"), missing


def verdict(order: tuple[str, ...] | list[str],
            values: Mapping[str, float | None]) -> tuple[str, list[str]]:
    """The expected ordering over values (label -> number; None or nan = none)."""
    return judge([(hi, lo, values.get(hi), values.get(lo)) for hi, lo in order_pairs(order)])


def paired_verdict(order: tuple[str, ...] | list[str],
                   values: Mapping[str, list[float | None]], seeds: list[int]
                   ) -> tuple[str, list[str], list[dict[str, Any]]]:
    """The expected ordering judged seed by seed: a recipe's seed fixes the partition and
    the initial model for every method, so for each pair "hi > lo" the differences hi - lo
    of the seeds both have are the evidence. Each pair: mean and 95 % Student t interval
    (fedbus.analysis.table.paired_difference); it holds when the interval lies above 0,
    fails when below, and is unresolved when it spans 0 or rests on one seed. The ordering
    fails when a pair fails, holds when every pair holds, is unresolved otherwise, and is
    not judged when no pair has a number. Returns (verdict, one line per pair, pair dicts)."""
    from fedbus.analysis.table import paired_difference

    lines, pairs, states = [], [], []
    for hi, lo in order_pairs(order):
        a = {s: v for s, v in zip(seeds, values.get(hi, [])) if _number(v)}
        b = {s: v for s, v in zip(seeds, values.get(lo, [])) if _number(v)}
        d = paired_difference(a, b)
        if d is None:
            lines.append(f"{hi} − {lo}: not judged (no seed has both)")
            pairs.append({"hi": hi, "lo": lo, "verdict": "not judged", "seeds": 0})
            continue
        if d.low is None:
            state, interval = "unresolved", "one seed, no interval"
        else:
            state = "holds" if d.low > 0 else "fails" if d.high < 0 else "unresolved"
            interval = f"95% CI [{d.low:+.2f}, {d.high:+.2f}]"
        states.append(state)
        lines.append(f"{hi} − {lo}: {d.mean:+.2f}, {interval}, {d.pairs} seed(s): {state}")
        pairs.append({"hi": hi, "lo": lo, "verdict": state, "seeds": d.pairs,
                      "mean": d.mean, "low": d.low, "high": d.high})
    if not states:
        return "not judged", lines, pairs
    overall = "fails" if "fails" in states else \
        "holds" if all(x == "holds" for x in states) else "unresolved"
    return overall, lines, pairs


def _number(v: float | None) -> bool:
    return v is not None and not math.isnan(v)


def paper_verdict(recipe: Recipe) -> tuple[str, list[str]]:
    """The expected ordering on the paper's own numbers, each pair in the first paper column
    that has both rows (a pair is never judged across two tables)."""
    rows = {r.label: r for r in recipe.rows}
    pairs = []
    for hi, lo in order_pairs(recipe.order):
        both = [(a.value, b.value) for a, b in zip(rows[hi].paper, rows[lo].paper)
                if a is not None and b is not None]
        pairs.append((hi, lo, *(both[0] if both else (None, None))))
    return judge(pairs)


def row_values(recipe: Recipe, per_run: Mapping[tuple[str, int], float | None],
               seeds: list[int]) -> dict[str, list[float | None]]:
    """label -> the per-seed values; per_run maps (label, seed) of the run rows, and a
    derived row takes, per seed, the mean of its rows (None if any is missing)."""
    out: dict[str, list[float | None]] = {}
    for row in recipe.rows:
        if row.mean_of:
            vals = []
            for i in range(len(seeds)):
                parts = [out[m][i] for m in row.mean_of]
                vals.append(None if any(p is None for p in parts)
                            else sum(parts) / len(parts))
            out[row.label] = vals
        else:
            out[row.label] = [per_run.get((row.label, s)) for s in seeds]
    return out


def _fmt(m: float | None, sd: float | None = None) -> str:
    if m is None or math.isnan(m):
        return "-"
    return f"{m:.2f}" + ("" if sd is None or math.isnan(sd) else f" ± {sd:.2f}")


def report(recipe: Recipe, values: Mapping[str, list[float | None]], *,
           rounds_of: Mapping[str, int] | None = None, seeds: list[int] | None = None,
           scale: str = "full") -> tuple[list[str], dict[str, Any]]:
    """The printed table and its JSON twin."""
    rounds_of = rounds_of or {}
    seeds = seeds if seeds is not None else list(range(max(map(len, values.values()),
                                                           default=0)))
    stats = {label: mean_std(v) for label, v in values.items()}
    w = max(len(r.label) for r in recipe.rows) + 2
    head = (f"  {'row':<{w}}{'metric':<16}{'rounds':>7}"
            + "".join(f"  {c:>22}" for c in recipe.paper_columns)
            + f"  {'ours (mean ± std)':>18}  per seed ({', '.join(map(str, seeds))})")
    at = "best over rounds" if recipe.at == "best" else "final"
    lines = [f"{recipe.name}: {recipe.title}",
             f"  scale {scale}, {len(seeds)} seed(s); accuracy in %, metric {at}", head]
    rows_json = []
    for row in recipe.rows:
        m, sd, n = stats[row.label]
        per_seed = values[row.label]
        metric = "mean of rows" if row.mean_of else (row.metric or recipe.metric)
        papers = list(row.paper) + [None] * (len(recipe.paper_columns) - len(row.paper))
        lines.append(f"  {row.label:<{w}}{metric:<16}{rounds_of.get(row.label, '')!s:>7}"
                     + "".join(f"  {_fmt(p.value, p.std) if p else '-':>22}" for p in papers)
                     + f"  {_fmt(m if n else None, sd if n > 1 else None):>18}  "
                     + " ".join(_fmt(v) for v in per_seed))
        rows_json.append({
            "label": row.label, "algorithm": row.algorithm or None,
            "params": dict(row.params), "metric": metric, "mean_of": list(row.mean_of),
            "rounds": rounds_of.get(row.label),
            "paper": [None if p is None else {"column": c, "value": p.value, "std": p.std,
                                              "source": p.source}
                      for c, p in zip(recipe.paper_columns, papers)],
            "ours": {"mean": m if n else None, "std": sd if n > 1 else None, "n": n,
                     "per_seed": per_seed}})
    ours_v, ours_why, ours_pairs = paired_verdict(recipe.order, values, seeds)
    paper_v, paper_why = paper_verdict(recipe) if recipe.paper_columns else ("-", [])
    lines.append(f"expected ordering: {'; '.join(recipe.order)}")
    lines.append(f"  ours:  {ours_v} (paired over {len(seeds)} seed(s))"
                 + "".join(f"\n         {x}" for x in ours_why))
    if recipe.paper_columns:
        lines.append(f"  paper: {paper_v}" + "".join(f"\n         {x}" for x in paper_why))
    gaps_json = []
    if recipe.gaps:
        lines.append("differences the paper states (points), ours per seed then mean ± std:")
    for g in recipe.gaps:
        diffs = [None if a is None or b is None else a - b
                 for a, b in zip(values.get(g.a, []), values.get(g.b, []))]
        dm, dsd, dn = mean_std(diffs)
        lines.append(f"  {g.a} − {g.b}: paper {g.value:+.1f} ({g.source}); ours "
                     + (f"{dm:+.2f}" + (f" ± {dsd:.2f}" if dn > 1 else "") if dn else "-"))
        gaps_json.append({"a": g.a, "b": g.b, "paper": g.value, "source": g.source,
                          "ours": {"mean": dm if dn else None, "std": dsd if dn > 1 else None,
                                   "per_seed": diffs}})
    lines.append("scale changes (what differs from the paper, and why):")
    lines += [f"  - {c}" for c in recipe.scale_changes]
    lines += [f"note: {x}" for x in recipe.notes]
    doc = {"recipe": recipe.name, "title": recipe.title, "scale": scale, "seeds": seeds,
           "at": recipe.at, "paper_setting": recipe.paper_setting,
           "paper_columns": list(recipe.paper_columns), "rows": rows_json,
           "ordering": {"expected": list(recipe.order),
                        "ours": {"verdict": ours_v, "pairs": ours_why, "paired": ours_pairs,
                                 "seeds": len(seeds)},
                        "paper": {"verdict": paper_v, "pairs": paper_why}},
           "gaps": gaps_json, "scale_changes": list(recipe.scale_changes),
           "notes": list(recipe.notes)}
    return lines, doc


# --- command line -----------------------------------------------------------------------

def describe(recipe: Recipe) -> list[str]:
    """`list`: the recipe's title, paper setting, shared settings and rows."""
    runs = [r for r in recipe.rows if not r.mean_of]
    lines = [f"{recipe.name}: {recipe.title}", f"  paper: {recipe.paper_setting}"]
    base = merge(recipe.base)
    lines.append("  ours: " + "; ".join(
        f"[{name}] " + ", ".join(f"{k} = {v!r}" for k, v in table.items())
        for name, table in base.items()) + (f"; MNIST subset {recipe.subset}"
                                             if recipe.subset else ""))
    for r in runs:
        opts = ", ".join(f"{k} = {v!r}" for k, v in r.params.items())
        changes = "; ".join(f"{k} = {v!r}" for t in r.set.values() for k, v in t.items())
        lines.append(f"    {r.label}: {r.algorithm}" + (f" ({opts})" if opts else "")
                     + (f"; {changes}" if changes else "")
                     + f"; metric {r.metric or recipe.metric}")
    lines.append(f"  {len(runs)} runs a seed; expected: {'; '.join(recipe.order)}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "recipes:\n" + "\n".join(f"  {n:<20} {r.title}" for n, r in RECIPES.items())
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("recipe", metavar="NAME", choices=["list", "verdicts", *RECIPES],
                   help="a recipe (below), `list` to print every recipe's settings, or "
                   "`verdicts` to print one markdown table of every paired verdict in the "
                   "--from files")
    p.add_argument("--from", dest="sources", action="append", default=[], metavar="JSON",
                   help="with `verdicts`: a table a run wrote with --json (repeatable)")
    p.add_argument("--scale", choices=SCALES, default="full",
                   help="full (default): the recipe as written; smoke: 1 seed, 2 rounds, "
                   "1 epoch, few clients (a check that it runs, not a result)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds 0..N-1 (default 3; 1 at --scale smoke)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every run (default: each row's, as the recipe says)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="change every run's config (repeatable; the value is read as TOML); "
                   "the runs' names change with it")
    p.add_argument("--only", action="append", default=[], metavar="LABEL",
                   help="run only this row (repeatable; a derived row brings its rows; "
                   "default every row)")
    p.add_argument("--data", default=str(MNIST),
                   help="the offline MNIST npz (default ../shared/data/mnist-10k.npz)")
    p.add_argument("--nodes", type=int, default=2, help="client-node processes per run "
                   "(default 2)")
    p.add_argument("--out", default=None,
                   help="folder for the run directories (kept and reused; default a "
                   "temporary folder)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the runs (name and config) without running them")


# --set keys the benchmark decides itself, each with the option that sets it instead: a
# --set of them would be overwritten without a word
_OWN_KEYS = {"federation.seed": "--seeds", "launch": "--nodes (runs are on the CPU, one "
             "thread a node)", "log": "nothing (runs log warnings, no message log)"}


def _overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """--set items, parsed by `fedbus run --set`'s own parser, as sections; ValueError for
    a key the benchmark sets itself (_OWN_KEYS)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        section, key, value = _parse_override(item)
        for own in (f"{section}.{key}", section):
            if own in _OWN_KEYS:
                raise ValueError(f"--set {section}.{key}: the benchmark sets {own} itself; "
                                 f"use {_OWN_KEYS[own]}")
        out.setdefault(section, {})[key] = value
    return out


def plan(recipe: Recipe, args: argparse.Namespace, data: str | Path
         ) -> list[tuple[Row, int, dict[str, dict[str, Any]]]]:
    only = set(args.only)
    seeds = list(range(args.seeds))
    rows = [r for r in recipe.rows if not r.mean_of]
    if only:
        wanted = set(only)
        for r in recipe.rows:
            if r.label in only and r.mean_of:
                wanted |= set(r.mean_of)
        rows = [r for r in rows if r.label in wanted]
    extra = merge(args.extra, {"launch": {"nodes": args.nodes}})
    return [(r, s, sections(recipe, r, s, scale=args.scale, rounds=args.rounds,
                            extra=extra, data=data)) for r in rows for s in seeds]


def run_all(recipe: Recipe, runs: list[tuple[Row, int, dict[str, dict[str, Any]]]],
            out: Path, timeout: float) -> tuple[dict[tuple[str, int], float | None], list[str]]:
    """Run (or reuse) every planned run once; ((label, seed) -> the row's metric, the runs
    that failed). A failed run is reported and its rows left empty; the others go on."""
    per_run: dict[tuple[str, int], float | None] = {}
    done: dict[str, list[dict[str, Any]] | None] = {}  # name -> records (rows share runs)
    failed: list[str] = []
    distinct = len({run_name(cfg) for _, _, cfg in runs})  # the count the plan line printed
    for row, seed, cfg in runs:
        name = run_name(cfg)
        if name not in done:
            head = f"[{len(done) + 1}/{distinct}] {name} ({row.label}, seed {seed})"
            try:
                res = run_or_reuse(cfg, name, out=out, timeout=timeout)
            except (RuntimeError, TimeoutError) as e:
                print(f"{head}: FAILED: {e}", flush=True)
                done[name] = None
                failed.append(name)
            else:
                done[name] = _records(res.run_dir)
                wall = "reused" if res.note == "reused" else f"{res.wall_s:.0f} s"
                note = f"  [{res.note}]" if res.note not in ("", "reused") else ""
                print(f"{head}: {wall}{note}", flush=True)
        records = done[name]
        per_run[(row.label, seed)] = (None if records is None else metric_value(
            records, row.metric or recipe.metric, recipe.at))
    return per_run, failed


def _variant(doc: Mapping[str, Any]) -> str:
    """How a --json table's runs differ from its recipe as written: its --set overrides and
    the rows it ran at other rounds than the recipe's (--rounds); "" for the recipe itself."""
    notes = [str(o) for o in doc.get("overrides") or []]
    recipe = RECIPES.get(doc["recipe"])
    if recipe is not None:
        written = {row.label: sections(recipe, row, 0)["federation"]["rounds"]
                   for row in recipe.rows if not row.mean_of}
        judged = [row for row in doc.get("rows", []) if (row.get("ours") or {}).get("n")
                  and row.get("rounds") is not None and row["label"] in written]
        moved = [row for row in judged if row["rounds"] != written[row["label"]]]
        if moved and len(moved) == len(judged) and len({r["rounds"] for r in moved}) == 1:
            notes.append(f"{moved[0]['rounds']} rounds")  # every row at one other count
        else:
            notes += [f"{row['label']}: {row['rounds']} rounds" for row in moved]
    return ", ".join(notes)


def verdict_table(docs: list[Mapping[str, Any]]) -> list[str]:
    """One markdown table of every ordering pair the --json tables `docs` judged seed by
    seed: the pair, the recipe (with what its runs changed: _variant), the paired mean
    difference, its 95 % interval, the seeds and the verdict. A pair that several tables of
    the same recipe and variant judged (a 3-seed run, then --only rows to 5 seeds) is shown
    once, from the table with the most seeds; pairs in the order first seen."""
    lines = ["| paper's ordering (pair) | recipe | paired mean difference | 95% interval | "
             "seeds | verdict |", "|---|---|---|---|---|---|"]
    best: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for doc in docs:
        variant = _variant(doc)
        where = f"`{doc['recipe']}`" + (f" ({variant})" if variant else "")
        for pair in doc["ordering"]["ours"].get("paired", []):
            key = (doc["recipe"], variant, pair["hi"], pair["lo"])
            if key not in best or pair["seeds"] >= best[key]["seeds"]:
                best[key] = {**pair, "where": where}
    unjudged: list[str] = []
    idle: dict[str, bool] = {}  # variant tables: whether one judged any pair
    for (_, variant, _, _), pair in best.items():
        if variant:
            idle[pair["where"]] = idle.get(pair["where"], True) and not pair["seeds"]
        if not pair["seeds"]:  # rows a partial run (--only) left out
            if not variant:
                unjudged.append(f"{pair['hi']} > {pair['lo']} ({pair['where']})")
            continue
        mean = pair.get("mean")
        low, high = pair.get("low"), pair.get("high")
        interval = "-" if low is None else f"[{low:+.2f}, {high:+.2f}]"
        lines.append(f"| {pair['hi']} > {pair['lo']} | {pair['where']} | "
                     + ("-" if mean is None else f"{mean:+.2f}")
                     + f" | {interval} | {pair['seeds']} | {pair['verdict']} |")
    if unjudged:
        lines += ["", "not judged (no seed has both rows): " + "; ".join(unjudged)]
    quiet = [where for where, none in idle.items() if none]
    if quiet:
        lines += ["", "variants that judged no pair (rows run with --only; compare them "
                  "with the recipe's own runs): " + "; ".join(quiet)]
    return lines


def _verdicts(args: argparse.Namespace) -> int:
    err = "fedbus bench reproduce verdicts"
    if not args.sources:
        print(f"{err}: give the tables with --from JSON (written by --json)", file=sys.stderr)
        return 2
    docs = []
    for source in args.sources:
        try:
            doc = json.loads(Path(source).read_text())
            doc["ordering"]["ours"], doc["recipe"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"{err}: {source}: not a table written by --json ({e})", file=sys.stderr)
            return 2
        docs.append(doc)
    print("\n".join(verdict_table(docs)))
    return 0


def main_args(args: argparse.Namespace) -> int:
    err = "fedbus bench reproduce"
    if args.recipe == "list":
        for r in RECIPES.values():
            print("\n".join(describe(r)) + "\n")
        return 0
    if args.recipe == "verdicts":
        return _verdicts(args)
    recipe = RECIPES[args.recipe]
    if args.seeds is None:
        args.seeds = 1 if args.scale == "smoke" else 3
    unknown = sorted(set(args.only) - {r.label for r in recipe.rows})
    if unknown:
        print(f"{err}: --only: no row {', '.join(map(repr, unknown))} in {recipe.name}; "
              f"rows are {'; '.join(r.label for r in recipe.rows)}", file=sys.stderr)
        return 2
    try:
        args.extra = _overrides(args.overrides)
    except ValueError as e:
        print(f"{err}: {e}", file=sys.stderr)
        return 2
    needs_mnist = "{mnist}" in str(recipe.base.get("data", {}).get("dataset", ""))
    if needs_mnist and not Path(args.data).exists():
        print(f"{err}: {args.data} not found (--data)", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    elif args.dry_run:
        out = Path(tempfile.gettempdir()) / "fedbus-reproduce-XXXX"  # not made
    else:
        out = Path(tempfile.mkdtemp(prefix="fedbus-reproduce-"))
    subset = recipe.subset and needs_mnist
    data = (out / "data" / f"{Path(args.data).stem}-{recipe.subset}.npz" if subset
            else Path(args.data))
    runs = plan(recipe, args, data)
    for row, _, cfg in runs:
        try:
            build_config(cfg)
        except ConfigError as e:
            print(f"{err}: {recipe.name}, row {row.label!r}: {e}", file=sys.stderr)
            return 2
    names = {run_name(cfg) for _, _, cfg in runs}  # rows may share a run (other metric)
    print(f"{err} {recipe.name} ({args.scale}): {len(names)} runs "
          f"({len(names) // max(args.seeds, 1)} a seed x {args.seeds} seeds); run dirs in {out}"
          + (" (not made: --dry-run)" if args.dry_run and not args.out else ""), flush=True)
    if args.dry_run:
        for row, seed, cfg in runs:
            print(f"  {run_name(cfg)}  [{row.label}, seed {seed}]  "
                  + json.dumps({k: v for k, v in cfg.items() if k not in ("launch", "log")},
                               default=str))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if subset:
        make_subset(Path(args.data), recipe.subset, out)
    t0 = time.perf_counter()
    per_run, failed = run_all(recipe, runs, out, args.timeout)
    seeds = list(range(args.seeds))
    rounds_of = {row.label: cfg["federation"]["rounds"] for row, _, cfg in runs}
    lines, doc = report(recipe, row_values(recipe, per_run, seeds), rounds_of=rounds_of,
                        seeds=seeds, scale=args.scale)
    doc.update(out=str(out), total_s=round(time.perf_counter() - t0, 1),
               overrides=args.overrides, failed=failed,
               runs={f"{r.label}|{s}": run_name(c) for r, s, c in runs})
    print("\n" + "\n".join(lines))
    if failed:
        print(f"{len(failed)} run(s) failed (their rows are empty): {', '.join(failed)}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    return 1 if failed else 0


if __name__ == "__main__":  # python -m fedbus.bench.reproduce
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main_args(parser.parse_args()))
