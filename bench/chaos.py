"""A long federation under a seeded storm of faults, with invariants checked at the end.

    fedbus bench chaos --seed 1                       # 300 sync FedProto rounds, flat
    fedbus bench chaos --seed 2 --mode async --relay --algorithm fedavg
    fedbus bench chaos --seed 3 --all --rounds 60     # the matrix: sync/async x flat/relay x
                                                      # fedproto/fedavg

The bench starts a broker, a server (with --out), client nodes and, with --relay, one relay
per node, as separate processes by hand, as on separate machines, and injects a fault
schedule drawn from a numpy Generator seeded with --seed (printed before the run: the same
seed gives the same schedule; the federation's own seed is --seed too, unless
--federation-seed is given):

  node_kill    SIGKILL a node, aimed right after it sent an update (its write counter in
               /proc/PID/io jumps while a round is open), then start it again by the same
               name and clients
  node_stop    SIGSTOP a node for longer than the round deadline, then SIGCONT
  broker_kill  SIGKILL the broker mid-round, start it again on the same address
  server_kill  SIGKILL the server, aimed right after a metrics line appears (inside the
               window between metrics.jsonl and the checkpoint) or mid-round, then
               `fedbus server --resume`
  relay_kill   (--relay) SIGKILL a relay mid-round, start it again on the same site address
  link_cut     (--links, where network namespaces can be built) take a node's link down for
               about one to two deadlines, mid-round, then up again. With --links every
               process runs in its own namespace on a bridge (tests/netns.py, loaded from the
               checkout), every link delayed and lossy all along (--link-delay-ms,
               --link-loss: the kernel's netem, else the userspace impairer tests/netem.py);
               where that cannot be built, link faults are skipped with the reason printed

Every fault fires on events, never after a wait in seconds, so a storm injects the same
faults on a fast machine and a slow one: a fault is due once its round's record is in
metrics.jsonl, and a process still down from an earlier fault is awaited (its restart),
not skipped. Its aim is then an event too: after_metrics, the next record's line (inside the
window before its checkpoint); after_update, the target node's next update leaving (its
write counter jumps); mid_round, the next update leaving any node (a round under way). An
aim whose event does not come before the next record fires there. Only how long a process
stays down or stopped (hold_s) is in seconds: what the fault does, not whether it fires.

At the end it replays the server's message log (the path `fedbus replay` takes) and checks,
from the run's files:

  once          every aggregation used each client's update for a (round, version) at most
                once, across restarts and resends (the updates and relay members the
                server accepted, with what a resume rolled back restored from the matching
                checkpoint)
  incarnation   no update from a killed incarnation (its peer's `inc`) counted after its
                replacement registered (its config acknowledgement after the broker's join)
  replay        the replay sends every logged output byte for byte; every resume loaded a
                state the replay reached at a checkpoint, and the final checkpoint equals the
                replay's last checkpointed state (bit-identical on the CPU)
  window        at each server kill, every version the checkpoint counts done has its
                metrics record, and the records are never behind the checkpoint; in sync mode
                at most one aggregation ahead (node/server.py _record writes the record, then
                the checkpoint; a resume drops records past it: RunDir.keep_through), unless
                the server's log, as it wrote the last record, named the checkpoint on disk
                as one held back while a node had not yet answered a flush (a stopped or
                killed node: PROTOCOL.md §4.2; the log line comes before the record). In the
                end the metrics hold each round once (in order in sync mode; an async record
                waits for its evaluation while later aggregations are recorded)
  completion    the server exits 0 with every round done, every node and relay exits after
                the shutdown, and no process of the bench is left behind

Prints the schedule, a table of faults by kind (injected, survived), rounds completed and
violations (each with its rounds and message-log records); exit 1 on a violation, 2 on a
usage error.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

KINDS = ("node_kill", "node_stop", "broker_kill", "server_kill", "relay_kill", "link_cut")
NETNS = Path(__file__).resolve().parents[1] / "tests" / "netns.py"
HEARTBEAT_S, LIVENESS = 0.3, 10
INVARIANTS = ("once", "incarnation", "replay", "window", "completion")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seed", type=int, default=1,
                   help="the fault schedule's seed (numpy Generator), and the federation's "
                   "unless --federation-seed (default 1)")
    p.add_argument("--federation-seed", type=int, default=None,
                   help="federation.seed (default: --seed)")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--mode", choices=("sync", "async"), default="sync")
    p.add_argument("--relay", action="store_true", help="each node below its own relay")
    p.add_argument("--algorithm", choices=("fedproto", "fedavg"), default="fedproto")
    p.add_argument("--batch", choices=("off", "auto"), default=None,
                   help="bus.batch of the federations (default: bus.batch's default)")
    p.add_argument("--faults", type=int, default=0,
                   help="faults in the schedule (default: one per 12 rounds, at least 5)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=2.0, help="round (task) deadline")
    p.add_argument("--slow-factor", type=float, default=8.0,
                   help="every client's simulated device is this much slower, so a round "
                   "lasts long enough to aim at (default 8)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="give up (a violation: the run hung) after this many seconds")
    p.add_argument("--all", action="store_true",
                   help="run the matrix: sync/async x flat/relay x fedproto/fedavg")
    p.add_argument("--out", default=None, help="folder for the run(s) (default: a temp dir)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--links", choices=("auto", "off"), default="auto",
                   help="auto: each process in its own network namespace, links delayed and "
                   "lossy, link cuts in the schedule, where namespaces can be built (root, "
                   "iproute2, the checkout's tests/netns.py); off: loopback, no link faults")
    p.add_argument("--link-delay-ms", type=float, default=5.0,
                   help="--links: every link's delay (+- 40%% jitter)")
    p.add_argument("--link-loss", type=float, default=0.005,
                   help="--links: every link's frame loss, each direction")


# ------------------------------------------------------------------ the schedule


@dataclass
class Fault:
    i: int
    kind: str
    target: str  # process name: node-0, broker, server, relay-1
    at_round: int  # fires once this many metrics records exist
    aim: str  # after_update | after_metrics | mid_round
    hold_s: float  # down (kill) or stopped (stop) this long
    injected: bool = False
    aimed: str = ""  # what the aim found
    fired_at_round: int = -1
    survived: bool | None = None
    note: str = ""


def make_schedule(seed: int, rounds: int, n_faults: int, *, nodes: int, relay: bool,
                  deadline_s: float, links: bool = False) -> list[Fault]:
    """The seeded fault schedule: every available kind at least once, the rest drawn; trigger
    rounds spread over the run, each fault's aim and hold times drawn too."""
    rng = np.random.default_rng(seed)
    kinds = ["node_kill", "node_stop", "broker_kill", "server_kill"] + \
        (["relay_kill"] if relay else []) + (["link_cut"] if links else [])
    chosen = list(rng.permutation(kinds))[:n_faults]
    while len(chosen) < n_faults:
        chosen.append(str(rng.choice(kinds)))
    rng.shuffle(chosen)
    lo, hi = 2, max(3, rounds - 3)
    at = np.sort(rng.choice(np.arange(lo, hi), size=min(n_faults, hi - lo), replace=False))
    faults = []
    for i, (kind, r) in enumerate(zip(chosen, at)):
        kind = str(kind)
        node = int(rng.integers(nodes))
        if kind in ("node_kill", "node_stop", "link_cut"):
            target = f"node-{node}"
        elif kind == "relay_kill":
            target = f"relay-{node}"
        else:
            target = kind.split("_")[0]
        if kind == "node_kill":
            aim = "after_update" if rng.random() < 0.7 else "mid_round"
            hold = float(rng.uniform(0.2, 3.0))
        elif kind in ("node_stop", "link_cut"):  # past the deadline, or the liveness
            aim = "mid_round"
            hold = float(rng.uniform(1.2, 2.5) * deadline_s)
        elif kind == "server_kill":
            aim = "after_metrics" if rng.random() < 0.6 else "mid_round"
            hold = float(rng.uniform(0.1, 2.0))
        else:
            aim = "mid_round"
            hold = float(rng.uniform(0.1, 2.0))
        # (a mid-round fraction, once a wait in seconds: still drawn, so that every seed
        # keeps the schedule it had)
        rng.uniform(0.05, 0.95)
        faults.append(Fault(i, kind, target, int(r), aim, round(hold, 3)))
    return faults


def schedule_text(faults: list[Fault]) -> str:
    lines = [f"  {'#':>3} {'round':>6}  {'kind':<12}{'target':<10}{'aim':<15}{'hold s':>7}"]
    for f in faults:
        lines.append(f"  {f.i:>3} {f.at_round:>6}  {f.kind:<12}{f.target:<10}{f.aim:<15}"
                     f"{f.hold_s:>7.2f}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Federation:
    """fedbus processes started by hand, each in its own process group (killed whole)."""

    def __init__(self, work: Path, cfg_path: Path, run: Path, *, nodes: int, clients: int,
                 relay: bool, net: Any = None):
        self.work, self.cfg_path, self.run = work, cfg_path, run
        self.logs = work / "proc-logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.net = net  # tests/netns.py's Network: one namespace per process, or None
        if net is None:
            self.broker = f"tcp://127.0.0.1:{free_port()}"
            self.sites = [f"tcp://127.0.0.1:{free_port()}" for _ in range(nodes)] \
                if relay else []
        else:
            self.broker = f"tcp://{net.address('broker')}:5555"
            self.sites = [f"tcp://{net.address(f'relay-{i}')}:5556" for i in range(nodes)] \
                if relay else []
        self.procs: dict[str, subprocess.Popen] = {}
        self.every: list[subprocess.Popen] = []  # every process started, for the sweep
        self.starts: dict[str, int] = {}
        per = [list(a) for a in np.array_split(np.arange(clients), nodes)]
        self.client_ranges = [f"{a[0]}-{a[-1]}" for a in per]
        self.state_dir = work / "client-states"
        self.bus = ("--heartbeat-s", str(HEARTBEAT_S), "--liveness", str(LIVENESS))

    def args(self, name: str, resume: bool = False) -> list[str]:
        # (in namespaces the endpoints are not loopback: plaintext asked for, no keys)
        plain = ["--insecure"] if self.net is not None else []
        if name == "broker":
            return ["broker", "--bind", self.broker, *self.bus, "--log-level", "warning",
                    *plain]
        if name == "server":
            if resume:
                return ["server", "--broker", self.broker, "--resume", str(self.run)]
            return ["server", "--broker", self.broker, str(self.cfg_path), "--out",
                    str(self.run)]
        kind, i = name.rsplit("-", 1)
        i = int(i)
        if kind == "relay":
            return ["relay", "--upstream", self.broker, "--bind", self.sites[i], "--name",
                    name, *self.bus, "--log-level", "warning", *plain,
                    "--log-file", str(self.logs / f"{name}.jsonl")]
        target = self.sites[i] if self.sites else self.broker
        return ["node", "--broker", target, "--clients", self.client_ranges[i], "--name",
                f"n{i}", *self.bus, "--state-dir", str(self.state_dir),
                "--log-file", str(self.logs / f"{name}.jsonl")]

    def start(self, name: str, resume: bool = False) -> subprocess.Popen:
        n = self.starts[name] = self.starts.get(name, 0) + 1
        argv = [sys.executable, "-m", "fedbus.launch", *self.args(name, resume)]
        if self.net is not None:  # (its own session too: killed as a group)
            proc = self.net.spawn(name, f"{name}.{n}", argv).popen
            self.procs[name] = proc
            self.every.append(proc)
            return proc
        log = open(self.logs / f"{name}.{n}.out", "ab")
        try:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.procs[name] = proc
        self.every.append(proc)
        return proc

    def signal(self, name: str, sig: int) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self, name: str) -> None:
        self.signal(name, signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def close(self) -> None:
        """Every process group ever started, killed (a stopped one continued first)."""
        for proc in self.every:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        if self.net is not None:
            self.net.close()


def build_network(work: Path, hosts: list[str], args: argparse.Namespace
                  ) -> tuple[Any, str]:
    """tests/netns.py's Network with one namespace per process, every link impaired; or
    (None, why it cannot be built here)."""
    import importlib.util

    if args.links == "off":
        return None, "link faults off (--links off): every process on loopback"
    if not NETNS.is_file():
        return None, (f"link faults skipped: the multi-host harness {NETNS} is not in this "
                      "installation (it lives in a fedbus checkout's tests/)")
    spec = importlib.util.spec_from_file_location("fedbus_chaos_netns", NETNS)
    netns = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = netns  # (its dataclasses look their module up)
    spec.loader.exec_module(netns)
    why = netns.unavailable()
    if why:
        return None, f"link faults skipped: {why}"
    imp = netns.Impairment(delay_ms=args.link_delay_ms, jitter_ms=0.4 * args.link_delay_ms,
                           loss=args.link_loss, seed=args.seed)
    net = netns.Network(hosts, work / "proc-logs", impairment=imp)
    try:
        net.build()
    except Exception as err:  # noqa: BLE001 (HarnessError, a timeout: say it, run on loopback)
        net.close()
        return None, f"link faults skipped: the namespaces could not be built: {err}"
    return net, (f"links: one namespace per process, every link {args.link_delay_ms:g} ms "
                 f"+- {0.4 * args.link_delay_ms:g} ms, loss {args.link_loss:g} each way "
                 f"({net.impairer}); link cuts in the schedule")


def children_now() -> set[int]:
    """The pids of this process's live children (before a storm: not the storm's)."""
    mine = os.getpid()
    return {pid for pid, ppid, _pgrp in _processes() if ppid == mine}


def _processes() -> list[tuple[int, int, int]]:
    """(pid, ppid, process group) of every live, non-zombie process, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            out.append((int(entry.name), int(fields[1]), int(fields[2])))
    return out


def left_behind(feds: list[Federation], before: set[int] = frozenset()) -> list[str]:
    """Processes of the bench still alive: its children (less BEFORE, those that were there
    when it began: a test runner's own helpers), and anything in the process groups it
    started."""
    groups = {p.pid for f in feds for p in f.every}
    mine = os.getpid()
    found = []
    for pid, ppid, pgrp in _processes():
        if (ppid == mine and pid not in before) or pgrp in groups:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            found.append(f"pid {pid} ({cmd.decode(errors='replace').strip()[:120]})")
    return found


# ------------------------------------------------------------------ the run


def federation_config(args: argparse.Namespace, rounds: int, mode: str, algorithm: str,
                      seed: int) -> dict[str, dict[str, Any]]:
    fed: dict[str, Any] = {"clients": args.clients, "rounds": rounds, "seed": seed,
                           "start_timeout_s": 60.0, "deadline_s": args.deadline_s,
                           "hard_deadline_s": 4 * args.deadline_s + 10, "late": "fold",
                           "eval_every": 10, "mode": mode}
    if mode == "async":
        fed.update(concurrency=max(2, args.clients - 1), buffer=2)
    return {
        "federation": fed,
        "data": {"dataset": "digits", "partition": "nway-kshot", "ways": 3, "ways_std": 1.0,
                 "shots": 20, "shots_std": 3.0},
        "model": {"arch": "mlp"},
        "algorithm": {"name": algorithm},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "system": {"slow_clients": list(range(args.clients)),
                   "slow_factor": float(args.slow_factor)},
        "bus": {"heartbeat_s": HEARTBEAT_S, "liveness": LIVENESS,
                **({} if getattr(args, "batch", None) is None else {"batch": args.batch})},
        "launch": {"nodes": args.nodes, "threads": 1},
        "log": {"level": "info"},
    }


def read_metrics(run: Path) -> list[dict]:
    """The whole lines of metrics.jsonl (a torn last line is left out)."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except OSError:
        return 0


def _wchar(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _checkpoint_version(run: Path) -> int | None:
    from fedbus.node.server import CheckpointError, read_checkpoint

    try:
        return int(read_checkpoint(run / "checkpoint.fbk")[1]["version"])
    except (CheckpointError, KeyError, ValueError):
        return None


def _held_checkpoints(run: Path) -> dict[int, list[int]]:
    """What the server's log said as each sync record was written while older checkpoints
    still waited for nodes' flushes: record version -> the versions that could be on disk
    then (the one on disk, and those held)."""
    out: dict[int, list[int]] = {}
    try:
        lines = (run / "logs" / "server.jsonl").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            ev = json.loads(line)
            if ev.get("event") == "checkpoint waits for flushes":
                out[int(ev["version"])] = [int(ev["checkpoint"]), *map(int, ev["held"])]
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line, or another process's text
    return out


class Storm:
    def __init__(self, fed: Federation, faults: list[Fault], rounds: int, deadline_s: float,
                 timeout: float, say):
        self.fed, self.faults, self.rounds = fed, faults, rounds
        self.deadline_s, self.timeout, self.say = deadline_s, timeout, say
        self.metrics = fed.run / "metrics.jsonl"
        self.kills: list[dict] = []  # at each server kill: last metrics version, checkpoint's
        self.errors: list[str] = []
        self.t0 = time.time()
        self.later: list[tuple[float, str, Any]] = []  # (when, "cont" | "start", what)
        self.down: set[str] = set()  # killed, restart pending

    def done_rounds(self) -> int:
        return _count_lines(self.metrics)

    def server_finished(self) -> bool:
        p = self.fed.procs["server"]
        return "server" not in self.down and p.poll() is not None

    def _wait(self, predicate, timeout: float, step: float = 0.02) -> bool:
        end = time.time() + timeout
        while time.time() < end:
            self.tend()
            if predicate():
                return True
            if self.server_finished():
                return predicate()
            time.sleep(step)
        return predicate()

    def tend(self) -> None:
        """Carry out what is due: a SIGCONT of a stopped node, a restart of a killed
        process (their hold times run while the next faults may already fire)."""
        now = time.time()
        for item in [x for x in self.later if x[0] <= now]:
            self.later.remove(item)
            _, action, arg = item
            if action == "cont":
                try:
                    os.killpg(arg.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            elif action == "heal":
                self.fed.net.heal(arg)
            else:
                name, resume = arg
                self.fed.start(name, resume=resume)
                self.down.discard(name)

    def run(self) -> None:
        fed = self.fed
        fed.start("broker")
        fed.start("server")
        for i in range(len(fed.client_ranges)):
            if fed.sites:
                fed.start(f"relay-{i}")
            fed.start(f"node-{i}")
        deadline = self.t0 + self.timeout
        for fault in self.faults:
            if not self._wait(lambda: self.done_rounds() >= fault.at_round,
                              deadline - time.time()):
                break
            if self.server_finished():
                break
            self.inject(fault)
            self.say(f"  fault {fault.i:>2} {fault.kind:<12} {fault.target:<8} at round "
                     f"{fault.fired_at_round:>4}: {fault.aimed}")
        if not self._wait(self.server_finished, deadline - time.time(), 0.1):
            self.errors.append(f"the run hung: {self.done_rounds()} of {self.rounds} rounds "
                               f"recorded after {self.timeout:.0f} s")

    def _update_left(self, names: list[str]) -> bool:
        """Waits, tending, for an update to leave one of `names` (its write counter in
        /proc/PID/io jumps by an update's size), until the next record lands or the run
        ends: whether one left."""
        pids = [self.fed.procs[n].pid for n in names if self.fed.alive(n) and n not in self.down]
        base = {pid: _wchar(pid) for pid in pids}
        base = {pid: b for pid, b in base.items() if b is not None}
        records = self.done_rounds()
        while base and self.done_rounds() == records and not self.server_finished():
            for pid, before in base.items():
                now = _wchar(pid)
                if now is not None and now - before >= 2048:  # an update (or its state)
                    return True
                if now is not None and now - before < 256:  # a heartbeat: a new baseline
                    base[pid] = now
            self.tend()
            time.sleep(0.002)
        return False

    def _await_restart(self, target: str) -> bool:
        """A target down from an earlier fault: wait (tending) for its restart, an event,
        rather than skip the fault. False if the run ended first."""
        while target in self.down and not self.server_finished():
            self.tend()
            time.sleep(0.005)
        return target not in self.down

    def inject(self, f: Fault) -> None:
        fed = self.fed
        if f.target in self.down and not self._await_restart(f.target):
            f.note = f"the run ended while {f.target} was down from an earlier fault"
            return
        if f.target not in fed.procs or not fed.alive(f.target):
            f.note = f"{f.target} was not running"
            return
        if f.aim == "after_metrics":
            # kill right as the next metrics line lands: between it and the checkpoint
            records = self.done_rounds()
            while self.done_rounds() == records and not self.server_finished():
                self.tend()
                time.sleep(0.001)
            f.aimed = "killed as a metrics line landed"
        elif f.aim == "after_update":
            f.aimed = "killed just after it wrote an update" if \
                self._update_left([f.target]) else "no update before the next record: killed there"
        else:
            nodes = [n for n in fed.procs if n.startswith("node-")]
            f.aimed = "after a record, as an update left a node" if \
                self._update_left(nodes) else "at the next record"
        if self.server_finished():
            f.note = "the run ended first"
            return
        f.fired_at_round = self.done_rounds()
        if f.kind == "link_cut":
            fed.net.cut(f.target)
            f.injected = True
            self.later.append((time.time() + f.hold_s, "heal", f.target))
            f.aimed += f"; link down {f.hold_s:.2f} s"
            return
        if f.kind == "node_stop":
            fed.signal(f.target, signal.SIGSTOP)
            f.injected = True
            self.later.append((time.time() + f.hold_s, "cont", fed.procs[f.target]))
            f.aimed += f"; stopped {f.hold_s:.2f} s"
            return
        fed.kill(f.target)
        f.injected = True
        if f.kind == "server_kill":
            versions = sorted(int(r["version"]) for r in read_metrics(fed.run))
            self.kills.append({"fault": f.i, "metrics_version": max(versions, default=0),
                               "metrics_versions": versions,
                               "checkpoint_version": _checkpoint_version(fed.run),
                               "held": _held_checkpoints(fed.run)})
        self.down.add(f.target)
        self.later.append((time.time() + f.hold_s, "start",
                           (f.target, f.kind == "server_kill")))

    def judge_survival(self) -> None:
        """A fault survived when the federation recorded a round after it and the process it
        hit is running again (or finished with the run)."""
        n = self.done_rounds()
        for f in self.faults:
            if f.injected:
                f.survived = n > f.fired_at_round

    def wind_down(self) -> list[str]:
        """After the server's exit: nodes and relays leave on the shutdown; then the broker
        is stopped. Returns the problems seen."""
        fed, problems = self.fed, []
        # a node still stopped is continued now (it must then find the run over); a restart
        # still due is not made (a fresh node waits for a run, as it should)
        self.later = [(0.0, a, b) for _, a, b in self.later if a in ("cont", "heal")]
        self.tend()
        for name, proc in fed.procs.items():
            if name in ("broker", "server"):
                continue
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                problems.append(f"{name} (pid {proc.pid}) did not exit within 30 s of the "
                                f"server's shutdown")
        broker = fed.procs.get("broker")
        if broker is not None and broker.poll() is None:
            fed.signal("broker", signal.SIGTERM)
            try:
                broker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                problems.append(f"broker (pid {broker.pid}) did not stop on SIGTERM")
        return problems


# ------------------------------------------------------------------ the history


@dataclass
class Violation:
    invariant: str
    detail: str
    rounds: list[int] = field(default_factory=list)
    records: list[int] = field(default_factory=list)  # message-log record indices

    def __str__(self) -> str:
        where = []
        if self.rounds:
            where.append(f"rounds {self.rounds}")
        if self.records:
            where.append(f"log records {self.records}")
        return f"[{self.invariant}] {self.detail}" + (f" ({'; '.join(where)})" if where else "")


def state_digest(state: dict[str, Any]) -> str:
    """The digest of a server state as checkpointed, less its wall-clock field."""
    from fedbus.broker.wire import encode_body

    return hashlib.sha256(encode_body({k: v for k, v in state.items() if k != "wall_s"})
                          ).hexdigest()


def read_history(run: Path) -> tuple[list[dict], list[Violation]]:
    """Replays the server's message log as `fedbus replay` does and returns its history:
    accept (an update or a relay member taken), register (a node's config acknowledgement
    after its join: its incarnation), checkpoint (where the live server wrote one: the
    replay's state), resume (the state a restarted server loaded), end. Divergences of the
    replay from the logged outputs come back as violations."""
    import torch

    from fedbus.analysis.replay import _compare, _decode, load_run, take_refused
    from fedbus.broker.wire import DEFAULT_MAX_FRAME, decode_body
    from fedbus.node.engine import NOTED_KINDS, out_params
    from fedbus.node.server import build_engine, judge, take
    from fedbus.record.msglog import read_log

    torch.set_num_threads(1)
    cfg, run_id = load_run(run)
    engine = build_engine(cfg, run_id)
    max_frame = max(int(cfg.bus.max_frame_mb) << 20, DEFAULT_MAX_FRAME)
    history: list[dict] = []
    problems: list[Violation] = []
    pending: list = []
    due = False  # the live server checkpoints once this input's outputs are sent

    def checkpoint(i: int) -> None:
        # an async update still in the buffer is not in the checkpointed state: a resume
        # from it has lost that update, and its client may send it again
        buffered = [[m.client, m.version] for u in engine.buffer for m in (u.members or (u,))]
        history.append({"op": "checkpoint", "i": i, "version": engine.version,
                        "digest": state_digest(engine.state_dict()), "buffered": buffered})

    for rec in read_log(run):
        if rec.direction == "out":
            m = _decode(rec, max_frame)
            if m.kind == "error":
                continue
            if not pending:
                problems.append(Violation("replay", f"the log has an extra {m.kind} to "
                                          f"{m.dst} the replay did not send", [m.round],
                                          [rec.index]))
                return history, problems
            out = pending.pop(0)
            div = _compare(out, rec, m)
            if div:
                problems.append(Violation("replay", f"replay diverged: {div}", [div.round],
                                          [div.index]))
                return history, problems
            if out.kind in NOTED_KINDS:  # as ServerNode._send
                engine.note_sent(out, rec.nbytes, out_params(out))
            continue
        if pending and rec.direction != "resume":
            problems.append(Violation("replay", f"replay sent {pending[0].kind} to "
                                      f"{pending[0].dst}, the log has none",
                                      [pending[0].round], [rec.index]))
            return history, problems
        if due and not pending:
            checkpoint(rec.index)
        due = False
        pending = []
        version = engine.version
        if rec.direction == "in":
            msg = _decode(rec, max_frame)
            if judge(engine, msg) is not None:
                problems.append(Violation("replay", f"the server took a {msg.kind} from "
                                          f"{msg.src} that a replay refuses", [msg.round],
                                          [rec.index]))
                return history, problems
            history += taken_entries(engine, msg, rec.index)
            pending = take(engine, msg, rec.time)
        elif rec.direction == "refused":
            pending = take_refused(engine, rec)
        elif rec.direction == "tick":
            pending = engine.on_tick(rec.time)
        elif rec.direction == "resume":
            state = decode_body(rec.frames[1], max_frame=max(len(rec.frames[1]), 1))
            history.append({"op": "resume", "i": rec.index, "version": int(state["version"]),
                            "digest": state_digest(state)})
            seed = engine.noise_seed
            engine = build_engine(cfg, run_id)
            engine.noise_seed = seed
            engine.load_state_dict(state)
            pending = engine.on_resumed(rec.time)
        pending = [o for o in pending if o.kind != "error"]
        due = (bool(engine.records) or engine.done or
               (engine.async_mode and engine.version != version)) \
            and not (engine.async_mode and engine.evals)  # as ServerNode._record
        engine.records.clear()
        engine.events.clear()
    if due and not pending:
        checkpoint(-1)
    history.append({"op": "end", "version": engine.version})
    return history, problems


# ------------------------------------------------------------------ the invariants


def taken_entries(engine: Any, msg: Any, index: int) -> list[dict]:
    """The history entries of a message the server takes (judged acceptable): each update
    or relay member accepted, or a node's registration (its config acknowledgement).
    Read off the engine before `take`, which forgets a task once it is answered."""
    from fedbus.node.engine import client_index
    from fedbus.node.server import config_sender

    if msg.kind == "update":
        task = engine.tasks[msg.body["task"]]
        client = client_index(msg.src)
        return [{"op": "accept", "i": index, "client": client, "round": task.round,
                 "version": task.version, "task": task.id, "inc": msg.inc,
                 "node": engine.host.get(client), "src": msg.src}]
    if msg.kind == "updates":  # a node's batch (bus.batch): each member it hosts, judged
        from fedbus.node.server import batch_members, judge

        hosted = set(engine.nodes.get(msg.src, ()))
        out = []
        for m in batch_members(msg):
            try:
                client = client_index(m.src)
            except ValueError:
                continue
            if client in hosted and judge(engine, m) is None:
                out += taken_entries(engine, m, index)
        for e in out:
            e["inc"], e["node"] = msg.inc, msg.src
        return out
    if msg.kind == "merged":  # a relay's: each member taken
        out = []
        for address, tid, _n, _w in msg.body["members"]:
            task = engine.tasks[tid]
            out.append({"op": "accept", "i": index, "client": client_index(address),
                        "round": task.round, "version": task.version, "task": tid,
                        "inc": msg.inc, "node": msg.src, "src": msg.src})
        return out
    if msg.kind == "config":
        node = config_sender(engine, msg.src)
        if node is not None:
            return [{"op": "register", "i": index, "node": node, "inc": msg.inc}]
    return []


def final_checkpoint(run: Path) -> tuple[str | None, int | None, list[Violation]]:
    """(digest, version) of the run's last checkpoint, or a replay violation saying why
    there is none."""
    from fedbus.node.server import CheckpointError, read_checkpoint

    try:
        state = read_checkpoint(run / "checkpoint.fbk")[1]
    except CheckpointError as err:
        return None, None, [Violation("replay", f"no final checkpoint: {err}")]
    return state_digest(state), int(state["version"]), []


def check_once(history: list[dict]) -> list[Violation]:
    """Each client's update for a (round, version) is taken at most once. A resume rolls
    back to the checkpoint it loaded: what was taken after that checkpoint, and what an
    async buffer held unaggregated at it, was lost with the killed server, and may be
    taken again, once."""
    taken: dict[tuple, int] = {}
    saved: dict[str, dict[tuple, int]] = {}
    out = []
    for ev in history:
        op = ev["op"]
        if op == "accept":
            key = (ev["client"], ev["round"], ev["version"])
            if key in taken:
                out.append(Violation(
                    "once", f"client {ev['client']}'s update for round {ev['round']} version "
                    f"{ev['version']} taken twice", [ev["round"]], [taken[key], ev["i"]]))
            else:
                taken[key] = ev["i"]
        elif op == "checkpoint":
            lost = {tuple(b) for b in ev.get("buffered", ())}  # (client, version)
            saved[ev["digest"]] = {k: v for k, v in taken.items() if (k[0], k[2]) not in lost}
        elif op == "resume":
            # (a resume from no checkpoint the replay reached is the replay invariant's)
            taken = dict(saved.get(ev["digest"], {k: v for k, v in taken.items()
                                                  if k[2] < ev["version"]}))
    return out


def check_incarnations(history: list[dict]) -> list[Violation]:
    """No update from a node's replaced incarnation (peer `inc`) is taken after the new one
    registered (its config acknowledgement)."""
    current: dict[str, int] = {}
    retired: dict[str, dict[int, int]] = {}  # node -> {inc: record where it was replaced}
    out = []
    for ev in history:
        if ev["op"] == "register":
            node, inc = ev["node"], ev["inc"]
            old = current.get(node)
            if old is not None and old != inc:
                retired.setdefault(node, {})[old] = ev["i"]
            current[node] = inc
        elif ev["op"] == "accept":
            node = ev["node"]
            gone = retired.get(node, {})
            if ev["inc"] in gone and ev["inc"] != current.get(node):
                out.append(Violation(
                    "incarnation", f"client {ev['client']}'s update (round {ev['round']}) "
                    f"from {node}'s incarnation {ev['inc']:#x} taken after its replacement "
                    f"{current.get(node, 0):#x} registered", [ev["round"]],
                    [gone[ev["inc"]], ev["i"]]))
    return out


def check_resumes(history: list[dict], final_digest: str | None,
                  final_version: int | None) -> list[Violation]:
    """Every resume loaded a state the replay reached where the live server checkpointed,
    and the final checkpoint is the replay's last checkpointed state."""
    out = []
    seen: dict[str, int] = {}
    last = None
    for ev in history:
        if ev["op"] == "checkpoint":
            seen[ev["digest"]] = ev["version"]
            last = ev
        elif ev["op"] == "resume":
            if ev["digest"] not in seen:
                versions = sorted({v for v in seen.values() if v == ev["version"]})
                out.append(Violation(
                    "replay", f"the resumed server loaded a version-{ev['version']} state no "
                    f"replay checkpoint reached" + (" (the replay's state of that version "
                                                    "differs)" if versions else ""),
                    [ev["version"]], [ev["i"]]))
    if final_digest is not None:
        if last is None or last["digest"] != final_digest:
            out.append(Violation(
                "replay", f"the final checkpoint (version {final_version}) is not the state "
                f"the replay of the message log reaches (version "
                f"{None if last is None else last['version']})",
                [] if final_version is None else [final_version],
                [] if last is None else [last["i"]]))
    return out


def check_window(kills: list[dict], records: list[dict], rounds: int,
                 mode: str = "sync") -> list[Violation]:
    """At each server kill: every version the checkpoint counts done has its metrics record
    (a resume does not write it again), and the records are never behind the checkpoint;
    in sync mode at most one aggregation ahead of it (the record is written, then the
    checkpoint), or as far as the server's log said, before that record, checkpoints were
    held for nodes' flushes (the kill's "held": record version -> possible on-disk ones).
    In the end the metrics hold versions 1..rounds once each (in order in sync mode: an
    async record waits for its evaluation while later aggregations are recorded)."""
    out = []
    for k in kills:
        m, c = k["metrics_version"], k["checkpoint_version"]
        have = set(k.get("metrics_versions", range(1, m + 1)))
        if c is None:
            if m > 1:
                out.append(Violation("window", f"server kill (fault {k['fault']}): no readable "
                                     f"checkpoint but metrics through version {m}", [m - 1]))
            continue
        lost = [v for v in range(1, c + 1) if v not in have]
        if lost:
            out.append(Violation(
                "window", f"server kill (fault {k['fault']}): the checkpoint (version {c}) "
                f"counts versions {lost[:10]} done but metrics.jsonl has no record of them: "
                f"a resume never writes them", [v - 1 for v in lost[:10]]))
        elif m < c or (mode == "sync" and m - c > 1 and c not in k.get("held", {}).get(m, [])):
            out.append(Violation(
                "window", f"server kill (fault {k['fault']}): metrics through version {m}, "
                f"checkpoint at version {c}: outside the window (0 to "
                f"{1 if mode == 'sync' else 'any'} aggregations ahead"
                + (", or the checkpoint the server's log says it held for flushes"
                   if mode == "sync" else "") + ")",
                sorted({max(0, m - 1), max(0, c - 1)})))
    versions = [int(r.get("version", -1)) for r in records]
    want = list(range(1, rounds + 1))
    ordered = versions == want
    if not ordered and (mode == "sync" or sorted(versions) != want):
        seen: dict[int, int] = {}
        for v in versions:
            seen[v] = seen.get(v, 0) + 1
        repeated = sorted(v - 1 for v, n in seen.items() if n > 1)
        missing = sorted(v - 1 for v in want if v not in seen)
        what = []
        if repeated:
            what.append(f"rounds recorded twice {repeated[:20]}")
        if missing:
            what.append(f"rounds missing {missing[:20]}")
        if not what:
            what.append("records out of order")
        out.append(Violation("window", "metrics.jsonl does not hold each round once"
                             + (", in order" if mode == "sync" else "") + ": "
                             + "; ".join(what), (repeated + missing)[:20]))
    return out


def check_completion(server_rc: int | None, summary: dict | None, rounds: int,
                     problems: list[str], leftovers: list[str]) -> list[Violation]:
    out = []
    if server_rc != 0:
        out.append(Violation("completion", f"the server exited {server_rc}"))
    done = None if summary is None else summary.get("rounds_completed")
    if done != rounds:
        out.append(Violation("completion", f"rounds completed {done}, not {rounds}"))
    out += [Violation("completion", p) for p in problems]
    out += [Violation("completion", f"process left behind: {p}") for p in leftovers]
    return out


def check_run(run: Path, kills: list[dict], rounds: int,
              mode: str = "sync") -> tuple[list[Violation], dict]:
    """Every invariant that reads the run's files; returns (violations, facts)."""
    from fedbus.record.msglog import LogCorrupt

    violations: list[Violation] = []
    try:
        history, problems = read_history(run)
    except (LogCorrupt, FileNotFoundError, KeyError, ValueError) as err:
        return [Violation("replay", f"the message log cannot be replayed: "
                          f"{type(err).__name__}: {err}")], {}
    violations += problems
    final_digest, final_version, missing = final_checkpoint(run)
    violations += missing
    violations += check_once(history)
    violations += check_incarnations(history)
    if not problems:
        violations += check_resumes(history, final_digest, final_version)
    violations += check_window(kills, read_metrics(run), rounds, mode)
    facts = {"accepted": sum(e["op"] == "accept" for e in history),
             "registrations": sum(e["op"] == "register" for e in history),
             "checkpoints": sum(e["op"] == "checkpoint" for e in history),
             "resumes": sum(e["op"] == "resume" for e in history)}
    return violations, facts


# ------------------------------------------------------------------ one storm


def run_storm(args: argparse.Namespace, *, mode: str, relay: bool, algorithm: str,
              out: Path, say=print, faults: list[Fault] | None = None) -> dict:
    from fedbus.bench.common import write_toml

    rounds = args.rounds
    n_faults = args.faults or max(5, rounds // 12)
    seed = args.seed
    fed_seed = seed if args.federation_seed is None else args.federation_seed
    name = f"{mode}-{'relay' if relay else 'flat'}-{algorithm}"
    out.mkdir(parents=True, exist_ok=True)
    hosts = ["broker", "server"] + [f"node-{i}" for i in range(args.nodes)] + \
        ([f"relay-{i}" for i in range(args.nodes)] if relay else [])
    before = children_now()
    net, links = build_network(out, hosts, args)
    if faults is None:
        faults = make_schedule(seed, rounds, n_faults, nodes=args.nodes, relay=relay,
                               deadline_s=args.deadline_s, links=net is not None)
    cfg = write_toml(out / "config.toml", federation_config(args, rounds, mode, algorithm,
                                                            fed_seed))
    run = out / "run"
    say(f"fedbus bench chaos {name}: seed {seed} (federation seed {fed_seed}), {rounds} "
        f"rounds, {args.clients} clients on {args.nodes} nodes"
        f"{' below a relay each' if relay else ''}; schedule:")
    say(schedule_text(faults))
    say(f"  {links}")
    fed = Federation(out, cfg, run, nodes=args.nodes, clients=args.clients, relay=relay,
                     net=net)
    storm = Storm(fed, faults, rounds, args.deadline_s, args.timeout, say)
    started = time.time()
    problems: list[str] = []
    try:
        storm.run()
        storm.judge_survival()
        problems = storm.errors + storm.wind_down()
    finally:
        server_rc = fed.procs["server"].poll() if "server" in fed.procs else None
        fed.close()
    leftovers = left_behind([fed], before)
    wall = time.time() - started
    try:
        summary = json.loads((run / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = None
    violations = check_completion(server_rc, summary, rounds, problems, leftovers)
    checked, facts = check_run(run, storm.kills, rounds, mode)
    violations += checked
    kinds: dict[str, dict[str, int]] = {}
    for f in faults:
        row = kinds.setdefault(f.kind, {"scheduled": 0, "injected": 0, "survived": 0})
        row["scheduled"] += 1
        row["injected"] += f.injected
        row["survived"] += bool(f.survived)
    return {"scenario": name, "seed": seed, "federation_seed": fed_seed, "rounds": rounds,
            "rounds_completed": len(read_metrics(run)), "wall_s": round(wall, 1),
            "faults": [asdict(f) for f in faults], "by_kind": kinds,
            "links": links, "server_kills": storm.kills, "history": facts,
            "violations": [asdict(v) | {"text": str(v)} for v in violations],
            "run": str(run)}


def table(res: dict) -> str:
    lines = [f"fedbus bench chaos {res['scenario']} seed {res['seed']}: "
             f"{res['rounds_completed']}/{res['rounds']} rounds in {res['wall_s']:.0f} s",
             f"  {res['links']}",
             f"  {'fault':<14}{'injected':>9}{'survived':>9}"]
    for kind in KINDS:
        row = res["by_kind"].get(kind)
        if kind == "link_cut" and not row:
            lines.append(f"  {'link_cut':<14}{'-':>9}{'-':>9}   ({res['links']})")
        elif row:
            lines.append(f"  {kind:<14}{row['injected']:>9}{row['survived']:>9}")
    for f in res["faults"]:
        if not f["injected"]:
            lines.append(f"  fault {f['i']} ({f['kind']}) not injected: "
                         f"{f['note'] or 'the run ended before its round'}")
    h = res["history"]
    if h:
        lines.append(f"  history: {h['accepted']} updates taken, {h['registrations']} "
                     f"registrations, {h['checkpoints']} checkpoints, {h['resumes']} resumes "
                     "replayed")
    for k in res["server_kills"]:
        lines.append(f"  server kill (fault {k['fault']}): metrics through version "
                     f"{k['metrics_version']}, checkpoint at {k['checkpoint_version']}")
    v = res["violations"]
    lines.append(f"  violations: {len(v)}")
    for item in v:
        lines.append(f"    {item['text']}")
    return "\n".join(lines)


def main_args(args: argparse.Namespace) -> int:
    if args.rounds < 6 or args.nodes < 1 or args.clients < args.nodes:
        print("fedbus bench chaos: needs --rounds >= 6 and --clients >= --nodes >= 1",
              file=sys.stderr)
        return 2
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fedbus-chaos-"))
    if args.all:
        matrix = [(m, r, a) for m in ("sync", "async") for r in (False, True)
                  for a in ("fedproto", "fedavg")]
    else:
        matrix = [(args.mode, args.relay, args.algorithm)]
    say = (lambda *a: None) if args.quiet else (lambda s: print(s, flush=True))
    results = []
    for mode, relay, algorithm in matrix:
        name = f"{mode}-{'relay' if relay else 'flat'}-{algorithm}"
        res = run_storm(args, mode=mode, relay=relay, algorithm=algorithm,
                        out=base / f"seed{args.seed}-{name}", say=say)
        results.append(res)
        print(table(res), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 1 if any(r["violations"] for r in results) else 0


__all__ = ["Fault", "Violation", "check_completion", "check_incarnations", "check_once",
           "check_resumes", "check_window", "make_schedule", "read_history", "run_storm"]
