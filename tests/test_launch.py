"""`fedbus run` as a process supervisor: no orphans whatever ends it."""
from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
from helpers import REPO, SMALL, merged, wait_until, write_config

LONG = merged(SMALL, federation={"rounds": 200})


def _start(tmp_path):
    cfg = write_config(tmp_path / "long.toml", LONG)
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                             str(tmp_path / "run"), "--quiet"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    launcher = psutil.Process(proc.pid)
    # broker + server + 2 nodes, and the first round done: everything is up
    wait_until(lambda: len(launcher.children()) == 4 and
               (tmp_path / "run" / "metrics.jsonl").exists() and
               (tmp_path / "run" / "metrics.jsonl").read_text().strip() != "", 120,
               "the federation to start")
    return proc, launcher.children()


def _all_gone(children, timeout=20):
    wait_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                               for c in children), timeout, "every child to exit")


def test_ctrl_c_stops_every_process(tmp_path):
    proc, children = _start(tmp_path)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)
    assert proc.returncode == 130
    _all_gone(children)


def test_a_dead_node_stops_the_run_and_names_it(tmp_path):
    proc, children = _start(tmp_path)
    # exec'd children show their command line; forked ones their name (PR_SET_NAME)
    node = next(c for c in children if "node-1" in " ".join([c.name(), *c.cmdline()]))
    node.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "node-1 exited" in err
    _all_gone(children)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_die_with_a_killed_launcher(tmp_path):
    proc, children = _start(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    _all_gone(children)


def test_started_processes_ignore_a_look_alike_package_in_the_working_directory(tmp_path):
    """A folder in the working directory named like fedbus (or a plugin's package) shadows
    the installed one under a plain `python -m`; the command the launcher, relays and
    benchmarks start their processes with (node.lifetime.fedbus_command) does not see it."""
    from fedbus.node.lifetime import fedbus_command

    fake = tmp_path / "fedbus" / "launch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text("print('SHADOWED')\n")
    plain = subprocess.run([sys.executable, "-m", "fedbus.launch", "--version"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert plain.stdout.strip() == "SHADOWED"  # the hazard is real
    safe = subprocess.run(fedbus_command("--version"), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert safe.returncode == 0 and "SHADOWED" not in safe.stdout
    assert safe.stdout.startswith("fedbus "), safe.stdout


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    """`fedbus algorithms | head -1`: the pipe closes under the writer; the command stops
    with 128 + SIGPIPE and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "fedbus.launch", "algorithms"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    proc.stdout.close()  # before it writes: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err
