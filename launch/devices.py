"""Which device each node process runs on.

`launch.devices` lists devices to spread nodes over, round-robin: "auto"
(every visible GPU, else the CPU), "cpu", "cuda" (every visible GPU) or
"cuda:N". A node pinned to GPU N is started with CUDA_VISIBLE_DEVICES=N and
addresses it as cuda:0, so a library inside it cannot wander onto another GPU.
"""
from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    device: str  # what the node passes to torch: "cpu" or "cuda:0"
    env: dict[str, str]  # environment additions for the node process
    label: str  # what the user sees: "cpu" or "cuda:3"


def visible_gpus() -> int:
    try:
        import torch

        # device_count asks NVML first and leaves the CUDA driver uninitialised, so
        # processes forked from the launcher can still use the GPUs
        return torch.cuda.device_count()
    except Exception:
        return 0


def _physical_ids(gpu_count: int) -> list[str]:
    # Respect a CUDA_VISIBLE_DEVICES the user already set for the launcher.
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited:
        ids = [d.strip() for d in inherited.split(",") if d.strip()]
        return ids[:gpu_count] if gpu_count else []
    return [str(i) for i in range(gpu_count)]


def assign(nodes: int, devices: list[str], gpu_count: int) -> tuple[list[Placement], str | None]:
    """Placements for `nodes` node processes, and a warning when GPUs were asked
    for but none is visible (the nodes then run on the CPU)."""
    ids = _physical_ids(gpu_count)
    pool: list[str] = []  # "cpu" or a physical GPU id
    warning = None
    for spec in devices or ["auto"]:
        if spec == "cpu":
            pool.append("cpu")
        elif spec in ("auto", "cuda"):
            if ids:
                pool.extend(ids)
            else:
                pool.append("cpu")
                if spec == "cuda":
                    warning = "launch.devices asks for cuda but no GPU is visible: using the CPU"
        elif spec.startswith("cuda:") and spec[5:].isdigit():
            n = int(spec[5:])
            if n < len(ids):
                pool.append(ids[n])
            else:
                pool.append("cpu")
                warning = (f"launch.devices asks for {spec} but only {len(ids)} GPU(s) are "
                           "visible: using the CPU for it")
        else:
            raise ValueError(f"launch.devices: {spec!r} is not auto, cpu, cuda or cuda:N")
    pool = list(dict.fromkeys(pool))  # a device listed twice is still one device
    out = []
    for i in range(nodes):
        dev = pool[i % len(pool)]
        if dev == "cpu":
            out.append(Placement("cpu", {"CUDA_VISIBLE_DEVICES": ""}, "cpu"))
        else:
            out.append(Placement("cuda:0", {"CUDA_VISIBLE_DEVICES": dev}, f"cuda:{dev}"))
    return out, warning


def split_clients(clients: int, nodes: int,
                  work: Sequence[float] | None = None) -> list[list[int]]:
    """Client ids per node (none empty, each sorted): contiguous ranges of equal length,
    or, given each client's work (its training samples), near-equal total work: largest
    client first onto the least loaded node, so a node of large clients does not hold
    every round back while the others wait."""
    nodes = max(1, min(nodes, clients))
    if work is not None and sum(work) > 0:
        load = [(0.0, i) for i in range(nodes)]
        groups: list[list[int]] = [[] for _ in range(nodes)]
        for c in sorted(range(clients), key=lambda c: (-work[c], c)):
            total, i = heapq.heappop(load)
            groups[i].append(c)
            heapq.heappush(load, (total + work[c], i))
        return [sorted(g) for g in groups]
    base, extra = divmod(clients, nodes)
    out, start = [], 0
    for i in range(nodes):
        size = base + (1 if i < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def parse_ids(text: str) -> list[int]:
    """'0-9,12,20-23' -> [0..9, 12, 20..23]."""
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                ids.extend(range(lo, hi + 1))
            else:
                ids.append(int(part))
        except ValueError:
            raise ValueError(f"--clients: {part!r} is not N or A-B") from None
    if not ids or min(ids) < 0:
        raise ValueError(f"--clients {text!r}: give ids like 0-99 or 0,5,7")
    return sorted(set(ids))


def format_ids(ids: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5' (the inverse of parse_ids)."""
    parts, start = [], None
    for i, c in enumerate(ids):
        if start is None:
            start = c
        if i + 1 == len(ids) or ids[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)
