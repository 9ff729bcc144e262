"""Running a whole federation from a benchmark and watching its resources."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _toml(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return repr(v)


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for name, table in sections.items():
        lines += [f"[{name}]"] + [f"{k} = {_toml(v)}" for k, v in table.items()] + [""]
    path.write_text("\n".join(lines))
    return path


@dataclass
class Finished:
    run_dir: Path
    wall_s: float
    peak_rss: int  # bytes, summed over the launcher and every process it started
    summary: dict[str, Any]
    records: list[dict[str, Any]]


def run(sections: dict[str, dict[str, Any]], name: str, *, out: Path | None = None,
        timeout: float = 900) -> Finished:
    out = out or Path(tempfile.mkdtemp(prefix="fedbus-bench-"))
    cfg = write_toml(out / f"{name}.toml", sections)
    run_dir = out / name
    import psutil  # the dev extra's: imported by the benchmarks that watch memory

    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                             str(run_dir), "--quiet", "--log-level", "warning"])
    peak = 0
    parent = psutil.Process(proc.pid)
    while proc.poll() is None:
        total = 0
        try:
            for p in [parent, *parent.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
        except psutil.Error:
            pass
        peak = max(peak, total)
        if time.perf_counter() - t0 > timeout:
            proc.kill()
            raise TimeoutError(f"{name}: no result after {timeout} s")
        time.sleep(0.1)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: fedbus run exited {proc.returncode}; see {run_dir}/logs")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return Finished(run_dir, wall, peak, summary, records)
