"""Progress of a running federation, read from its run directory.

On a terminal: a live rich display (rounds done and to go, live, sampled and
late clients, last accuracy with the number of clients it is over, whom the round
waits for and when its deadlines fall, elapsed and estimated time). Otherwise: one
plain line per finished round (failures by kind, accuracy with its client count), and
a line for a round that has waited WAIT_NOTE_S. A run whose dropped tasks may hold each
round until the hard deadline is warned about first. The final summary is a short table.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from fedbus.record.rundir import read_metrics

# a round with no record for this long gets a line saying whom it waits for
WAIT_NOTE_S = 10.0


def _read_status(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _fmt_acc(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def evaluated(n: Any, live: Any) -> str:
    """" (7 of 10 clients)" beside an accuracy: how many live clients it is the mean over
    ("" when the record predates the count)."""
    if n is None:
        return ""
    return f" ({n} of {live} clients)" if live is not None and live != n else \
        f" ({n} clients)"


def missing_text(rec: dict[str, Any]) -> str:
    """"busy 2, dead 1": why an evaluation's other live clients are not in it."""
    counts: dict[str, int] = {}
    for why in (rec.get("eval_missing") or {}).values():
        counts[str(why)] = counts.get(str(why), 0) + 1
    return ", ".join(f"{why} {k}" for why, k in sorted(counts.items()))


def best_clients(best: dict[str, Any]) -> str:
    return ", ".join(str(best[f"{key}_eval_clients"]) for key in ("acc", "proto_acc")
                     if f"{key}_eval_clients" in best)


def waiting_text(st: dict[str, Any]) -> str:
    """Whom the round in progress waits for and when it must close, from status.json:
    "waiting for c3,c7 (deadline in 4s, hard deadline in 590s)"; "" when none."""
    who = st.get("waiting")
    if not who:
        return ""
    more = int(st.get("waiting_count", len(who))) - len(who)
    names = ",".join(f"c{c}" for c in who) + (f" +{more}" if more > 0 else "")
    times = [f"deadline in {st['deadline_in_s']:.0f}s"] if "deadline_in_s" in st else []
    if "hard_deadline_in_s" in st:
        times.append(f"hard deadline in {st['hard_deadline_in_s']:.0f}s")
    return f"waiting for {names}" + (f" ({', '.join(times)})" if times else "")


def failures_text(rec: dict[str, Any]) -> str:
    """A record's failed count with each failure named: "failed 3 (dropped 1, late 2)"."""
    counts: dict[str, int] = {}
    for why in (rec.get("failures") or {}).values():
        word = "refused" if why == "rejected" else str(why)
        counts[word] = counts.get(word, 0) + 1
    named = ", ".join(f"{why} {n}" for why, n in sorted(counts.items()))
    return f"failed {rec.get('failed', 0)}" + (f" ({named})" if named else "")


def status_line(st: dict[str, Any]) -> str:
    done, total = st.get("version", 0), st.get("rounds", 0)
    elapsed = st.get("elapsed_s", 0.0)
    eta = elapsed / done * (total - done) if done else None
    acc = st.get("proto_acc") if st.get("acc") is None else st.get("acc")
    wait = waiting_text(st)
    return (f"{done}/{total} rounds done  live {st.get('live', 0)}  "
            f"sampled {st.get('sampled', 0)}  pending {st.get('pending', 0)}  "
            f"late {st.get('late', 0)}  acc {_fmt_acc(acc)}"
            f"{evaluated(st.get('eval_clients'), st.get('eval_live'))}  "
            f"elapsed {elapsed:.0f}s" + (f"  eta {eta:.0f}s" if eta is not None else "")
            + (f"  {wait}" if wait else ""))


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
        from fedbus.node.engine import unbounded_wait

        self.warning = unbounded_wait(cfg)
        self.last_record_at = time.monotonic()
        self.waiting_noted: int | None = None  # the round whose wait was last printed

    def __enter__(self) -> "Progress":
        if self.enabled and self.warning:  # (before a live display takes the terminal)
            print(f"warning: {self.warning}", file=sys.stderr, flush=True)
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
                wait = waiting_text(st)
                self._live.update(self._task, completed=st.get("version", 0), description=(
                    f"live {st.get('live', 0)} sampled {st.get('sampled', 0)} "
                    f"late {st.get('late', 0)} acc {_fmt_acc(acc)}"
                    f"{evaluated(st.get('eval_clients'), st.get('eval_live'))}"
                    + (f" {wait}" if wait else "")))
            return
        records = read_metrics(self.run_dir)
        for rec in records[self.seen:]:
            # the round's number (0-based, as in every file), then the count done; each
            # accuracy with the number of live clients it is the mean over
            over = evaluated(rec.get("eval_clients"), rec.get("eval_live"))
            print(f"round {rec['round']} ({rec['version']}/{self.rounds} done)  "
                  f"updates {rec['updates']}  {failures_text(rec)}  "
                  f"acc {_fmt_acc(rec.get('acc_mean'))}{over}  "
                  f"proto_acc {_fmt_acc(rec.get('proto_acc_mean'))}  "
                  f"wall {rec.get('wall_s', 0):.1f}s", file=sys.stderr, flush=True)
        if len(records) > self.seen:
            self.last_record_at = time.monotonic()
        self.seen = len(records)
        self._note_waiting()

    def _note_waiting(self) -> None:
        """Without a terminal: one line for a round that has waited WAIT_NOTE_S with no
        record, saying whom it waits for and when it must close (once a round)."""
        if time.monotonic() - self.last_record_at < WAIT_NOTE_S:
            return
        st = _read_status(self.run_dir)
        wait = waiting_text(st)
        if wait and self.waiting_noted != st.get("version"):
            self.waiting_noted = st.get("version")
            print(f"round {st.get('version')}: {wait}", file=sys.stderr, flush=True)

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
    if "eval_clients" in final:  # how many live clients those accuracies are the mean over
        live = final.get("eval_live")
        table.add_row("clients evaluated", f"{final['eval_clients']}" +
                      (f" of {live} live" if live is not None else ""), best_clients(best))
        if missing_text(final):
            table.add_row("not evaluated (why)", missing_text(final), "")
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

