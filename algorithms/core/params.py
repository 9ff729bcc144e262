"""Parameter declarations: `Opt` (one declared option, with its default, help text,
allowed values and bounds), `opt()` to declare one, and the `Params` mixin through which
a handler reads its [algorithm] section.

An algorithm declares its [algorithm] parameters as `PARAMS = {key: opt(...)}`; the config
layer (fedbus.node.config) validates a run's TOML against them, and declares its own
sections' options with the same class. It lives here, with the algorithms, so that imports
point one way: node -> algorithms.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, ClassVar


@dataclass(frozen=True)
class Opt:
    default: Any
    help: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None


def opt(default: Any, help: str = "", choices: tuple | None = None,
        min: float | None = None, max: float | None = None) -> Any:
    """Declare an [algorithm] parameter: an `Opt` (the config layer validates its
    choices and bounds)."""
    return Opt(default, help, choices, min, max)


def default_of(declared: Any) -> Any:
    """The default value of a PARAMS entry (an Opt or a plain value)."""
    return getattr(declared, "default", declared)


class Params:
    """Mixin for handlers: `param(key)` reads the [algorithm] section and falls
    back to the declared default, so a handler built from a partial params
    mapping (tests, notebooks) still sees every key."""

    PARAMS: ClassVar[dict[str, Any]] = {}
    params: Mapping[str, Any]

    def param(self, key: str) -> Any:
        if key in self.params:
            return self.params[key]
        return default_of(self.PARAMS[key])

    def resolved_params(self) -> dict[str, Any]:
        """Every declared key with its value: what a relay's MergeRule is given."""
        return resolved_params(type(self), self.params)


def resolved_params(handler_cls: type, section: Mapping[str, Any]) -> dict[str, Any]:
    """A handler class's declared PARAMS with their defaults, overridden by `section` (the
    [algorithm] table): the values its handler's param() would read."""
    out = {k: default_of(v) for k, v in getattr(handler_cls, "PARAMS", {}).items()}
    out.update(section)
    return out
