"""`fedbus run`: a whole federation on this machine.

Starts a broker on loopback, the server and `launch.nodes` client-node
processes (spread over the visible GPUs, else the CPU), shows progress, and
writes the run directory. Ctrl-C, or the death of any process, stops all of
them: children also die with the launcher (PR_SET_PDEATHSIG), so nothing is
left behind.
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import sys
import time
import warnings
from pathlib import Path

from fedbus.launch import streams
from fedbus.launch.common import add_config_arguments, config_from_args
from fedbus.launch.devices import assign, format_ids, split_clients, visible_gpus
from fedbus.launch.preflight import PreflightError, check_inputs
from fedbus.launch.processes import Federation, preload, start_method
from fedbus.launch.progress import Progress, print_summary
from fedbus.launch.server_cmd import default_run_dir
from fedbus.record.rundir import read_metrics


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--out", default=None, help="run directory (default runs/DATE-ALGORITHM); "
                   "one that already holds a run is refused unless --resume or --force")
    p.add_argument("--resume", default=None, metavar="RUN",
                   help="continue the stopped run in RUN from its last checkpoint: broker, "
                   "server and nodes start again and every client continues from the state "
                   "it saved (no CONFIG or --set: the run keeps its own config)")
    p.add_argument("--no-client-state", action="store_true",
                   help="nodes save no client state (by default each client's state after "
                   "each task, two per client, in RUN/clients/: mind the disk for large "
                   "models and many clients); a --resume then restarts every client from "
                   "its initial state")
    p.add_argument("--force", action="store_true",
                   help="start the run in --out again from scratch, deleting the run there")
    p.add_argument("--quiet", action="store_true", help="print nothing but errors")
    p.add_argument("--keep-going", action="store_true",
                   help="a client node's death is tolerated (the federation copes) "
                   "instead of stopping the run")
    p.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                   help="level of the processes' logs in RUN/logs (default: log.level)")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (CONFIG or the embedded default, with "
                   "--set applied) as TOML, then exit: what the run would use")
    p.add_argument("--help-config", action="store_true",
                   help="list every config key with its default, and under [algorithm] the "
                   "parameters of the algorithm CONFIG or --set algorithm.name chooses "
                   "(else the default's), then exit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cause(log: Path) -> str:
    """The one line of a dead process's log that says why: the exception line
    closing its last traceback, else its last error event, else its last line."""
    try:
        lines = [x.rstrip() for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return "(no log)"
    last_tb = max((i for i, x in enumerate(lines) if x.startswith("Traceback")), default=None)
    if last_tb is not None:
        after = [x for x in lines[last_tb + 1:] if not x.startswith((" ", "\t"))]
        if after:
            return after[-1][:300]
    errors = [x for x in lines if "level='error'" in x or '"level": "error"' in x]
    return (errors or lines or ["(empty log)"])[-1][:300]


def main(args: argparse.Namespace) -> int:
    if args.help_config:
        from fedbus.launch.algorithms_cmd import help_config

        return help_config(args)
    if args.resume:
        try:
            run_dir, cfg = resumable(args)
        except ValueError as err:
            print(f"fedbus run: {err}", file=sys.stderr)
            return 2
    else:
        cfg = config_from_args(args)
        if cfg is None:
            return 2
    if args.print_config:
        from fedbus.node.config import to_toml

        print(to_toml(cfg.to_dict()), end="")
        return 0
    say = (lambda *a: None) if args.quiet else (lambda *a: streams.err(" ".join(map(str, a))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            check_inputs(cfg)
        except PreflightError as err:
            print(f"fedbus run: {err}", file=sys.stderr)
            return 2
    for w in caught:  # e.g. a partition that ran short of samples: one line each
        say(f"fedbus run: warning: {' '.join(str(w.message).split())}")
    if not args.resume:
        run_dir = Path(args.out) if args.out else default_run_dir(cfg.algorithm.name)
        try:
            clear_out(run_dir, force=args.force)
        except ValueError as err:
            print(f"fedbus run: {err}", file=sys.stderr)
            return 2
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    level = args.log_level or cfg.log.level

    if cfg.bus.broker:
        address = cfg.bus.broker
    elif cfg.bus.transport == "ipc":
        address = f"ipc://{run_dir.resolve() / 'broker.sock'}"
    else:
        address = f"tcp://127.0.0.1:{free_port()}"
    from fedbus.node.setup import federated_data  # loaded by the preflight already

    groups = split_clients(cfg.federation.clients, cfg.launch.nodes,
                           [len(p.train) for p in federated_data(cfg).parts])
    try:
        placements, warning = assign(len(groups), cfg.launch.devices, visible_gpus())
    except ValueError as err:
        print(f"fedbus run: config error: {err}", file=sys.stderr)
        return 2
    if warning:
        say(f"warning: {warning}")

    fed = Federation(run_dir, level, start_method(cfg.launch.start,
                                                  [p.device for p in placements]))
    interrupted, restore = catch_interrupt()
    hb = ["--heartbeat-s", str(cfg.bus.heartbeat_s), "--liveness", str(cfg.bus.liveness)]
    keys: list[str] = []
    if cfg.bus.curve:
        try:
            keys = ["--keys-dir", str(run_keys(cfg, run_dir, groups))]
        except (ValueError, OSError) as err:
            print(f"fedbus run: CurveZMQ keys: {err}", file=sys.stderr)
            return 2
    say(f"fedbus run: {cfg.algorithm.name} on {cfg.data.dataset}, "
        f"{cfg.federation.clients} clients in {len(groups)} node(s) "
        f"[{', '.join(sorted({p.label for p in placements}))}], broker {address}\n"
        f"fedbus run: run directory {run_dir}")
    try:
        if not cfg.bus.broker:
            # First, as the others connect to it; always a fresh interpreter: it needs no
            # torch, and forked from this launcher (which imported torch for the preflight)
            # it would map ~250 MB of torch's pages it never uses.
            fed.spawn("broker", ["broker", "--bind", address, *hb,
                                 "--max-frame-mb", str(cfg.bus.max_frame_mb),
                                 *(["--curve", *keys] if keys else [])], method="exec")
        if fed.method == "fork":
            preload(cfg)
        state_dir = "none" if args.no_client_state else str(run_dir / "clients")
        where = ["--resume", str(run_dir)] if args.resume else \
            [str(run_dir / "config.json"), "--out", str(run_dir)]
        fed.spawn("server", ["server", "--broker", address, *where, *keys])
        for i, (ids, place) in enumerate(zip(groups, placements)):
            fed.spawn(f"node-{i}", ["node", "--broker", address, "--clients", format_ids(ids),
                                    "--device", place.device, "--name", f"node-{i}", *hb,
                                    "--state-dir", state_dir, *keys],
                      env=place.env, essential=not args.keep_going)
        code = supervise(fed, run_dir, cfg, quiet=args.quiet, say=say, interrupted=interrupted)
    except KeyboardInterrupt:
        code = 128 + (interrupted() or signal.SIGINT)
    finally:
        # the server takes SIGTERM as a stop: it leaves the run interrupted, not complete
        fed.stop()
        restore()
    if code == 0:
        say(f"next: fedbus plot {run_dir}   fedbus replay {run_dir}   fedbus log {run_dir}")
    elif code != 2:
        code = stopped(run_dir, cfg, code)
    return code


def stopped(run_dir: Path, cfg, code: int) -> int:
    """After a stop (a signal, a process that died): the line saying how to go on, even
    under --quiet and with stdout or stderr a pipe whose reader died first. A run that
    completed as it was stopped is complete (0); a signal's stop is 130 (SIGINT) or 143."""
    from fedbus.analysis.table import load_run

    streams.mute_if_broken(sys.stdout)
    if load_run(run_dir).complete:
        streams.tell(f"fedbus run: {run_dir} completed as it was stopped")
        return 0
    status = read_status(run_dir)
    done = status.get("version", 0)
    if (run_dir / "checkpoint.fbk").is_file():
        how = f"continue with `fedbus run --resume {run_dir}`"
    else:
        how = (f"it stopped before its first round closed: start it again with "
               f"`fedbus run ... --out {run_dir} --force`")
    what = "interrupted" if code >= 128 else "stopped"
    streams.tell(f"fedbus run: {what} after {done} of {cfg.federation.rounds} rounds; {how}")
    return code


def read_status(run_dir: Path) -> dict:
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def resumable(args: argparse.Namespace):
    """(run directory, its config) for --resume; ValueError says why it cannot resume."""
    from fedbus.launch.server_cmd import load_run_config
    from fedbus.node.config import ConfigError

    run_dir = Path(args.resume)
    if args.config or args.overrides or args.out or args.force:
        raise ValueError("--resume continues a run with its own config and directory; "
                         "drop CONFIG, --set, --out and --force")
    refusal = resume_refusal(run_dir)
    if refusal:
        raise ValueError(refusal)
    try:
        cfg = load_run_config(run_dir / "config.json", [])
    except (ConfigError, ValueError) as error:
        raise ValueError(f"{run_dir / 'config.json'}: {error}") from None
    if not args.no_client_state and not any((run_dir / "clients").glob("*/client-*.pt")):
        print(f"fedbus run: warning: {run_dir} holds no client states (started with "
              f"--no-client-state, or stopped before any task): every client starts again "
              f"from its initial state", file=sys.stderr)
    return run_dir, cfg


def resume_refusal(run_dir: Path) -> str:
    """Why the run in `run_dir` cannot be resumed, one line; "" when it can. A run is
    complete when its summary.json holds every round (a stopped server writes none; one
    short of rounds is an older fedbus's summary of a stopped run, resumed all the same)."""
    from fedbus.analysis.table import load_run
    from fedbus.node.server import read_checkpoint

    if not (run_dir / "config.json").is_file():
        return f"{run_dir} holds no run (no config.json)"
    found = load_run(run_dir)
    if found.complete:
        return f"{run_dir} is complete (summary.json): nothing to resume"
    if found.summary is not None and found.problem.startswith("summary.json or config"):
        return f"{run_dir}: {found.problem}: cannot tell whether it is complete"
    if not (run_dir / "checkpoint.fbk").is_file():
        return (f"{run_dir} has no checkpoint: it stopped before its first round closed; "
                f"start it again with --out {run_dir} --force")
    try:
        read_checkpoint(run_dir / "checkpoint.fbk")  # one line, before anything starts
        read_metrics(run_dir)
    except ValueError as error:  # CheckpointError, DamagedFile
        return str(error)
    return ""


def clear_out(run_dir: Path, *, force: bool) -> None:
    """Refuse an --out that already holds something (a run's files would be overwritten
    and its metrics mixed with the new ones), unless --force and it holds a run: then it
    is deleted. A folder that holds no run is never deleted."""
    if not run_dir.exists() or not any(run_dir.iterdir()):
        return
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"--out {run_dir} is not empty and holds no run: choose another "
                         f"--out")
    if not force:
        raise ValueError(f"--out {run_dir} already holds a run: continue it with "
                         f"`fedbus run --resume {run_dir}`, or add --force to start it again "
                         f"from scratch")
    shutil.rmtree(run_dir)


def catch_interrupt():
    """Ctrl-C (SIGINT) and SIGTERM set a flag that the supervisor loop turns into
    KeyboardInterrupt at a point of its choosing. Raised anywhere, it can land inside
    Popen.poll() between taking and guarding the Popen's wait lock, and the stop that
    follows then blocks on that lock forever. Returns (interrupted() -> the first signal's
    number, 0 while none came; restore())."""
    hits: list[int] = []
    old: dict[int, object] = {}

    def restore() -> None:
        for sig, handler in old.items():
            signal.signal(sig, handler)

    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, lambda signum, _frame: hits.append(signum))
    except ValueError:  # not the main thread: keep Python's defaults
        restore()
        return (lambda: 0), (lambda: None)
    return (lambda: hits[0] if hits else 0), restore


def run_keys(cfg, run_dir: Path, groups: list[list[int]]) -> Path:
    """[bus] curve: the keys folder of a local run. bus.keys_dir when set (it must hold
    broker, server and node-I keys); else fresh keys in RUN/keys, node-I allowed its group."""
    if cfg.bus.keys_dir:
        return Path(cfg.bus.keys_dir)
    if cfg.bus.broker:
        raise ValueError("bus.curve with an external bus.broker needs bus.keys_dir (the keys "
                         "that broker allow-lists)")
    from fedbus.broker.auth import format_addresses, write_keypair
    from fedbus.node.engine import client_address

    keys = run_dir / "keys"
    write_keypair(keys, "broker", "broker", force=True)
    write_keypair(keys, "server", "server", force=True)
    signing = bool(cfg.privacy.secure_aggregation)
    if signing:  # each node signs its clients' secure-aggregation keys (SECURITY.md 3a)
        from fedbus.node.privacy.identity import signed_dropout_refusal, write_signing_key

        refusal = signed_dropout_refusal(cfg)
        if refusal:
            raise ValueError(refusal)
    for i, ids in enumerate(groups):
        clients = format_addresses([client_address(c) for c in ids])
        write_keypair(keys, f"node-{i}", "client", force=True, clients=clients)
        if signing:
            write_signing_key(keys, f"node-{i}", clients, force=True)
    return keys


# exit codes of a process a signal stopped: its own handling (130 SIGINT, 143 SIGTERM) or
# the signal's default action (Popen's -N)
SIGNALLED = (130, 143, -signal.SIGINT, -signal.SIGTERM)


def supervise(fed: Federation, run_dir: Path, cfg, *, quiet: bool, say,
              interrupted=lambda: False) -> int:
    progress = Progress(run_dir, cfg, enabled=not quiet)
    server = next(c for c in fed.children if c.name == "server")
    reported: set[str] = set()
    with progress:
        while True:
            if interrupted():
                raise KeyboardInterrupt
            try:
                progress.refresh()
            except OSError:  # stderr's reader left (`| tee` that died): the run goes on
                streams.mute(sys.stderr)
            if server.proc.poll() is not None:
                break
            for child in fed.dead():
                if child.name in reported:
                    continue
                reported.add(child.name)
                if child.proc.returncode == 0:
                    continue  # a node leaves cleanly on the server's shutdown message
                if child.essential:
                    progress.stop()
                    streams.err(f"fedbus run: {child.name} exited with code {child.proc.returncode}: "
                        f"{cause(child.log)} (log: {child.log}); stopping the run")
                    return 130 if child.proc.returncode in SIGNALLED else 1
                say(f"fedbus run: {child.name} died (code {child.proc.returncode}): "
                    f"{cause(child.log)}; going on")
            time.sleep(0.05)
    code = server.proc.returncode
    if code in SIGNALLED:
        streams.err(f"fedbus run: the server was stopped by a signal (exit {code})")
        return 130
    if code != 0:
        streams.err(f"fedbus run: the server exited with code {code}: {cause(server.log)} "
            f"(log: {server.log})")
        return 1
    # nodes leave on the server's shutdown message; give them a moment
    end = time.time() + 5
    while time.time() < end and not interrupted() and any(
            c.proc.poll() is None for c in fed.children if c.name.startswith("node")):
        time.sleep(0.02)
    summary_path = run_dir / "summary.json"
    if not quiet and summary_path.exists():
        try:
            print_summary(json.loads(summary_path.read_text()), run_dir)
        except OSError:  # stdout's reader left: the summary is in the run directory
            streams.mute(sys.stdout)
    return 0
