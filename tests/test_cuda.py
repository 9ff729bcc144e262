"""Every built-in algorithm on a GPU: a short real federation (broker, server and client node
processes on loopback, scikit-learn's digits) with its client nodes pinned to CUDA. Skipped
where torch sees no GPU, as in CI; a lent GPU machine runs it through .gpu/check.sh
(`pytest -k "device or cuda or gpu"`). The federations run side by side, one per algorithm,
so the whole sweep costs about as long as the slowest one.

What it catches: a handler that hands a CUDA tensor to numpy or msgpack, builds a tensor on
the CPU next to a model on the GPU, or seeds only the CPU generator."""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import MNIST_NPZ, TINY, merged, metrics, run_federation

from fedbus.algorithms import BUILTIN, available

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")

ROUNDS = 2
# the configuration each needs beyond its defaults to run on TINY's digits federation: FedPCL's
# frozen backbone is pre-trained on data disjoint from the federation's (the MNIST subset; the
# GPU check points $FEDBUS_MNIST_NPZ at its copy)
NEEDS = {"fedpcl": {"model": {"arch": f"frozen:cnn@{MNIST_NPZ}"}}}
ALGORITHMS = tuple(sorted(name for name in BUILTIN if name in available()
                          and (name != "fedpcl" or MNIST_NPZ.is_file())))


def federate_on_cuda(tmp_path, name):
    sections = merged(TINY, federation={"rounds": ROUNDS}, algorithm={"name": name},
                      launch={"nodes": 2, "devices": ["cuda"]})
    for section, table in NEEDS.get(name, {}).items():
        sections[section].update(table)
    return run_federation(tmp_path, sections, name=name, timeout=600)


def node_devices(run_dir) -> set[str]:
    """The devices the client nodes said they were configured on (their JSON-lines logs)."""
    found = set()
    for path in (run_dir / "logs").iterdir():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("event") == "configured" and "device" in record:
                found.add(record["device"])
    return found


def test_every_algorithm_federates_with_its_nodes_on_cuda(tmp_path):
    workers = max(1, min(len(ALGORITHMS), (os.cpu_count() or 2) // 2))
    with ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(federate_on_cuda, tmp_path, name) for name in ALGORITHMS}
    failed = {}
    for name, future in futures.items():
        try:
            run_dir, summary = future.result()
        except Exception as exc:  # collect all, so one run shows every broken handler
            failed[name] = str(exc)[-1500:]
            continue
        devices = node_devices(run_dir)
        rows = metrics(run_dir)
        acc = summary.get("final", {}).get("acc_mean")
        if devices != {"cuda:0"}:
            failed[name] = f"nodes configured on {sorted(devices)}, not cuda:0"
        elif len(rows) != ROUNDS:
            failed[name] = f"{len(rows)} rounds recorded of {ROUNDS}"
        elif acc is None or not math.isfinite(acc):
            failed[name] = f"final acc_mean {acc!r}"
    assert not failed, "\n\n".join(f"{name}: {why}" for name, why in failed.items())
