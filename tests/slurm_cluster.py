"""A real one-machine Slurm for the tests: Debian's slurm-wlm daemons (slurmctld, slurmd)
and munge, started for the tests with a configuration of their own (in a temporary folder,
on free ports) and stopped after them. Two GPUs are declared as Slurm generic resources
backed by character-device files made here (Slurm needs device files to hand out GPU
indices; nothing opens them), so jobs that ask for `--gres=gpu:N` are granted indices
0..1 and see CUDA_VISIBLE_DEVICES as on a GPU cluster. Needs root (slurmd runs jobs as
their submitter, the daemons as root here) and the tools; `why_not()` says which is
missing, for a one-line skip."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from helpers import wait_until

TOOLS = ("sbatch", "squeue", "scancel", "scontrol", "slurmctld", "slurmd", "munged", "munge")
GPUS = 2


def why_not() -> str | None:
    missing = [t for t in TOOLS if shutil.which(t) is None and
               not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        return (f"no {', '.join(missing)} (Debian: apt-get install slurm-wlm munge; "
                ".ci/run installs them as root)")
    if os.geteuid() != 0:
        return "the Slurm daemons need root here"
    if not Path("/etc/munge/munge.key").is_file():
        return "no /etc/munge/munge.key (reinstall munge)"
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _munge_answers() -> bool:
    """munged is up and serving its socket: it encodes a credential."""
    return subprocess.run(["munge", "-n"], capture_output=True, check=False).returncode == 0


def _munged_gone() -> bool:
    return subprocess.run(["pgrep", "-x", "munged"], capture_output=True,
                          check=False).returncode != 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv: list[str], env: dict | None = None, check: bool = True,
         timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=check,
                          timeout=timeout)


class SlurmCluster:
    """The daemons of one private cluster; `env` is what a Slurm command needs to reach it
    (SLURM_CONF)."""

    def __init__(self, root: Path):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.started_munge = False

    def write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        gpus = [self.root / f"gpu{i}" for i in range(GPUS)]
        for i, dev in enumerate(gpus):
            if not dev.exists():
                os.mknod(dev, 0o600 | 0o020000, os.makedev(195, i))  # a character device
        cpus = os.cpu_count() or 1
        r = self.root
        self.conf.write_text(f"""\
ClusterName=fedbustest
SlurmctldHost={self.host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits cred_expire s (default 120) before it may start again
AuthInfo=cred_expire=30
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MinJobAge=3600
KillWait=10
GresTypes=gpu
NodeName={self.host} CPUs={cpus} Gres=gpu:{GPUS} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        (self.root / "gres.conf").write_text(
            f"NodeName={self.host} Name=gpu File={r}/gpu[0-{GPUS - 1}]\n")

    def start(self) -> None:
        self.write_config()
        if not _munge_answers():
            # a munged an earlier session stopped may still be exiting (pgrep would find it
            # and its socket be gone a moment later): wait for it before starting ours
            wait_until(_munged_gone, 60, "munged to exit")
            Path("/run/munge").mkdir(parents=True, exist_ok=True)
            shutil.chown("/run/munge", "munge", "munge")
            _run(["runuser", "-u", "munge", "--", _tool("munged")])
            self.started_munge = True
            wait_until(_munge_answers, 60, "munged to answer")
        _run([_tool("slurmctld"), "-f", str(self.conf)], env=self.env)
        _run([_tool("slurmd"), "-f", str(self.conf)], env=self.env)
        deadline = time.monotonic() + 120  # a liveness guard: the daemons come up in seconds
        while time.monotonic() < deadline:
            out = _run(["sinfo", "-h", "-o", "%T"], env=self.env, check=False)
            state = out.stdout.strip()
            if state.startswith(("idle", "mix")):
                return
            if state.startswith(("inval", "drain", "down")):
                _run(["scontrol", "update", f"nodename={self.host}", "state=resume"],
                     env=self.env, check=False)
            time.sleep(0.5)
        self.stop()  # the daemons that did start go with the error, not on after the tests
        raise RuntimeError(f"the test Slurm did not come up: sinfo says {state!r}; logs in "
                           f"{self.root / 'log'}")

    def stop(self) -> None:
        _run(["scancel", "--full", "--user=root"], env=self.env, check=False)
        for name in ("slurmd", "slurmctld"):
            pid_file = self.root / f"{name}.pid"
            try:
                os.kill(int(pid_file.read_text().split()[0]), 15)
            except (OSError, ValueError, IndexError):
                pass
        if self.started_munge:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True, check=False)
            wait_until(_munged_gone, 60, "munged to exit")

    def job_state(self, job: str) -> str:
        out = _run(["scontrol", "show", "job", "-o", job], env=self.env, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job: str, timeout: float = 900) -> str:
        """The job's final state, once it has left the queue (a liveness guard only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                             "SUSPENDED", "UNKNOWN"):
                return state
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {self.job_state(job)} after {timeout} s")
