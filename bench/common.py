"""Running a whole federation from a benchmark and watching its resources."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedbus.node.lifetime import fedbus_command


def out_dir(out: str | None, name: str) -> Path:
    """A benchmark's folder for its run directories: --out (made if missing), or a fresh
    temporary folder fedbus-NAME-*."""
    if out:
        path = Path(out)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return Path(tempfile.mkdtemp(prefix=f"fedbus-{name}-"))


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    from fedbus.node.config import to_toml

    path.write_text(to_toml(sections))
    return path


@dataclass
class Finished:
    run_dir: Path
    wall_s: float
    peak_rss: int  # bytes, summed over the launcher and every process it started
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    # per process: the peak RSS of each (pid -> bytes) and the peak of the summed PSS (shared
    # pages divided among the processes sharing them: forked processes share torch and the
    # data, which a sum of RSS counts once per process)
    peak_rss_by_pid: dict[int, int] = field(default_factory=dict)
    peak_pss: int = 0
    # pid -> (role, CPU seconds user + system at the last sample before it exited); the
    # role is read off the process's threads and files: launcher, broker, server or node
    cpu_by_pid: dict[int, tuple[str, float]] = field(default_factory=dict)


class _Watch:
    """Peak memory of a process tree, sampled every `every` seconds."""

    def __init__(self, pid: int):
        import psutil  # the dev extra's: imported by the benchmarks that watch memory

        self.psutil = psutil
        self.parent = psutil.Process(pid)
        self.peak = self.peak_pss = 0
        self.by_pid: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.roles: dict[int, str] = {}
        self._pss_at = 0.0

    def sample(self) -> None:
        psutil = self.psutil
        try:
            procs = [self.parent, *self.parent.children(recursive=True)]
        except psutil.Error:
            return
        total = 0
        for p in procs:
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            total += rss
            self.by_pid[p.pid] = max(self.by_pid.get(p.pid, 0), rss)
            try:
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
                if p.pid not in self.roles or self.roles[p.pid] == "?":
                    self.roles[p.pid] = _role(p, self.parent.pid)
            except psutil.Error:
                pass
        self.peak = max(self.peak, total)
        now = time.perf_counter()
        if now - self._pss_at >= 1.0:  # reading smaps is slower: once a second
            self._pss_at = now
            pss = 0
            for p in procs:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pass
            self.peak_pss = max(self.peak_pss, pss)


def run(sections: dict[str, dict[str, Any]], name: str, *, out: Path | None = None,
        timeout: float = 900) -> Finished:
    out = out or Path(tempfile.mkdtemp(prefix="fedbus-bench-"))
    cfg = write_toml(out / f"{name}.toml", sections)
    run_dir = out / name
    return watch(fedbus_command("run", str(cfg), "--out", str(run_dir), "--quiet",
                                "--log-level", "warning"), name, run_dir,
                 timeout=timeout, what="fedbus run")


def watch(cmd: list[str], name: str, run_dir: Path, *, timeout: float,
          what: str) -> Finished:
    """Run `cmd`, a launcher that starts a federation writing `run_dir` and exits when
    the run ends, sampling the memory and CPU of its whole process tree; `what` names
    the launcher in errors. The launcher is stopped after `timeout` seconds, or when
    watching fails (psutil missing, Ctrl-C); its children die with it (PR_SET_PDEATHSIG)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    try:
        tree = _Watch(proc.pid)
        while proc.poll() is None:
            tree.sample()
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{name}: no result after {timeout} s")
            time.sleep(0.1)
    except BaseException:
        _stop(proc)
        raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: {what} exited {proc.returncode}; see {run_dir}/logs")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cpu = {pid: (tree.roles.get(pid, "?"), sec) for pid, sec in tree.cpu.items()}
    return Finished(run_dir, wall, tree.peak, summary, records, tree.by_pid, tree.peak_pss,
                    cpu)


def _stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; the launcher's children die with it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def complete_summary(run_dir: Path, rounds: int) -> dict[str, Any] | None:
    """RUN/summary.json when it holds every one of `rounds` rounds, else None."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("rounds_completed") == rounds else None


@dataclass
class Outcome:
    run_dir: Path
    summary: dict[str, Any]
    wall_s: float  # nan when reused
    note: str  # "reused", "" (ran), or why a failed launcher still counts


# The sections whose every key (defaults filled in) decides what a run computes.
COMPUTING = ("algorithm", "data", "model", "train", "system")
# Keys of those that choose how a run computes, its results equal within float32 rounding
# (tests/test_cohort.py): a run made before or under another value still stands.
HOW_NOT_WHAT = {("train", "cohort")}


def stale(run_dir: Path, sections: dict[str, dict[str, Any]]) -> str:
    """Why RUN's saved config.json no longer is what `sections` build today ("" when it
    is): a run name hashes only the sections a benchmark sets, so a changed default (say
    an algorithm's) would otherwise let an old run stand in for a new one."""
    from fedbus.analysis.replay import with_legacy_values
    from fedbus.node.config import build_config

    try:
        saved = json.loads((Path(run_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    # a key added since with a default that changed the behaviour (train.optimizer_state)
    # is read with the value the old run had, as replay reads it
    saved = with_legacy_values(saved)
    today = json.loads(json.dumps(build_config(sections).to_dict()))
    for section in COMPUTING:
        old, new = saved.get(section, {}), today.get(section, {})
        # Any other key only one side has is an option added (or dropped) since: an added
        # one defaults to the old behaviour, so only a value both sides have can differ.
        changed = sorted(k for k in set(old) & set(new)
                         if old[k] != new[k] and (section, k) not in HOW_NOT_WHAT)
        if changed:
            return f"[{section}] " + ", ".join(
                f"{k}: {old[k]!r} then, {new[k]!r} now" for k in changed)
    return ""


def run_or_reuse(sections: dict[str, dict[str, Any]], name: str, *, out: Path,
                 timeout: float) -> Outcome:
    """OUT/NAME reused when its summary holds every round (an interrupted benchmark resumes
    where it stopped) and its config is what `sections` build today, else one real `fedbus
    run` of `sections` there; a stale run directory is kept as NAME.stale, an interrupted
    one (its summary short of the rounds, or none) is run again from the start."""
    rounds = sections["federation"]["rounds"]
    run_dir = out / name
    summary = complete_summary(run_dir, rounds)
    why = stale(run_dir, sections) if summary is not None else ""
    if summary is not None and not why:
        return Outcome(run_dir, summary, float("nan"), "reused")
    if why:
        old = run_dir.with_name(run_dir.name + ".stale")
        if old.exists():
            shutil.rmtree(old)
        run_dir.rename(old)
    elif run_dir.exists():
        # an interrupted run (no summary of every round): `fedbus run --out` refuses a folder
        # that holds a run, so it starts again from scratch, as it would have run
        shutil.rmtree(run_dir)
    t0 = time.perf_counter()
    try:
        summary, note = run(sections, name, out=out, timeout=timeout).summary, ""
    except RuntimeError as err:
        # A launcher that fails after the server wrote a summary of every round (say, a
        # node that dies while shutting down) still leaves a complete run; the note says so.
        summary = complete_summary(run_dir, rounds)
        if summary is None:
            raise
        note = f"launcher exit 1 after a complete run ({err})"
    if why:
        note = "; ".join(x for x in (note, f"rerun: the old run was stale ({why})") if x)
    return Outcome(run_dir, summary, time.perf_counter() - t0, note)


def mean_std(values: list[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the values that are numbers; (nan, nan, 0) when none."""
    vals = [float(v) for v in values if v is not None and not math.isnan(float(v))]
    if not vals:
        return float("nan"), float("nan"), 0
    m = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return m, sd, len(vals)


def _role(proc, launcher: int) -> str:
    """launcher, broker, server, node or relay: forked processes are named fedbus-NAME
    (launch.processes.die_with_parent); exec'd ones by their command line."""
    if proc.pid == launcher:
        return "launcher"
    try:
        # python [-P] -m fedbus.launch ROLE ...: the role is the word after the module
        cmd = proc.cmdline()
        words = [proc.name(), *cmd[cmd.index("fedbus.launch") + 1:][:1]] \
            if "fedbus.launch" in cmd else [proc.name(), *cmd[:4]]
    except Exception:  # psutil.Error
        return "?"
    for word in words:
        for role in ("broker", "server", "node", "relay"):
            if word == role or word.startswith(f"fedbus-{role}"):
                return role
    return "?"


# --------------------------------------------------------------------------- the floor
# Every speed figure a benchmark prints is also given as a ratio to this floor, measured in
# the same invocation: on a loaded or a faster machine both move together, so a ratio that
# grows between commits is the code, not the machine (docs/PERFORMANCE.md keeps a history).
@dataclass(frozen=True)
class Floor:
    """The raw-zmq floor of a message pattern: the median seconds for one ROUTER to send
    `messages` bodies of `down_bytes`, spread over `nodes` DEALER processes, and take one
    `up_bytes` answer for each (loopback TCP; no broker, no framework, bodies pre-built)."""
    ms: float
    messages: int
    down_bytes: int
    up_bytes: int
    nodes: int

    def ratio(self, ms: float | None) -> float:
        if ms is None or not self.ms > 0:
            return math.nan
        return ms / self.ms

    def figures(self, ms: float | None) -> dict[str, float]:
        """The --json keys of a figure of `ms` milliseconds: floor_ms and ratio."""
        return {"floor_ms": self.ms, "ratio": self.ratio(ms)}

    def describe(self) -> str:
        return (f"raw-zmq floor {self.ms:.2f} ms, measured in this run: {self.messages} "
                f"messages of {self.down_bytes:,} B out and {self.up_bytes:,} B back, "
                f"{self.nodes} DEALER process{'es' if self.nodes > 1 else ''}, no broker")


def zmq_floor(messages: int, down_bytes: int, up_bytes: int, *, nodes: int = 1,
              repeats: int = 10) -> Floor:
    """Measure the Floor of the pattern now: the median of `repeats` round trips after
    one that warms the connections up."""
    import multiprocessing as mp
    import statistics

    import zmq

    messages, nodes = max(1, int(messages)), max(1, int(nodes))
    # an empty body is the DEALERs' signal to stop, so a payload is at least one byte
    down, up = max(1, int(down_bytes)), max(1, int(up_bytes))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    procs = [mp.get_context("fork").Process(target=_floor_dealer,
                                            args=(endpoint, f"n{i}".encode(), up))
             for i in range(nodes)]
    for p in procs:
        p.start()
    idents: list[bytes] = []
    times = []
    try:
        while len(idents) < nodes:
            ident, _ = sock.recv_multipart()
            idents.append(ident)
        body = bytes(down)
        for _ in range(max(1, repeats) + 1):
            t0 = time.perf_counter()
            for i in range(messages):
                sock.send(idents[i % nodes], zmq.SNDMORE)
                sock.send(body, copy=False)
            for _ in range(messages):
                sock.recv_multipart(copy=False)
            times.append(time.perf_counter() - t0)
    finally:
        for ident in idents:
            sock.send_multipart([ident, b""])
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        sock.close()
        ctx.term()
    return Floor(statistics.median(times[1:]) * 1000, messages, down, up, nodes)


def _floor_dealer(endpoint: str, ident: bytes, up_bytes: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    reply = bytes(up_bytes)
    sock.send(b"hello")
    while sock.recv():
        sock.send(reply)
    sock.close()
    ctx.term()


def ratio_text(ratio: float | None) -> str:
    if ratio is None or math.isnan(ratio):
        return "-"
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x"


FIGURE_HEAD = f"  {'figure':<38}{'fedbus ms':>11}{'floor ms':>10}{'ratio':>9}"


def figure_line(label: str, ms: float | None, floor_ms: float | None) -> str:
    """One table line under FIGURE_HEAD: a figure, the same-run floor it is divided by
    (for a figure spanning several rounds, that many rounds' floor) and the ratio."""
    ratio = ms / floor_ms if ms is not None and floor_ms else math.nan
    shown = "-" if ms is None else (f"{ms:.1f}" if ms >= 10 else f"{ms:.3g}")
    base = "-" if not floor_ms else (f"{floor_ms:.2f}" if floor_ms >= 0.1 else f"{floor_ms:.3g}")
    return f"  {label:<38}{shown:>11}{base:>10}{ratio_text(ratio):>9}"


def floor_table(rows: list[tuple[str, float | None, float | None]],
                floor: Floor | None) -> list[str]:
    """The lines a benchmark prints for its times: FIGURE_HEAD, one figure_line per
    (label, fedbus ms, floor ms) row, and what the floor measured (None: not measured)."""
    return [FIGURE_HEAD, *(figure_line(*row) for row in rows),
            *([f"  ({floor.describe()})"] if floor else [])]


def run_floor(summary: dict[str, Any], records: list[dict[str, Any]], nodes: int, *,
              repeats: int = 5) -> Floor:
    """The floor of one round of a finished run: its tasks a round (the mean of the
    records' `sampled`, else `updates`), each of the run's mean task bytes out and mean
    update bytes back, over `nodes` DEALERs."""
    per_round = [r.get("sampled") or r.get("updates") or 0 for r in records if "round" in r]
    per_round = [n for n in per_round if n] or [1]
    tasks = sum(per_round)
    return zmq_floor(round(tasks / len(per_round)), int(summary.get("bytes_down", 0) / tasks),
                     int(summary.get("bytes_up", 0) / tasks), nodes=nodes, repeats=repeats)


def floor_figures(res: Finished, nodes: int, ms: float | None) -> dict[str, Any]:
    """A run's --json floor keys for its figure of `ms`: floor_ms, ratio and floor_pattern
    (what the floor measured), the floor of one of its rounds measured now."""
    floor = run_floor(res.summary, res.records, nodes)
    return {**floor.figures(ms), "floor_pattern": floor.describe()}


def floor_lines(rows: list[tuple[str, float | None]], figures: dict[str, Any]) -> list[str]:
    """floor_table's lines for (label, ms) rows against floor_figures' `figures`."""
    return [FIGURE_HEAD, *(figure_line(label, ms, figures["floor_ms"]) for label, ms in rows),
            f"  ({figures['floor_pattern']})"]
