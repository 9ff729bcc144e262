"""`fedbus ARGS` for the tests, forked from an interpreter that has already imported torch.

Started as `python -m fedbus.launch`, every fedbus process a test starts imports torch and the
fedbus modules itself: about 1.3 s of CPU for a node or a `fedbus run` launcher here, and the
suite starts several hundred of them on a 2-core machine. Each pytest worker instead keeps one
fork server (multiprocessing's "forkserver": a fresh interpreter started once, so it inherits
no test's threads, sockets or state) that has imported torch and the fedbus process modules
and nothing else. A `fedbus` call is a fork of it that runs what the console script runs
(`fedbus.launch.cli.console_main`) with the test's argv, working directory, environment and
files: a real OS process with its own pid, sockets, signals and exit status. It is what
`fedbus run` already does for its own children (launch/processes.py, `launch.start = "fork"`).

Not forked: a test that needs a property of a fresh interpreter (what gets imported, a process
group of its own, an environment variable read at import time) starts `python -m
fedbus.launch` itself. FEDBUS_TEST_EXEC=1 starts every fedbus process of the suite that way.
"""
from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.util  # noqa: F401  its exit handler, registered now: see _kill_leftovers
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# What a fedbus process imports before its main() does anything (launch.processes.preload,
# less the data): imported once in the fork server, shared copy-on-write by every fork.
PRELOAD = ["torch", "torch._dynamo", "fedbus.launch.cli", "fedbus.broker.broker",
           "fedbus.node.client_host", "fedbus.node.server", "fedbus.node.relay"]

EXEC = os.environ.get("FEDBUS_TEST_EXEC", "") not in ("", "0")

_context: multiprocessing.context.BaseContext | None = None
_live: list[ForkedFedbus] = []


def _fork_server() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([m for m in PRELOAD if _importable(m)])
    return _context


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _child(argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str | None) -> None:
    """The forked process: a fresh process's signals, files, directory, environment and argv,
    then the console script's main(), which leaves with os._exit."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = out if stderr is None else os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                                 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in {null, out, err}:
            os.close(fd)
        sys.argv = ["fedbus", *argv]
        from fedbus.launch.cli import console_main

        console_main()
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  as an interpreter would: the traceback on stderr
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ForkedFedbus:
    """A fedbus process forked from the worker's fork server; the part of subprocess.Popen's
    interface the tests use (pid, returncode, poll, wait, send_signal, terminate, kill)."""

    def __init__(self, argv: list[str], *, stdout: Path, stderr: Path | None = None,
                 cwd: Path | str, env: dict[str, str] | None = None):
        self.args = ["fedbus", *argv]
        self._proc = _fork_server().Process(
            target=_child, name=f"fedbus {argv[0] if argv else ''}",
            args=(list(argv), str(cwd), dict(os.environ if env is None else env), str(stdout),
                  None if stderr is None else str(stderr)))
        self._proc.start()
        self.pid: int = self._proc.pid
        self.returncode: int | None = None
        _live.append(self)

    def poll(self) -> int | None:
        if self.returncode is None and self._proc.exitcode is not None:
            self.returncode = self._proc.exitcode
            self._proc.close()
            _live.remove(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            self._proc.join(timeout)
            if self.poll() is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: list[str], *, stdout: Path, stderr: Path | None = None, cwd: Path | str,
          env: dict[str, str] | None = None) -> ForkedFedbus | subprocess.Popen:
    """`fedbus ARGV` with its standard output appended to STDOUT and its standard error to
    STDERR (None: to STDOUT); standard input is /dev/null. The files exist when this returns,
    as they do after subprocess.Popen."""
    for path in (stdout, stderr):
        if path is not None:
            open(path, "ab").close()
    if EXEC:
        out = open(stdout, "ab")
        err = subprocess.STDOUT if stderr is None else open(stderr, "ab")
        try:
            return subprocess.Popen([sys.executable, "-m", "fedbus.launch", *argv], cwd=cwd,
                                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
        finally:
            out.close()
            if stderr is not None:
                err.close()
    return ForkedFedbus(argv, stdout=stdout, stderr=stderr, cwd=cwd, env=env)


def run(argv: list[str], *, cwd: Path | str, timeout: float,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) for `fedbus ARGV`: the streams go to
    files and are read back once the process has exited; past TIMEOUT it is killed and
    subprocess.TimeoutExpired raised, as subprocess.run does."""
    with tempfile.TemporaryDirectory(prefix="fedbus-out-") as d:
        out, err = Path(d, "stdout"), Path(d, "stderr")
        proc = start(argv, stdout=out, stderr=err, cwd=cwd, env=env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            raise subprocess.TimeoutExpired(proc.args, timeout,
                                            output=out.read_text(errors="replace"),
                                            stderr=err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(proc.args, code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


@atexit.register
def _kill_leftovers() -> None:
    """Before multiprocessing's own exit handler joins every child it started, kill the ones
    a failed test left running. atexit runs handlers last-registered first, and
    multiprocessing.util registers its handler when it is first imported, which a bare
    `import multiprocessing` does not do: hence the import at the top of this module,
    before this registration (without it a leaked process hung the worker's exit)."""
    for proc in list(_live):  # poll() removes from _live
        proc.kill()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            pass
