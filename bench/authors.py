"""FedNH and FPL side by side with their authors' code: one partition, one start, per round.

Issue 26, item 3. The authors' code runs from a local checkout patched to read a partition
that fedbus exports (the patch is never committed to fedbus: FedNH's code is MIT, RethinkFL's
has no license); fedbus runs the same partition as one real `fedbus run`; this module prints
the two per round.

    # 1. export: per-client arrays, the initial weights, the seeds of fedbus's batch order
    fedbus bench authors --method fednh --data digits --epochs 2 --batch-size 32 --lr 0.05 \
        --rounds 30 --export /tmp/nh
    # 2. the authors' code (patched checkout, below), one process, the manifest's threads
    cd FedNH && python fedbus_driver.py /tmp/nh /tmp/nh/authors
    # 3. fedbus on the same settings, printed beside the authors' rounds.jsonl
    fedbus bench authors --method fednh --data digits --epochs 2 --batch-size 32 --lr 0.05 \
        --rounds 30 --reference /tmp/nh/authors/rounds.jsonl --json nh.json
    # FPL: the five-domain set (digit5-offline from ../shared/data/mnist-10k.npz), 300
    # images a domain, client i on domain i % 5
    fedbus bench authors --method fpl --domain-samples 300 --epochs 2 --batch-size 32 \
        --lr 0.01 --rounds 20 --export /tmp/fpl       # then RethinkFL's driver, then:
    fedbus bench authors --method fpl --domain-samples 300 --epochs 2 --batch-size 32 \
        --lr 0.01 --rounds 20 --reference /tmp/fpl/authors/rounds.jsonl

Both sides compute the same thing. fedbus's options are set to the code's choices
(CODE_OPTIONS): FedNH init = "orthogonal" (FedUHClient._initialize_model's
FedNH_head_init) and lr_schedule = "diminishing" (the paper runs' --client_lr_scheduler; rho
0.9, scale_init 1, learn_scale, clip_norm 10, weighted prototype and unweighted body averages
are fedbus's defaults and the code's); FPL partition = "last", align_loss = "mean",
proto_source = "during", keep_missing = false (the code's, docs/FIDELITY.md fpl). [train]:
SGD with the given lr, momentum 0.9 and weight decay 1e-5 (both codes'), a new optimiser
every round (train.optimizer_state = "fresh", both codes'), every client every round. The
model is fedbus's cnn4 (PFLlib's FedAvgCNN, 512-d features), which has no dropout: with the
same start and the same batches nothing else is drawn at random, so the two sides differ by
float rounding only, unless their computations differ.

The export (`--export DIR`): DIR/train/<i>.npz and DIR/test/<i>.npz ({"x": float32, "y":
int64}: client i's arrays as fedbus's node builds them, normalised), DIR/init.npz (the
seeded initial state dict every fedbus client and the server start from; for FedNH also the
server's W^0 under "fednh.prototype"), DIR/manifest.json (the settings, the fedbus options,
each client's domain, the torch threads of one fedbus node, and task_seeds[r][i], the seed
of client i's local run in round r: fedbus's LocalRun draws one torch.randperm per epoch
from a Generator seeded with it and takes consecutive batches, the last partial one kept).

The patch (under the checkouts, not here): a file fedbus_common.py beside the two checkouts
and a fedbus_driver.py in each. fedbus_common: a stand-in `torchvision` module whose
attributes are inert classes (both codes import torchvision at module level for data they do
not load here; the local wheel does not match torch 2.13); fedbus's cnn4 with its parameter
names; a Dataset over the exported tensors with the `targets` both codes read; a Sampler
that replays fedbus's batch order from the task seeds (start(r) seeds round r's Generator,
each epoch's __iter__ draws the next permutation; `indices` for RethinkFL's aggregate_nets);
and a log writing rounds.jsonl ({"round" from 0, "acc" a fraction, "train_s", "eval_s",
"seconds": wall seconds since the previous round's end}).
- FedNH (Yutong-Dai/FedNH @ 60c3161): the driver replaces main.get_datasets (the pooled
  exported splits: the global train and test sets) and main.setup_clients (one client per
  exported split, setup_seed(2022) before each as the code's, its trainloader drawing
  fedbus's order); adds FedbusCNN4NH, Conv2CifarNH's forward (normalised embedding times
  the frozen prototype, times the learnable scaling 1.0) over cnn4's body; after
  FedUHClient._initialize_model loads init.npz (body and W^0); FedAvgServer.testing scores
  the global model only (GM, the 'uniform' accuracy: fedbus's acc_weighted) and copies it
  into the clients' PM stats, so collect_stats runs without ten local-model passes; times
  the round around FedNHServer.aggregate and the test. It writes the yaml from
  experiments/Cifar10_Conv2Cifar.yaml with model FedbusCNN4, num_epochs, batch_size, lr
  decay 0.99, FedNH_head_init orthogonal, and calls main.run with participate_ratio 1.0,
  --client_lr_scheduler diminishing, the momentum and weight decay, FedNH_smoothing 0.9.
  Nothing in strategies/, client.py, server.py or utils.py changes.
- FPL (WenkeHuang/RethinkFL @ 74201b3): the driver calls main.parse_args (best_args
  included), then sets args.local_lr and the batch size from the manifest and torch's
  threads to the manifest's (parse_args sets 4); builds every participant's net as cnn4
  (features = body, classifier = fc) loaded from init.npz; hands utils.training.train a
  dataset whose get_data_loaders returns one train loader per client (fedbus's order) and
  one test loader per client (global_evaluate's mean is then fedbus's acc_mean); wraps
  FPL._train_net to start each client's order at the round (model.epoch_index) and
  global_evaluate to log. Its transforms (Resize 32, RandomCrop 32 pad 4,
  RandomHorizontalFlip, 3-channel repeat, ImageNet normalisation) are not applied: both
  sides see fedbus's normalised 1x28x28 arrays. One edit of models/fpl.py: in
  hierarchical_info_loss, np.array(all_f) and np.array(mean_f) become an object array of
  the same tensors, which is what numpy 1.23.5 makes of that list (checked); numpy >= 1.24
  refuses the list when the classes' cluster counts differ, and numpy 2.4 turns an even one
  into a float array that has no .to: the code needs numpy < 1.24.
Environment: a venv with --system-site-packages (torch 2.13 CPU, numpy, scikit-learn,
scipy, PyYAML) plus tqdm and setproctitle from pip; wandb off.

Time per round: fedbus's is the server's round_s + eval_s (first task sent to the last
evaluation result; 2 node processes of 1 thread each on this 2-core machine); the authors'
is the wall time from one round's end to the next (one process, DRIVER_THREADS = the
manifest's threads, one fedbus node's share of the cores: on a busy machine 2 threads took
162 s for a FedNH round 0 that 1 thread did in 23). fedbus's CPU seconds by role are printed
too (the authors': time the driver with /usr/bin/time). The machine may be shared: the load
averages are printed, and wall seconds of runs made at different moments are indications.

--threads N (launch.threads) changes the torch threads of fedbus's nodes and nothing else:
the float order of the convolutions changes (~4e-9 in the gradients), which shows how far
rounding alone moves a trajectory (docs/RESULTS.md: FedNH drifts from round 5 on, as it does
against the authors' code). Figures and their reading: docs/RESULTS.md, "FedNH and FPL beside
their authors' code"; the fidelity findings: docs/FIDELITY.md, fednh and fpl.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "data" / "mnist-10k.npz"
METHODS = ("fednh", "fpl")

# fedbus's options set to the authors' code's choices (the docstring says which function each
# follows), so that both sides compute the same thing
CODE_OPTIONS = {
    # FedNH: FedUHClient._initialize_model's FedNH_head_init = "orthogonal" and the paper runs'
    # --client_lr_scheduler diminishing; every other PARAM's default is the code's already
    "fednh": {"init": "orthogonal", "lr_schedule": "diminishing"},
    # FPL: proto_aggregation's c[:, -1], hierarchical_info_loss's nn.MSELoss, _train_net's
    # last-epoch features, the set rebuilt from each round's online clients
    "fpl": {"partition": "last", "align_loss": "mean", "proto_source": "during",
            "keep_missing": False},
}
# the accuracy the authors' code prints: FedNH's GM (the global model on the pooled test
# set: fedbus's sample-weighted mean over the clients' test splits); FPL's global_evaluate
# (the global model's mean accuracy over the test loaders, one per client here: fedbus's
# unweighted mean)
COMPARED = {"fednh": "acc_weighted", "fpl": "acc_mean"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, default="fednh")
    p.add_argument("--data", default=None,
                   help="an npz file or a dataset name (default: ../shared/data/mnist-10k.npz for "
                   "fednh, digit5-offline:../shared/data/mnist-10k.npz for fpl)")
    p.add_argument("--partition", default=None,
                   help="data.partition (default: dirichlet for fednh, domains for a "
                   "digit5 set, else dirichlet)")
    p.add_argument("--alpha", type=float, default=0.3, help="Dirichlet label skew (default 0.3)")
    p.add_argument("--domain-samples", type=int, default=0,
                   help="data.domain_samples of a digit5 set: at most this many images per "
                   "domain (default 0: all)")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--epochs", type=int, default=1, help="local epochs (default 1)")
    p.add_argument("--batch-size", type=int, default=64, help="(default 64, both codes')")
    p.add_argument("--lr", type=float, default=0.01, help="(default 0.01, both codes')")
    p.add_argument("--momentum", type=float, default=0.9, help="(default 0.9, both codes')")
    p.add_argument("--weight-decay", type=float, default=1e-5,
                   help="(default 1e-5, both codes')")
    p.add_argument("--arch", default="cnn4", help="model.arch (default cnn4: no dropout, so "
                   "both sides draw nothing but the batch order)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nodes", type=int, default=2, help="fedbus client-node processes")
    p.add_argument("--threads", type=int, default=0,
                   help="launch.threads: torch threads of each fedbus node (default 0: the "
                   "cores shared among the nodes); another count changes only the rounding")
    p.add_argument("--export", default=None, metavar="DIR",
                   help="write the partition, initial weights and batch seeds to DIR for the "
                   "patched authors' code, print its command, and exit")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="the patched authors' code's rounds.jsonl, printed beside fedbus's run")
    p.add_argument("--fedbus-json", default=None, metavar="FILE",
                   help="a fedbus side written by an earlier --json: compare without rerunning")
    p.add_argument("--out", default=None, help="folder for the fedbus run (default temporary)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")


# --------------------------------------------------------------------------- config
def data_spec(args: argparse.Namespace) -> tuple[str, str]:
    """(data.dataset, data.partition) from the options and the method's defaults."""
    data = args.data or (f"digit5-offline:{MNIST}" if args.method == "fpl" else str(MNIST))
    dataset = f"npz:{data}" if Path(data).is_file() else data
    partition = args.partition or (
        "domains" if args.method == "fpl" and dataset.split(":", 1)[0].startswith("digit5")
        else "dirichlet")
    return dataset, partition


def sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    dataset, partition = data_spec(args)
    data: dict[str, Any] = {"dataset": dataset, "partition": partition}
    if partition.startswith("dirichlet") or partition == "domains-dirichlet":
        data["alpha"] = args.alpha
    if args.domain_samples:
        data["domain_samples"] = args.domain_samples
    return {
        "federation": {"clients": args.clients, "rounds": args.rounds, "eval_every": 1,
                       "seed": args.seed, "start_timeout_s": 600.0},
        "data": data,
        "model": {"arch": args.arch},
        "algorithm": {"name": args.method, **CODE_OPTIONS[args.method]},
        # a new SGD each round, as both codes build one per local update
        "train": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr,
                  "momentum": args.momentum, "weight_decay": args.weight_decay,
                  "optimizer_state": "fresh"},
        "launch": {"nodes": args.nodes, "threads": args.threads},
        "log": {"level": "warning"},
    }


# --------------------------------------------------------------------------- export
def export(cfg_sections: dict[str, dict[str, Any]], folder: Path) -> dict[str, Any]:
    """Write what the patched authors' code reads (module doc) and return the manifest:
    train/<i>.npz and test/<i>.npz ({"x": float32, "y": int64}, the arrays fedbus's client i
    trains and tests on), init.npz (the initial network's state dict, plus for FedNH the
    server's initial prototypes under "fednh.prototype"), manifest.json (the settings, each
    client's domain, and the seed of every (round, client) local run: fedbus's batch order)."""
    from fedbus.algorithms.core.params import default_of
    from fedbus.algorithms.fednh import FedNHServer, initial_prototypes
    from fedbus.algorithms.fpl import FPLServer
    from fedbus.node.client_host import node_threads
    from fedbus.node.config import build_config
    from fedbus.node.engine import task_seed
    from fedbus.node.setup import federated_data, make_model

    cfg = build_config(cfg_sections)
    method = cfg.algorithm["name"]
    data = federated_data(cfg)
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    for i in range(data.num_clients):
        d = data.client(i)
        for split, x, y in (("train", d.train_x, d.train_y), ("test", d.test_x, d.test_y)):
            np.savez(folder / split / f"{i}.npz", x=np.asarray(x, np.float32),
                     y=np.asarray(y, np.int64))
    model = make_model(cfg, 0, data)  # every client's and the server's start (seeded)
    init = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    handler = {"fednh": FedNHServer, "fpl": FPLServer}[method]
    params = {k: cfg.algorithm.get(k, default_of(v)) for k, v in handler.PARAMS.items()}
    if method == "fednh":
        init["fednh.prototype"] = initial_prototypes(data.num_classes, model.feature_dim,
                                                     params["init"], cfg.federation.seed)
    np.savez(folder / "init.npz", **init)
    rounds, clients = cfg.federation.rounds, data.num_clients
    manifest = {
        "method": method, "clients": clients, "rounds": rounds, "seed": cfg.federation.seed,
        "epochs": int(cfg.train["epochs"]), "batch_size": int(cfg.train["batch_size"]),
        "lr": float(cfg.train["lr"]), "momentum": float(cfg.train["momentum"]),
        "weight_decay": float(cfg.train["weight_decay"]),
        "num_classes": int(data.num_classes), "in_shape": [int(s) for s in data.in_shape],
        "arch": cfg.model.arch, "feature_dim": int(model.feature_dim),
        "head": model.head_module if hasattr(model, "head_module") else None,
        "params": {k: v for k, v in params.items() if isinstance(v, (bool, int, float, str))},
        "domains": [p.meta.get("domain_name") for p in data.parts],
        "compared": COMPARED[method],
        # task_seeds[r][i]: the seed of client i's local run in round r (LocalRun.batches:
        # one torch.randperm per epoch from a Generator seeded with it)
        "task_seeds": [[task_seed(cfg.federation.seed, i, r) for i in range(clients)]
                       for r in range(rounds)],
        # the threads of one fedbus node (cores shared among launch.nodes): a reference on
        # more threads than its share of a busy machine waits on its slowest thread at every
        # op (2 threads under load ~9: 162 s for a FedNH round 0 that 1 thread did in 23)
        "torch_threads": node_threads(cfg),
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def read_export(folder: Path) -> tuple[dict[str, Any], list[dict[str, np.ndarray]]]:
    """The manifest and each client's {"train_x", "train_y", "test_x", "test_y"}."""
    manifest = json.loads((folder / "manifest.json").read_text())
    clients = []
    for i in range(manifest["clients"]):
        arrays = {}
        for split in ("train", "test"):
            with np.load(folder / split / f"{i}.npz") as z:
                arrays[f"{split}_x"], arrays[f"{split}_y"] = z["x"], z["y"]
        clients.append(arrays)
    return manifest, clients


# --------------------------------------------------------------------------- fedbus side
def fedbus_side(cfg: dict[str, dict[str, Any]], out: Path) -> dict[str, Any]:
    """One real `fedbus run`: per round the two accuracies and the seconds from the server's
    first task to the last evaluation result (round_s + eval_s)."""
    from fedbus.bench.common import floor_figures, run

    res = run(cfg, cfg["algorithm"]["name"], out=out, timeout=3600)
    records = sorted((r for r in res.records if "acc_mean" in r), key=lambda r: r["round"])
    seconds = [float(r["round_s"]) + float(r.get("eval_s", 0.0)) for r in records]
    return {"run_dir": str(res.run_dir),
            "acc_mean": [float(r["acc_mean"]) for r in records],
            "acc_weighted": [float(r.get("acc_weighted", math.nan)) for r in records],
            "round_s": [float(r["round_s"]) for r in records],
            "eval_s": [float(r.get("eval_s", 0.0)) for r in records],
            "seconds": seconds,
            "failed": [int(r.get("failed", 0)) for r in records],
            "run_wall_s": res.wall_s,
            # CPU seconds of the run's processes by role, start-up included (a busy machine
            # stretches wall seconds more than CPU seconds)
            "cpu_s": cpu_by_role(getattr(res, "cpu_by_pid", {})),
            **floor_figures(res, int(cfg.get("launch", {}).get("nodes", 1)),
                            statistics.median(seconds) * 1000 if seconds else None)}


def cpu_by_role(cpu_by_pid: dict[int, tuple[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for role, sec in cpu_by_pid.values():
        out[role] = out.get(role, 0.0) + float(sec)
    return out


def read_reference(path: Path) -> dict[str, Any]:
    """The patched authors' code's rounds.jsonl: one {"round", "acc", "train_s", "eval_s",
    "seconds"} per round (round from 0; acc a fraction)."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no rounds")
    rows.sort(key=lambda r: r["round"])
    return {"acc": [float(r["acc"]) for r in rows],
            "train_s": [float(r.get("train_s", math.nan)) for r in rows],
            "eval_s": [float(r.get("eval_s", math.nan)) for r in rows],
            "seconds": [float(r["seconds"]) for r in rows]}


# --------------------------------------------------------------------------- output
def summary(acc: list[float]) -> dict[str, Any]:
    """First, middle and last round's accuracy and the best (with its round)."""
    if not acc:
        return {}
    best = max(range(len(acc)), key=lambda r: acc[r])
    return {"first": acc[0], "middle": acc[(len(acc) - 1) // 2], "last": acc[-1],
            "best": acc[best], "best_round": best}


def _f(v: float | None, width: int = 7, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return f"{'-':>{width}}"
    return f"{v:>{width}.{digits}f}"


def table(method: str, fb: dict[str, Any] | None, ref: dict[str, Any] | None) -> list[str]:
    """Per round: fedbus's compared accuracy, the reference's, their difference, and each
    side's seconds; then the summary rows."""
    key = COMPARED[method]
    fb_acc = fb[key] if fb else []
    ref_acc = ref["acc"] if ref else []
    lines = [f"  accuracy = {key} on fedbus's side"
             + (" (the authors' GM on the pooled test set)" if method == "fednh" else
                " (the authors' mean over the test loaders, one per client)"),
             f"  {'round':>5} {'fedbus':>8} {'authors':>8} {'diff':>8} {'fedbus s':>9}"
             f" {'authors s':>10}"]
    fb_s = fb["seconds"] if fb else []
    ref_s = ref["seconds"] if ref else []
    for r in range(max(len(fb_acc), len(ref_acc))):
        a = fb_acc[r] if r < len(fb_acc) else None
        b = ref_acc[r] if r < len(ref_acc) else None
        # the authors' accuracies are float32 (FedNH) or percentages rounded to 2 decimals
        # (FPL's global_evaluate): a residue below 1e-4 is no difference of a test sample
        d = (0.0 if abs(a - b) < 1e-4 else a - b) if a is not None and b is not None else None
        lines.append(f"  {r:>5} {_f(a, 8)} {_f(b, 8)} {_f(d, 8)}"
                     f" {_f(fb_s[r] if r < len(fb_s) else None, 9, 2)}"
                     f" {_f(ref_s[r] if r < len(ref_s) else None, 10, 2)}")
    for name, side, acc in (("fedbus", fb, fb_acc), ("authors", ref, ref_acc)):
        if not side:
            continue
        s = summary(acc)
        secs = side["seconds"]
        lines.append(f"  {name:<8} first {s['first']:.4f}  middle {s['middle']:.4f}  last "
                     f"{s['last']:.4f}  best {s['best']:.4f} (round {s['best_round']})  "
                     f"s/round mean {statistics.mean(secs):.2f}, median "
                     f"{statistics.median(secs):.2f}")
    if fb and fb.get("cpu_s"):
        lines.append("  fedbus CPU seconds over the whole run: " + ", ".join(
            f"{role} {sec:.1f}" for role, sec in sorted(fb["cpu_s"].items())))
    if fb and ref and fb_acc and ref_acc:
        n = min(len(fb_acc), len(ref_acc))
        diffs = [fb_acc[r] - ref_acc[r] for r in range(n)]
        ratio = statistics.mean(fb_s[:n]) / statistics.mean(ref_s[:n])
        lines.append(f"  fedbus - authors over {n} rounds: mean {statistics.mean(diffs):+.4f}, "
                     f"largest |diff| {max(abs(d) for d in diffs):.4f}; seconds per round, "
                     f"fedbus / authors: {ratio:.2f}")
    if fb and any(fb.get("failed", [])):
        lines.append(f"  WARNING: fedbus rounds lost updates ({fb['failed']})")
    if fb and fb.get("floor_ms"):  # a --fedbus-json from before the floor has none
        from fedbus.bench.common import floor_lines

        rows = [("fedbus, median round", statistics.median(fb_s) * 1000 if fb_s else None)]
        if ref_s:
            rows.append(("authors' code, median round", statistics.median(ref_s) * 1000))
        lines += floor_lines(rows, fb)
    return lines


def main_args(args: argparse.Namespace) -> int:
    from fedbus.node.config import ConfigError, build_config
    from fedbus.node.setup import federated_data

    cfg = sections(args)
    try:  # a bad option is a one-line error here, not a failed run
        federated_data(build_config(cfg))
    except (ConfigError, ValueError, OSError) as e:
        print(f"fedbus bench authors: {e}")
        return 2
    if args.export:
        folder = Path(args.export)
        manifest = export(cfg, folder)
        driver = {"fednh": "FedNH", "fpl": "RethinkFL"}[args.method]
        print(f"wrote {manifest['clients']} clients' splits, init.npz and manifest.json to "
              f"{folder}; with the patched authors' code (module doc), from its folder:")
        print(f"  python fedbus_driver.py {folder} {folder / 'authors'}   "
              f"# {driver}: writes {folder / 'authors' / 'rounds.jsonl'}")
        return 0
    ref = None
    if args.reference:
        try:
            ref = read_reference(Path(args.reference))
        except (OSError, ValueError, KeyError) as e:
            print(f"fedbus bench authors: --reference {args.reference}: not a rounds.jsonl "
                  f"of the patched authors' code ({e})")
            return 2
    if args.fedbus_json:
        fb = json.loads(Path(args.fedbus_json).read_text())["fedbus"]
    else:
        from fedbus.bench.common import out_dir

        out = out_dir(args.out, "authors")
        print(f"fedbus bench authors: fedbus run ({args.method}) in {out} ...", flush=True)
        load_before = os.getloadavg()
        fb = fedbus_side(cfg, out)
        fb["load"] = [load_before, os.getloadavg()]
    dataset, partition = data_spec(args)
    options = ", ".join(f"{k} = {v!r}" for k, v in CODE_OPTIONS[args.method].items())
    print(f"fedbus bench authors: {args.method}, {args.clients} clients, "
          f"{Path(dataset.split(':', 1)[-1]).name} {partition}, {args.arch}, "
          f"{args.epochs} epoch(s) of batch {args.batch_size}, lr {args.lr}, momentum "
          f"{args.momentum}, weight decay {args.weight_decay}, {args.rounds} rounds, seed "
          f"{args.seed}; the code's options: {options}")
    if fb.get("load"):
        print("  load average before / after the fedbus run: "
              + " | ".join(" ".join(f"{v:.2f}" for v in lo) for lo in fb["load"]))
    print("\n".join(table(args.method, fb, ref)))
    if args.json:
        Path(args.json).write_text(json.dumps({"config": cfg, "fedbus": fb, "authors": ref},
                                              indent=1))
    return 0


if __name__ == "__main__":  # python -m fedbus.bench.authors
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_arguments(parser)
    raise SystemExit(main_args(parser.parse_args()))
