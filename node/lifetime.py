"""Child processes: one that dies with its parent (Linux's PR_SET_PDEATHSIG), and the
command line that starts a fedbus module in a fresh interpreter.

The launcher's children (fedbus.launch.processes), a relay's site broker
(fedbus.node.relay) and the benchmarks use them, so they live here, below the launcher:
imports point one way, launch -> node. fedbus.launch.processes re-exports die_with_parent.
"""
from __future__ import annotations

import ctypes
import signal
import sys

# Python 3.10 has no -P: drop the working directory (sys.path[0] under -c) by hand
_SAFE_RUN = ("import runpy, sys; del sys.path[0]; "
             "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")


def python_module(module: str, *argv: str) -> list[str]:
    """`python -m MODULE ARGV` in this interpreter, without the working directory on
    sys.path (-P): a folder there named like fedbus or like a plugin's package would
    otherwise shadow the installed one in every process a launcher or benchmark starts."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *argv]
    return [sys.executable, "-c", _SAFE_RUN, module, *argv]


def fedbus_command(*argv: str) -> list[str]:
    """`fedbus ARGV` as python_module's command line."""
    return python_module("fedbus.launch", *argv)


def die_with_parent(name: str | None = None) -> None:
    """PR_SET_PDEATHSIG: SIGTERM when the launcher dies, however it dies. With a
    name, also PR_SET_NAME, so that ps and top tell forked processes apart (they
    share the launcher's command line)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)
        if name:
            libc.prctl(15, name.encode()[:15], 0, 0, 0)
    except OSError:
        pass
