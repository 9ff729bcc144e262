"""What secure aggregation costs a round: time and bytes, with and without it.

    fedbus bench secagg                                  # 10, 100 and 1,000 clients
    fedbus bench secagg --clients 100 --rounds 10 --neighbours 8
    fedbus bench secagg --clients 100 --dropout-clients 5

For each cohort size the same federation runs twice, back to back, in real processes on
loopback (`fedbus run`: broker, server, --nodes node processes): plain, then with
`[privacy] secure_aggregation = true`. Both use the no-op algorithm (no training; a
"prototypes" payload of 10 x 512 float32 each way, summed by its merge rule), the same
seed, clients, nodes and fraction 1, and keep the server's message log (the phases below
are read off it; it costs both runs the same).

The figures, from the server's metrics (RUN/metrics.jsonl):
  s/round       the median `round_s` over the rounds after the first (the first also
                builds every client); a round runs from the close of the previous one
                to the server taking its last answer (plain: the last update; secure:
                the last reveal).
  bytes/round   the mean over rounds of what moved each way: plain, the updates
                (`bytes_up`) and tasks (`bytes_down`); secure, the same (the masked
                inputs are the updates: ring_bits / 8 bytes an element instead of 4)
                plus the secure steps both ways (the record's secagg bytes_up: keys,
                shares, reveals; bytes_down: peers, masking, unmask).
  reveal_s, t, neighbours, ring_bits, quant_bound
                the secure rounds' secagg records (reveal_s: the median; the others
                are fixed by the cohort): reveal_s runs from the unmask requests to
                the last reveal (the server's reconstruction that follows is not in
                it: see "after close" below), t is the Shamir threshold among a
                client's neighbours + 1 holders, quant_bound the worst quantisation
                error of a summed value.
The target from the issue is printed beside the 100-client row:
<= 2x the plain round's time and <= 1.5x its bytes. Times are printed as measured on
whatever else the machine runs; nothing here asserts them. Each cohort's median rounds are
also printed beside the raw-zmq floor of its plain round's messages, measured in the same
run (bench.common.run_floor; --json: each row's `floor_ms`, each run's `ratio`).

Where a secure round's time goes: its phases, from the times the server logged each
message (RUN/messages.jsonl; "in" when taken, "out" when sent), medians over the rounds
after the first:
  close prev    the previous round's close up to this round's first task; under secure
                aggregation that is the server unmasking the previous round: rebuilding
                every survivor's self-mask seed (one numpy product per set of share
                indices, node/privacy/shamir.py: ~10 ms for 1,000 seeds; pycryptodome's
                GF(2^128) Shamir, before issue 43, took ~28 ms a seed at t = 22), one
                ChaCha20 stream per survivor, then the aggregation and the next round's
                set-up.
                (The engine stamps a round's close before that work: it lands in the
                next round's `round_s`, and the last round's in none.)
  tasks         first task sent to last task sent.
  keys          to the last client's two X25519 public keys in.
  peers         the server fixes the neighbour graph and sends each its peers.
  shares        to the last client's encrypted shares in: each client's 2k key
                agreements, one Shamir split of both seeds and k AES-GCM encryptions
                (the clients' heaviest step; the nodes share the machine's cores).
  masking       the server sends each client which of its peers sent shares.
  inputs        to the last masked input in (plain: the last update): each client's
                fixed-point encoding and k+1 ChaCha20 mask streams, then the upload.
  unmask        the server sends each survivor the shares it must open.
  reveals       to the last reveal in: each survivor decrypts and returns its shares.
  after close   from a round's close to the server's next task (or evaluation) out,
                median over every round, the last included: the unmasking above as
                it follows its own round.
Each step is a round trip through the broker on top of the plain task/update pair: the
secure round makes four (keys, shares, masked input, reveal) where the plain one makes one.

The default invocation (5 rounds a run) took 5.5 minutes on a shared 2-core machine with
pycryptodome's Shamir, most of it the secure run of 1,000 clients (~50 s a round: ~30 s of
unmasking, ~18 s of shares); with the prime-field sharing (issue 43) a secure round of 1,000
clients takes ~10 s (~4 s of shares, 0.3 s of unmasking).

--dropout-clients N: N clients (spread over the cohort) drop after sending their masked
input (`[system] drop_clients`, `drop_stage = "input"`); in the plain run the same clients
drop their tasks. The secure round then waits secagg_timeout_s for the reveals that never
come, and the plain round its federation.deadline_s for the updates that never come: both
get --timeout-s, so both rounds measure that wait too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from fedbus.bench.common import FIGURE_HEAD, Finished, figure_line, out_dir, run, run_floor
from fedbus.bench.rounds import DIGITS_CLIENTS, blobs
from fedbus.bench.rounds import config as rounds_config

#: the phases of a round, in order, each ending at a mark of the message log
PHASES = ("close prev", "tasks", "keys", "peers", "shares", "masking", "inputs", "unmask",
          "reveals")
#: the issue's target at 100 clients: secure / plain
TARGET_CLIENTS, TARGET_TIME, TARGET_BYTES = 100, 2.0, 1.5


def cohorts(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}")
    if not sizes or min(sizes) < 2:
        raise argparse.ArgumentTypeError("every cohort needs 2 clients at least (the secure "
                                         "sum of one input is that input)")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=cohorts, default=[10, 100, 1000],
                   help="cohort sizes, comma-separated (default 10,100,1000)")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of each run (default 5; the first is reported apart; a "
                   "secure round of 1,000 clients takes about 10 s on 2 cores)")
    p.add_argument("--nodes", type=int, default=4, help="node processes (default 4)")
    p.add_argument("--neighbours", type=int, default=0,
                   help="privacy.secagg_neighbours (default 0: auto, every other client up "
                   "to 20, else the even number >= 3 log2(cohort))")
    p.add_argument("--dropout-clients", type=int, default=0, metavar="N",
                   help="N clients drop after their masked input (drop_stage = input); in "
                   "the plain run they drop their tasks (default 0)")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="the secure runs' secagg_timeout_s (default 600: a bound, every "
                   "phase ends when all have answered); with --dropout-clients the wait "
                   "for the dropped clients, also the plain runs' deadline_s (default "
                   "then: 30, or clients / 10 s when larger)")
    p.add_argument("--plain-batch", choices=("off", "auto"), default="off",
                   help="bus.batch of the plain runs (default off: one message a client each "
                   "way, as a secure run's steps always travel, so the ratio is what secure "
                   "aggregation adds; auto: a run's default, one message a node)")
    p.add_argument("--out", default=None, help="keep the run directories here")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")


def timeout_for(args: argparse.Namespace, clients: int) -> float:
    if args.timeout_s is not None:
        return args.timeout_s
    return max(30.0, clients / 10) if args.dropout_clients else 600.0


def dropped(clients: int, n: int) -> list[int]:
    """n client ids spread evenly over the cohort (the nodes take clients in order)."""
    return [i * clients // n for i in range(n)]


def sections(args: argparse.Namespace, clients: int, secure: bool,
             dataset: str) -> dict[str, dict[str, Any]]:
    """bench rounds' no-op federation at fraction 1 with the message log on, plain or
    secure; the dropping clients and the wait for them as --dropout-clients asks."""
    fed = argparse.Namespace(clients=clients, rounds=args.rounds, fraction=1.0,
                             payload="prototypes", nodes=args.nodes, memory_mb=None,
                             max_resident=None, evict_to=None, message_log=True,
                             batch=getattr(args, "plain_batch", "off"))
    cfg = rounds_config(fed, dataset)
    wait = timeout_for(args, clients)
    cfg["privacy"] = {"secure_aggregation": secure}
    if secure:
        cfg["privacy"].update(secagg_neighbours=args.neighbours, secagg_timeout_s=wait)
    if args.dropout_clients:
        cfg["system"] = {"drop_clients": dropped(clients, args.dropout_clients),
                         "drop_stage": "input"}
        if not secure:
            cfg["federation"]["deadline_s"] = wait
    return cfg


# --------------------------------------------------------------------------- phases
def _log_rows(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "messages.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def round_marks(rows: list[dict[str, Any]], record: dict[str, Any]) -> dict[str, float]:
    """The times (server clock) at which one round's phases end, from its message log
    rows: the first and last task out, the last client step in before each of the
    server's secagg batches (keys, shares; reveals after the last), the last of each
    batch out (peers, masking, unmask), the last update in. A mark the round never
    reached (a failed secure round, a plain one) is absent."""
    r = record["round"]
    marks: dict[str, float] = {"start": record["time"] - record["round_s"]}
    batches, prev_out = 0, False  # the server's secagg steps go out in one batch each
    steps_in = ("keys", "shares", "shares", "reveals")  # by the batches seen before
    steps_out = ("peers", "masking", "unmask")
    for row in rows:
        if row["round"] != r or row["t"] > record["time"] + 1e-6:
            continue
        kind, out = row["kind"], row["dir"] == "out"
        if out and kind in ("task", "tasks"):  # alone, or batched (a plain run's default)
            marks.setdefault("close prev", row["t"])
            marks["tasks"] = row["t"]
        elif out and kind == "secagg":
            if not prev_out:
                batches += 1
            if batches <= len(steps_out):
                marks[steps_out[batches - 1]] = row["t"]
        elif row["dir"] == "in" and kind == "secagg":
            marks[steps_in[min(batches, 3)]] = row["t"]
        elif row["dir"] == "in" and kind in ("update", "updates"):
            marks["inputs"] = row["t"]
        prev_out = out and kind == "secagg"
    marks["reveals" if "unmask" in marks else "inputs"] = record["time"]
    return marks


def round_phases(marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase the round went through: from the previous mark reached to
    its own (so the phases sum to the round's round_s)."""
    out, at = {}, marks["start"]
    for name in PHASES:
        if name in marks:
            out[name] = max(0.0, marks[name] - at)
            at = max(at, marks[name])
    return out


def after_close(rows: list[dict[str, Any]], record: dict[str, Any]) -> float | None:
    """Seconds from a round's close to the server's next task or evaluation out: the
    work the engine does after stamping the close (secure: the unmasking), which its
    `round_s` leaves to the next round (the last round's to none)."""
    for row in rows:
        if row["dir"] == "out" and row["kind"] in ("task", "tasks", "eval", "evals") and \
                row["t"] >= record["time"] - 1e-6 and \
                (row["kind"] in ("eval", "evals") or row["round"] > record["round"]):
            return row["t"] - record["time"]
    return None


def phases(res: Finished) -> list[dict[str, float]]:
    """Per round (in order), the seconds of each phase it went through and, as
    "after close", the server's work once it closed."""
    rows = _log_rows(res.run_dir)
    if not rows:
        return []
    out = []
    for rec in sorted(res.records, key=lambda x: x["round"]):
        ph = round_phases(round_marks(rows, rec))
        after = after_close(rows, rec)
        if after is not None:
            ph["after close"] = after
        out.append(ph)
    return out


# --------------------------------------------------------------------------- figures
def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def side(res: Finished, secure: bool) -> dict[str, Any]:
    """One run's figures: round times (the first apart), bytes a round, its phases
    (medians over the rounds after the first) and, secure, its secagg records."""
    records = sorted(res.records, key=lambda x: x["round"])
    times = [x["round_s"] for x in records]
    steady = times[1:] or times
    sa = [x.get("secagg") or {} for x in records]
    per = phases(res)
    per_steady = per[1:] or per
    fig: dict[str, Any] = {
        "run_dir": str(res.run_dir), "rounds_completed": res.summary["rounds_completed"],
        "first_round_s": times[0], "round_s_median": statistics.median(steady),
        "round_s_mean": statistics.mean(steady), "round_s_max": max(steady),
        "round_s": times,
        "updates_bytes_per_round": statistics.mean(x["bytes_up"] for x in records),
        "tasks_bytes_per_round": statistics.mean(x["bytes_down"] for x in records),
        "secagg_bytes_up_per_round": statistics.mean(s.get("bytes_up", 0) for s in sa),
        "secagg_bytes_down_per_round": statistics.mean(s.get("bytes_down", 0) for s in sa),
        "updates_min": min(x["updates"] for x in records),
        "phases_s": {name: _median([p[name] for p in per_steady if name in p])
                     for name in PHASES},
        # every round's, the last included (its unmasking is in no round_s)
        "after_close_s": _median([p["after close"] for p in per if "after close" in p]),
        "wall_s": res.wall_s}
    fig["bytes_per_round"] = sum(fig[k] for k in (
        "updates_bytes_per_round", "tasks_bytes_per_round", "secagg_bytes_up_per_round",
        "secagg_bytes_down_per_round"))
    if secure:
        last = next((s for s in reversed(sa) if s.get("t") is not None), sa[-1])
        fig["secagg"] = {
            "records": sa, "survivors_min": min(s.get("survivors", 0) for s in sa),
            "failed": [[x["round"], s["failed"]] for x, s in zip(records, sa) if "failed" in s],
            "missing": [x["round"] for x, s in zip(records, sa) if not s],
            "reveal_s_median": _median([s["reveal_s"] for s in sa if "reveal_s" in s]),
            **{k: last.get(k) for k in ("t", "neighbours", "ring_bits", "frac_bits",
                                        "quant_bound")}}
    return fig


def measure(args: argparse.Namespace, out: Path, clients: int) -> dict[str, Any]:
    """The plain and the secure run of one cohort, back to back."""
    dataset = "digits" if clients <= DIGITS_CLIENTS else \
        blobs(out / f"blobs-{clients}.npz", clients)
    row: dict[str, Any] = {"clients": clients, "rounds": args.rounds,
                           "nodes": args.nodes, "dropout_clients": args.dropout_clients}
    finished = {}
    for secure in (False, True):
        name = "secure" if secure else "plain"
        print(f"fedbus bench secagg: {clients} clients, {name} ...", file=sys.stderr,
              flush=True)
        try:
            res = run(sections(args, clients, secure, dataset),
                      f"secagg-{clients}-{name}", out=out, timeout=3600)
        except (RuntimeError, TimeoutError) as err:
            row[name] = {"error": str(err)}
            continue
        row[name], finished[name] = side(res, secure), res
    # both runs against the floor of the plain run's messages: what secure aggregation
    # adds shows in the secure ratio
    base = finished.get("plain") or finished.get("secure")
    if base is not None:
        floor = run_floor(base.summary, base.records, args.nodes)
        row["floor_ms"], row["floor_pattern"] = floor.ms, floor.describe()
        for name in finished:
            row[name].update(floor.figures(row[name]["round_s_median"] * 1000))
    plain, secure_ = row["plain"], row["secure"]
    if "error" not in plain and "error" not in secure_:
        row["time_ratio"] = secure_["round_s_median"] / plain["round_s_median"]
        row["bytes_ratio"] = secure_["bytes_per_round"] / plain["bytes_per_round"]
    return row


# --------------------------------------------------------------------------- printing
def _fmt(value: Any, spec: str, width: int) -> str:
    return format("-" if value is None else format(value, spec), f">{width}")


def verdict(row: dict[str, Any]) -> str:
    if "time_ratio" not in row:
        return f"target at {TARGET_CLIENTS} clients: <= 2x time, <= 1.5x bytes: not measured"
    t, b = row["time_ratio"], row["bytes_ratio"]
    return (f"target at {TARGET_CLIENTS} clients: <= {TARGET_TIME:g}x time, "
            f"<= {TARGET_BYTES:g}x bytes: time {'met' if t <= TARGET_TIME else 'not met'} "
            f"({t:.2f}x), bytes {'met' if b <= TARGET_BYTES else 'not met'} ({b:.2f}x)")


HEAD = (f"{'clients':>7} {'rounds':>6} | {'plain s/rd':>10} {'secure s/rd':>11} {'ratio':>7} | "
        f"{'plain B/rd':>12} {'secure B/rd':>12} {'ratio':>6} | {'reveal_s':>8} {'t':>3} "
        f"{'nbrs':>4} {'ring':>4} {'quant_bound':>11} {'survivors':>9}")


def table_row(row: dict[str, Any]) -> str:
    plain, sec = row["plain"], row["secure"]
    sa = sec.get("secagg", {})
    cells = [f"{row['clients']:>7} {row['rounds']:>6} |",
             _fmt(plain.get("round_s_median"), ".3f", 10),
             _fmt(sec.get("round_s_median"), ".3f", 11),
             _fmt(row.get("time_ratio"), ".2f", 6) + "x |",
             _fmt(plain.get("bytes_per_round"), ",.0f", 12),
             _fmt(sec.get("bytes_per_round"), ",.0f", 12),
             _fmt(row.get("bytes_ratio"), ".2f", 5) + "x |",
             _fmt(sa.get("reveal_s_median"), ".3f", 8), _fmt(sa.get("t"), "d", 3),
             _fmt(sa.get("neighbours"), "d", 4), _fmt(sa.get("ring_bits"), "d", 4),
             _fmt(sa.get("quant_bound"), ".2e", 11), _fmt(sa.get("survivors_min"), "d", 9)]
    return " ".join(cells)


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    drops = (f"{args.dropout_clients} client(s) drop after their masked input"
             if args.dropout_clients else "no dropouts")
    print(f"fedbus bench secagg: no-op algorithm, prototype payload (10 x 512 float32), "
          f"{args.nodes} nodes, fraction 1, seed 0, secagg_neighbours "
          f"{args.neighbours or 'auto'}, {drops}, plain runs' bus.batch "
          f"{getattr(args, 'plain_batch', 'off')} (secure runs: one message a client)")
    print("  s/round: median round_s after the first round; B/round: mean bytes a round, "
          "updates + tasks (+ secure steps both ways)")
    print(HEAD)
    print("-" * len(HEAD))
    for row in rows:
        print(table_row(row))
        if row["clients"] == TARGET_CLIENTS:
            print(f"{'':>15}^ {verdict(row)}")
    if TARGET_CLIENTS not in [r["clients"] for r in rows]:
        print(f"(target at {TARGET_CLIENTS} clients: <= 2x time, <= 1.5x bytes: "
              f"{TARGET_CLIENTS} clients not measured)")
    for row in rows:
        for name in ("plain", "secure"):
            if "error" in row[name]:
                print(f"  {row['clients']} clients, {name}: the run failed: {row[name]['error']}")
        sa = row["secure"].get("secagg", {})
        for r, why in sa.get("failed", []):
            print(f"  {row['clients']} clients, secure round {r} failed: {why}")
        if sa.get("missing"):
            print(f"  {row['clients']} clients: secure rounds without a secagg record: "
                  f"{sa['missing']}")
    print_phases(rows)
    print("each cohort's median round beside the raw-zmq floor of its plain round's messages, "
          "measured in the same run:")
    print(FIGURE_HEAD)
    for row in rows:
        for name in ("plain", "secure"):
            fig = row[name]
            if "error" not in fig:
                print(figure_line(f"{row['clients']} clients, {name} round",
                                  fig["round_s_median"] * 1000, row.get("floor_ms")))
        if "floor_pattern" in row:
            print(f"  ({row['floor_pattern']})")


def print_phases(rows: list[dict[str, Any]]) -> None:
    print("where a round's time goes, ms: medians over the rounds after the first, from the "
          "server's message log (plain: 'inputs' are the updates); 'after close': from a "
          "round's close to the next task out, median over every round (secure: the server "
          "unmasking the sum), which the engine's round_s counts in the next round's "
          "'close prev'")
    widths = [max(7, len(p) + 1) for p in PHASES]
    head = f"{'clients':>7} {'run':>6} |" + "".join(
        f"{p:>{w}}" for p, w in zip(PHASES, widths)) + \
        f" | {'round':>7} {'first':>7} | {'after close':>11}"
    print(head)
    print("-" * len(head))
    for row in rows:
        for name in ("plain", "secure"):
            fig = row[name]
            if "error" in fig:
                continue
            ph = fig["phases_s"]
            after = fig["after_close_s"]
            print(f"{row['clients']:>7} {name:>6} |" + "".join(
                _fmt(None if ph.get(p) is None else ph[p] * 1000, ".0f", w)
                for p, w in zip(PHASES, widths))
                + f" | {fig['round_s_median'] * 1000:7.0f} {fig['first_round_s'] * 1000:7.0f}"
                + f" | {_fmt(None if after is None else after * 1000, '.0f', 11)}")


def main_args(args: argparse.Namespace) -> int:
    smallest = min(args.clients)
    if not 0 <= args.dropout_clients <= smallest - 2:
        print(f"fedbus bench secagg: --dropout-clients must lie in 0..{smallest - 2} (a "
              "secure sum needs two survivors)", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.nodes < 1:
        print("fedbus bench secagg: --rounds and --nodes must be at least 1", file=sys.stderr)
        return 2
    out = out_dir(args.out, "secagg")
    rows = [measure(args, out, clients) for clients in args.clients]
    print_table(args, rows)
    print(f"  runs kept in {out}")
    if args.json:
        print(json.dumps({"rows": rows}))
    failed = any("error" in r[n] for r in rows for n in ("plain", "secure"))
    return 1 if failed else 0
