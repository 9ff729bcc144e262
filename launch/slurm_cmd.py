"""`fedbus slurm CONFIG`: a whole federation as one Slurm job, submitted and followed.

What it writes (all in the run directory, which must be on a filesystem every allocated
node sees, as the keys and the client states are):

    RUN/config.json             the validated config (as `fedbus run` writes it)
    RUN/keys/                   CurveZMQ keys: broker, server, node-K (allowed its clients)
    RUN/slurm/job.sbatch        the job: broker and server on the first allocated node,
                                then one step over every node running node-step.sh
    RUN/slurm/node-step.sh      one allocated node's client-node processes: one per
                                granted GPU (pinned to it) or --tasks-per-node on CPUs
    RUN/slurm/job-ID.out        what the job printed (Slurm writes it)

Stopping and coming back (the interrupted-run rules of `fedbus run`): every process runs
as a job step, so `scancel --signal=TERM JOB`, preemption and the time-limit warning reach
the server, which leaves the run interrupted at its checkpoint (never complete). The job
asks Slurm for a warning signal `--signal-s` seconds before its time limit; with
`--requeue` the job then requeues itself, and the requeued job resumes the run.
`fedbus slurm --resume RUN` submits the run's job again, which resumes it too. A port is
picked free on the first node when the job starts, and keys and files live in the run
directory, so concurrent jobs do not meet.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from fedbus.launch import streams
from fedbus.launch.common import add_config_arguments, config_from_args

EXAMPLES = """\
examples:
  fedbus slurm examples/fedproto-mnist-offline.toml --nodes 2 --gpus-per-node 4 --time 04:00:00
  fedbus slurm --dry-run --tasks-per-node 2   # print the job script, submit nothing
  fedbus slurm --resume runs/RUN              # submit the run's job again: it resumes
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = EXAMPLES
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    add_config_arguments(p)
    p.add_argument("--out", default=None, help="run directory, on a filesystem every node "
                   "sees (default runs/DATE-ALGORITHM)")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="submit RUN's job again: it continues the run from its checkpoint")
    p.add_argument("--force", action="store_true", help="replace a run already in --out")
    p.add_argument("--nodes", type=int, default=1, help="allocated nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=0,
                   help="GPUs per node (--gres=gpu:N): one client-node process per GPU "
                   "(default 0: CPUs, see --tasks-per-node)")
    p.add_argument("--tasks-per-node", type=int, default=1,
                   help="without GPUs: client-node processes per allocated node (default 1)")
    p.add_argument("--cpus-per-node", type=int, default=0,
                   help="CPUs to ask for on each node (--cpus-per-task; default: Slurm's)")
    p.add_argument("--device", default=None,
                   help="the client nodes' device (default: cuda:0 in each process pinned "
                   "to its GPU, cpu without GPUs)")
    p.add_argument("--time", default="02:00:00", help="the job's time limit (default 02:00:00)")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--job-name", default=None, help="default fedbus-ALGORITHM")
    p.add_argument("--signal-s", type=int, default=120,
                   help="seconds before the time limit at which the run is stopped at its "
                   "checkpoint (default 120)")
    p.add_argument("--requeue", action="store_true",
                   help="when the time limit comes first, requeue the job: it resumes the run")
    p.add_argument("--sbatch", dest="sbatch_args", action="append", default=[],
                   metavar="ARG", help="one more sbatch option, e.g. --sbatch=--qos=long")
    p.add_argument("--relays", action="store_true",
                   help="a relay on every allocated node: its client nodes connect to the "
                   "relay's site broker there, and the relay sends the server one merged "
                   "update a round for them (docs/RELAYS.md)")
    p.add_argument("--no-curve", action="store_true",
                   help="no CurveZMQ (only inside a network you trust)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the job script and the node step, write and submit nothing")
    p.add_argument("--no-follow", action="store_true",
                   help="submit and return (default: follow the job until it ends)")
    p.add_argument("--job-state", default=None, metavar="RUN", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    if args.job_state:  # the job script asks what to do with its run: fresh, resume, done
        print(job_state(Path(args.job_state)))
        return 0
    problem = check_args(args)
    if problem:
        print(f"fedbus slurm: {problem}", file=sys.stderr)
        return 2
    if args.resume:
        return resubmit(Path(args.resume), args)
    cfg = config_from_args(args)
    if cfg is None:
        return 2
    run_dir = Path(args.out) if args.out else _default_run_dir(cfg.algorithm.name)
    run_dir = run_dir.absolute()
    groups = client_groups(cfg, processes(args))
    job, step = scripts(cfg, run_dir, groups, args)
    if args.dry_run:
        print(f"# {run_dir}/slurm/job.sbatch\n{job}\n# {run_dir}/slurm/node-step.sh\n{step}",
              end="")
        return 0
    if shutil.which("sbatch") is None:
        print("fedbus slurm: sbatch is not on PATH: run this on a Slurm login node "
              "(--dry-run prints the job script anywhere)", file=sys.stderr)
        return 2
    from fedbus.launch.preflight import PreflightError, check_inputs
    from fedbus.launch.run_cmd import clear_out

    try:
        check_inputs(cfg)
        if cfg.privacy.secure_aggregation and not args.no_curve:
            from fedbus.node.privacy.identity import signed_dropout_refusal

            refusal = signed_dropout_refusal(cfg)
            if refusal:
                raise ValueError(refusal)
        clear_out(run_dir, force=args.force)
    except (PreflightError, ValueError) as err:
        print(f"fedbus slurm: {err}", file=sys.stderr)
        return 2
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "slurm").mkdir(exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    if not args.no_curve:
        write_keys(run_dir, groups, (args.gpus_per_node or args.tasks_per_node)
                   if args.relays else 0, signing=bool(cfg.privacy.secure_aggregation))
    (run_dir / "slurm" / "job.sbatch").write_text(job)
    (run_dir / "slurm" / "node-step.sh").write_text(step)
    (run_dir / "slurm" / "node-step.sh").chmod(0o755)
    return submit(run_dir, cfg.federation.rounds, args)


def check_args(args: argparse.Namespace) -> str:
    if args.nodes < 1:
        return "--nodes must be at least 1"
    if args.gpus_per_node < 0 or args.tasks_per_node < 1 or args.cpus_per_node < 0:
        return "--gpus-per-node and --cpus-per-node must be >= 0, --tasks-per-node >= 1"
    if args.signal_s < 0:
        return "--signal-s must be >= 0"
    if args.resume and (args.config or args.overrides or args.out or args.force):
        return "--resume submits the run's own job again; drop CONFIG, --set, --out, --force"
    return ""


def _default_run_dir(algorithm: str) -> Path:
    from fedbus.launch.server_cmd import default_run_dir

    return default_run_dir(algorithm)


def processes(args: argparse.Namespace) -> int:
    """Client-node processes in the job: one per GPU, or --tasks-per-node per node."""
    return args.nodes * (args.gpus_per_node or args.tasks_per_node)


def client_groups(cfg, count: int) -> list[list[int]]:
    """Client ids per node process, balanced by training samples as `fedbus run` does."""
    from fedbus.launch.devices import split_clients
    from fedbus.node.setup import federated_data

    sizes = [len(p.train) for p in federated_data(cfg).parts]
    return split_clients(cfg.federation.clients, count, sizes)


def write_keys(run_dir: Path, groups: list[list[int]], per_node: int = 0, *,
               signing: bool = False) -> None:
    """RUN/keys: broker, server and node-K (allowed its clients); with relays (per_node:
    node processes per allocated node), relay-I upstream instead (allowed node I's
    clients), and RUN/site-keys/relay-I for its site: broker, server (the relay, downstream)
    and its node-K. With signing (secure aggregation), node-K's Ed25519 identity beside its
    certificate and every node's public NAME.sign in every folder a node reads, so each
    client checks every other client's signed keys (SECURITY.md 3a): the files reach the
    nodes through the job's shared run folder, never through the server."""
    from fedbus.broker.auth import format_addresses, write_keypair
    from fedbus.node.engine import client_address

    def allowed(ids: list[int]) -> str:
        return format_addresses([client_address(c) for c in sorted(ids)])

    keys = run_dir / "keys"
    write_keypair(keys, "broker", "broker", force=True)
    write_keypair(keys, "server", "server", force=True)
    folder_of = {k: keys for k in range(len(groups))}  # where node-K's keys live
    for i in range(0, len(groups), per_node) if per_node else ():
        site, members = run_dir / "site-keys" / f"relay-{i // per_node}", groups[i:i + per_node]
        write_keypair(keys, f"relay-{i // per_node}", "client", force=True,
                      clients=allowed([c for g in members for c in g]))
        write_keypair(site, "broker", "broker", force=True)
        write_keypair(site, "server", "server", force=True)
        folder_of.update((k, site) for k in range(i, i + len(members)))
    for k, ids in enumerate(groups):
        write_keypair(folder_of[k], f"node-{k}", "client", force=True, clients=allowed(ids))
    if signing:
        from fedbus.node.privacy.identity import write_signing_key

        public = [write_signing_key(folder_of[k], f"node-{k}", allowed(ids), force=True)[0]
                  for k, ids in enumerate(groups)]
        for folder in set(folder_of.values()):
            for pub in public:
                if pub.parent != folder:
                    shutil.copyfile(pub, folder / pub.name)


def job_state(run_dir: Path) -> str:
    """What a (re)started job does with its run: "done" (complete), "resume" (a
    checkpoint), or "fresh" (nothing a resume could use)."""
    from fedbus.analysis.table import load_run

    if load_run(run_dir).complete:
        return "done"
    return "resume" if (run_dir / "checkpoint.fbk").is_file() else "fresh"


def scripts(cfg, run_dir: Path, groups: list[list[int]], args: argparse.Namespace
            ) -> tuple[str, str]:
    from fedbus.launch.devices import format_ids

    q = shlex.quote
    py = q(sys.executable)
    run = q(str(run_dir))
    per_node = args.gpus_per_node or args.tasks_per_node
    device = args.device or ("cuda:0" if args.gpus_per_node else "cpu")
    name = args.job_name or f"fedbus-{cfg.algorithm.name}"
    sb = [f"--job-name={name}", f"--nodes={args.nodes}", "--ntasks-per-node=1",
          f"--time={args.time}", f"--output={run_dir}/slurm/job-%j.out",
          "--open-mode=append", f"--signal=B:USR1@{args.signal_s}",
          "--requeue" if args.requeue else "--no-requeue"]
    if args.gpus_per_node:
        sb.append(f"--gres=gpu:{args.gpus_per_node}")
    if args.cpus_per_node:
        sb.append(f"--cpus-per-task={args.cpus_per_node}")
    sb += [f"--partition={args.partition}"] * bool(args.partition)
    sb += [f"--account={args.account}"] * bool(args.account)
    sb += list(args.sbatch_args)
    keys = "" if args.no_curve else '--keys-dir "$RUN/keys"'
    curve = "" if args.no_curve else "--curve "
    hb = f"--heartbeat-s {cfg.bus.heartbeat_s:g} --liveness {cfg.bus.liveness}"
    command = " ".join(q(a) for a in ["fedbus", "slurm", *sys.argv[2:]] if a != "--dry-run") \
        if sys.argv[1:2] == ["slurm"] else "fedbus slurm"
    job = f"""#!/bin/bash
# A fedbus federation as one Slurm job, written by `{command}`.
# Broker and server on the first allocated node, {per_node} client-node process(es) per node
# (node-step.sh); {len(groups)} in all, client ids split by training samples. Submitting
# this file again continues the run from its checkpoint (fedbus slurm --resume RUN).
{chr(10).join('#SBATCH ' + s for s in sb)}
set -uo pipefail
PY={py}
RUN={run}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
export FEDBUS_BROKER="tcp://$HEAD:$PORT"
STATE=$("$PY" -m fedbus.launch slurm --job-state "$RUN")
echo "fedbus slurm: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST: broker $FEDBUS_BROKER, run $RUN ($STATE)"
case "$STATE" in
  done) echo "fedbus slurm: $RUN is complete: nothing to do"; exit 0 ;;
  resume) WHERE=(--resume "$RUN") ;;
  *) WHERE=("$RUN/config.json" --out "$RUN") ;;
esac
# The time-limit warning (--signal=B:USR1) reaches this shell only: it stops every step,
# which leaves the run interrupted at its checkpoint, and (--requeue) requeues the job.
LIMIT=0
trap 'LIMIT=1; echo "fedbus slurm: time limit near: stopping the run at its checkpoint"; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" "$PY" -m fedbus.launch broker \\
    --bind "tcp://0.0.0.0:$PORT" {hb} {curve}{keys} --log-file "$RUN/logs/broker.jsonl" &
BROKER=$!
srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" "$PY" -m fedbus.launch server \\
    --broker "$FEDBUS_BROKER" "${{WHERE[@]}}" {keys} &
SERVER=$!
srun --overlap --nodes={args.nodes} --ntasks-per-node=1 bash "$RUN/slurm/node-step.sh" &
NODES=$!
CODE=
while [ -z "$CODE" ]; do  # a trapped signal interrupts wait: wait again
  wait "$SERVER"; CODE=$?
  if [ "$CODE" -gt 128 ] && kill -0 "$SERVER" 2>/dev/null; then CODE=; fi
done
kill -TERM "$NODES" "$BROKER" 2>/dev/null
wait
STATE=$("$PY" -m fedbus.launch slurm --job-state "$RUN")
echo "fedbus slurm: server exited $CODE; run $RUN: $STATE"
if [ "$STATE" != done ] && [ "$LIMIT" = 1 ] && {'true' if args.requeue else 'false'}; then
  echo "fedbus slurm: requeueing job $SLURM_JOB_ID: it resumes the run"
  scontrol requeue "$SLURM_JOB_ID"
fi
exit "$CODE"
"""
    ids = " ".join(format_ids(g) for g in groups)
    pin = (f'  GPU=${{GRANTED[$g]:?"node-step.sh: Slurm granted fewer GPUs than '
           f'{per_node} (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)"}}\n'
           if args.gpus_per_node else '  GPU=\n')
    if args.relays:
        site_keys = '--keys-dir "$RUN/site-keys/relay-$SLURM_NODEID"'
        relay = (
            '# This node\'s relay: upstream one participant for its clients, downstream the\n'
            '# server of its site broker (started by the relay), which its node processes join.\n'
            'SITE_PORT=$("$PY" -c \'import socket; s = socket.socket(); s.bind(("", 0)); '
            'print(s.getsockname()[1])\')\n'
            '"$PY" -m fedbus.launch relay --upstream "$FEDBUS_BROKER" '
            '--bind "tcp://127.0.0.1:$SITE_PORT" \\\n'
            f'    --name "relay-$SLURM_NODEID" {hb} '
            + ('' if args.no_curve else '--keys-dir "$RUN/keys" --key "relay-$SLURM_NODEID" '
               '\\\n    --site-keys-dir "$RUN/site-keys/relay-$SLURM_NODEID" ')
            + '--log-file "$RUN/logs/relay-$SLURM_NODEID.jsonl" &\n'
            'PIDS=($!)\n'
            'BROKER="tcp://127.0.0.1:$SITE_PORT"\n')
    else:
        site_keys, relay = keys, 'PIDS=()\nBROKER=$FEDBUS_BROKER\n'
    step = f"""#!/bin/bash
# One allocated node's client-node processes, started once per node by job.sbatch's srun.
set -uo pipefail
PY={py}
RUN={run}
{relay}CLIENTS=({ids})  # node-K hosts the clients CLIENTS[K]
PER_NODE={per_node}
IFS=, read -r -a GRANTED <<< "${{CUDA_VISIBLE_DEVICES:-}}"  # the GPUs Slurm granted here
trap 'kill -TERM "${{PIDS[@]}}" 2>/dev/null' TERM INT
for ((g = 0; g < PER_NODE; g++)); do
  K=$((SLURM_NODEID * PER_NODE + g))
  [ "$K" -lt "${{#CLIENTS[@]}}" ] || continue
{pin}  echo "fedbus slurm: node-$K on $(hostname -s): clients ${{CLIENTS[$K]}}, device {device}, CUDA_VISIBLE_DEVICES=$GPU"
  CUDA_VISIBLE_DEVICES=$GPU "$PY" -m fedbus.launch node --broker "$BROKER" \\
      --clients "${{CLIENTS[$K]}}" --device {q(device)} --name "node-$K" {hb} \\
      --state-dir "$RUN/clients" {site_keys if keys else ''} {'--key "node-$K"' if keys else ''} \\
      --log-file "$RUN/logs/node-$K.jsonl" &
  PIDS+=($!)
done
wait
"""
    return job, step


def submit(run_dir: Path, rounds: int, args: argparse.Namespace) -> int:
    script = run_dir / "slurm" / "job.sbatch"
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        print(f"fedbus slurm: sbatch refused the job: {done.stderr.strip()}", file=sys.stderr)
        return 2
    job = done.stdout.strip().split(";")[0]
    with open(run_dir / "slurm" / "jobs.txt", "a") as f:
        f.write(job + "\n")
    streams.err(f"fedbus slurm: submitted job {job}; run directory {run_dir}\n"
                f"fedbus slurm: its output: {run_dir}/slurm/job-{job}.out")
    if args.no_follow:
        print(job)
        return 0
    return follow(job, run_dir, rounds)


def resubmit(run_dir: Path, args: argparse.Namespace) -> int:
    from fedbus.launch.run_cmd import resume_refusal

    if not (run_dir / "slurm" / "job.sbatch").is_file():
        print(f"fedbus slurm: {run_dir} was not started by `fedbus slurm` (no "
              "slurm/job.sbatch): continue it with `fedbus run --resume`", file=sys.stderr)
        return 2
    refusal = resume_refusal(run_dir)
    if refusal:
        print(f"fedbus slurm: {refusal}", file=sys.stderr)
        return 2
    cfg = json.loads((run_dir / "config.json").read_text())
    return submit(run_dir.absolute(), int(cfg["federation"]["rounds"]), args)


def slurm_state(job: str) -> str:
    """The job's state as the controller has it (PENDING, RUNNING, COMPLETED, ...);
    "" once the controller no longer knows it."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True,
                         text=True, check=False).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return ""


ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING",
          "SUSPENDED", "REQUEUE_HOLD", "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}


def follow(job: str, run_dir: Path, rounds: int, poll_s: float = 2.0) -> int:
    """The job's state and the run's progress line until the job ends; 0 when the run is
    complete, 1 when it ended otherwise (with how to go on)."""
    from fedbus.launch.progress import status_line
    from fedbus.launch.run_cmd import read_status

    last = ""
    try:
        while True:
            state = slurm_state(job)
            status = read_status(run_dir)
            line = f"job {job} {state.lower() or 'gone'}" + (
                f"  {status_line(status)}" if status else "")
            if line != last:
                streams.err(f"fedbus slurm: {line}")
                last = line
            if state not in ACTIVE:
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        streams.tell(f"fedbus slurm: stopped following; job {job} goes on (scancel "
                     f"--signal=TERM {job} stops it at its checkpoint)")
        return 130
    final = job_state(run_dir)
    if final == "done":
        streams.err(f"fedbus slurm: job {job} {state.lower()}; run complete: {run_dir}\n"
                    f"next: fedbus plot {run_dir}   fedbus log {run_dir}")
        return 0
    done = read_status(run_dir).get("version", 0)
    how = f"fedbus slurm --resume {run_dir}" if final == "resume" else \
        f"fedbus slurm ... --out {run_dir} --force (no checkpoint yet)"
    streams.tell(f"fedbus slurm: job {job} ended {state.lower() or '(unknown)'} after {done} "
                 f"of {rounds} rounds; continue with `{how}`; its output: "
                 f"{run_dir}/slurm/job-{job}.out")
    return 1
