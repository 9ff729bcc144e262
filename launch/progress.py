"""Progress of a running federation, read from its run directory.

On a terminal: a live rich display (rounds done and to go, live, sampled and
late clients, last accuracy, elapsed and estimated time). Otherwise: one plain
line per finished round. The final summary is a short table.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from fedbus.record.rundir import read_metrics


def _read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _fmt_acc(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def status_line(st: dict[str, Any]) -> str:
    done, total = st.get("version", 0), st.get("rounds", 0)
    elapsed = st.get("elapsed_s", 0.0)
    eta = elapsed / done * (total - done) if done else None
    acc = st.get("proto_acc") if st.get("acc") is None else st.get("acc")
    return (f"{done}/{total} rounds done  live {st.get('live', 0)}  "
            f"sampled {st.get('sampled', 0)}  pending {st.get('pending', 0)}  "
            f"late {st.get('late', 0)}  acc {_fmt_acc(acc)}  "
            f"elapsed {elapsed:.0f}s" + (f"  eta {eta:.0f}s" if eta is not None else ""))


class Progress:
    def __init__(self, run_dir: Path, cfg, *, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.rounds = cfg.federation.rounds
        self.seen = 0
        self.models_shown = False
        self._live = None
        self._task = None

    def __enter__(self) -> "Progress":
        if self.enabled and self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, \
                TimeElapsedColumn, TimeRemainingColumn

            # on stderr, the terminal it checked: stdout may be a file (the summary)
            self._live = RichProgress(TextColumn("[bold]rounds"), BarColumn(),
                                      TextColumn("{task.completed}/{task.total}"),
                                      TimeElapsedColumn(), TimeRemainingColumn(),
                                      TextColumn("{task.description}"), transient=False,
                                      console=Console(file=sys.stderr))
            self._live.start()
            self._task = self._live.add_task("starting", total=self.rounds)
        return self

    def refresh(self) -> None:
        if not self.enabled:
            return
        self._models()
        st = _read_status(self.run_dir)
        if self._live is not None:
            if st:
                acc = st.get("proto_acc") if st.get("acc") is None else st.get("acc")
                self._live.update(self._task, completed=st.get("version", 0), description=(
                    f"live {st.get('live', 0)} sampled {st.get('sampled', 0)} "
                    f"late {st.get('late', 0)} acc {_fmt_acc(acc)}"))
            return
        records = read_metrics(self.run_dir)
        for rec in records[self.seen:]:
            # the round's number (0-based, as in every file), then the count done
            print(f"round {rec['round']} ({rec['version']}/{self.rounds} done)  "
                  f"updates {rec['updates']}  "
                  f"failed {rec['failed']}  acc {_fmt_acc(rec.get('acc_mean'))}  "
                  f"proto_acc {_fmt_acc(rec.get('proto_acc_mean'))}  "
                  f"wall {rec.get('wall_s', 0):.1f}s", file=sys.stderr, flush=True)
        self.seen = len(records)

    def _models(self) -> None:
        """The networks' parameter counts and feature dims, once the server wrote them."""
        if self.models_shown:
            return
        try:
            rows = json.loads((self.run_dir / "models.json").read_text())
        except (OSError, json.JSONDecodeError):
            return
        self.models_shown = True
        from fedbus.models import format_group

        text = format_group(rows)
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __exit__(self, *exc) -> None:
        # the server may have written its last rounds since the last look
        if self._live is not None or not self.tty:
            self.refresh()
        self.stop()


def print_summary(summary: dict[str, Any], run_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"fedbus: {summary['algorithm']} ({run_dir})", show_header=True)
    table.add_column("metric")
    table.add_column("final")
    table.add_column("best")
    final, best = summary.get("final", {}), summary.get("best", {})
    for key in ("acc", "proto_acc"):
        if f"{key}_mean" in final:
            table.add_row(f"{key} (mean ± std over clients)",
                          f"{100 * final[f'{key}_mean']:.2f} ± {100 * final[f'{key}_std']:.2f}",
                          f"{100 * best[f'{key}_mean']:.2f} (round {best[f'{key}_round']})")
    table.add_row("rounds completed", str(summary["rounds_completed"]), "")
    table.add_row("bytes up / down", f"{summary['bytes_up']:,} / {summary['bytes_down']:,}", "")
    table.add_row("params up / down", f"{summary['params_up']:,} / {summary['params_down']:,}",
                  "")
    table.add_row("wall time", f"{summary['wall_s']:.1f} s", "")
    privacy = summary.get("privacy")
    if privacy:
        stopped = f"stopped: {privacy['stopped']}" if privacy.get("stopped") else ""
        table.add_row(f"epsilon ({privacy['mechanism']}-level DP)",
                      f"{privacy['epsilon']:.3g} at delta {privacy['delta']:g}", stopped)
    if "secure_aggregation" in summary:
        table.add_row("secure aggregation", "on",
                      f"{summary['secure_aggregation']['rounds_failed']} round(s) failed")
    Console(file=sys.stdout).print(table)

