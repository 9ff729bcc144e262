"""What `fedbus run` prints: plain per-round lines and a summary table when
its output is not a terminal, a live rich display on a terminal, nothing
with --quiet."""
from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

from helpers import REPO, SMALL, fedbus, merged, write_config

TINY = merged(SMALL, federation={"clients": 2, "rounds": 2},
              data={"shots": 15}, launch={"nodes": 1})

ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07]*\x07|[()][0-9A-Za-z]|[=>78])")


def test_plain_lines_and_summary_table_when_not_a_terminal(tmp_path):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"))
    err = proc.stderr.splitlines()
    # each line: the round's number, 0-based as in every file, then the count done
    rounds = [ln for ln in err if re.match(r"round \d+ \(\d+/2 done\) ", ln)]
    assert [ln.split()[1:3] for ln in rounds] == [["0", "(1/2"], ["1", "(2/2"]], proc.stderr
    assert all(re.search(r"updates 2 +failed 0 +acc \d+\.\d% ", ln) for ln in rounds), rounds
    assert any(ln.startswith("fedbus run: fedavg on digits, 2 clients in 1 node(s)")
               for ln in err), proc.stderr
    assert "\x1b[" not in proc.stderr  # no terminal codes in a pipe
    out = proc.stdout
    assert "fedbus: fedavg" in out
    for row in ("acc (mean ± std over clients)", "rounds completed", "bytes up / down",
                "params up / down", "wall time"):
        assert row in out, out
    assert re.search(r"rounds completed\s*│\s*2\s", out), out
    assert len(out.splitlines()) < 20  # a short table


def test_quiet_prints_nothing(tmp_path):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"), "--quiet")
    assert proc.stdout == "" and proc.stderr == ""
    assert (tmp_path / "run" / "summary.json").exists()


def test_quiet_still_prints_errors(tmp_path):
    cfg = write_config(tmp_path / "bad.toml", {"federation": {"rounds": 0}})
    proc = fedbus("run", str(cfg), "--out", str(tmp_path / "run"), "--quiet", check=False)
    assert proc.returncode == 2
    assert proc.stdout == "" and "federation.rounds" in proc.stderr


def _run_on_a_terminal(argv: list[str], timeout: float) -> tuple[int, str]:
    """Run argv with stdin, stdout and stderr on a pseudo-terminal; its exit code
    and everything it wrote there."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "120", "LINES": "40"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env,
                            close_fds=True)
    os.close(slave)
    chunks = []
    end = time.time() + timeout
    try:
        while time.time() < end:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
    return code, b"".join(chunks).decode("utf-8", errors="replace")


def test_live_display_on_a_terminal(tmp_path):
    cfg = write_config(tmp_path / "tiny.toml", TINY)
    code, raw = _run_on_a_terminal(
        [sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out", str(tmp_path / "run")],
        timeout=240)
    text = ANSI.sub("", raw)
    assert code == 0, text[-3000:]
    assert "rounds" in text and "2/2" in text, text[-3000:]
    assert not re.search(r"^round \d+ \(", text, re.MULTILINE), "plain lines on a terminal"
    assert "rounds completed" in text  # the summary table follows the display
