"""Shared test fixtures: free loopback ports, polling helpers, and real subprocesses.

* ``free_port()`` / ``tcp_endpoint``: a tcp://127.0.0.1:PORT nobody listens on.
* ``wait_for(predicate, timeout)``: poll until true (never a fixed sleep in a test).
* ``broker_proc``: start ``python -m fedbus.launch broker ...`` as a subprocess, wait until it
  logs that it listens; kill/restart it; read its JSON log.
* ``spawn_py``: run a Python source string in a subprocess with a JSON config as argv[1];
  read the JSON lines it prints on stdout with a timeout.

Everything started through these fixtures is killed at the end of the test.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zygote

# Test modules that import the privacy extra at their top. Where it is missing (a lent GPU
# machine, a user's base install plus pytest) they are left out and named in the header rather
# than stopping collection; under CI, which installs .[dev], a missing extra stays an error.
PRIVACY_MODULES = ("dp_accounting", "cryptography")
NEEDS_PRIVACY = ("test_dp.py", "test_dp_sgd.py", "test_privacy_runs.py", "test_secagg.py")
_missing = [m for m in PRIVACY_MODULES if importlib.util.find_spec(m) is None]
collect_ignore = [] if os.environ.get("CI") or not _missing else list(NEEDS_PRIVACY)


def pytest_report_header(config):
    if collect_ignore:
        return (f"left out, the privacy extra missing ({', '.join(_missing)}): "
                f"{', '.join(collect_ignore)}")
    return None


# generous: the machine may be loaded (2 cores shared by several test runs)
START_TIMEOUT = 60.0


def _event_is(event: str, line: dict) -> bool:
    return line.get("event") == event


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate: Callable[[], Any], timeout: float = 30.0, interval: float = 0.02,
             message: str = "condition") -> Any:
    """Call predicate until it returns something truthy (returned); AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {message}")
        time.sleep(interval)


@pytest.fixture
def tcp_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture
def ipc_endpoint(tmp_path) -> str:
    # unix socket paths are limited to ~107 bytes: use a short directory
    import tempfile

    d = tempfile.mkdtemp(prefix="fb-")
    yield f"ipc://{d}/broker.sock"
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def _read_json_lines(path: Path) -> list[dict]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line being written right now
    except FileNotFoundError:
        pass
    return out


def require_fast_path() -> None:
    """Skip unless the broker's C fast path is built here; under CI, fail instead, so a
    broken build cannot pass as a skip."""
    from fedbus.broker.fastroute import why_not

    if why_not():
        if os.environ.get("CI"):
            pytest.fail(f"the broker's C fast path is off in CI: {why_not()}")
        pytest.skip(f"the broker's C fast path is not built here: {why_not()}")


class BrokerProc:
    """The fedbus broker CLI in a subprocess."""

    def __init__(self, endpoint: str, workdir: Path, *, heartbeat_s: float = 1.0,
                 liveness: int = 3, log_level: str = "info", max_frame_mb: float | None = None,
                 grace_s: float | None = None, fast_path: bool | None = None,
                 ended_runs: Path | None = None):
        self.endpoint = endpoint
        # None: as a user gets it (C where built); False: the Python loop (fastroute.py)
        self.env = None if fast_path is None else \
            {**os.environ, "FEDBUS_BROKER_FASTPATH": "1" if fast_path else "0"}
        self.workdir = workdir
        self.log_file = workdir / f"broker-{free_port()}.jsonl"
        self.stderr_file = self.log_file.with_suffix(".stderr")
        self.args = ["--bind", endpoint, "--heartbeat-s", str(heartbeat_s), "--liveness",
                     str(liveness), "--log-level", log_level, "--log-file", str(self.log_file)]
        if max_frame_mb is not None:
            self.args += ["--max-frame-mb", str(max_frame_mb)]
        if grace_s is not None:
            self.args += ["--grace-s", str(grace_s)]
        if ended_runs is not None:
            self.args += ["--ended-runs", str(ended_runs)]
        self.proc: subprocess.Popen | zygote.ForkedFedbus | None = None
        self.starts = 0

    def start(self, timeout: float = START_TIMEOUT) -> BrokerProc:
        already = len(self.events("broker listening"))
        self.proc = zygote.start(["broker", *self.args], stdout=Path(os.devnull),
                                 stderr=self.stderr_file, cwd=self.workdir, env=self.env)
        self.starts += 1

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"broker exited with {self.proc.returncode}: {self.stderr_file.read_text()}")
            return len(self.events("broker listening")) > already

        wait_for(up, timeout, message="the broker to listen")
        return self

    def events(self, event: str | None = None, **match) -> list[dict]:
        """Log records (JSON lines), optionally only one event with matching fields."""
        recs = _read_json_lines(self.log_file)
        if event is not None:
            recs = [r for r in recs if r.get("event") == event]
        for k, v in match.items():
            recs = [r for r in recs if r.get(k) == v]
        return recs

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (no clean shutdown) and reap."""
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM, wait for a clean exit; returns the exit code."""
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("the broker did not stop on SIGTERM") from None
        return self.proc.returncode if self.proc is not None else 0

    def restart(self) -> BrokerProc:
        self.kill()
        return self.start()


@pytest.fixture
def broker_proc(tmp_path):
    """Factory: broker_proc(endpoint, heartbeat_s=..., liveness=..., ...) -> started BrokerProc."""
    started: list[BrokerProc] = []

    def make(endpoint: str, *, start: bool = True, **kw) -> BrokerProc:
        b = BrokerProc(endpoint, tmp_path, **kw)
        started.append(b)
        return b.start() if start else b

    yield make
    for b in started:
        try:
            b.kill()
        except Exception:
            pass


class PyProc:
    """A Python subprocess running `code` with json.dumps(cfg) as sys.argv[1].

    Each line it prints on stdout is parsed as JSON (kept as {"raw": line} otherwise) and
    queued; ``expect`` waits for a line matching a predicate.
    """

    def __init__(self, code: str, cfg: dict, workdir: Path, name: str = "proc"):
        self.name = name
        self.stderr_file = workdir / f"{name}-{os.getpid()}-{free_port()}.stderr"
        self._err = open(self.stderr_file, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(cfg)],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True, bufsize=1)
        self.lines: list[dict] = []
        self._q: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                rec = {"raw": line}
            self._q.put(rec)
        self._q.put(None)

    def expect(self, predicate: Callable[[dict], bool] | str, timeout: float = 30.0) -> dict:
        """The next line for which predicate(line) is true (or whose "event" equals it)."""
        if isinstance(predicate, str):
            predicate = functools.partial(_event_is, predicate)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{self.name}: timed out; stderr:\n{self.stderr()}")
            try:
                rec = self._q.get(timeout=remaining)
            except queue.Empty:
                continue
            if rec is None:
                self._q.put(None)
                raise AssertionError(
                    f"{self.name} exited ({self.proc.poll()}) before the expected line; "
                    f"stderr:\n{self.stderr()}")
            self.lines.append(rec)
            if predicate(rec):
                return rec

    def records(self, event: str | None = None) -> list[dict]:
        """Every line printed so far (optionally only one event), without waiting."""
        while True:
            try:
                rec = self._q.get_nowait()
            except queue.Empty:
                break
            if rec is None:
                self._q.put(None)
                break
            self.lines.append(rec)
        return [r for r in self.lines if event is None or r.get("event") == event]

    def stderr(self) -> str:
        try:
            return self.stderr_file.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(30)

    def wait(self, timeout: float = 60.0) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._err.close()


@pytest.fixture
def spawn_py(tmp_path):
    """Factory: spawn_py(code, cfg, name=...) -> PyProc; all are killed at teardown."""
    procs: list[PyProc] = []

    def make(code: str, cfg: dict, name: str = "proc") -> PyProc:
        p = PyProc(code, cfg, tmp_path, name)
        procs.append(p)
        return p

    yield make
    for p in procs:
        try:
            p.close()
        except Exception:
            pass
