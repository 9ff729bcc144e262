"""The processes of a local run, and the two ways of starting them.

exec: each process is a fresh interpreter (`python -m fedbus.launch server ...`)
      that imports torch, loads the data and partitions it by itself.
fork: the launcher imports torch and the fedbus modules once, loads and
      partitions the data once, then forks each process, which runs the same
      sub-command's main() with that work already done (copy-on-write). On a
      2-core machine three interpreters importing torch at once take about
      three times one import; forking makes start-up cost one.

Either way a child is a real OS process with its own sockets, its own log file
(stdout and stderr) and PR_SET_PDEATHSIG, so it dies with the launcher. Fork is
used only where it is safe: Linux, and no process on a GPU (a CUDA driver
initialised before a fork cannot be used in the child; see `start_method`).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

# die_with_parent lives in node (a relay's site broker uses it too); re-exported here
from fedbus.node.lifetime import die_with_parent, fedbus_command


def start_method(asked: str, devices: list[str]) -> str:
    """"fork" or "exec" for launch.start = auto | fork | exec."""
    if asked != "auto":
        return asked
    on_gpu = any(d != "cpu" for d in devices)
    return "fork" if sys.platform == "linux" and not on_gpu else "exec"


def preload(cfg) -> None:
    """What every forked process would otherwise do for itself: import torch and
    the process modules, initialise what the first optimizer step imports
    (torch._dynamo, ~1.5 s), and load and partition the data. Runs in the
    launcher before any fork; starts no thread and touches no GPU."""
    import torch
    import torch._dynamo

    import fedbus.broker.broker
    import fedbus.node.client_host
    import fedbus.node.server  # noqa: F401
    from fedbus.node.setup import federated_data

    from fedbus.node.client_host import node_threads

    federated_data(cfg)
    torch.set_num_threads(node_threads(cfg))  # also what the nodes use; no pool starts here


class Process(Protocol):
    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Forked:
    """A child forked from the launcher running `fedbus ARGV`; the part of
    subprocess.Popen's interface that Federation uses."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str], name: str):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os._exit(_run_child(argv, log, env, name))
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _run_child(argv: list[str], log: Path, env: dict[str, str], name: str) -> int:
    """The forked child's life: a fresh process's signals, files and argv, then the
    sub-command's main(). os._exit follows: no launcher atexit handler runs here."""
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent(f"fedbus-{name}")
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(null)
        os.close(out)
        os.environ.update(env)
        sys.argv = ["fedbus", *argv]
        from fedbus.launch.cli import main

        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001  the traceback goes to the child's log
        traceback.print_exc()
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


@dataclass
class Child:
    name: str
    proc: Process
    log: Path
    essential: bool


class Federation:
    """The processes of one local run."""

    def __init__(self, run_dir: Path, log_level: str, method: str = "exec"):
        self.run_dir = run_dir
        self.log_level = log_level
        self.method = method
        self.children: list[Child] = []

    def spawn(self, name: str, argv: list[str], *, env: dict[str, str] | None = None,
              essential: bool = True, method: str | None = None) -> Child:
        """Start `fedbus ARGV` as a child; `method` overrides the federation's fork/exec."""
        log = self.run_dir / "logs" / f"{name}.log"
        argv = [*argv, "--log-level", self.log_level,
                "--log-file", str(self.run_dir / "logs" / f"{name}.jsonl")]
        if (method or self.method) == "fork":
            proc: Process = Forked(argv, log, env or {}, name)
        else:
            proc = subprocess.Popen(fedbus_command(*argv),
                                    stdin=subprocess.DEVNULL, stdout=open(log, "ab"),
                                    stderr=subprocess.STDOUT,
                                    env={**os.environ, **(env or {})},
                                    preexec_fn=die_with_parent)
        child = Child(name, proc, log, essential)
        self.children.append(child)
        return child

    def dead(self) -> list[Child]:
        return [c for c in self.children if c.proc.poll() is not None]

    def stop(self, grace_s: float = 5.0) -> None:
        for c in self.children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        end = time.time() + grace_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, end - time.time()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=30)
