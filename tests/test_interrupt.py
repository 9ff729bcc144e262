"""Ctrl-C and SIGTERM leave a resumable run: whichever process the signal reaches (the
whole process group, as a terminal's Ctrl-C sends it; the launcher alone; the server or a
node alone), a run stopped before its last round writes no summary.json, says it was
interrupted, exits 130 (SIGINT) or 143 (SIGTERM) with the line saying how to continue, and
`--resume` gives the records of the uninterrupted run. The same for `fedbus sweep` and a
bare `fedbus server`. Every signal is sent on an event (a round's record in metrics.jsonl),
never after a fixed time; the run has rounds enough left that it cannot end first."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import termios

import psutil
import pytest
from helpers import (
    REPO,
    SMALL,
    Processes,
    fedbus,
    free_port,
    merged,
    metrics,
    wait_until,
    write_config,
)

from fedbus.record.rundir import read_metrics

ROUNDS = 10
SIGNAL_AT = 2  # records written when the signal goes: ROUNDS - SIGNAL_AT rounds left
# metrics that depend on the wall clock, not on the mathematics
TIMING = {"time", "round_s", "eval_s", "wall_s"}
# 4 clients on 2 nodes, every sampled client awaited (no deadline), and a node declared
# dead only after 30 missed heartbeats (9 s): a node stalled on a loaded machine, or one
# killed alone until its launcher stops the run, never closes a round without its clients,
# so the records are the same in every run of the config
SECTIONS = merged(SMALL, federation={"rounds": ROUNDS, "clients": 4}, bus={"liveness": 30})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(config file, the records of the uninterrupted run)."""
    tmp = tmp_path_factory.mktemp("reference")
    cfg = write_config(tmp / "run.toml", SECTIONS)
    fedbus("run", str(cfg), "--out", str(tmp / "whole"), "--quiet")
    return cfg, metrics(tmp / "whole")


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def _start(argv: list[str], stdout, stderr) -> subprocess.Popen:
    """`fedbus ARGV` in a session of its own: its process group is what a terminal's
    Ctrl-C would signal, and nothing reaches this test's group."""
    return subprocess.Popen([sys.executable, "-m", "fedbus.launch", *argv], cwd=REPO,
                            stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                            start_new_session=True)


def _await_records(run_dir, n: int, proc: subprocess.Popen) -> None:
    """Until `n` rounds are recorded (the event a signal is sent on)."""
    wait_until(lambda: len(read_metrics(run_dir)) >= n or proc.poll() is not None, 300,
               f"{n} records in {run_dir}", interval=0.01)
    assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before round {n}"
    assert len(read_metrics(run_dir)) < ROUNDS


def _stop(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _assert_interrupted(run_dir) -> None:
    assert not (run_dir / "summary.json").exists(), "a stopped run claims to be complete"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted" and status["done"] is False, status
    assert len(read_metrics(run_dir)) < ROUNDS


def _assert_resumes_to_the_reference(run_dir, expected: list[dict]) -> None:
    out = fedbus("run", "--resume", str(run_dir), "--quiet")
    assert out.returncode == 0
    got = metrics(run_dir)
    assert [r["round"] for r in got] == list(range(ROUNDS))  # one record per round
    assert _comparable(got) == _comparable(expected)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == ROUNDS


def _child(proc: subprocess.Popen, name: str) -> psutil.Process:
    """The launcher's child process `name` (server, node-0, ...): a forked child is named
    fedbus-NAME (PR_SET_NAME), an exec'd one has NAME's sub-command line."""
    for child in psutil.Process(proc.pid).children():
        try:
            cmd = child.cmdline()
            if child.name() == f"fedbus-{name}"[:15] or (
                    name == "server" and "server" in cmd) or f"--name={name}" in cmd or (
                    "--name" in cmd and cmd[cmd.index("--name") + 1] == name):
                return child
        except (psutil.NoSuchProcess, IndexError):
            continue
    raise AssertionError(f"no {name} process under the launcher")


# (who is signalled, the signal, the launcher's exit code)
STOPS = {
    "ctrl-c": ("group", signal.SIGINT, 130),
    "sigterm-launcher": ("launcher", signal.SIGTERM, 143),
    "sigint-server": ("server", signal.SIGINT, 130),
    "sigterm-node": ("node-1", signal.SIGTERM, 130),
}


@pytest.mark.slow
@pytest.mark.parametrize("stop", list(STOPS))
def test_a_signalled_run_is_interrupted_and_resumes_to_the_same_records(tmp_path, reference,
                                                                        stop):
    cfg, expected = reference
    target, sig, code = STOPS[stop]
    run_dir = tmp_path / "run"
    with open(tmp_path / "stderr", "wb") as err:
        proc = _start(["run", str(cfg), "--out", str(run_dir), "--quiet"],
                      subprocess.DEVNULL, err)
        try:
            _await_records(run_dir, SIGNAL_AT, proc)
            if target == "group":
                os.killpg(proc.pid, sig)
            elif target == "launcher":
                proc.send_signal(sig)
            else:
                _child(proc, target).send_signal(sig)
        finally:
            rc = _stop(proc)
    stderr = (tmp_path / "stderr").read_text()
    assert rc == code, stderr
    assert f"continue with `fedbus run --resume {run_dir}`" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    _assert_interrupted(run_dir)
    _assert_resumes_to_the_reference(run_dir, expected)
    if stop == "ctrl-c":  # a run that did finish stays complete: a resume is refused
        again = fedbus("run", "--resume", str(run_dir), check=False)
        assert again.returncode == 2 and "is complete (summary.json)" in again.stderr


@pytest.mark.slow
def test_ctrl_c_with_the_output_piped_to_a_reader_that_died_first(tmp_path, reference):
    """`fedbus run ... 2>&1 | tee log` in a terminal, then Ctrl-C: tee dies first. The
    launcher's progress and its last line meet a closed pipe: no exit 141 on SIGPIPE, no
    traceback, exit 130, the run interrupted and resumable, and the `--resume` line on the
    terminal (here a pseudo-terminal, the session's controlling one, read by the test)."""
    cfg, expected = reference
    run_dir = tmp_path / "run"
    read, write = os.pipe()
    terminal, tty = os.openpty()

    def take_the_terminal() -> None:  # in the child, after setsid (start_new_session)
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                             str(run_dir)], cwd=REPO, stdin=tty, stdout=write,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=take_the_terminal)  # noqa: PLW1509 (ioctl only)
    os.close(write)
    os.close(read)  # the reader is gone before the launcher's first line
    try:
        _await_records(run_dir, SIGNAL_AT, proc)  # progress lines went into the broken pipe
        os.killpg(proc.pid, signal.SIGINT)
    finally:
        rc = _stop(proc)
    os.set_blocking(terminal, False)
    try:
        shown = os.read(terminal, 1 << 16).decode(errors="replace")
    except OSError:
        shown = ""
    finally:
        os.close(terminal)
        os.close(tty)
    assert rc == 130
    assert f"continue with `fedbus run --resume {run_dir}`" in shown, shown
    _assert_interrupted(run_dir)
    _assert_resumes_to_the_reference(run_dir, expected)


@pytest.mark.slow
def test_an_interrupted_sweep_resumes_its_run_when_run_again(tmp_path, reference):
    """Ctrl-C to a sweep's process group stops its running run interrupted; the same sweep
    command again resumes that run (neither skipped as complete nor moved aside and run
    from scratch), and its records are those of the uninterrupted run."""
    cfg, expected = reference
    out = tmp_path / "sweep"
    argv = ["sweep", str(cfg), "--seeds", f"{SECTIONS['federation']['seed']},", "--jobs", "1",
            "--out", str(out)]
    run_dir = out / f"s{SECTIONS['federation']['seed']}"
    with open(tmp_path / "stdout", "wb") as so, open(tmp_path / "stderr", "wb") as se:
        proc = _start(argv, so, se)
        try:
            _await_records(run_dir, SIGNAL_AT, proc)
            os.killpg(proc.pid, signal.SIGINT)
        finally:
            rc = _stop(proc)
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 130, stderr
    assert "the same command continues it" in stderr
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["name"], r["status"]) for r in runs] == [(run_dir.name, "interrupted")]
    _assert_interrupted(run_dir)

    again = fedbus(*argv)
    assert f"{run_dir.name}: " in again.stdout and "resuming it" in again.stdout, again.stdout
    assert "1 complete (0 skipped), 0 failed" in again.stdout, again.stdout
    assert not list(out.glob("*.incomplete-*"))
    got = metrics(run_dir)
    assert [r["round"] for r in got] == list(range(ROUNDS))
    assert _comparable(got) == _comparable(expected)
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert [(r["name"], r["status"]) for r in runs] == [(run_dir.name, "complete")]
    skipped = fedbus(*argv)  # a third time: the complete run is skipped, as before
    assert "complete already" in skipped.stdout and "1 complete (1 skipped)" in skipped.stdout


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_bare_server_stopped_by_a_signal_resumes(tmp_path, sig):
    """`fedbus server` started by hand, its nodes too: SIGTERM (or SIGINT) stops it
    interrupted, with exit 128 + the signal and the `fedbus server --resume` line; the nodes
    wait, and `fedbus server --resume` finishes every round once."""
    broker = f"tcp://127.0.0.1:{free_port()}"
    cfg = write_config(tmp_path / "run.toml", SECTIONS)
    run = tmp_path / "run"
    procs = Processes(tmp_path)
    hb = ("--heartbeat-s", "0.3", "--liveness", "30")
    try:
        procs.start("broker", "broker", "--bind", broker, *hb)
        server = procs.start("server", "server", "--broker", broker, str(cfg), "--out", str(run))
        for i, clients in enumerate(("0-1", "2-3")):
            procs.start(f"node-{i}", "node", "--broker", broker, "--clients", clients,
                        "--name", f"n{i}", "--state-dir", str(tmp_path / "states"), *hb)
        _await_records(run, SIGNAL_AT, server)
        procs.kill("server", sig)
        assert server.returncode == 128 + sig, procs.log("server")
        assert f"--resume {run}`" in procs.log("server")
        _assert_interrupted(run)

        resumed = procs.start("server2", "server", "--broker", broker, "--resume", str(run))
        wait_until(lambda: resumed.poll() is not None, 300, "the resumed run")
        assert resumed.returncode == 0, procs.log("server2")
        assert [r["round"] for r in metrics(run)] == list(range(ROUNDS))
        summary = json.loads((run / "summary.json").read_text())
        assert summary["rounds_completed"] == ROUNDS
        assert json.loads((run / "status.json").read_text())["state"] == "complete"
    finally:
        procs.close()
