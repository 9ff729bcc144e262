"""Framework overhead per round: no-op training, real processes, real bus.

    fedbus bench rounds --quick          # CI's perf smoke: 100 clients, 1 node, 5 rounds
    fedbus bench rounds --clients 100 --payload prototypes
    fedbus bench rounds --clients 1000 --nodes 4 --rounds 10
    fedbus bench rounds --clients 10000 --nodes 4 --rounds 5 --fraction 0.1
    fedbus bench rounds --clients 1000 --nodes 4 --rounds 10 --relays 4

A round's time is measured by the server from sending its first task to closing it
(metrics.jsonl `round_s`); the first round, which also materialises every sampled
client, is reported apart. Memory: the peak of the RSS summed over every process of the
federation (pages that forked processes share are counted once per process), each
process's own peak, and the peak of the summed PSS (shared pages divided among their
sharers: what the federation really holds).

The floor: the same message pattern over raw zmq in the same run, with no broker, no
engine and pre-encoded bodies: a ROUTER "server" sends each round's tasks (bodies of the
run's mean task size) to --nodes DEALER processes, which answer each with a body of the
run's mean update size; a round is the first send to the last answer. fedbus's ratio
to it is what the framework costs on top of moving the bytes: every time is printed beside
the floor with its ratio (--json: `floor_ms`, `ratio` for the median round, `ratios` for
each time), and docs/PERFORMANCE.md keeps a history of those ratios by commit.

Relays (--relays N): the same federation (clients, nodes, rounds, payload, seed) run a
second time in the same invocation through N `fedbus relay` processes, each starting its
own site broker; the nodes are split among them in order (node i below relay
floor(i N / nodes)), so --nodes must be at least --relays. Each relay sends the server one
merged update a round (the no-op algorithm's ArraySums rule: the state summed in float64,
twice the float32 payload, plus one [address, task, samples, work] entry per client).
Printed beside the flat run: the time per round, the bytes and the messages into the
server a round (metrics.jsonl `bytes_up` and `messages_up`: the round's updates and
merged updates), memory and CPU by role, and the ratios relays / flat.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fedbus.bench.common import Finished, floor_table, run, run_floor, watch, write_toml
from fedbus.node.lifetime import python_module


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=None, help="default 100")
    p.add_argument("--payload", choices=["prototypes", "resnet18"], default="prototypes")
    p.add_argument("--rounds", type=int, default=None, help=f"default {FULL['rounds']} "
                   f"({QUICK['rounds']} with --quick)")
    p.add_argument("--nodes", type=int, default=None, help=f"default {FULL['nodes']} "
                   f"({QUICK['nodes']} with --quick)")
    p.add_argument("--quick", action="store_true",
                   help=f"CI's perf smoke: {QUICK['clients']} clients, {QUICK['nodes']} node, "
                   f"{QUICK['rounds']} rounds unless given; prints only the times, each "
                   "beside the same-run raw-zmq floor and its ratio to it")
    p.add_argument("--fraction", type=float, default=1.0,
                   help="clients sampled per round (federation.fraction, default 1)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="launch.node_memory_mb (default: the config default)")
    p.add_argument("--max-resident", type=int, default=None,
                   help="launch.max_resident (default: the config default, no cap)")
    p.add_argument("--evict-to", choices=["memory", "disk"], default=None)
    p.add_argument("--message-log", action="store_true",
                   help="keep the server's message log on (off: measure the bus alone)")
    p.add_argument("--eval-clients", type=int, default=0, metavar="N",
                   help="federation.eval_clients: the final evaluation asks N clients drawn "
                   "from the seed (default 0: every client)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="federation.eval_every: evaluate every N rounds (default: once, after "
                   "the last; a run's own default is 1, which puts an evaluation in every "
                   "round's time)")
    p.add_argument("--batch", choices=["off", "auto"], default="auto",
                   help="bus.batch: auto (the default, as a run's) sends a round's tasks to a "
                   "node as one message and takes its answers as one (PROTOCOL.md §4.3)")
    p.add_argument("--no-floor", action="store_true", help="skip the raw-zmq floor")
    p.add_argument("--relays", type=int, default=0,
                   help="also run the same federation through this many `fedbus relay` "
                   "processes (each with its own site broker, the nodes split among them; "
                   "at most --nodes) and compare it with the flat run (default 0: flat only)")
    p.add_argument("--out", default=None, help="keep the run directory here")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


# the defaults of --clients, --nodes and --rounds, and --quick's (under a minute on 2 cores)
FULL = {"clients": 100, "nodes": 4, "rounds": 10}
QUICK = {"clients": 100, "nodes": 1, "rounds": 10}

# the figures that are times (figures' keys), each printed beside the floor and its ratio
TIMES = {"first_round_ms": "first round (builds clients)",
         "round_ms_median": "per round, median of the rest",
         "round_ms_mean": "per round, mean of the rest",
         "round_ms_max": "per round, max of the rest"}

# digits (1,797 samples) gives every client of up to this many at least one sample
DIGITS_CLIENTS = 1000


def blobs(path: Path, clients: int) -> str:
    """A generated npz dataset of 4 samples per client (16 features, 10 labels) for
    federations beyond DIGITS_CLIENTS: no-op training needs a partition, not a task."""
    rng = np.random.default_rng(0)
    np.savez(path, x=rng.normal(size=(4 * clients, 16)).astype(np.float32),
             y=np.arange(4 * clients) % 10)
    return f"npz:{path}"


def config(args: argparse.Namespace, dataset: str = "digits") -> dict:
    launch: dict = {"nodes": args.nodes}
    for key, value in (("node_memory_mb", args.memory_mb), ("max_resident", args.max_resident),
                       ("evict_to", args.evict_to)):
        if value is not None:
            launch[key] = value
    return {
        "federation": {"clients": args.clients, "rounds": args.rounds,
                       "fraction": args.fraction, "seed": 0,
                       "eval_every": getattr(args, "eval_every", None) or args.rounds,
                       "eval_clients": getattr(args, "eval_clients", 0),
                       "start_timeout_s": 600.0},
        "data": {"dataset": dataset, "partition": "iid", "test_fraction": 0.25},
        "model": {"arch": "mlp"},
        "algorithm": {"name": "noop", "payload": args.payload},
        "launch": launch,
        "log": {"messages": bool(args.message_log), "level": "warning"},
        "bus": {"batch": getattr(args, "batch", "auto")},
    }


def main_args(args: argparse.Namespace) -> int:
    from fedbus.bench.common import out_dir

    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in FULL:
        if getattr(args, key) < 1:
            print(f"fedbus bench rounds: --{key} must be at least 1", file=sys.stderr)
            return 2
    if args.quick and args.relays:
        print("fedbus bench rounds: --quick measures the flat federation only (no --relays)",
              file=sys.stderr)
        return 2
    if args.relays < 0 or args.relays > min(args.nodes, args.clients):
        print(f"fedbus bench rounds: --relays must lie in 0..{min(args.nodes, args.clients)} "
              "(each relay serves at least one node of --nodes)", file=sys.stderr)
        return 2
    out = out_dir(args.out, "rounds")
    dataset = "digits" if args.clients <= DIGITS_CLIENTS else \
        blobs(out / f"blobs-{args.clients}.npz", args.clients)
    res = run(config(args, dataset), f"rounds-{args.clients}-{args.payload}", out=out,
              timeout=3600)
    # one metrics line per aggregation (eval results only on the last)
    records = sorted(res.records, key=lambda r: r["round"])
    per_round = [r["round_s"] for r in records]
    steady = per_round[1:] or per_round
    sampled = records[-1].get("sampled") or math.ceil(args.fraction * args.clients)
    figures = {"clients": args.clients, "nodes": args.nodes, "payload": args.payload,
               "rounds": args.rounds, "fraction": args.fraction, "sampled": sampled,
               "first_round_ms": per_round[0] * 1000,
               "round_ms_median": statistics.median(steady) * 1000,
               "round_ms_mean": statistics.mean(steady) * 1000,
               "round_ms_max": max(steady) * 1000,
               "rounds_completed": res.summary["rounds_completed"],
               "bytes_up": res.summary["bytes_up"], "bytes_down": res.summary["bytes_down"],
               "peak_rss_total": res.peak_rss, "peak_pss_total": res.peak_pss,
               "peak_rss_per_process": sorted(res.peak_rss_by_pid.values(), reverse=True),
               "wall_s": res.wall_s}
    floor = None
    if not args.no_floor:
        # batched tasks (--batch auto) have no size of their own a task: the floor stays
        # single messages each way, out as big as back (a task and an update carry the same
        # payload here), so batched and unbatched runs are held to the same pattern
        summary = res.summary if args.batch == "off" else \
            {**res.summary, "bytes_down": res.summary["bytes_up"]}
        floor = run_floor(summary, records, args.nodes, repeats=max(5, args.rounds))
        figures.update(floor.figures(figures["round_ms_median"]))
        figures["ratios"] = {k: floor.ratio(figures[k]) for k in TIMES}
    evals = f", an evaluation every {args.eval_every} round(s)" \
        if getattr(args, "eval_every", None) else ""
    if args.quick:
        print(f"fedbus bench rounds --quick: {args.clients} clients, {args.nodes} "
              f"node{'s' if args.nodes > 1 else ''}, {args.rounds} rounds, payload "
              f"{args.payload}, batch {args.batch}{evals}; the ratios are information, "
              "not a verdict")
    else:
        print(f"fedbus bench rounds: {args.clients} clients, {args.nodes} nodes, "
              f"{sampled} sampled a round, payload {args.payload}, {args.rounds} rounds, "
              f"message log {'on' if args.message_log else 'off'}, batch {args.batch}{evals}")
    rows = [(label, figures[key], floor.ms if floor else None) for key, label in TIMES.items()]
    print("\n".join(floor_table(rows, floor)))
    if args.quick:
        print(f"  ({figures['rounds_completed']} rounds completed; wall time incl. start-up "
              f"{res.wall_s:.1f} s)")
        if args.json:
            print(json.dumps(figures))
        if not args.out:  # CI's smoke leaves no run behind (a failed run's stays, for its logs)
            shutil.rmtree(out, ignore_errors=True)
        return 0
    print(f"  rounds completed             {figures['rounds_completed']:9d}")
    print(f"  bytes up / down              {figures['bytes_up']:,} / {figures['bytes_down']:,}")
    print(f"  peak RSS, all processes      {res.peak_rss / 2**30:9.2f} GiB"
          f"   (PSS {res.peak_pss / 2**30:.2f} GiB: shared pages counted once)")
    rss = figures["peak_rss_per_process"]
    if rss:
        print(f"  peak RSS per process         {', '.join(f'{r / 2**20:.0f}' for r in rss)} MiB")
    by_role = cpu_by_role(res)
    figures["cpu_s_by_role"] = by_role
    if by_role:
        print("  CPU seconds, whole run       " + ", ".join(
            f"{role} {sec:.1f}" for role, sec in sorted(by_role.items(), key=lambda x: -x[1]))
            + "  (nodes summed; start-up included)")
    print(f"  wall time incl. start-up     {res.wall_s:9.1f} s")
    if args.relays:
        name = f"rounds-{args.clients}-{args.payload}-relays{args.relays}"
        cfg = write_toml(out / f"{name}.toml", config(args, dataset))
        tree = watch(python_module("fedbus.bench.rounds", str(cfg), "--out",
                                   str(out / name), "--relays", str(args.relays)), name, out / name,
                     timeout=3600, what="the relays' launcher")
        figures["relays"] = compare_relays(res, tree, args.relays,
                                           min(args.nodes, args.clients))
        print_relays(figures["relays"])
    if args.json:
        print(json.dumps(figures))
    return 0


def cpu_by_role(res: Finished) -> dict[str, float]:
    by_role: dict[str, float] = {}
    for role, sec in res.cpu_by_pid.values():
        by_role[role] = by_role.get(role, 0.0) + sec
    return by_role


# --------------------------------------------------------------------------- relays
def relay_nodes(nodes: int, relays: int) -> list[int]:
    """The relay each node connects to: node i below relay floor(i * relays / nodes), so
    the nodes split in order and as evenly as they divide."""
    return [i * relays // nodes for i in range(nodes)]


def round_rows(res: Finished) -> list[dict[str, Any]]:
    """Per aggregation, from the server's metrics: its time, the bytes into the server
    (`bytes_up`) and the messages that carried them (`messages_up`: the round's on-time
    updates and relays' merged updates), the merged ones and the clients aggregated."""
    return [{"round": r["round"], "round_ms": r["round_s"] * 1000,
             "bytes_up": int(r["bytes_up"]), "messages_up": int(r["messages_up"]),
             "merged": int(r.get("merged", 0)), "updates": int(r["updates"])}
            for r in sorted(res.records, key=lambda r: r["round"])]


def _side(res: Finished, rows: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [x["round_ms"] for x in rows[1:]] or [x["round_ms"] for x in rows]
    roles = {pid: role for pid, (role, _) in res.cpu_by_pid.items()}
    rss_by_role: dict[str, list[int]] = {}
    for pid, rss in sorted(res.peak_rss_by_pid.items(), key=lambda x: -x[1]):
        rss_by_role.setdefault(roles.get(pid, "?"), []).append(rss)
    return {"first_round_ms": rows[0]["round_ms"],
            "round_ms_median": statistics.median(steady),
            "round_ms_mean": statistics.mean(steady), "round_ms_max": max(steady),
            "rounds_completed": res.summary["rounds_completed"],
            "bytes_up_per_round": statistics.mean(x["bytes_up"] for x in rows),
            "messages_up_per_round": statistics.mean(x["messages_up"] for x in rows),
            "merged_per_round": statistics.mean(x["merged"] for x in rows),
            "bytes_up": res.summary["bytes_up"], "bytes_down": res.summary["bytes_down"],
            "peak_rss_total": res.peak_rss, "peak_pss_total": res.peak_pss,
            "peak_rss_by_role": rss_by_role, "cpu_s_by_role": cpu_by_role(res),
            "wall_s": res.wall_s, "per_round": rows}


RATIOS = ("first_round_ms", "round_ms_median", "round_ms_mean", "bytes_up_per_round",
          "messages_up_per_round", "peak_rss_total", "peak_pss_total")


def compare_relays(flat: Finished, tree: Finished, relays: int, nodes: int) -> dict[str, Any]:
    """The --json "relays" entry: the relayed run's figures, the flat run's on the same
    footing ("flat"), and relays / flat for each of RATIOS."""
    out = {"relays": relays,
           "nodes_per_relay": [relay_nodes(nodes, relays).count(j) for j in range(relays)],
           **_side(tree, round_rows(tree))}
    out["flat"] = _side(flat, round_rows(flat))
    out["ratio"] = {k: out[k] / out["flat"][k] if out["flat"][k] else math.nan
                    for k in RATIOS}
    return out


def print_relays(fig: dict[str, Any]) -> None:
    flat, ratio = fig["flat"], fig["ratio"]
    per = sorted(set(fig["nodes_per_relay"]))
    print(f"fedbus bench rounds: the same federation through {fig['relays']} relays "
          f"(`fedbus relay`, each with its own site broker; "
          f"{'-'.join(map(str, per))} node(s) each)")
    print(f"  {'':34}{'flat':>12}{'relays':>12}{'relays/flat':>13}")

    def row(label: str, key: str, fmt: str, scale: float | None = None) -> None:
        def show(value):
            return format(value * scale if scale else value, fmt)

        r = f"{ratio[key]:.3g}x" if key in ratio else ""
        print(f"  {label:34}{show(flat[key]):>12}{show(fig[key]):>12}{r:>13}")

    row("first round (builds clients), ms", "first_round_ms", ".1f")
    row("per round, median of the rest, ms", "round_ms_median", ".1f")
    row("per round, mean of the rest, ms", "round_ms_mean", ".1f")
    row("bytes into the server a round", "bytes_up_per_round", ",.0f")
    row("messages into the server a round", "messages_up_per_round", ".1f")
    row("merged updates a round", "merged_per_round", ".1f")
    row("rounds completed", "rounds_completed", "d")
    row("peak RSS, all processes, GiB", "peak_rss_total", ".2f", scale=2**-30)
    row("peak PSS, all processes, GiB", "peak_pss_total", ".2f", scale=2**-30)
    for role, note in (("relay", ""), ("broker", "  (the server's broker and the site brokers)")):
        if fig["peak_rss_by_role"].get(role):
            print(f"  {f'peak RSS per {role}, relays run':34}"
                  f"{', '.join(f'{r / 2**20:.0f}' for r in fig['peak_rss_by_role'][role])} MiB"
                  + note)
    for side, label in ((flat, "flat"), (fig, "relays")):
        print(f"  {f'CPU seconds, whole run, {label}':34}" + ", ".join(
            f"{role} {sec:.1f}" for role, sec in
            sorted(side["cpu_s_by_role"].items(), key=lambda x: -x[1])))
    print(f"  {'wall time incl. start-up, s':34}{flat['wall_s']:12.1f}{fig['wall_s']:12.1f}")


def serve_tree(config_path: Path, run_dir: Path, relays: int, level: str = "warning") -> int:
    """The relays run's launcher: `fedbus run`'s federation (its broker, server and
    nodes, the same client groups, started the same way) with `relays` `fedbus relay`
    processes between the server's broker and the nodes; node i connects to the site
    broker of relay relay_nodes(...)[i]. Returns when the server is done, every process
    stopped (also on failure or Ctrl-C)."""
    from fedbus.launch.devices import assign, format_ids, split_clients, visible_gpus
    from fedbus.launch.processes import Federation, preload, start_method
    from fedbus.launch.run_cmd import catch_interrupt, free_port, supervise
    from fedbus.node.config import load_config
    from fedbus.node.setup import federated_data

    cfg = load_config(config_path)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    groups = split_clients(cfg.federation.clients, cfg.launch.nodes,
                           [len(p.train) for p in federated_data(cfg).parts])
    if not 0 < relays <= len(groups):
        print(f"fedbus bench rounds: {relays} relays for {len(groups)} nodes", file=sys.stderr)
        return 2
    placements, _ = assign(len(groups), cfg.launch.devices, visible_gpus())
    method = start_method(cfg.launch.start, [p.device for p in placements])
    fed = Federation(run_dir, level, method)
    hb = ["--heartbeat-s", str(cfg.bus.heartbeat_s), "--liveness", str(cfg.bus.liveness)]
    frame = ["--max-frame-mb", str(cfg.bus.max_frame_mb)]
    address = f"tcp://127.0.0.1:{free_port()}"
    interrupted, restore = catch_interrupt()
    try:
        fed.spawn("broker", ["broker", "--bind", address, *hb, *frame], method="exec")
        if method == "fork":
            preload(cfg)
        fed.spawn("server", ["server", "--broker", address, str(run_dir / "config.json"),
                             "--out", str(run_dir)])
        sites = []
        for j in range(relays):
            sites.append(f"tcp://127.0.0.1:{free_port()}")
            fed.spawn(f"relay-{j}", ["relay", "--upstream", address, "--bind", sites[j],
                                     "--name", f"relay-{j}", *hb, *frame])
        for i, (ids, place, j) in enumerate(zip(groups, placements,
                                               relay_nodes(len(groups), relays))):
            fed.spawn(f"node-{i}", ["node", "--broker", sites[j], "--clients", format_ids(ids),
                                    "--device", place.device, "--name", f"node-{i}", *hb],
                      env=place.env)
        return supervise(fed, run_dir, cfg, quiet=True, say=lambda *a: None,
                         interrupted=interrupted)
    except KeyboardInterrupt:
        return 130
    finally:
        fed.stop()
        restore()


def _tree_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m fedbus.bench.rounds",
                                description="the launcher of `fedbus bench rounds --relays`")
    p.add_argument("config")
    p.add_argument("--out", required=True)
    p.add_argument("--relays", type=int, required=True)
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    return serve_tree(Path(a.config), Path(a.out), a.relays, a.log_level)


if __name__ == "__main__":
    sys.exit(_tree_main(sys.argv[1:]))
