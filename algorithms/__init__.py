"""Algorithms as swappable message handlers, looked up by name.

Built-in algorithms live one per module here; a third party registers one
through the `fedbus.algorithms` entry-point group, whose value points at an
`Algorithm` object (``my_pkg.my_algo:ALGORITHM``; docs/PLUGINS.md, and the
template package examples/plugin/). No if/elif chain anywhere: the engine asks
`get_algorithm(name)` and gets the two handler classes. An entry point that does
not load is a `PluginError`, one line naming the entry point, its module and
what was found there.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
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
    "fednh": "fedbus.algorithms.fednh",
    "fedhkd": "fedbus.algorithms.fedhkd",
    "fpl": "fedbus.algorithms.fpl",
    "fedpac": "fedbus.algorithms.fedpac",
    "fedpcl": "fedbus.algorithms.fedpcl",
    "noop": "fedbus.algorithms.noop",
}

_loaded: dict[str, Algorithm] = {}


class PluginError(KeyError):
    """An algorithm entry point that does not give a usable Algorithm: its module fails to
    import, lacks the attribute, holds something else, or an Algorithm of another name.
    The message is one line naming the entry point, its module and what was found.

    A KeyError, like an unknown name: every caller that already turns an unknown
    algorithm into a one-line error (the config layer's `algorithm.name = ...: ...`,
    `fedbus algorithms NAME`) does the same for a plugin that does not load."""

    def __str__(self) -> str:  # KeyError's own str() is the repr of its message
        return str(self.args[0]) if self.args else ""


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {' '.join(str(err).split())}"[:300]


def _found(value: object) -> str:
    if isinstance(value, Algorithm):
        return f"an Algorithm named {value.name!r}"
    shown = " ".join(repr(value).split())
    return f"{type(value).__name__} {shown[:80]}{'...' if len(shown) > 80 else ''}"


def _load_plugin(name: str, ep: EntryPoint) -> Algorithm:
    """The Algorithm an entry point names, or PluginError saying what is wrong with it."""
    dist = getattr(ep, "dist", None)
    package = f", package {dist.name} {dist.version}" if dist is not None else ""
    where = f"plugin entry point {name!r} ({name} = {ep.value}{package})"
    try:
        module = importlib.import_module(ep.module)
    except Exception as err:  # any import-time failure of third-party code
        raise PluginError(f"{where}: module {ep.module} does not import: "
                          f"{_one_line(err)}") from err
    value: object = module
    for part in filter(None, (ep.attr or "").split(".")):  # "module:Class.attribute" too
        if not hasattr(value, part):
            raise PluginError(f"{where}: module {ep.module} has no attribute {ep.attr}")
        value = getattr(value, part)
    found = f"{ep.module}.{ep.attr}" if ep.attr else f"module {ep.module}"
    if not isinstance(value, Algorithm):
        raise PluginError(f"{where}: {found} is {_found(value)}, not a "
                          f"fedbus.algorithms.Algorithm")
    if value.name != name:
        raise PluginError(f"{where}: {found} is {_found(value)}; the entry point's name and "
                          f"Algorithm.name must be the same")
    return value


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
        algo = _load_plugin(name, plugins[name])
    else:
        raise KeyError(f"unknown algorithm {name!r}; available: {', '.join(available())}")
    if not isinstance(algo, Algorithm) or algo.name != name:  # a built-in module's bug
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
