"""Separate "hosts" on one Linux machine, for tests: network namespaces joined by a bridge.

``Network(["broker", "server", "n0"], workdir)`` builds

* a *switch* namespace holding a Linux bridge ``br0``;
* one namespace per host, joined to the switch by one link: ``eth0`` on the host side with
  ``10.77.0.N/24``, a bridge port on the switch side. Nothing links them to the root
  namespace, so their traffic never leaves them (and the addresses cannot clash with
  anything outside);
* optionally an ``Impairment`` (delay, jitter, loss) on every link, both directions: the
  kernel's netem qdisc where it exists, else the userspace impairer tests/netem.py, whose
  links are pairs of TAP devices instead of veth pairs (``network.impairer`` says which ran,
  and why).

Then ``spawn(host, name, argv)`` runs a command inside a host's namespace
(``ip netns exec``), ``cut(host)`` / ``heal(host)`` take its link down and up,
``rate_limit(host, "1mbit")`` puts a token bucket (tbf) on both ends of its link, and
``close()`` (also on an exception or Ctrl-C, as a context manager) kills every process left
in the namespaces and deletes them.

``Network(hosts, workdir, loopback=True)`` is the control: one namespace for every host, each
host's address 127.0.0.1, the same ``spawn``.

Namespace names are ``fbmh<owner pid>-<random>-<host>``: a run that crashed leaves its
namespaces behind, and the next ``Network`` deletes those whose owner process is gone (and
never another live run's). ``unavailable()`` says why the harness cannot run here (not root,
no iproute2, namespaces refused), for a skip.
"""
from __future__ import annotations

import functools
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

PREFIX = "fbmh"
SUBNET = "10.77.0"
BRIDGE = "br0"
NETEM = Path(__file__).resolve().with_name("netem.py")
_STALE = re.compile(rf"^{PREFIX}(\d+)-")


class HarnessError(RuntimeError):
    """An ip/tc command failed while the network was being built or changed."""


def _run(argv: Sequence[str], check: bool = True, timeout: float = 30.0
         ) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(argv), check=False, capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise HarnessError(f"{' '.join(argv)}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace_processes(ns: str) -> None:
    """SIGKILL whatever still runs inside `ns` (processes this harness started there)."""
    for _ in range(3):
        pids = [int(p) for p in _run(["ip", "netns", "pids", ns], check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def _delete_namespace(ns: str) -> None:
    _kill_namespace_processes(ns)
    _run(["ip", "netns", "del", ns], check=False)


def cleanup_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose owning process is gone; their names."""
    removed = []
    for ns in _namespaces():
        m = _STALE.match(ns)
        if m and not _owner_alive(int(m.group(1))):
            _delete_namespace(ns)
            removed.append(ns)
    return removed


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why namespaces and links cannot be built here (a skip reason), or None."""
    if sys.platform != "linux":
        return f"network namespaces need Linux, not {sys.platform}"
    if os.geteuid() != 0:
        return "not root: creating network namespaces and links needs root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"iproute2 missing ({', '.join(missing)} not on PATH)"
    cleanup_stale()
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "a1"])
    except (HarnessError, subprocess.TimeoutExpired) as err:
        return f"cannot build a network namespace with a veth pair: {err}"
    finally:
        _delete_namespace(probe)
    return None


@functools.lru_cache(maxsize=1)
def kernel_netem() -> str | None:
    """None when `tc qdisc add ... netem` works here, else why not (tc's words)."""
    probe = f"{PREFIX}{os.getpid()}-netem"
    try:
        _run(["ip", "netns", "add", probe])
        _run(["ip", "-n", probe, "link", "add", "a0", "type", "veth", "peer", "name", "a1"])
        _run(["ip", "-n", probe, "link", "set", "a0", "up"])
        _run(["tc", "-n", probe, "qdisc", "add", "dev", "a0", "root", "netem", "delay", "1ms"])
    except (HarnessError, subprocess.TimeoutExpired) as err:
        return str(err).rsplit(": ", 1)[-1]
    finally:
        _delete_namespace(probe)
    return None


def tun_unavailable() -> str | None:
    """Why the userspace impairer's TAP devices cannot be made, or None."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError as err:
        return f"/dev/net/tun: {err.strerror}"
    os.close(fd)
    return None


def impairer_choice() -> tuple[str | None, str]:
    """("kernel" or "userspace", why), or (None, why neither can run). The environment
    variable FEDBUS_IMPAIRER=userspace forces the userspace impairer where netem exists."""
    forced = os.environ.get("FEDBUS_IMPAIRER", "")
    netem_missing = kernel_netem()
    if netem_missing is None and forced != "userspace":
        return "kernel", "kernel netem qdisc"
    why = ("FEDBUS_IMPAIRER=userspace" if netem_missing is None
           else f"kernel netem unavailable: {netem_missing}")
    tun_missing = tun_unavailable()
    if tun_missing is not None:
        return None, f"{why}; and no TAP devices for the userspace impairer ({tun_missing})"
    return "userspace", f"userspace tests/netem.py ({why})"


@dataclass(frozen=True)
class Impairment:
    """Delay (+- uniform jitter) and loss, applied on every link in both directions."""

    delay_ms: float = 50.0
    jitter_ms: float = 10.0
    loss: float = 0.01  # per frame, per link and direction
    seed: int = 1  # the userspace impairer's random stream


class HostProcess:
    """A command running in a host's namespace; its stdout and stderr go to `log_path`."""

    def __init__(self, host: str, name: str, argv: list[str], popen: subprocess.Popen,
                 log_path: Path):
        self.host, self.name, self.argv = host, name, argv
        self.popen = popen
        self.log_path = log_path

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive:
            self.popen.send_signal(sig)
        self.popen.wait(30)

    def log(self, tail: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail:]
        except OSError:
            return ""


class Network:
    """Hosts in namespaces joined by a bridge (see the module docstring)."""

    def __init__(self, hosts: Sequence[str], workdir: Path, *,
                 impairment: Impairment | None = None, loopback: bool = False):
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts must be distinct names, got {list(hosts)}")
        if len(hosts) > 200:
            raise ValueError("at most 200 hosts on one /24")
        self.hosts = list(hosts)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.impairment = impairment
        self.loopback = loopback
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-switch"
        self.namespaces: dict[str, str] = {}  # host -> namespace
        self.ports: dict[str, str] = {}  # host -> its bridge port in the switch namespace
        self.impairer = "none"  # "kernel netem qdisc", "userspace tests/netem.py (...)", ...
        self.impairer_stats: dict | None = None
        self.processes: list[HostProcess] = []
        self._impairer_proc: subprocess.Popen | None = None
        self._impairer_out: queue.Queue = queue.Queue()
        self._made: list[str] = []  # namespaces created, in order
        self._closed = False

    # ------------------------------------------------------------------ building
    def __enter__(self) -> Self:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def build(self) -> Network:
        cleanup_stale()
        if self.loopback:
            ns = self._add_namespace(f"{self.tag}-loopback")
            for host in self.hosts:
                self.namespaces[host] = ns
            return self
        self._add_namespace(self.switch)
        _run(["ip", "-n", self.switch, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", BRIDGE, "up"])
        for host in self.hosts:
            self.namespaces[host] = self._add_namespace(f"{self.tag}-{host}")
            self.ports[host] = f"p{len(self.ports)}"
        mode = None
        if self.impairment is not None:
            mode, self.impairer = impairer_choice()
            if mode is None:
                raise HarnessError(self.impairer)
        if mode == "userspace":
            self._start_userspace_impairer()
        else:
            for host in self.hosts:
                _run(["ip", "-n", self.namespaces[host], "link", "add", "eth0", "type", "veth",
                      "peer", "name", self.ports[host], "netns", self.switch])
        for host in self.hosts:
            ns, port = self.namespaces[host], self.ports[host]
            if mode != "userspace":
                _run(["ip", "-n", self.switch, "link", "set", port, "master", BRIDGE])
                _run(["ip", "-n", self.switch, "link", "set", port, "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            if mode == "kernel":
                imp = self.impairment
                netem = ["netem", "delay", f"{imp.delay_ms}ms", f"{imp.jitter_ms}ms",
                         "loss", f"{imp.loss * 100}%"]
                _run(["tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *netem])
                _run(["tc", "-n", self.switch, "qdisc", "add", "dev", port, "root", *netem])
        return self

    def _add_namespace(self, ns: str) -> str:
        _run(["ip", "netns", "add", ns])
        self._made.append(ns)
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        return ns

    def _start_userspace_impairer(self) -> None:
        imp = self.impairment
        cfg = {"bridge": BRIDGE, "seed": imp.seed, "delay_ms": imp.delay_ms,
               "jitter_ms": imp.jitter_ms, "loss": imp.loss,
               "links": [{"name": host, "host_ns": self.namespaces[host],
                          "host_dev": f"h{i}", "switch_dev": self.ports[host]}
                         for i, host in enumerate(self.hosts)]}
        # stdin stays open: the impairer stops when it closes (also if this process dies)
        with open(self.workdir / "netem.stderr", "wb") as err:
            self._impairer_proc = subprocess.Popen(
                ["ip", "netns", "exec", self.switch, sys.executable, str(NETEM),
                 json.dumps(cfg)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                start_new_session=True)
        threading.Thread(target=self._read_impairer, daemon=True).start()
        try:
            line = self._impairer_out.get(timeout=60)
        except queue.Empty:
            line = None
        if not line or json.loads(line).get("event") != "ready":
            why = (self.workdir / "netem.stderr").read_text(errors="replace")[-2000:]
            raise HarnessError(f"the userspace impairer did not start: {why}")

    def _read_impairer(self) -> None:
        for line in self._impairer_proc.stdout:
            self._impairer_out.put(line.strip())
        self._impairer_out.put(None)

    # ------------------------------------------------------------------ using
    def address(self, host: str) -> str:
        """The host's IPv4 address as the other hosts reach it."""
        if self.loopback:
            return "127.0.0.1"
        return f"{SUBNET}.{self.hosts.index(host) + 2}"

    def spawn(self, host: str, name: str, argv: Sequence[str], *,
              env: dict[str, str] | None = None) -> HostProcess:
        """Start argv inside host's namespace; output appended to WORKDIR/NAME.log."""
        log_path = self.workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(["ip", "netns", "exec", self.namespaces[host], *argv],
                                     cwd=self.workdir, stdin=subprocess.DEVNULL, stdout=log,
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        proc = HostProcess(host, name, list(argv), popen, log_path)
        self.processes.append(proc)
        return proc

    def cut(self, host: str) -> float:
        """Take the host's link down at both ends; returns the time (time.time())."""
        self._link(host, "down")
        return time.time()

    def heal(self, host: str) -> float:
        """Bring the host's link back up; returns the time (time.time())."""
        self._link(host, "up")
        return time.time()

    def _link(self, host: str, state: str) -> None:
        if self.loopback:
            raise HarnessError("a loopback network has no links")
        _run(["ip", "-n", self.namespaces[host], "link", "set", "eth0", state])
        _run(["ip", "-n", self.switch, "link", "set", self.ports[host], state])

    def rate_limit(self, host: str, rate: str = "1mbit", burst: str = "32kbit",
                   latency: str = "400ms") -> None:
        """A token bucket of `rate` on the host's link, both directions (replacing any
        impairment qdisc on it)."""
        if self.loopback:
            raise HarnessError("a loopback network has no links")
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        _run(["tc", "-n", self.namespaces[host], "qdisc", "replace", "dev", "eth0", "root", *tbf])
        _run(["tc", "-n", self.switch, "qdisc", "replace", "dev", self.ports[host], "root",
              *tbf])

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop every process started here, the impairer, and delete the namespaces."""
        if self._closed:
            return
        self._closed = True
        for proc in self.processes:
            try:
                if proc.alive:
                    proc.popen.send_signal(signal.SIGTERM)
            except OSError:
                pass
        deadline = time.monotonic() + 10
        for proc in self.processes:
            try:
                proc.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.popen.kill()
                proc.popen.wait(30)
        if self._impairer_proc is not None:
            p = self._impairer_proc
            try:
                p.stdin.close()  # its signal to stop; it prints its counters then
                p.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                p.kill()
                p.wait(30)
            lines = []
            while True:
                try:
                    line = self._impairer_out.get(timeout=2)
                except queue.Empty:
                    break
                if line is None:
                    break
                lines.append(line)
            for line in lines:
                rec = json.loads(line)
                if rec.get("event") == "stats":
                    self.impairer_stats = rec["links"]
        for ns in reversed(self._made):
            _delete_namespace(ns)
