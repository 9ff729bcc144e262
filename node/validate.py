"""Checks an update must pass before any handler sees it.

The engine checks that it answers an outstanding task of this run (sender,
task id, version); this module checks its shape: the fields the engine needs,
the arrays the algorithm declared (dtype and shape), no NaN or Inf anywhere,
non-negative plausible counts and class ids in range. A failing update is
rejected with the reason, counted, and never aggregated.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np


class Rejected(ValueError):
    """Why an update was refused (the message goes back to the client)."""


def _check_number(name: str, value: Any, *, low: float = 0, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Rejected(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < low or (high is not None and value > high):
        raise Rejected(f"{name} = {value!r} is out of range")


def _walk(value: Any, path: str = "payload"):
    """(path, value) for every array and float in a payload."""
    if isinstance(value, (np.ndarray, float)):
        yield path, value
    elif isinstance(value, (dict, Mapping)):  # a dict is decided without the ABC check
        for k, v in value.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}[{i}]")


def _finite(value: np.ndarray | float) -> bool:
    if isinstance(value, np.ndarray):
        return value.dtype.kind not in "fc" or bool(np.isfinite(value).all())
    return math.isfinite(value)


def non_finite(payload: Any) -> list[str]:
    """Paths of the floats and float arrays in a payload that are or hold NaN or Inf (a
    node checks its own update with this before sending; the server rejects such)."""
    return [path for path, value in _walk(payload) if not _finite(value)]


def _flatten_spec(spec: Mapping[str, Any], prefix: tuple[str, ...] = ()):
    """{"delta": {"conv1.weight": (dtype, shape)}} -> ((delta, conv1.weight), dtype, shape).
    Keys are kept whole: weight names contain dots."""
    for key, value in spec.items():
        if isinstance(value, Mapping):
            yield from _flatten_spec(value, prefix + (key,))
        else:
            yield prefix + (key,), value[0], value[1]


def _lookup(payload: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = payload
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            raise Rejected(f"payload lacks {'/'.join(path)!r}")
        node = node[part]
    return node


def _check_work(work: Any, name: str = "work") -> None:
    if not isinstance(work, (dict, Mapping)):
        raise Rejected(f"{name} must be a map")
    for key in ("epochs_asked", "epochs_done", "steps", "samples"):
        if key not in work:
            raise Rejected(f"{name} lacks {key!r}")
        _check_number(f"{name}.{key}", work[key])


def _check_arrays(payload: Any, spec: Mapping[str, Any], max_bytes: int | None) -> None:
    """The declared arrays are there with their dtype and shape; nothing is NaN or Inf;
    the arrays fit under max_bytes."""
    if not isinstance(payload, (dict, Mapping)):
        raise Rejected("payload must be a map")
    for path, dtype, shape in _flatten_spec(spec):
        name = "/".join(path)
        arr = _lookup(payload, path)
        if not isinstance(arr, np.ndarray):
            raise Rejected(f"{name} must be an array, got {type(arr).__name__}")
        if arr.dtype != np.dtype(dtype):
            raise Rejected(f"{name} has dtype {arr.dtype}, expected {dtype}")
        if len(arr.shape) != len(shape) or any(
                want is not None and got != want for got, want in zip(arr.shape, shape)):
            raise Rejected(f"{name} has shape {tuple(arr.shape)}, expected "
                           f"{tuple('*' if s is None else s for s in shape)}")
    total = 0
    for path, value in _walk(payload):
        if not _finite(value):
            raise Rejected(f"{path} contains NaN or Inf" if isinstance(value, np.ndarray)
                           else f"{path} is {value}")
        total += value.nbytes if isinstance(value, np.ndarray) else 0
    if max_bytes is not None and total > max_bytes:
        raise Rejected(f"payload arrays of {total} bytes exceed the {max_bytes}-byte cap")


def check_merged(body: Any, spec: Mapping[str, Any], *, max_samples: Callable[[int], int],
                 max_bytes: int | None = None, nbytes: int = 0, units: int = 1) -> None:
    """Raise Rejected if a relay's pre-aggregated update (kind "merged", PROTOCOL.md §4) is
    not acceptable: its members ([client address, task, num_samples, work], each client
    once, its samples at most max_samples(client)), and its payload, the handler's sum
    form (`spec`: MergeRule.spec), finite, with a non-negative "mass" no larger than the
    members' samples allow (units: label pixels a sample, as for check_update). Which tasks the members answer is the engine's check."""
    if max_bytes is not None and nbytes > max_bytes:
        raise Rejected(f"merged update of {nbytes} bytes exceeds the {max_bytes}-byte cap")
    if not isinstance(body, (dict, Mapping)):
        raise Rejected(f"merged body must be a map, got {type(body).__name__}")
    for key in ("version", "members", "payload"):
        if key not in body:
            raise Rejected(f"merged update lacks {key!r}")
    members = body["members"]
    if not isinstance(members, list) or not members:
        raise Rejected("members must be a non-empty list")
    seen = set()
    samples = 0.0
    for i, m in enumerate(members):
        if not isinstance(m, list) or len(m) != 4 or not isinstance(m[0], str):
            raise Rejected(f"members[{i}] must be [client, task, num_samples, work]")
        address, task, n, work = m
        if address in seen:
            raise Rejected(f"client {address!r} is listed twice")
        seen.add(address)
        if isinstance(task, bool) or not isinstance(task, int):
            raise Rejected(f"members[{i}] task must be an int")
        try:
            bound = max_samples(int(address[1:])) if address[1:].isdigit() else 0
        except (KeyError, ValueError):
            bound = 0
        _check_number(f"members[{i}] num_samples", n, high=bound)
        _check_work(work, f"members[{i}] work")
        samples += float(n)
    _check_arrays(body["payload"], spec, max_bytes)
    mass = body["payload"].get("mass")
    if isinstance(mass, np.ndarray) and mass.size and (
            mass.min() < 0 or mass.sum() > samples * max(1, units) * max(1, mass.size) * (1 + 1e-9)):
        raise Rejected("mass is negative or more than the members' samples")


def check_update(body: Any, spec: Mapping[str, Any], *,
                 num_classes: int, max_samples: int, max_bytes: int | None = None,
                 nbytes: int = 0, label_pixels: int = 1) -> None:
    """Raise Rejected with the reason if an update body is not acceptable.

    max_bytes: the size cap (the bus's max_frame): the message (nbytes, header + body) and
    the arrays of its payload must both stay under it.
    label_pixels: labelled units per sample, 1 for classification; H * W for segmentation
    masks, whose per-class counts count pixels (at feature resolution, at most H * W a
    sample): counts may then sum to max_samples * label_pixels per epoch asked.
    """
    if max_bytes is not None and nbytes > max_bytes:
        raise Rejected(f"update of {nbytes} bytes exceeds the {max_bytes}-byte cap")
    if not isinstance(body, (dict, Mapping)):
        raise Rejected(f"update body must be a map, got {type(body).__name__}")
    for key in ("task", "version", "num_samples", "work", "payload"):
        if key not in body:
            raise Rejected(f"update lacks {key!r}")
    _check_number("num_samples", body["num_samples"], high=max_samples)
    work = body["work"]
    _check_work(work)
    payload = body["payload"]
    _check_arrays(payload, spec, max_bytes)
    counts = payload.get("counts")
    if isinstance(counts, np.ndarray) and counts.size:
        if counts.dtype.kind not in "iu":
            raise Rejected(f"counts must be integers, got {counts.dtype}")
        if counts.min() < 0:
            raise Rejected("counts must be non-negative")
        units = max(1, int(label_pixels))
        if counts.sum() > max_samples * units * max(1, int(work["epochs_asked"]) or 1):
            raise Rejected(f"counts sum to {int(counts.sum())}, more than the client's "
                           f"{max_samples} samples" + (f" x {units} label pixels"
                                                       if units > 1 else ""))
    classes = payload.get("classes")
    if isinstance(classes, np.ndarray) and classes.size:
        if classes.dtype.kind not in "iu" or classes.min() < 0 or classes.max() >= num_classes:
            raise Rejected(f"class ids must lie in [0, {num_classes})")
