"""Algorithms as swappable message handlers, looked up by name.

Built-in algorithms live one per module here; a third party registers one
through the `fedbus.algorithms` entry-point group, whose value points at an
`Algorithm` object (``my_pkg.my_algo:ALGORITHM``). No if/elif chain anywhere:
the engine asks `get_algorithm(name)` and gets the two handler classes.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

from fedbus.algorithms.core.moved import alias_moved

if TYPE_CHECKING:  # torch: imported with the first algorithm, not with the registry
    from fedbus.algorithms.core.handlers import ClientHandler, ServerHandler


@dataclass(frozen=True)
class Algorithm:
    name: str
    server: type[ServerHandler]
    client: type[ClientHandler]
    summary: str = ""


# name -> module defining ALGORITHM; imported only when asked for.
BUILTIN: dict[str, str] = {
    "local": "fedbus.algorithms.local",
    "fedavg": "fedbus.algorithms.fedavg",
    "fedprox": "fedbus.algorithms.fedprox",
    "fedatt": "fedbus.algorithms.fedatt",
    "central": "fedbus.algorithms.central",
    "fedproto": "fedbus.algorithms.fedproto",
    "fedavg-proto": "fedbus.algorithms.fedavg_proto",
    "mpfedcl": "fedbus.algorithms.mpfedcl",
    "proto-attention": "fedbus.algorithms.proto_attention",
    "fedtgp": "fedbus.algorithms.fedtgp",
    "fd": "fedbus.algorithms.fd",
    "lg-fedavg": "fedbus.algorithms.lg_fedavg",
    "fml": "fedbus.algorithms.fml",
    "fedkd": "fedbus.algorithms.fedkd",
    "fedgh": "fedbus.algorithms.fedgh",
    "fedgen": "fedbus.algorithms.fedgen",
    "fedper": "fedbus.algorithms.fedper",
    "fedrep": "fedbus.algorithms.fedrep",
    "noop": "fedbus.algorithms.noop",
}

_loaded: dict[str, Algorithm] = {}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group="fedbus.algorithms")}


def available() -> list[str]:
    names = [n for n in BUILTIN if importlib.util.find_spec(BUILTIN[n]) is not None]
    return sorted(set(names) | set(_plugins()))


def get_algorithm(name: str) -> Algorithm:
    if name in _loaded:
        return _loaded[name]
    if name in BUILTIN:
        algo = importlib.import_module(BUILTIN[name]).ALGORITHM
    elif name in (plugins := _plugins()):
        algo = plugins[name].load()
    else:
        raise KeyError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    if not isinstance(algo, Algorithm) or algo.name != name:
        raise TypeError(f"{name!r} does not resolve to an Algorithm named {name!r}")
    _loaded[name] = algo
    return algo


def register(algo: Algorithm) -> Algorithm:
    """Register an algorithm defined at run time (tests, notebooks)."""
    _loaded[algo.name] = algo
    return algo


# module names from before the algorithms' shared machinery moved into fedbus.algorithms.core
alias_moved("fedbus.algorithms", {
    "base": ("fedbus.algorithms.core.handlers", "fedbus.algorithms.core.metrics"),
    "params": ("fedbus.algorithms.core.params",),
    "protos": ("fedbus.algorithms.core.protos",),
    "merge": ("fedbus.algorithms.core.merge",),
    "weights": ("fedbus.algorithms.core.weights",),
    "split": ("fedbus.algorithms.core.split",),
    "robust": ("fedbus.algorithms.core.robust",),
    "dp_sgd": ("fedbus.algorithms.core.dp_sgd",),
    "aux_model": ("fedbus.algorithms.fml",),
})
