"""The broker's compiled fast path (``_fastroute.c``), bound to pyzmq's own libzmq.

``fast_route(sock)`` returns the C ``route`` function and the socket's libzmq address, or
None when the fast path cannot be used: the extension was not built (it is optional: a
machine without a C compiler installs fedbus all the same), FEDBUS_BROKER_FASTPATH=0 asks
for the Python loop, or pyzmq's libzmq cannot be found or is older than 4.0. The broker
then runs its Python loop, which makes the same decisions (broker.py, process_batch).

The C module links no libzmq of its own: it calls the functions of the libzmq that pyzmq
loaded (found through pyzmq's backend module, whose dependencies include it), so both work
on one socket of one library.
"""
from __future__ import annotations

import ctypes
import os

import zmq

__all__ = ["credit_type", "fast_route", "why_not"]

_FUNCS = ("zmq_msg_init", "zmq_msg_recv", "zmq_msg_send", "zmq_msg_close", "zmq_msg_data",
          "zmq_msg_size", "zmq_msg_more", "zmq_msg_get", "zmq_msg_gets", "zmq_send",
          "zmq_errno", "zmq_msg_move")
_state: dict[str, object] = {}


def _load():
    """The bound C module, or the reason there is none (cached)."""
    if "module" in _state or "why" in _state:
        return _state.get("module")
    try:
        if os.environ.get("FEDBUS_BROKER_FASTPATH", "1") == "0":
            raise RuntimeError("FEDBUS_BROKER_FASTPATH=0")
        if zmq.zmq_version_info() < (4, 0):
            raise RuntimeError(f"libzmq {zmq.zmq_version()} predates 4.0")
        try:
            from . import _fastroute  # optional, built at install time
        except ImportError as e:
            raise RuntimeError("the extension fedbus.broker._fastroute is not built (pip "
                               "builds it where a C compiler and the Python headers are "
                               f"found): {e}") from None
        if not hasattr(_fastroute, "Credit"):  # built from an older _fastroute.c
            raise RuntimeError("the extension fedbus.broker._fastroute predates the broker's "
                               "rate limits (no Credit type): rebuild it (pip install -e .)")

        lib = ctypes.CDLL(_backend_file())  # dlsym also searches its dependencies: libzmq
        _fastroute.bind(*(ctypes.cast(getattr(lib, f), ctypes.c_void_p).value for f in _FUNCS))
        _state["module"] = _fastroute
    except (ImportError, OSError, AttributeError, RuntimeError, ValueError) as e:
        _state["why"] = f"{type(e).__name__}: {e}"
    return _state.get("module")


def _backend_file() -> str:
    """The file of pyzmq's compiled backend, which links the libzmq pyzmq uses."""
    import importlib

    for name in ("zmq.backend.cython._zmq", "zmq.backend.cython.socket"):  # pyzmq >= 26, < 26
        try:
            return importlib.import_module(name).__file__
        except ImportError:
            continue
    raise RuntimeError("pyzmq has no Cython backend here (CFFI?)")


def fast_route(sock: zmq.Socket):
    """(route, socket address) for the C fast path on this socket, or None."""
    mod = _load()
    if mod is None:
        return None
    return mod.route, sock.underlying


def credit_type():
    """The C extension's Credit type (a node's rate-limit credit that the fast path spends),
    or None when the extension is not in use (the broker then uses a Python class with the
    same two attributes, msgs and nbytes)."""
    mod = _load()
    return None if mod is None else mod.Credit


def why_not() -> str | None:
    """Why the fast path is off (None when it is on)."""
    _load()
    return _state.get("why")  # type: ignore[return-value]
