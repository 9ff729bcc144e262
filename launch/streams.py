"""Standard streams whose reader may have left.

`fedbus run ... 2>&1 | tee log`, then Ctrl-C: the terminal signals the whole process group,
tee dies first, and the launcher's next line to it fails with EPIPE (Python ignores
SIGPIPE and raises BrokenPipeError). A launcher that let that error escape would exit 141
with its run half stopped and the line saying how to continue lost. Here a broken stream
is pointed at /dev/null (later writes, and the flush at exit, go nowhere instead of
raising), and the lines a user must see go to the terminal itself when stderr is gone.
"""
from __future__ import annotations

import os
import sys
from typing import TextIO

_muted: set[int] = set()  # descriptors pointed at /dev/null after their reader left


def mute(stream: TextIO) -> None:
    """Point `stream`'s descriptor at /dev/null, dropping what it still buffers."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)
    _muted.add(fd)
    try:
        stream.flush()  # what failed to go out now goes to /dev/null
    except OSError:
        pass


def mute_if_broken(stream: TextIO) -> bool:
    """Flush `stream`; if its reader left, mute it. True when it is (now) muted."""
    try:
        stream.flush()
    except OSError:
        mute(stream)
    try:
        return stream.fileno() in _muted
    except (OSError, ValueError):
        return True


def err(line: str) -> None:
    """A line on stderr, or nowhere once stderr's reader has left."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        mute(sys.stderr)


def tell(line: str) -> None:
    """A line the user must see (how to continue a stopped run): on stderr, or, when
    stderr's reader has left, on the controlling terminal if there is one."""
    if not mute_if_broken(sys.stderr):
        try:
            print(line, file=sys.stderr, flush=True)
            return
        except OSError:
            mute(sys.stderr)
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line + "\n")
    except OSError:  # no terminal (a detached session): the run's status.json still says it
        pass


def out(line: str) -> None:
    """A line on stdout, or nowhere once stdout's reader has left (`| head`)."""
    try:
        print(line, flush=True)
    except OSError:
        mute(sys.stdout)
