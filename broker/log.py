"""Logging for every fedbus process: structlog on top of the stdlib ``logging`` module.

``configure_logging`` sets up, under the stdlib logger ``fedbus``:

* a console handler on stderr: structlog's pretty ConsoleRenderer when stderr is a TTY
  (or ``console=True``), plain ``key=value`` lines otherwise, nothing with ``console=False``;
* optionally a JSON-lines file (one object per line with timestamp, level, event, logger,
  process, pid and the event's own keys), appended to.

``get_logger(name)`` returns a structlog BoundLogger whose stdlib name lives under
``fedbus.`` so that it reaches these handlers. A process that logs before calling
``configure_logging`` gets the defaults (info level, console only). Hot paths should check
``logger.isEnabledFor(logging.DEBUG)`` once and keep the answer in a bool.
"""
from __future__ import annotations

import logging
import os
import sys
import threading

import structlog

__all__ = ["LEVELS", "configure_logging", "get_logger"]

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_ROOT = "fedbus"
_lock = threading.Lock()
_configured = False
_handlers: list[logging.Handler] = []


def _level(level: str | int) -> int:
    if isinstance(level, int):
        return level
    try:
        return LEVELS[str(level).lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r} (one of {', '.join(LEVELS)})") from None


def configure_logging(
    *,
    level: str = "info",
    json_file: str | os.PathLike | None = None,
    console: bool | None = None,
    process: str = "",
) -> None:
    """Configure structlog + the ``fedbus`` stdlib logger for this process (idempotent)."""
    global _configured
    lvl = _level(level)
    proc = process or os.path.basename(sys.argv[0] or "python")
    pid = os.getpid()

    def add_process(_logger, _name, event_dict):
        event_dict.setdefault("process", proc)
        event_dict.setdefault("pid", pid)
        return event_dict

    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        add_process,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    with _lock:
        root = logging.getLogger(_ROOT)
        for h in _handlers:
            root.removeHandler(h)
            try:
                h.close()
            except Exception:
                pass
        _handlers.clear()
        root.setLevel(lvl)
        root.propagate = False

        tty = False
        try:
            tty = sys.stderr.isatty()
        except (AttributeError, ValueError):
            pass
        if console is None or console:
            if console or tty:
                chain = [structlog.dev.ConsoleRenderer(colors=tty)]
            else:
                chain = [
                    structlog.processors.format_exc_info,
                    structlog.processors.KeyValueRenderer(
                        key_order=["timestamp", "level", "logger", "event", "process"],
                        drop_missing=True,
                    ),
                ]
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(
                structlog.stdlib.ProcessorFormatter(
                    processors=[
                        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        *chain,
                    ],
                    foreign_pre_chain=shared,
                )
            )
            root.addHandler(h)
            _handlers.append(h)
        if json_file is not None:
            path = os.fspath(json_file)
            d = os.path.dirname(path)
            if d:
                os.makedirs(d, exist_ok=True)
            fh = logging.FileHandler(path, mode="a", encoding="utf-8")
            fh.setFormatter(
                structlog.stdlib.ProcessorFormatter(
                    processors=[
                        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.format_exc_info,
                        structlog.processors.JSONRenderer(default=repr),
                    ],
                    foreign_pre_chain=shared,
                )
            )
            root.addHandler(fh)
            _handlers.append(fh)

        structlog.configure(
            processors=[structlog.stdlib.filter_by_level, *shared,
                        structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
            logger_factory=structlog.stdlib.LoggerFactory(),
            wrapper_class=structlog.stdlib.BoundLogger,
            cache_logger_on_first_use=False,
        )
        _configured = True


def get_logger(name: str):
    """A structlog BoundLogger named ``fedbus.<name>`` (configures defaults on first use)."""
    if not _configured:
        configure_logging()
    if name != _ROOT and not name.startswith(_ROOT + "."):
        name = f"{_ROOT}.{name}"
    return structlog.get_logger(name)
