"""`Opt`: one declared option, with its default, help text, allowed values and bounds.

An algorithm declares its [algorithm] parameters as `PARAMS = {key: Opt(...)}` (through
fedbus.algorithms.local.opt); the config layer (fedbus.node.config) validates a run's
TOML against them, and declares its own sections' options with the same class. It lives
here, with the algorithms, so that imports point one way: node -> algorithms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Opt:
    default: Any
    help: str = ""
    choices: tuple | None = None
    min: float | None = None
    max: float | None = None
