"""tests/zygote.py, the tests' fork server: a fedbus process a test leaves running is killed
when the pytest worker exits, not waited for (which hung the worker's exit)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers import free_port

LEAKER = r'''
import sys
import time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import zygote

if __name__ == "__main__":
    proc = zygote.start(["broker", "--bind", sys.argv[2]], stdout=Path(sys.argv[3]),
                        cwd=sys.argv[4])
    while "listening" not in Path(sys.argv[3]).read_text(errors="replace"):
        assert proc.poll() is None, Path(sys.argv[3]).read_text(errors="replace")
        time.sleep(0.05)
    print(proc.pid, flush=True)  # and leave it running, as a failed test can
'''


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_forked_process_left_running_is_killed_when_the_worker_exits(tmp_path):
    script = tmp_path / "leaker.py"
    script.write_text(LEAKER)
    log = tmp_path / "broker.log"
    # timeout: a liveness guard; the bug it pins down was an exit that never came
    out = subprocess.run([sys.executable, str(script), str(Path(__file__).parent),
                          f"tcp://127.0.0.1:{free_port()}", str(log), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = int(out.stdout.split()[0])
    assert not _alive(pid), f"the broker {pid} outlived the process that started it"
