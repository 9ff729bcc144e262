"""Framework overhead per round: no-op training, real processes, real bus.

    fedbus bench rounds --clients 100 --payload prototypes
    fedbus bench rounds --clients 1000 --nodes 4 --rounds 10
    fedbus bench rounds --clients 10000 --nodes 4 --rounds 5 --fraction 0.1

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
to it is what the framework costs on top of moving the bytes.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import time
from pathlib import Path

import numpy as np

from fedbus.bench.common import run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--payload", choices=["prototypes", "resnet18"], default="prototypes")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--fraction", type=float, default=1.0,
                   help="clients sampled per round (federation.fraction, default 1)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="launch.node_memory_mb (default: the config default)")
    p.add_argument("--max-resident", type=int, default=None,
                   help="launch.max_resident (default: the config default, no cap)")
    p.add_argument("--evict-to", choices=["memory", "disk"], default=None)
    p.add_argument("--message-log", action="store_true",
                   help="keep the server's message log on (off: measure the bus alone)")
    p.add_argument("--no-floor", action="store_true", help="skip the raw-zmq floor")
    p.add_argument("--out", default=None, help="keep the run directory here")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


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
                       "fraction": args.fraction, "eval_every": args.rounds, "seed": 0,
                       "start_timeout_s": 600.0},
        "data": {"dataset": dataset, "partition": "iid", "test_fraction": 0.25},
        "model": {"arch": "mlp"},
        "algorithm": {"name": "noop", "payload": args.payload},
        "launch": launch,
        "log": {"messages": bool(args.message_log), "level": "warning"},
    }


def main_args(args: argparse.Namespace) -> int:
    from fedbus.bench.common import out_dir

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
    tasks = sum(r.get("sampled", 0) for r in records) or 1
    down = res.summary["bytes_down"] / tasks
    up = res.summary["bytes_up"] / tasks
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
    print(f"fedbus bench rounds: {args.clients} clients, {args.nodes} nodes, "
          f"{sampled} sampled a round, payload {args.payload}, {args.rounds} rounds, "
          f"message log {'on' if args.message_log else 'off'}")
    print(f"  first round (builds clients) {figures['first_round_ms']:9.1f} ms")
    print(f"  per round, median of the rest {figures['round_ms_median']:9.1f} ms"
          f"   (mean {figures['round_ms_mean']:.1f}, max {figures['round_ms_max']:.1f})")
    if not args.no_floor:
        floor = raw_zmq_floor(sampled, args.nodes, int(down), int(up), rounds=max(5, args.rounds))
        figures["floor_ms"] = floor * 1000
        figures["ratio_to_floor"] = figures["round_ms_median"] / figures["floor_ms"]
        print(f"  raw zmq floor, same pattern  {floor * 1000:9.1f} ms   (fedbus / floor "
              f"{figures['ratio_to_floor']:.1f}x; {2 * sampled} messages of "
              f"{int(down):,} B down / {int(up):,} B up, no broker)")
    print(f"  rounds completed             {figures['rounds_completed']:9d}")
    print(f"  bytes up / down              {figures['bytes_up']:,} / {figures['bytes_down']:,}")
    print(f"  peak RSS, all processes      {res.peak_rss / 2**30:9.2f} GiB"
          f"   (PSS {res.peak_pss / 2**30:.2f} GiB: shared pages counted once)")
    rss = figures["peak_rss_per_process"]
    if rss:
        print(f"  peak RSS per process         {', '.join(f'{r / 2**20:.0f}' for r in rss)} MiB")
    by_role: dict[str, float] = {}
    for role, sec in res.cpu_by_pid.values():
        by_role[role] = by_role.get(role, 0.0) + sec
    figures["cpu_s_by_role"] = by_role
    if by_role:
        print("  CPU seconds, whole run       " + ", ".join(
            f"{role} {sec:.1f}" for role, sec in sorted(by_role.items(), key=lambda x: -x[1]))
            + "  (nodes summed; start-up included)")
    print(f"  wall time incl. start-up     {res.wall_s:9.1f} s")
    if args.json:
        print(json.dumps(figures))
    return 0


# --------------------------------------------------------------------------- the floor
def _floor_node(endpoint: str, ident: bytes, up_bytes: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, ident)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    reply = bytes(up_bytes)
    sock.send(b"hello")
    while True:
        body = sock.recv()
        if not body:
            break
        sock.send(reply)
    sock.close()
    ctx.term()


def raw_zmq_floor(tasks: int, nodes: int, down_bytes: int, up_bytes: int, *,
                  rounds: int = 10) -> float:
    """Median seconds for a ROUTER to send `tasks` bodies of `down_bytes` spread over
    `nodes` DEALER processes and receive one `up_bytes` answer for each."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    procs = [mp.get_context("fork").Process(target=_floor_node,
                                            args=(endpoint, f"n{i}".encode(), up_bytes))
             for i in range(nodes)]
    for p in procs:
        p.start()
    idents = []
    while len(idents) < nodes:
        ident, _ = sock.recv_multipart()
        idents.append(ident)
    body = bytes(down_bytes)
    times = []
    try:
        for _ in range(rounds + 1):  # the first warms the connections up
            t0 = time.perf_counter()
            for i in range(tasks):
                sock.send(idents[i % nodes], zmq.SNDMORE)
                sock.send(body, copy=False)
            for _ in range(tasks):
                sock.recv_multipart(copy=False)
            times.append(time.perf_counter() - t0)
    finally:
        for ident in idents:
            sock.send_multipart([ident, b""])
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        sock.close()
        ctx.term()
    return statistics.median(times[1:])
