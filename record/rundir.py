"""The run directory: what a run leaves behind for people and tools.

    config.json       the resolved config (every key, defaults filled in)
    metrics.jsonl     one JSON line per aggregation (with eval results when evaluated)
    metrics.csv       the same, scalar columns only, for spreadsheets
    summary.json      final and best accuracy, bytes, wall time
    status.json       live state for progress displays (rewritten often)
    checkpoint.fbk    the server's state after the last aggregation (--resume)
    embeddings.fbk    final test embeddings + global prototypes (plots)
    masks.fbk         segmentation: a few final test images, truth and predicted masks
    messages.bin/.jsonl  the message log (see fedbus.record.msglog)
    logs/             JSON-lines logs of every process
    tensorboard/      the metrics as TensorBoard scalars (log.tensorboard = true)
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path
from typing import Any, Iterable

from fedbus.record import DamagedFile

SCALAR = (int, float, str, bool)
ACC_KEYS = ("acc_mean", "acc_std", "acc_weighted", "proto_acc_mean", "proto_acc_std",
            "proto_acc_weighted", "loss_mean", "miou_mean", "miou_std", "miou_weighted",
            "proto_miou_mean", "proto_miou_std", "proto_miou_weighted", "aux_acc_mean",
            "aux_acc_std", "local_head_acc_mean", "global_head_acc_mean")


def atomic_write(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Replace PATH by DATA whole: a reader sees the old bytes or the new ones, never a mix.
    durable: the bytes reach the disk before the rename (fsync), so a crash of the machine
    cannot leave the new name on lost data; False for files rewritten often whose loss
    costs nothing but a moment's display (status.json)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records. A torn last line (a stop while the server wrote it) is left
    out; any other line that is not a JSON object is DamagedFile naming it, rather than
    records silently cut short there."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DamagedFile(f"{path} cannot be read ({type(err).__name__}: {err})") from None
    out = []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # a torn last line after a crash
            rec = None
        if not isinstance(rec, dict):
            raise DamagedFile(f"{path}, line {i + 1}, is not a metrics record: the file is "
                              f"damaged (its {len(lines) - i - 1} later line(s) cannot be "
                              f"trusted); the run's checkpoint and message log are separate "
                              f"files") from None
        out.append(rec)
    return out


class RunDir:
    def __init__(self, path: str | Path, *, resume: bool = False, tensorboard: bool = False):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "logs").mkdir(exist_ok=True)
        self._tb = None
        if tensorboard:  # imported only when on; MissingExtra if TensorBoard is not installed
            from fedbus.record.tensorboard import TensorBoardWriter

            self._tb = TensorBoardWriter(self.path)
        self.records: list[dict[str, Any]] = read_metrics(self.path) if resume else []
        self._metrics = open(self.path / "metrics.jsonl", "a" if resume else "w")

    def keep_through(self, version: int) -> int:
        """On resume from a checkpoint at `version`: drop the records of later
        aggregations (written after that checkpoint, before the stop; the resumed run writes
        them again) so each round has one record. Returns how many were dropped."""
        kept = [r for r in self.records if int(r.get("version", 0)) <= version]
        dropped = len(self.records) - len(kept)
        if dropped:
            self._metrics.close()
            atomic_write(self.path / "metrics.jsonl", "".join(
                json.dumps(r, sort_keys=True) + "\n" for r in kept).encode())
            self._metrics = open(self.path / "metrics.jsonl", "a")
            self.records = kept
        return dropped

    def write_config(self, cfg: dict[str, Any]) -> None:
        atomic_write(self.path / "config.json", json.dumps(cfg, indent=2).encode())

    def append_metrics(self, records: Iterable[dict[str, Any]]) -> None:
        records = list(records)
        for rec in records:
            self.records.append(rec)
            self._metrics.write(json.dumps(rec, sort_keys=True) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            self._tb.add(records)

    def write_status(self, status: dict[str, Any], *, durable: bool = False) -> None:
        """status.json: rewritten up to four times a second while a run goes (a progress
        display's, not a resume's: no fsync then, which cost the server's loop about a
        millisecond each); durable for the state a run ends in."""
        atomic_write(self.path / "status.json", json.dumps(status).encode(), durable=durable)

    def write_csv(self) -> None:
        cols: list[str] = []
        for rec in self.records:
            for k, v in rec.items():
                if isinstance(v, SCALAR) and k not in cols:
                    cols.append(k)
            for k, v in rec.get("agg", {}).items():
                if f"agg_{k}" not in cols:
                    cols.append(f"agg_{k}")
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for rec in self.records:
            row = {k: v for k, v in rec.items() if isinstance(v, SCALAR)}
            row.update({f"agg_{k}": v for k, v in rec.get("agg", {}).items()})
            w.writerow(row)
        atomic_write(self.path / "metrics.csv", buf.getvalue().encode())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.path / "summary.json", json.dumps(summary, indent=2).encode())

    def close(self) -> None:
        self._metrics.close()
        if self._tb is not None:
            self._tb.close()  # flushes the last events
            self._tb = None


def summarise(records: list[dict[str, Any]], *, algorithm: str, totals: dict[str, int],
              wall_s: float, target_acc: float = 0.0) -> dict[str, Any]:
    evaluated = [r for r in records if "acc_mean" in r or "proto_acc_mean" in r]
    final = {k: evaluated[-1][k] for k in ACC_KEYS if evaluated and k in evaluated[-1]}
    # how many live clients the final accuracy is over, and why the others are not in it
    final.update({k: evaluated[-1][k] for k in ("eval_clients", "eval_live", "eval_missing")
                  if evaluated and k in evaluated[-1]})
    best: dict[str, Any] = {}
    for key in ("acc", "proto_acc", "miou", "proto_miou"):
        scored = [r for r in evaluated if f"{key}_mean" in r]
        if scored:
            top = max(scored, key=lambda r: r[f"{key}_mean"])
            best[f"{key}_mean"] = top[f"{key}_mean"]
            best[f"{key}_std"] = top.get(f"{key}_std")
            best[f"{key}_round"] = top["round"]
            if "eval_clients" in top:
                best[f"{key}_eval_clients"] = top["eval_clients"]
    reached = None
    if target_acc > 0:
        for r in evaluated:
            if max(r.get("acc_mean", 0.0), r.get("proto_acc_mean", 0.0) or 0.0) >= target_acc:
                reached = r["round"]
                break
    return {
        "algorithm": algorithm,
        "rounds_completed": max((r["version"] for r in records), default=0),
        "final": final,
        "best": best,
        "bytes_up": totals.get("bytes_up", 0),
        "bytes_down": totals.get("bytes_down", 0),
        "params_up": totals.get("params_up", 0),
        "params_down": totals.get("params_down", 0),
        "late_dropped": totals.get("late_dropped", 0),
        "late_folded": totals.get("late_folded", 0),
        "rejected": totals.get("rejected", 0),
        "rounds_to_target": reached,
        "wall_s": round(wall_s, 3),
    }
