"""`fedbus slurm` against a real Slurm (tests/slurm_cluster.py: Debian's slurm-wlm and munge,
one machine, two GPUs declared as generic resources). Real jobs: a federation completes with
its client nodes on the GPUs Slurm granted; a job stopped with `scancel --signal=TERM`
mid-run leaves the run interrupted and the resubmitted job ends with the uninterrupted
run's records; two jobs at once do not meet on ports or keys. Every stop is sent on an
event (a round's record, with the server held by SIGSTOP so the run cannot end first),
never after a fixed time; waits are liveness guards only."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import REPO, SMALL, fedbus, free_port, merged, metrics, wait_until, write_config
from slurm_cluster import GPUS, SlurmCluster, why_not

from fedbus.record.rundir import read_metrics

_why = why_not()
needs_slurm = pytest.mark.skipif(_why is not None, reason=f"real Slurm: {_why}")

ROUNDS = 6
TIMING = {"time", "round_s", "eval_s", "wall_s"}
# 4 clients, every sampled client awaited (no deadline), nodes declared dead only after 30
# missed heartbeats: the records are the same in every run of the config. One client node,
# as a job of `fedbus slurm`'s defaults has (one node, one task): a batched round sends
# its payload once a node, so the uninterrupted `fedbus run` needs the same topology for
# its records' bytes_down to be the job's.
SECTIONS = merged(SMALL, federation={"rounds": ROUNDS, "clients": 4}, bus={"liveness": 30},
                  launch={"nodes": 1})


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def submit(slurm: SlurmCluster, *argv: str) -> str:
    """`fedbus slurm ARGV --no-follow` against the test cluster; the job id."""
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "slurm", *argv,
                          "--no-follow"], cwd=REPO, env=slurm.env, capture_output=True,
                         text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def job_output(run_dir, job: str) -> str:
    return (run_dir / "slurm" / f"job-{job}.out").read_text()


def test_dry_run_prints_a_job_that_bash_parses_and_writes_nothing(tmp_path):
    out = fedbus("slurm", "--dry-run", "--nodes", "2", "--gpus-per-node", "4", "--requeue",
                 "--time", "04:00:00", "--out", str(tmp_path / "run"), "--set",
                 "federation.clients=16")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "run").exists()
    job, step = out.stdout.split(f"# {tmp_path / 'run'}/slurm/node-step.sh\n")
    for line in ("#SBATCH --nodes=2", "#SBATCH --gres=gpu:4", "#SBATCH --time=04:00:00",
                 "#SBATCH --requeue", "#SBATCH --signal=B:USR1@120"):
        assert line in job, line
    assert len(re.search(r"CLIENTS=\((.*)\)", step)[1].split()) == 8, step  # 2 x 4 GPUs
    for name, text in (("job", job), ("step", step)):
        (tmp_path / name).write_text(text)
        assert subprocess.run(["bash", "-n", str(tmp_path / name)], check=False).returncode == 0, name


def test_bad_options_are_refused_in_one_line(tmp_path):
    out = fedbus("slurm", "--nodes", "0", "--dry-run", check=False)
    assert out.returncode == 2 and "--nodes must be at least 1" in out.stderr
    out = fedbus("slurm", "--resume", str(tmp_path), "--set", "federation.rounds=2", check=False)
    assert out.returncode == 2 and "drop CONFIG" in out.stderr
    out = fedbus("slurm", "--resume", str(tmp_path), check=False)
    assert out.returncode == 2 and "not started by `fedbus slurm`" in out.stderr


@needs_slurm
def test_a_federation_completes_with_a_client_node_on_each_granted_gpu(tmp_path, slurm):
    cfg = write_config(tmp_path / "run.toml", merged(SECTIONS, federation={"rounds": 2}))
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "fedbus.launch", "slurm", str(cfg), "--out",
                          str(run_dir), "--gpus-per-node", str(GPUS), "--device", "cpu"],
                         cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stderr
    assert "run complete" in out.stderr
    job = (run_dir / "slurm" / "jobs.txt").read_text().split()[-1]
    assert slurm.job_state(job) == "COMPLETED"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_completed"] == 2
    text = job_output(run_dir, job)
    pinned = re.findall(r"node-(\d+) on \S+: clients (\S+), device cpu, "
                        r"CUDA_VISIBLE_DEVICES=(\d*)", text)
    assert sorted(k for k, _, _ in pinned) == ["0", "1"], text
    # each process pinned to one GPU Slurm granted, none shared
    assert sorted(gpu for _, _, gpu in pinned) == [str(i) for i in range(GPUS)], text
    hosted = set()
    for _, ids, _ in pinned:
        hosted |= {int(c) for part in ids.split(",") for c in
                   (range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))}
    assert hosted == {0, 1, 2, 3}


@needs_slurm
def test_relays_a_relay_on_each_allocated_node_sends_one_merged_update(tmp_path, slurm):
    """--relays: the node's relay joins upstream for its clients and its two client-node
    processes join the relay's site broker: one merged update a round reaches the server."""
    cfg = write_config(tmp_path / "run.toml", merged(SECTIONS, federation={"rounds": 2}))
    run_dir = tmp_path / "run"
    job = submit(slurm, str(cfg), "--out", str(run_dir), "--relays", "--tasks-per-node", "2")
    assert slurm.wait_job(job) == "COMPLETED", job_output(run_dir, job)
    records = [r for r in metrics(run_dir) if "participants" in r]
    assert len(records) == 2
    for r in records:
        assert r["merged"] == 1 and r["participants"] == [0, 1, 2, 3], r
    relay_log = [json.loads(line) for line in
                 (run_dir / "logs" / "relay-0.jsonl").read_text().splitlines()]
    assert len({e.get("node") for e in relay_log if e.get("event") == "node joined"}) == 2


def test_secure_aggregation_keys_are_signed_and_every_site_verifies_every_node(tmp_path):
    """Under secure aggregation the job's keys carry each node's Ed25519 identity beside its
    certificate (relay sites included), and every node's folder holds every other node's
    public NAME.sign: a key advertisement signed by any node verifies at every other node,
    for its own clients only."""
    from fedbus.launch.slurm_cmd import write_keys
    from fedbus.node.privacy.identity import advert_message, load_identity

    groups = [[0, 1], [2, 3], [4, 5], [6, 7]]
    write_keys(tmp_path, groups, per_node=2, signing=True)
    folder = {k: tmp_path / "site-keys" / f"relay-{k // 2}" for k in range(4)}
    nodes = {k: load_identity(folder[k], f"node-{k}") for k in range(4)}
    assert all(ident is not None for ident in nodes.values())
    assert not list((tmp_path / "keys").glob("*.sign_secret"))  # secrets stay on their site
    for k, ids in enumerate(groups):
        assert (folder[k] / f"node-{k}.sign_secret").stat().st_mode & 0o077 == 0
        for c in ids:
            msg = advert_message(b"fedbus-secagg/run/0", c, b"c" * 32, b"s" * 32)
            sig = nodes[k].sign(msg)
            for j, other in nodes.items():
                assert other.verify(c, sig, msg) is None, (k, j, c)
            wrong = (c + 2) % 8  # a client of another node: its key does not verify
            assert nodes[0].verify(wrong, sig, msg) == "its signature does not verify"
    write_keys(tmp_path / "plain", groups, signing=False)
    assert not list((tmp_path / "plain").rglob("*.sign*"))


@needs_slurm
def test_secure_aggregation_behind_relays_runs_signed(tmp_path, slurm):
    """A secure-aggregation job with relays: every node signs its clients' keys with the
    identity `fedbus slurm` wrote, every round unmasks all four clients' sum through the
    relay, and no node runs unsigned or refuses a peer."""
    cfg = write_config(tmp_path / "run.toml", merged(
        SECTIONS, algorithm={"name": "fedproto"}, federation={"rounds": 2},
        privacy={"secure_aggregation": True, "secagg_timeout_s": 120.0}))
    run_dir = tmp_path / "run"
    job = submit(slurm, str(cfg), "--out", str(run_dir), "--relays", "--tasks-per-node", "2")
    assert slurm.wait_job(job) == "COMPLETED", job_output(run_dir, job)
    assert sorted(p.name for p in (run_dir / "site-keys" / "relay-0").glob("*.sign")) == [
        "node-0.sign", "node-1.sign"]
    records = [r for r in metrics(run_dir) if "participants" in r]
    assert len(records) == 2
    for r in records:
        assert r["secagg"].get("failed") is None and r["secagg"]["survivors"] == 4, r
    logs = [line for p in (run_dir / "logs").glob("node-*.jsonl")
            for line in p.read_text().splitlines()]
    assert logs
    assert not [line for line in logs if "secure aggregation" in line and (
        "refused" in line or "without a signing identity" in line)]


def _server_of(run_dir) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "server" in cmd and str(run_dir) in " ".join(cmd) and "fedbus.launch" in cmd:
            return p
    raise AssertionError(f"no server process for {run_dir}")


@needs_slurm
def test_a_job_stopped_by_scancel_term_resumes_to_the_uninterrupted_records(tmp_path, slurm):
    cfg = write_config(tmp_path / "run.toml", SECTIONS)
    whole = tmp_path / "whole"
    assert fedbus("run", str(cfg), "--out", str(whole), "--quiet").returncode == 0
    expected = metrics(whole)

    run_dir = tmp_path / "run"
    job = submit(slurm, str(cfg), "--out", str(run_dir))
    wait_until(lambda: len(read_metrics(run_dir)) >= 2 if (run_dir / "metrics.jsonl").exists()
               else slurm.job_state(job) not in ("PENDING", "RUNNING"), 600,
               "round 2's record", interval=0.05)
    server = _server_of(run_dir)
    server.send_signal(signal.SIGSTOP)  # held: the run cannot finish before the stop lands
    try:
        assert len(read_metrics(run_dir)) < ROUNDS
        done = subprocess.run(["scancel", "--signal=TERM", job], env=slurm.env,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
    finally:
        server.send_signal(signal.SIGCONT)
    state = slurm.wait_job(job)
    assert not (run_dir / "summary.json").exists(), "a stopped job's run claims completion"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted", (status, state, job_output(run_dir, job))
    assert "server exited 143" in job_output(run_dir, job)

    again = subprocess.run([sys.executable, "-m", "fedbus.launch", "slurm", "--resume",
                            str(run_dir)], cwd=REPO, env=slurm.env, capture_output=True,
                           text=True, timeout=900, check=False)
    assert again.returncode == 0, again.stderr
    job2 = (run_dir / "slurm" / "jobs.txt").read_text().split()[-1]
    assert job2 != job and "(resume)" in job_output(run_dir, job2)
    got = metrics(run_dir)
    assert [r["round"] for r in got] == list(range(ROUNDS))
    assert _comparable(got) == _comparable(expected)


@needs_slurm
def test_the_time_limit_warning_requeues_the_job_and_it_resumes(tmp_path, slurm):
    """--requeue: the signal Slurm sends the job's shell before its time limit (USR1, as
    --signal=B:USR1@S asks; sent here by hand on round 2's record, Slurm's timer being the
    one part not exercised) stops the run at its checkpoint and requeues the job, whose
    second start resumes the run to the uninterrupted records."""
    cfg = write_config(tmp_path / "run.toml", SECTIONS)
    whole = tmp_path / "whole"
    assert fedbus("run", str(cfg), "--out", str(whole), "--quiet").returncode == 0
    run_dir = tmp_path / "run"
    job = submit(slurm, str(cfg), "--out", str(run_dir), "--requeue")
    wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(read_metrics(run_dir)) >= 2,
               600, "round 2's record", interval=0.05)
    server = _server_of(run_dir)
    server.send_signal(signal.SIGSTOP)
    try:
        done = subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm.env,
                              capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        wait_until(lambda: "time limit near" in job_output(run_dir, job), 120,
                   "the job's shell took the warning", interval=0.05)
    finally:
        server.send_signal(signal.SIGCONT)
    assert slurm.wait_job(job, timeout=1200) == "COMPLETED", job_output(run_dir, job)
    text = job_output(run_dir, job)
    assert "requeueing job" in text and "(resume)" in text, text
    assert _comparable(metrics(run_dir)) == _comparable(metrics(whole))


@needs_slurm
def test_two_jobs_at_once_keep_their_own_ports_and_keys(tmp_path, slurm):
    """Job a is held (its server stopped) from its first record until job b has run to its
    end beside it: the two were in the allocation together, whatever the machine's speed."""
    cfg = write_config(tmp_path / "run.toml", merged(SECTIONS, federation={"rounds": 2}))
    a, b = tmp_path / "a", tmp_path / "b"
    job_a = submit(slurm, str(cfg), "--out", str(a))
    wait_until(lambda: (a / "metrics.jsonl").exists() and len(read_metrics(a)) >= 1, 600,
               "job a's first record", interval=0.05)
    server_a = _server_of(a)
    server_a.send_signal(signal.SIGSTOP)
    try:
        job_b = submit(slurm, str(cfg), "--out", str(b))
        assert slurm.wait_job(job_b) == "COMPLETED", job_output(b, job_b)
        assert slurm.job_state(job_a) == "RUNNING"
    finally:
        server_a.send_signal(signal.SIGCONT)
    assert slurm.wait_job(job_a) == "COMPLETED", job_output(a, job_a)
    ports = []
    for job, run_dir in ((job_a, a), (job_b, b)):
        assert json.loads((run_dir / "summary.json").read_text())["rounds_completed"] == 2
        ports.append(re.search(r"broker tcp://\S+:(\d+)", job_output(run_dir, job))[1])
    assert ports[0] != ports[1]
    assert (a / "keys" / "server.key").read_bytes() != (b / "keys" / "server.key").read_bytes()


@needs_slurm
def test_the_relay_site_example_runs_as_a_real_job_below_a_server_site(tmp_path, slurm):
    """examples/slurm-relays.sbatch submitted with sbatch as its header says (one node here,
    its two granted GPUs, CPU devices), a server site outside the job: every round gets the
    site's one merged update, and each node process sits on its own granted GPU."""
    fed = [sys.executable, "-m", "fedbus.launch"]
    site_s, relay_keys = tmp_path / "S", tmp_path / "relay-a"
    for name in ("broker", "server"):
        subprocess.run([*fed, "keygen", name, "--dir", str(site_s / "keys")], check=True,
                       capture_output=True)
    subprocess.run([*fed, "keygen", "relay-a", "--clients", "0-5", "--dir", str(relay_keys)],
                   check=True, capture_output=True)
    (site_s / "keys" / "relay-a.key").write_bytes((relay_keys / "relay-a.key").read_bytes())
    (relay_keys / "broker.key").write_bytes((site_s / "keys" / "broker.key").read_bytes())
    upstream = f"tcp://127.0.0.1:{free_port()}"
    env = {**slurm.env, "DEVICE": "cpu", "SITE_PORT": str(free_port()),
           "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{slurm.env['PATH']}"}
    procs = []
    try:
        for name, args in (("broker", ["broker", "--bind", upstream, "--curve"]),
                           ("server", ["server", "--broker", upstream,
                                       str(REPO / "examples" / "two-sites" / "server.toml"),
                                       "--out", "runs/exp1"])):
            with open(tmp_path / f"{name}.log", "wb") as out:
                procs.append(subprocess.Popen([*fed, *args, "--keys-dir", "keys"], cwd=site_s,
                                              stdout=out, stderr=subprocess.STDOUT))
        done = subprocess.run(
            ["sbatch", "--parsable", "--nodes=1", f"--gres=gpu:{GPUS}", "--cpus-per-task=1",
             f"--chdir={tmp_path}", f"--output={tmp_path}/job.out",
             str(REPO / "examples" / "slurm-relays.sbatch"), upstream, str(relay_keys), "0-5"],
            env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr
        job = done.stdout.strip().split(";")[0]
        assert slurm.wait_job(job) == "COMPLETED", (tmp_path / "job.out").read_text()
        assert procs[1].wait(timeout=120) == 0, (tmp_path / "server.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    records = metrics(site_s / "runs" / "exp1")
    assert len(records) == 3
    for r in records:
        assert r["merged"] == 1 and r["participants"] == list(range(6)), r
    pinned = re.findall(r"gpu(\d) on \S+: clients (\S+), CUDA_VISIBLE_DEVICES=(\d*)",
                        (tmp_path / "job.out").read_text())
    assert sorted(pinned) == [("0", "0-2", "0"), ("1", "3-5", "1")], pinned
    relay_log = [json.loads(line) for line in
                 (tmp_path / "runs" / f"slurm-site-{job}" / "relay.log").read_text()
                 .splitlines() if line.startswith("{")]
    assert len({e.get("node") for e in relay_log if e.get("event") == "node joined"}) == 2
