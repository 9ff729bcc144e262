"""The relay examples (docs/RELAYS.md): examples/two-sites/ and
examples/slurm-relays.sbatch load, parse, and run as documented, with CurveZMQ keys made
and exchanged the way docs/RELAYS.md says, through real brokers, relays and nodes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fedbus.algorithms import get_algorithm
from fedbus.node.config import load_config
from tests.helpers import REPO, free_port, metrics

EXAMPLE = REPO / "examples" / "two-sites"
SLURM = REPO / "examples" / "slurm-relays.sbatch"


def _env(**extra: str) -> dict[str, str]:
    """The environment of a user who installed fedbus: `fedbus` and `python` on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _run_script(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float,
                log: Path) -> int:
    """Run a bash example in its own session; whatever it started is killed at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{cmd[1]} ran past {timeout} s:\n"
                                 f"{log.read_text(errors='replace')[-3000:]}") from None
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def test_the_two_site_server_config_loads_and_its_algorithm_merges():
    cfg = load_config(EXAMPLE / "server.toml")
    assert cfg.data.dataset == "digits"  # offline, as the walk-through runs anywhere
    assert cfg.federation.clients == 6 and cfg.federation.mode == "sync"
    # the walk-through promises one merged update per relay and round
    assert get_algorithm(cfg.algorithm.name).server.merge_rule() is not None


@pytest.mark.parametrize("script", [EXAMPLE / "rehearse.sh", SLURM], ids=lambda p: p.name)
def test_the_example_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_two_site_walk_through_runs_with_one_merged_update_per_relay(tmp_path):
    work = tmp_path / "sites"
    rc = _run_script(["bash", str(EXAMPLE / "rehearse.sh"), str(work)], cwd=REPO,
                     env=_env(), timeout=280, log=tmp_path / "rehearse.log")
    assert rc == 0, (tmp_path / "rehearse.log").read_text(errors="replace")[-3000:]
    records = metrics(work / "S" / "runs" / "two-sites")
    assert [r["round"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["merged"] == 2, r  # relay-a and relay-b, each for its whole site
        assert r["participants"] == list(range(6)) and not r["failures"], r
    for machine, clients in (("RA", 3), ("RB", 3)):
        log = (work / machine / "relay.log").read_text(errors="replace")
        assert log.count("merged update sent") == 3, machine
        assert f"clients={clients} tasks={clients}" in log, machine
    # docs/RELAYS.md's check: `fedbus log --kind merged` names both relays
    timeline = subprocess.run([sys.executable, "-m", "fedbus.launch", "log",
                               str(work / "S" / "runs" / "two-sites"), "--round", "1",
                               "--kind", "merged"], check=False, capture_output=True, text=True,
                              cwd=REPO)
    assert timeline.returncode == 0, timeline.stderr
    assert "relay-a" in timeline.stdout and "relay-b" in timeline.stdout, timeline.stdout


STAND_IN_SRUN = r"""#!/bin/bash
# Slurm's srun, as this machine can play it: the step's command once per allocation node
# (--nodes=N), each with its SLURM_NODEID, all here.
n=1
while [[ $1 == -* ]]; do
  case $1 in
    --nodes=*) n=${1#--nodes=} ;;
    -w|--nodelist) shift ;;
  esac
  shift
done
pids=()
for i in $(seq 0 $((n - 1))); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


@pytest.mark.slow
def test_the_slurm_relay_job_runs_one_site_below_its_relay(tmp_path):
    """examples/slurm-relays.sbatch as one allocation of two nodes with two CPU node
    processes each, Slurm's launcher played on this machine, below a real server site."""
    fedbus = [sys.executable, "-m", "fedbus.launch"]
    site_s, relay_keys = tmp_path / "S", tmp_path / "relay-a"
    for name in ("broker", "server"):
        subprocess.run([*fedbus, "keygen", name, "--dir", str(site_s / "keys")], check=True,
                       capture_output=True)
    subprocess.run([*fedbus, "keygen", "relay-a", "--clients", "0-5", "--dir",
                    str(relay_keys)], check=True, capture_output=True)
    (site_s / "keys" / "relay-a.key").write_bytes((relay_keys / "relay-a.key").read_bytes())
    (relay_keys / "broker.key").write_bytes((site_s / "keys" / "broker.key").read_bytes())

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(STAND_IN_SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho 127.0.0.1\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)

    upstream = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        for name, args in (("broker", ["broker", "--bind", upstream, "--curve"]),
                           ("server", ["server", "--broker", upstream,
                                       str(EXAMPLE / "server.toml"), "--out", "runs/exp1"])):
            with open(tmp_path / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([*fedbus, *args, "--keys-dir", "keys"],
                                              cwd=site_s, stdout=out, stderr=subprocess.STDOUT))
        env = _env(SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES="2",
                   SLURM_JOB_NODELIST="127.0.0.1", DEVICE="cpu", PROCS_PER_NODE="2",
                   SITE_PORT=str(free_port()))
        env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
        rc = _run_script(["bash", str(SLURM), upstream, str(relay_keys), "0-5"],
                         cwd=tmp_path, env=env, timeout=280, log=tmp_path / "job.log")
        assert rc == 0, (tmp_path / "job.log").read_text(errors="replace")[-3000:]
        assert procs[1].wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    records = metrics(site_s / "runs" / "exp1")
    assert len(records) == 3
    for r in records:
        assert r["merged"] == 1 and r["participants"] == list(range(6)), r
    listing = subprocess.run([*fedbus, "keygen", "--list", "--dir",
                              str(tmp_path / "runs" / "slurm-site-42" / "site-keys")],
                             capture_output=True, text=True, check=True).stdout
    # process k = node * 2 + gpu hosts its share of 0-5
    column = listing.splitlines()[0].split().index("clients")  # (the columns' header)
    hosts = {line.split()[0]: line.split()[column] for line in listing.splitlines()
             if line.startswith("gpu") and ".key " in line}
    assert hosts == {"gpu0.key": "c0", "gpu1.key": "c1-2", "gpu2.key": "c3",
                     "gpu3.key": "c4-5"}, listing
    relay_log = [json.loads(line) for line in
                 (tmp_path / "runs" / "slurm-site-42" / "relay.log").read_text().splitlines()
                 if line.startswith("{")]
    # each of the four node processes joined through the relay (a node that misses its
    # heartbeats on a loaded machine registers again: a second join, the same node)
    assert len({e.get("node") for e in relay_log if e.get("event") == "node joined"}) == 4
