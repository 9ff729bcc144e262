"""A child process that dies with its parent (Linux's PR_SET_PDEATHSIG).

The launcher's children (fedbus.launch.processes) and a relay's site broker
(fedbus.node.relay) both use it, so it lives here, below the launcher: imports
point one way, launch -> node. fedbus.launch.processes re-exports the name.
"""
from __future__ import annotations

import ctypes
import signal


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
