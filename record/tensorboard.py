"""An optional TensorBoard writer for the server (`log.tensorboard = true`).

Every aggregation record that goes to metrics.jsonl also goes to
RUN/tensorboard/ as scalars, at step = the record's `round` (0-based, as in
metrics.jsonl and `fedbus plot`) and at the record's own wall time:

    eval/           acc_mean, proto_acc_mean, loss_mean, ... (the evaluated rounds)
    participation/  sampled, updates, failed, late, dead, partial, folded, ...
    comm/           bytes_up, bytes_down, params_up, params_down
    time/           round_s, eval_s, wall_s
    agg/            the algorithm's own aggregation metrics

Compare runs with `tensorboard --logdir runs/`. This module, and TensorBoard
with it, is imported only when the option is on (see fedbus.record.rundir).
"""
from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fedbus.record import MissingExtra

PARTICIPATION = ("sampled", "updates", "failed", "late", "dead", "partial", "folded",
                 "stale_max", "work_fraction", "eval_clients")
COMM = ("bytes_up", "bytes_down", "params_up", "params_down")
TIME = ("round_s", "eval_s", "wall_s")
NOT_SCALARS = ("round", "version", "time")  # the step, the step again, the wall time

INSTALL = "log.tensorboard = true needs TensorBoard: pip install tensorboard " \
          "(or pip install 'fedbus[tensorboard]')"


def require() -> None:
    """MissingExtra (one line naming the install) if TensorBoard is not installed;
    imports nothing, so a launcher can check before any process starts."""
    if importlib.util.find_spec("tensorboard") is None:
        raise MissingExtra(INSTALL)


def tag(key: str) -> str:
    if key in PARTICIPATION:
        return f"participation/{key}"
    if key in COMM:
        return f"comm/{key}"
    if key in TIME:
        return f"time/{key}"
    return f"eval/{key}"


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The record's numeric scalars by TensorBoard tag (lists, dicts, text,
    booleans, None and NaN left out; `agg` flattened under agg/)."""
    out: dict[str, float] = {}
    for key, value in rec.items():
        if key in NOT_SCALARS:
            continue
        if key == "agg" and isinstance(value, dict):
            out.update({f"agg/{k}": float(v) for k, v in value.items() if _number(v)})
        elif _number(value):
            out[tag(key)] = float(value)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


class TensorBoardWriter:
    def __init__(self, run_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MissingExtra(INSTALL) from None
        self.path = Path(run_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.path))

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        for rec in records:
            step = rec.get("round", rec.get("version"))
            if not isinstance(step, int):
                continue
            walltime = rec.get("time") if _number(rec.get("time")) else None
            for name, value in scalars(rec).items():
                self._writer.add_scalar(name, value, global_step=step, walltime=walltime)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
