"""Real FedProto training speed: fedbus beside a single-process reference loop.

    fedbus bench train                     # the issue's row, 5 rounds
    fedbus bench train --rounds 10 --json train.json --out runs/train
    fedbus bench train --export-htfllib ../HtFLlib/dataset/FEDBUS  # run HtFLlib itself

The row: FedProto (Tan et al. 2022, fedbus.algorithms.fedproto at its defaults: lam 1,
per-sample MSE to the class's global prototype, count-weighted aggregation, prototypes
from an eval-mode pass after training, inference over every class with a global
prototype), 20 clients, the offline MNIST-10k, Dirichlet(0.1) label skew, the 4-layer CNN
of HtFLlib/FedTGP (cnn4), batch 10, 1 local epoch, SGD lr 0.01 (momentum 0.5, fedbus's
default), every client trained and evaluated every round.

Two sides, one after the other in the same invocation, on the same partition
(fedbus.node.setup.federated_data of the same [data] table and seed) and the same
networks (fedbus.node.setup.make_model: the same seeded initial weights):

- fedbus: one real `fedbus run` (broker, server, --nodes client-node processes, message
  log on as in a default run). Time per round = the server's round_s (first task sent to
  aggregation) + eval_s (evaluation requests to the last result), from metrics.jsonl.
- reference: one Python process doing per round what HtFLlib's FedProto does
  (system/flcore/clients/clientproto.py, servers/serverproto.py, with clienttgp.py's
  collect_protos pass), every client in turn: a torch DataLoader over the client's tensors
  (batch 10, in a seeded random order), one epoch of CE + lam * MSE(feature, its label's global
  prototype); the collect pass (eval mode, a DataLoader of batch 10, per-sample lists of
  features averaged per class); the server's per-class average; then every client
  evaluated by its head and by the nearest global prototype over a test DataLoader of
  batch 10. torch threads: every core the process may use (HtFLlib sets none, so torch's
  default applies; --threads overrides).
  Style "htfllib" keeps HtFLlib's per-sample Python loops (the target rows built one
  sample at a time, features appended one sample at a time, the nearest-prototype search
  as a sample x class loop of MSEs); style "lean" is the same computation vectorised
  (index batches, index_add_ class sums, cdist; collect and evaluation passes in batches
  of 512, as fedbus does them): what one process needs at the least.
  Where HtFLlib differs from fedbus's FedProto defaults the reference follows fedbus, so
  both sides compute the same thing: an SGD per client with fedbus's momentum, its
  state emptied at every task as train.optimizer_state says (default "fresh": as a new
  SGD, HtFLlib's choice; HtFLlib's has no momentum), count-weighted prototype averaging
  (HtFLlib: unweighted), the last partial batch kept (HtFLlib's loaders drop it), the
  batch order of fedbus's task seed (a DataLoader seeded with it draws the same
  permutation as fedbus's LocalRun), and evaluation after aggregation (HtFLlib scores
  at the start of the next round, the same models) by head and prototypes (HtFLlib's
  FedProto scores prototypes only).

Printed: time per round (median and mean over rounds), total, accuracy of the head and
of the prototypes (mean over clients of each client's test accuracy) at every round for
each side, fedbus / reference, and CPU seconds (fedbus's node processes over the whole
run, start-up included, where fedbus.bench.common records them; the reference's process
over its rounds). The machine may be shared: the load averages before and after are
printed; compare ratios from one invocation, not figures across invocations. A reference
on several threads suffers most from a busy core (each parallel op waits for its slowest
thread): its CPU seconds then grow well past its wall time.

Running HtFLlib itself (optional, for the record): --export-htfllib DIR writes this
partition in HtFLlib's dataset layout (DIR/train/<i>.npz, DIR/test/<i>.npz, each
{"data": {"x", "y"}}, the arrays fedbus trains on) and prints the main.py command line.
HtFLlib's main.py imports every algorithm's server, so it needs torchvision, scikit-learn
and the FedKTL generators' packages installed; it has no 1-channel model family: add one
locally (not part of fedbus):

    elif args.model_family == "CNN-1":
        args.models = ['FedAvgCNN(in_features=1, num_classes=args.num_classes, dim=1024)']

then, with DIR = HtFLlib/dataset/FEDBUS, from HtFLlib/system:

    python main.py -data FEDBUS -m CNN-1 -algo FedProto -nc 20 -gr 5 -lbs 10 -ls 1 \\
        -lr 0.01 -lam 1 -eg 1 -fd 512 -ncl 10 -dev cpu

(its last line of timing is the mean time per round after the first).

Cohort training (train.cohort, fedbus.algorithms.core.cohort), side by side in one
invocation: --cohort off|on|auto runs fedbus alone in that mode; --cohort both runs it
twice, off then on, on the same partition and seeds, and prints per-round time and accuracy
of each with their ratio (no reference loop unless --reference names one). --setting picks
the row: "fedproto-mnist" (default, the row above: cnn4, where auto is off on the CPU) or
"michieli-synthetic" (Michieli & Ozay's synthetic setting as the michieli-synthetic recipe:
FedProx's synthetic data phi1 = phi2 = 1, 60-dim, 10 classes, natural power-law sizes, 80/20
split, mlp:128 with a 256-d feature layer, batch 10, lr 0.01, no momentum, F = 20 local
epochs; every one of the 30 clients in every round, where the recipe samples 10, so a node's
cohort holds its 15). --algorithm, --arch, --epochs, --clients, --nodes override the
setting's. --device cuda puts the nodes on the GPU (launch.devices) and then samples the
GPU's utilisation during each run (torch.cuda.utilization, else nvidia-smi; "unavailable"
when neither answers) and measures, in this process on that device, the share of a FedProto
local epoch spent in prototype maths (--proto-share forces it on the CPU): one epoch of
--proto-clients clients through the node's own task path (run_tasks) with every class's
global prototype present, against the same epoch with none (the loss is then the plain
cross-entropy), plus the eq. 3 prototype pass after training, each timed apart.

    fedbus bench train --cohort both --setting michieli-synthetic --rounds 3
    fedbus bench train --cohort both --rounds 3            # the cnn4 row (auto: off on CPU)
    fedbus bench train --cohort both --device cuda --nodes 1 --clients 50 --rounds 3
"""
from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "data" / "mnist-10k.npz"
STYLES = ("htfllib", "lean")
SETTINGS = ("fedproto-mnist", "michieli-synthetic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=5, help="rounds for both sides (default 5)")
    p.add_argument("--clients", type=int, default=None,
                   help="clients (default 20; 30 for michieli-synthetic)")
    p.add_argument("--alpha", type=float, default=0.1, help="Dirichlet label skew (default 0.1)")
    p.add_argument("--arch", default=None,
                   help="model.arch (default cnn4; mlp:128 for michieli-synthetic)")
    p.add_argument("--batch-size", type=int, default=10)
    p.add_argument("--nodes", type=int, default=2, help="fedbus client-node processes (default 2)")
    p.add_argument("--data", default=str(MNIST),
                   help="an npz file, or a dataset name such as digits "
                   "(default ../shared/data/mnist-10k.npz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", choices=[*STYLES, "both", "none"], default=None,
                   help="reference loop style(s) to run (default both; none with --cohort)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of the reference (default 0: every core this process "
                   "may use, torch's default and so HtFLlib's)")
    p.add_argument("--out", default=None, help="folder for the fedbus run (default temporary)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures here")
    p.add_argument("--export-htfllib", default=None, metavar="DIR",
                   help="write the partition in HtFLlib's dataset layout to DIR and exit")
    p.add_argument("--cohort", type=_cohort_modes, default=None, metavar="MODES",
                   help="cohort training: run fedbus with train.cohort = off, on or auto, or "
                   "several side by side (both = off,on; e.g. off,auto); no reference loop "
                   "unless --reference is given")
    p.add_argument("--partition", default=None,
                   help="data.partition (michieli-synthetic: natural, its power-law sizes; "
                   "iid = equal sizes)")
    p.add_argument("--setting", choices=SETTINGS, default="fedproto-mnist",
                   help="the row: fedproto-mnist (default) or michieli-synthetic")
    p.add_argument("--algorithm", default=None,
                   help="algorithm.name (default: fedproto; fedavg for michieli-synthetic)")
    p.add_argument("--epochs", type=int, default=None,
                   help="local epochs (default 1; 20 for michieli-synthetic)")
    p.add_argument("--device", default=None,
                   help="launch.devices for the nodes: cpu, cuda, cuda:N (default: the "
                   "config's auto)")
    p.add_argument("--rows", default=None, metavar="ARCH:CLIENTS,...",
                   help="with --cohort: several rows in one invocation, each an architecture "
                   "and a client count (e.g. cnn4:20,cnn4:100,resnet8:20), one summary table "
                   "at the end")
    p.add_argument("--proto-share", action="store_true",
                   help="measure the prototype maths' share of a FedProto local epoch "
                   "(always with --device cuda)")
    p.add_argument("--proto-clients", type=int, default=0,
                   help="clients in that measurement (default: the clients a node hosts)")


def _cohort_modes(value: str) -> str:
    modes = ["off", "on"] if value == "both" else value.split(",")
    if not modes or any(m not in ("off", "on", "auto") for m in modes):
        raise argparse.ArgumentTypeError(f"--cohort: off, on, auto, both or a comma list of "
                                         f"them, not {value!r}")
    return value


def dataset_spec(data: str) -> str:
    """The [data] dataset value: "npz:PATH" for a file, else the name as given."""
    return f"npz:{data}" if Path(data).is_file() else data


def defaults(args: argparse.Namespace) -> argparse.Namespace:
    """The options the setting decides where they were not given."""
    synthetic = getattr(args, "setting", "fedproto-mnist") == "michieli-synthetic"
    for key, plain, michieli in (("clients", 20, 30), ("arch", "cnn4", "mlp:128"),
                                 ("algorithm", "fedproto", "fedavg"), ("epochs", 1, 20)):
        if getattr(args, key, None) is None:
            setattr(args, key, michieli if synthetic else plain)
    if getattr(args, "reference", None) is None:
        args.reference = "none" if getattr(args, "cohort", None) else "both"
    return args


def sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The row's config (as /work/perf/fedproto-row.toml), from the options."""
    defaults(args)
    cfg = {
        "federation": {"clients": args.clients, "rounds": args.rounds, "eval_every": 1,
                       "seed": args.seed, "start_timeout_s": 600.0},
        "data": {"dataset": dataset_spec(args.data), "partition": "dirichlet",
                 "alpha": args.alpha},
        "model": {"arch": args.arch},
        "algorithm": {"name": args.algorithm},
        "train": {"epochs": args.epochs, "batch_size": args.batch_size, "lr": 0.01},
        "launch": {"nodes": args.nodes},
        "log": {"level": "warning"},
    }
    if getattr(args, "setting", None) == "michieli-synthetic":  # recipes/michieli.toml
        cfg["data"] = {"dataset": "synthetic", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
                       "partition": "natural", "test_fraction": 0.2}
        if args.arch == "mlp:128":
            cfg["model"]["feature_dim"] = 256
        cfg["train"]["momentum"] = 0.0
    if getattr(args, "partition", None):
        cfg["data"]["partition"] = args.partition
    if getattr(args, "device", None):
        cfg["launch"]["devices"] = [args.device]
    return cfg


def summary_stats(per_round: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(per_round), "mean_s": statistics.mean(per_round),
            "total_s": sum(per_round)}


# --------------------------------------------------------------------------- fedbus
def fedbus_side(cfg: dict[str, dict[str, Any]], out: Path,
                name: str = "fedbus") -> dict[str, Any]:
    """One real `fedbus run` of cfg: per-round times and accuracies from its metrics,
    and the partition its nodes trained and tested on (from the server's message log)."""
    from fedbus.bench.common import floor_figures, run, watch, write_toml
    from fedbus.node.lifetime import fedbus_command

    if cfg.get("log", {}).get("level") == "info":  # run() quiets the processes to warnings
        run_dir = out / name
        res = watch(fedbus_command("run", str(write_toml(out / f"{name}.toml", cfg)), "--out",
                                   str(run_dir), "--quiet", "--log-level", "info"),
                    name, run_dir, timeout=3600, what="fedbus run")
    else:
        res = run(cfg, name, out=out, timeout=3600)
    records = sorted((r for r in res.records if "acc_mean" in r), key=lambda r: r["round"])
    per_round = [float(r["round_s"]) + float(r.get("eval_s", 0.0)) for r in records]
    walls = [float(r["wall_s"]) for r in records]
    train, test = logged_sizes(res.run_dir)
    return {"run_dir": str(res.run_dir), "per_round_s": per_round,
            "round_s": [float(r["round_s"]) for r in records],
            "eval_s": [float(r.get("eval_s", 0.0)) for r in records],
            "wall_s_diffs": [b - a for a, b in itertools.pairwise(walls)],
            "failed": [int(r.get("failed", 0)) for r in records],
            "acc": [r.get("acc_mean") for r in records],
            "proto_acc": [r.get("proto_acc_mean") for r in records],
            "train_sizes": train, "test_sizes": test, "run_wall_s": res.wall_s,
            # CPU seconds of the node processes over the whole run, start-up included
            # (known where fedbus.bench.common records them)
            "node_cpu_s": sum(sec for role, sec in getattr(res, "cpu_by_pid", {}).values()
                              if role == "node") or None,
            **summary_stats(per_round),
            **floor_figures(res, int(cfg.get("launch", {}).get("nodes", 1)),
                            statistics.median(per_round) * 1000 if per_round else None)}


def logged_sizes(run_dir: Path) -> tuple[list[int] | None, list[int] | None]:
    """Each client's training-set size (its updates' num_samples) and test-set size (its
    eval results' num_test) as the server received them; None without a message log."""
    from fedbus.broker.wire import decode
    from fedbus.node.engine import client_index
    from fedbus.record.msglog import read_log

    if not (Path(run_dir) / "messages.bin").exists():
        return None, None
    train: dict[int, int] = {}
    test: dict[int, int] = {}
    for rec in read_log(run_dir):
        if rec.direction != "in":
            continue
        msg = decode(rec.frames)
        if not isinstance(msg.body, dict):
            continue
        if msg.kind == "update":
            train[client_index(msg.src)] = int(msg.body["num_samples"])
        elif msg.kind == "eval_result":
            test[client_index(msg.src)] = int(msg.body["metrics"]["num_test"])
    n = max([*train, *test], default=-1) + 1
    return ([train.get(i, -1) for i in range(n)] if train else None,
            [test.get(i, -1) for i in range(n)] if test else None)


# --------------------------------------------------------------------------- reference
class Reference:
    """The single-process FedProto loop (module doc): every client's data, network and
    optimizer in this process, trained, aggregated and evaluated in turn."""

    def __init__(self, cfg_sections: dict[str, dict[str, Any]], style: str = "htfllib"):
        import torch

        from fedbus.algorithms.core.params import default_of
        from fedbus.algorithms.fedproto import FedProtoServer
        from fedbus.node.config import build_config
        from fedbus.node.setup import federated_data, make_model

        if style not in STYLES:
            raise ValueError(f"style must be one of {STYLES}, got {style!r}")
        self.style = style
        cfg = build_config(cfg_sections)
        params = {k: cfg.algorithm.get(k, default_of(v)) for k, v in FedProtoServer.PARAMS.items()}
        # the loop implements FedProto's defaults; anything else would compare unlike things
        fixed = {"proto_loss": "mse", "keep_missing": True, "infer_classes": "all",
                 "proto_source": "after"}
        for key, want in fixed.items():
            if params[key] != want:
                raise ValueError(f"the reference loop implements {key} = {want!r}, "
                                 f"not {params[key]!r}")
        self.lam = float(params["lam"])
        self.weighted = params["aggregate"] == "weighted"
        self.fresh_optimizer = cfg.train["optimizer_state"] == "fresh"
        self.seed = cfg.federation.seed
        self.batch_size = int(cfg.train["batch_size"])
        self.epochs = int(cfg.train["epochs"])
        data = federated_data(cfg)
        self.num_classes = data.num_classes
        self.clients = []
        for i in range(data.num_clients):
            d = data.client(i)
            model = make_model(cfg, i, data)
            opt = torch.optim.SGD(model.parameters(), lr=cfg.train["lr"],
                                  momentum=cfg.train["momentum"],
                                  weight_decay=cfg.train["weight_decay"])
            self.clients.append({
                "x": torch.from_numpy(np.ascontiguousarray(d.train_x, np.float32)),
                "y": torch.from_numpy(np.ascontiguousarray(d.train_y, np.int64)),
                "tx": torch.from_numpy(np.ascontiguousarray(d.test_x, np.float32)),
                "ty": torch.from_numpy(np.ascontiguousarray(d.test_y, np.int64)),
                "model": model, "opt": opt})
        self.global_protos: dict[int, Any] = {}  # class -> [D] tensor (HtFLlib's dict)
        self.round = 0

    @property
    def train_sizes(self) -> list[int]:
        return [len(c["y"]) for c in self.clients]

    @property
    def test_sizes(self) -> list[int]:
        return [len(c["ty"]) for c in self.clients]

    def run(self, rounds: int, on_round=None) -> list[dict[str, float]]:
        out = []
        for _ in range(rounds):
            out.append(self.one_round())
            if on_round is not None:
                on_round(out[-1])
        return out

    def one_round(self) -> dict[str, float]:
        """Train every client, aggregate, evaluate every client: seconds and accuracies."""
        from fedbus.node.engine import task_seed

        t0, cpu0 = time.perf_counter(), time.process_time()
        uploads = []
        for i, c in enumerate(self.clients):
            self.train(c, task_seed(self.seed, i, self.round))
            uploads.append(self.collect(c))
        t1 = time.perf_counter()
        self.aggregate(uploads)
        t2 = time.perf_counter()
        scores = [self.evaluate(c) for c in self.clients]
        t3 = time.perf_counter()
        self.round += 1
        accs = [a for a, _ in scores if not math.isnan(a)]
        protos = [p for _, p in scores if not math.isnan(p)]
        return {"round": self.round - 1, "train_s": t1 - t0, "aggregate_s": t2 - t1,
                "eval_s": t3 - t2, "round_s": t3 - t0, "cpu_s": time.process_time() - cpu0,
                "acc": float(np.mean(accs)) if accs else float("nan"),
                "proto_acc": float(np.mean(protos)) if protos else float("nan")}

    # -- one client's local update -----------------------------------------------------
    def train(self, c: dict[str, Any], seed: int) -> None:
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset

        model, opt = c["model"], c["opt"]
        if self.fresh_optimizer:
            opt.state.clear()  # as fedbus's LocalRun does at the start of a task
        model.train()
        have = sorted(self.global_protos)
        if self.style == "lean" and have:
            table = torch.zeros(self.num_classes, self._dim(), dtype=torch.float32)
            has = torch.zeros(self.num_classes, dtype=torch.bool)
            for k in have:
                table[k], has[k] = self.global_protos[k], True
        for _ in range(self.epochs):
            # the shuffle of fedbus's LocalRun for this task seed (a DataLoader's own
            # shuffle would draw a worker seed from its generator first)
            order = torch.randperm(len(c["y"]), generator=torch.Generator().manual_seed(seed))
            if self.style == "htfllib":
                batches = DataLoader(TensorDataset(c["x"], c["y"]), self.batch_size,
                                     sampler=order.tolist())
            else:
                batches = ((c["x"].index_select(0, idx), c["y"].index_select(0, idx))
                           for idx in order.split(self.batch_size))
            for x, y in batches:
                rep = model.features(x)
                loss = F.cross_entropy(model.head(rep), y)
                if have and self.lam > 0:
                    if self.style == "htfllib":  # clientproto.py's proto_new, row by row
                        target = copy.deepcopy(rep.detach())
                        for j, yy in enumerate(y):
                            y_c = yy.item()
                            if y_c in self.global_protos:
                                target[j, :] = self.global_protos[y_c].data
                    else:
                        target = torch.where(has[y].unsqueeze(1), table[y], rep.detach())
                    loss = loss + self.lam * F.mse_loss(target, rep)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

    def _dim(self) -> int:
        return int(next(iter(self.global_protos.values())).shape[0])

    def collect(self, c: dict[str, Any]) -> tuple[dict[int, Any], dict[int, int]]:
        """The client's prototypes after training (eval mode, every training sample) and
        its class counts: ({class: mean feature [D]}, {class: samples})."""
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        model = c["model"]
        model.eval()
        with torch.no_grad():
            if self.style == "htfllib":  # clienttgp.py's collect_protos + agg_func
                lists = defaultdict(list)
                for x, y in DataLoader(TensorDataset(c["x"], c["y"]), self.batch_size,
                                       shuffle=False):
                    rep = model.features(x)
                    for j, yy in enumerate(y):
                        lists[yy.item()].append(rep[j, :].detach().data)
                protos = {}
                for k, rows in lists.items():
                    total = 0 * rows[0]
                    for r in rows:
                        total += r
                    protos[k] = total / len(rows)
                counts = {k: len(rows) for k, rows in lists.items()}
            else:
                sums = counts_t = None
                for i in range(0, len(c["y"]), 512):
                    h = model.features(c["x"][i:i + 512]).float()
                    y = c["y"][i:i + 512]
                    s = torch.zeros(self.num_classes, h.shape[1]).index_add_(0, y, h)
                    n = torch.bincount(y, minlength=self.num_classes)
                    sums = s if sums is None else sums + s
                    counts_t = n if counts_t is None else counts_t + n
                protos, counts = {}, {}
                if sums is not None:
                    for k in torch.nonzero(counts_t).flatten().tolist():
                        protos[k] = sums[k] / counts_t[k]
                        counts[k] = int(counts_t[k])
        model.train()
        return protos, counts

    # -- the server ---------------------------------------------------------------------
    def aggregate(self, uploads: list[tuple[dict[int, Any], dict[int, int]]]) -> None:
        """Per class, the mean of the clients' prototypes weighted by their class counts
        (FedProto eq. 6, fedbus's default) or unweighted (aggregate = "mean", HtFLlib's);
        a class nobody sent keeps its prototype."""
        by_class = defaultdict(list)
        for protos, counts in uploads:
            for k, p in protos.items():
                by_class[k].append((p, counts[k] if self.weighted else 1))
        for k, rows in by_class.items():
            total = 0 * rows[0][0]
            mass = 0
            for p, w in rows:
                total = total + w * p
                mass += w
            self.global_protos[k] = total / mass

    # -- evaluation ---------------------------------------------------------------------
    def evaluate(self, c: dict[str, Any]) -> tuple[float, float]:
        """(head accuracy, nearest-prototype accuracy) on the client's test split."""
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset

        model = c["model"]
        n = len(c["ty"])
        if n == 0:
            return float("nan"), float("nan")
        model.eval()
        head = proto = 0
        with torch.no_grad():
            if self.style == "htfllib":  # clientproto.py's test_metrics, plus the head
                for x, y in DataLoader(TensorDataset(c["tx"], c["ty"]), self.batch_size,
                                       shuffle=False):
                    rep = model.features(x)
                    head += (model.head(rep).argmax(1) == y).sum().item()
                    if self.global_protos:
                        output = float("inf") * torch.ones(y.shape[0], self.num_classes)
                        for j, r in enumerate(rep):
                            for k, pro in self.global_protos.items():
                                output[j, k] = F.mse_loss(r, pro)
                        proto += (output.argmin(1) == y).sum().item()
            else:
                classes = sorted(self.global_protos)
                table = (torch.stack([self.global_protos[k] for k in classes])
                         if classes else None)
                ids = torch.tensor(classes, dtype=torch.int64)
                for i in range(0, n, 512):
                    rep = model.features(c["tx"][i:i + 512])
                    y = c["ty"][i:i + 512]
                    head += (model.head(rep).argmax(1) == y).sum().item()
                    if table is not None:
                        near = ids[torch.cdist(rep.float(), table).argmin(1)]
                        proto += (near == y).sum().item()
        model.train()
        return head / n, (proto / n if self.global_protos else float("nan"))


def reference_side(cfg: dict[str, dict[str, Any]], rounds: int, style: str,
                   threads: int) -> dict[str, Any]:
    """The reference loop for `rounds` rounds on `threads` torch threads (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ref = Reference(cfg, style)
        rows = ref.run(rounds)
    finally:
        torch.set_num_threads(before)
    per_round = [r["round_s"] for r in rows]
    return {"style": style, "threads": threads, "per_round_s": per_round,
            "train_s": [r["train_s"] for r in rows], "eval_s": [r["eval_s"] for r in rows],
            "cpu_s": sum(r["cpu_s"] for r in rows),
            "acc": [r["acc"] for r in rows], "proto_acc": [r["proto_acc"] for r in rows],
            "train_sizes": ref.train_sizes, "test_sizes": ref.test_sizes,
            **summary_stats(per_round)}


# --------------------------------------------------------------------------- HtFLlib
def export_htfllib(cfg: dict[str, dict[str, Any]], folder: Path) -> int:
    """The partition in HtFLlib's dataset layout; returns the number of clients."""
    from fedbus.node.config import build_config
    from fedbus.node.setup import federated_data

    data = federated_data(build_config(cfg))
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True, exist_ok=True)
    for i in range(data.num_clients):
        d = data.client(i)
        for split, x, y in (("train", d.train_x, d.train_y), ("test", d.test_x, d.test_y)):
            with open(folder / split / f"{i}.npz", "wb") as f:
                np.savez_compressed(f, data={"x": np.asarray(x, np.float32),
                                             "y": np.asarray(y, np.int64)})
    return data.num_clients


# --------------------------------------------------------------------------- output
def _fmt_acc(v: float | None) -> str:
    return "   -  " if v is None or math.isnan(float(v)) else f"{float(v):.4f}"


def report(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    fb, refs = result.get("fedbus"), result.get("reference", {})
    load = {k: " / ".join(f"{v:.2f}" for v in result[k]) for k in ("load_before", "load_after")}
    lines = [(f"fedbus bench train: FedProto, {args.clients} clients, "
              f"{Path(args.data).name} Dir({args.alpha}), {args.arch}, batch {args.batch_size}, "
              f"1 epoch, lr 0.01, {args.rounds} rounds, every client evaluated every round"),
             (f"  machine: {result['cores']} cores; load average before {load['load_before']}, "
              f"after {load['load_after']}"),
             (f"  {'':<40}{'per round: median':>18}{'mean':>9}{'total':>9}"
              f"{'acc (head)':>12}{'proto_acc':>11}")]
    rows = []
    if fb:
        threads = result.get("node_threads")
        plural = "s" if threads != 1 else ""
        rows.append((f"fedbus ({args.nodes} nodes x {threads or '?'} thread{plural})", fb))
    for style, ref in refs.items():
        rows.append((f"reference {style} (1 process, {ref['threads']} threads)", ref))
    for name, side in rows:
        lines.append(f"  {name:<40}{side['median_s']:>16.2f} s{side['mean_s']:>7.2f} s"
                     f"{side['total_s']:>7.1f} s{_fmt_acc(side['acc'][-1]):>12}"
                     f"{_fmt_acc(side['proto_acc'][-1]):>11}")
    if fb and any(fb.get("failed", [])):
        lines.append(f"  WARNING: fedbus rounds lost updates ({fb['failed']} per round): "
                     "its times and accuracies are not comparable")
    if fb and fb.get("wall_s_diffs"):
        lines.append(f"  fedbus wall_s differences between rounds: median "
                     f"{statistics.median(fb['wall_s_diffs']):.2f} s")
    cpu = ([f"fedbus nodes {fb['node_cpu_s']:.1f} s (whole run, start-up included)"]
           if fb and fb.get("node_cpu_s") else [])
    cpu += [f"reference {style} {ref['cpu_s']:.1f} s (its rounds)" for style, ref in refs.items()]
    if cpu:
        lines.append("  CPU seconds: " + "; ".join(cpu))
    for style, ratio in result.get("ratio", {}).items():
        lines.append(f"  fedbus / reference {style}: {ratio['median']:.2f} (median per round), "
                     f"{ratio['mean']:.2f} (mean), {ratio['total']:.2f} (total)")
    if fb and fb.get("floor_ms"):
        from fedbus.bench.common import floor_lines

        lines += floor_lines([(f"{name[:30]}, median round", side["median_s"] * 1000)
                              for name, side in rows], fb)
    if fb and refs:
        names = ["fedbus", *refs]
        lines.append("  accuracy per round (acc / proto_acc): "
                     + " | ".join(f"{n:>17}" for n in names))
        for r in range(args.rounds):
            cells = [fb, *refs.values()]
            lines.append(f"  {'round ' + str(r):<38}"
                         + " | ".join(f"{_fmt_acc(s['acc'][r])} / {_fmt_acc(s['proto_acc'][r])}"
                                      if r < len(s["acc"]) else f"{'-':>17}" for s in cells))
        same = result.get("same_partition")
        lines.append("  partition: " + (
            f"the same on both sides ({sum(next(iter(refs.values()))['train_sizes']):,} training "
            f"and {sum(next(iter(refs.values()))['test_sizes']):,} test samples over "
            f"{args.clients} clients, sizes compared client by client)" if same else
            "NOT the same on both sides" if same is False else
            "fedbus's sizes unknown (no message log)"))
    return lines


# --------------------------------------------------------------------------- cohort
class GpuSampler:
    """The GPU's utilisation (%), sampled every `every` seconds in a thread while a run
    goes: torch.cuda.utilization() (NVML), else nvidia-smi; `source` None = unavailable."""

    def __init__(self, device: str, every: float = 0.2):
        import threading

        self.device, self.every = device, every
        self.samples: list[float] = []
        self.source = self._probe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _index(self) -> int:
        return int(self.device.split(":")[1]) if ":" in self.device else 0

    def _read(self, source: str) -> float:
        if source == "torch":
            import torch

            return float(torch.cuda.utilization(self._index()))
        import subprocess

        out = subprocess.run(["nvidia-smi", f"--id={self._index()}",
                              "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return float(out.strip().splitlines()[0])

    def _probe(self) -> str | None:
        for source in ("torch", "nvidia-smi"):
            try:
                self._read(source)
                return source
            except Exception:  # NVML or the tool missing: try the next, else unavailable
                continue
        return None

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.samples.append(self._read(self.source))
            except Exception:
                pass

    def __enter__(self) -> "GpuSampler":
        if self.source is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def summary(self) -> dict[str, Any]:
        if self.source is None:
            return {"source": None}
        busy = [v for v in self.samples if v > 0]
        return {"source": self.source, "samples": len(self.samples),
                "mean": statistics.mean(self.samples) if self.samples else None,
                "max": max(self.samples, default=None),
                "mean_busy": statistics.mean(busy) if busy else None}


def proto_share(cfg: dict[str, dict[str, Any]], device: str, clients: int,
                mode: str) -> dict[str, float]:
    """Seconds of one FedProto local epoch of `clients` clients on `device`, through the
    node's task path (run_tasks, train.cohort = `mode`): with every class's global prototype
    (the regulariser on), with none (plain cross-entropy), and the eq. 3 prototype pass
    after training alone; the share of prototype maths = (regulariser's extra + the pass) /
    the epoch with the regulariser. Each timed after one warm-up epoch, best of 3."""
    import numpy as np_
    import torch

    from fedbus.algorithms.core.protos import local_prototypes
    from fedbus.node.client_host import ClientPool, run_tasks
    from fedbus.node.config import build_config
    from fedbus.node.engine import task_seed

    raw = copy.deepcopy(cfg)
    raw["algorithm"] = {"name": "fedproto"}
    raw["train"] = {**raw["train"], "epochs": 1, "cohort": mode}
    conf = build_config(raw)
    dev = torch.device(device)
    pool = ClientPool(conf, dev, clients=list(range(min(clients, conf.federation.clients))),
                      memory_mb=1e9)
    hosted = pool.node_data.clients
    c, d = pool.data.num_classes, pool.get(hosted[0]).ctx.feature_dim
    rng = np_.random.default_rng(0)
    protos = rng.standard_normal((c, d)).astype(np_.float32) * 0.1

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def epoch(has: bool) -> float:
        bodies = [{"task": 1, "version": 0, "epochs": 1, "seed": task_seed(0, k, 0),
                   "payload": {"protos": protos, "has": np_.full(c, has)}} for k in hosted]
        handlers = [pool.get(k) for k in hosted]
        sync()
        t0 = time.perf_counter()
        run_tasks(handlers, bodies, mode)
        sync()
        return time.perf_counter() - t0

    def pass_only() -> float:
        sync()
        t0 = time.perf_counter()
        for k in hosted:
            ctx = pool.get(k).ctx
            local_prototypes(ctx.model, ctx.train_x, ctx.train_y, c)
        sync()
        return time.perf_counter() - t0

    import logging

    logging.getLogger("fedbus.node").setLevel(logging.WARNING)  # no line per epoch here
    epoch(True)  # warm-up: allocations, kernels
    with_reg = min(epoch(True) for _ in range(3))
    without = min(epoch(False) for _ in range(3))
    protos_pass = min(pass_only() for _ in range(3))
    share = (max(0.0, with_reg - without) + protos_pass) / with_reg
    return {"clients": len(hosted), "epoch_s": with_reg, "epoch_ce_s": without,
            "protos_pass_s": protos_pass, "share": share}


def cohort_main(args: argparse.Namespace, cfg: dict[str, dict[str, Any]],
                keep: dict[str, Any] | None = None) -> int:
    """--cohort: fedbus in each mode asked for, side by side (module doc)."""
    modes = ["off", "on"] if args.cohort == "both" else args.cohort.split(",")
    from fedbus.bench.common import out_dir

    out = out_dir(args.out, "train")
    device = args.device or "cpu"
    result: dict[str, Any] = {"config": cfg, "load_before": os.getloadavg(), "modes": {}}
    if keep is not None:
        result = keep
        result.update({"config": cfg, "load_before": os.getloadavg(), "modes": {}})
    for mode in modes:
        run_cfg = copy.deepcopy(cfg)
        run_cfg["log"]["level"] = "info"  # the nodes' "cohort trained" / "cohort off" lines
        run_cfg["train"]["cohort"] = mode
        print(f"fedbus bench train: fedbus run, train.cohort = {mode}, in {out} ...",
              flush=True)
        sampler = GpuSampler(device) if device.startswith("cuda") else None
        if sampler is not None:
            with sampler:
                side = fedbus_side(run_cfg, out, name=f"cohort-{mode}")
            side["gpu_util"] = sampler.summary()
        else:
            side = fedbus_side(run_cfg, out, name=f"cohort-{mode}")
        side["cohorts"] = _cohort_log(Path(side["run_dir"]))
        result["modes"][mode] = side
    if device.startswith("cuda") or args.proto_share:
        per_node = -(-int(cfg["federation"]["clients"]) // int(cfg["launch"]["nodes"]))
        clients = args.proto_clients or per_node
        result["proto_share"] = {}
        for mode in modes:
            print(f"fedbus bench train: prototype maths share ({clients} clients, "
                  f"{device}, cohort {mode}) ...", flush=True)
            result["proto_share"][mode] = proto_share(cfg, device, clients, mode)
    result["load_after"] = os.getloadavg()
    print("\n".join(cohort_report(args, result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def _cohort_log(run_dir: Path) -> dict[str, Any]:
    """What the nodes logged about cohorts: trained cohorts (count, mean size) and the
    reasons clients trained one by one."""
    sizes, reasons = [], set()
    for path in (run_dir / "logs").glob("node-*.jsonl"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "cohort trained":
                sizes.append(int(rec.get("clients", 0)))
            elif rec.get("event") == "cohort off":
                reasons.add(str(rec.get("reason")))
    return {"cohorts": len(sizes), "mean_size": statistics.mean(sizes) if sizes else 0.0,
            "off_reasons": sorted(reasons)}


def cohort_report(args: argparse.Namespace, result: dict[str, Any]) -> list[str]:
    cfg = result["config"]
    load = {k: " / ".join(f"{v:.2f}" for v in result[k]) for k in ("load_before", "load_after")}
    tr = cfg["train"]
    lines = [(f"fedbus bench train --cohort {args.cohort}: {args.setting}, {args.algorithm}, "
              f"{cfg['federation']['clients']} clients in {cfg['launch']['nodes']} nodes, "
              f"{cfg['model']['arch']}, {cfg['data']['dataset']} "
              f"({cfg['data']['partition']}), batch {tr['batch_size']}, "
              f"{tr['epochs']} local epoch(s), {args.rounds} rounds, device "
              f"{args.device or 'cpu (auto)'}"),
             f"  load average before {load['load_before']}, after {load['load_after']}",
             (f"  {'train.cohort':<14}{'per round: median':>18}{'mean':>9}{'total':>9}"
              f"{'acc':>9}{'proto_acc':>11}  cohorts (mean size)  GPU util mean/max")]
    modes = result["modes"]
    for mode, side in modes.items():
        gpu = side.get("gpu_util")
        util = ("-" if gpu is None else "unavailable" if gpu["source"] is None else
                f"{gpu['mean'] or 0:.0f}% / {gpu['max'] or 0:.0f}% ({gpu['source']})")
        co = side["cohorts"]
        lines.append(f"  {mode:<14}{side['median_s']:>16.2f} s{side['mean_s']:>7.2f} s"
                     f"{side['total_s']:>7.1f} s{_fmt_acc(side['acc'][-1]):>9}"
                     f"{_fmt_acc(side['proto_acc'][-1]):>11}  {co['cohorts']:>7} "
                     f"({co['mean_size']:.1f}){'':>6}{util}")
        for reason in co["off_reasons"]:
            lines.append(f"    one by one: {reason}")
    if "off" in modes and len(modes) > 1:
        off = modes["off"]
        for mode, side in modes.items():
            if mode != "off":
                lines.append(f"  speed-up {mode} over off: "
                             f"{off['median_s'] / side['median_s']:.2f}x (median per round), "
                             f"{off['total_s'] / side['total_s']:.2f}x (total)")
    lines.append("  per round (s; acc): " + " | ".join(f"{m:>20}" for m in modes))
    for r in range(args.rounds):
        cells = []
        for side in modes.values():
            cells.append(f"{side['per_round_s'][r]:>8.2f} s {_fmt_acc(side['acc'][r])}"
                         if r < len(side["per_round_s"]) else f"{'-':>20}")
        lines.append(f"  {'round ' + str(r):<19}" + " | ".join(cells))
    for mode, ps in result.get("proto_share", {}).items():
        lines.append(f"  prototype maths, cohort {mode}: {100 * ps['share']:.1f} % of a FedProto "
                     f"local epoch ({ps['clients']} clients: epoch {ps['epoch_s']:.3f} s, "
                     f"without the regulariser {ps['epoch_ce_s']:.3f} s, eq. 3 pass "
                     f"{ps['protos_pass_s']:.3f} s)")
    return lines


def rows_main(args: argparse.Namespace) -> int:
    """--rows: cohort_main once per (arch, clients), then one table of them all. A row whose
    run fails is named in the table and makes the exit status 1; the other rows still run."""
    rows, failed = [], []
    for item in args.rows.split(","):
        arch, _, clients = item.strip().partition(":")
        row = argparse.Namespace(**vars(args))
        row.arch, row.clients, row.rows = arch, int(clients or args.clients or 20), None
        row.json = None
        row.out = str(Path(args.out) / f"{arch}-{row.clients}") if args.out else None
        result: dict[str, Any] = {}
        try:
            cohort_main(row, sections(row), keep=result)
        except RuntimeError as exc:  # a run that failed (its config refused, say): the rest go on
            print(f"fedbus bench train: row {arch}:{row.clients} failed: {exc}", file=sys.stderr)
            failed.append((arch, row.clients, str(exc)))
            continue
        rows.append((arch, row.clients, result))
    modes = list(rows[0][2]["modes"]) if rows else []
    lines = ["", f"fedbus bench train --rows: {args.setting}, {args.algorithm}, "
             f"device {args.device or 'cpu'}, {args.nodes} node(s), {args.rounds} rounds "
             "(median seconds per round; GPU utilisation mean over the run; prototype maths "
             "share of a FedProto local epoch)",
             f"  {'arch':<10}{'clients':>8}" + "".join(f"{m + ' s/round':>15}" for m in modes)
             + "".join(f"{m + ' acc':>10}" for m in modes) + f"{'speed-up':>10}"
             + "".join(f"{m + ' GPU%':>11}" for m in modes)
             + "".join(f"{m + ' proto%':>13}" for m in modes)]
    for arch, clients, result in rows:
        sides = result["modes"]
        cells = "".join(f"{sides[m]['median_s']:>15.2f}" for m in modes)
        cells += "".join(f"{_fmt_acc(sides[m]['acc'][-1]):>10}" for m in modes)
        speed = (sides["off"]["median_s"] / sides[modes[-1]]["median_s"]
                 if "off" in sides and len(modes) > 1 else float("nan"))
        cells += f"{speed:>9.2f}x"
        for m in modes:
            gpu = sides[m].get("gpu_util")
            util = "-" if gpu is None else "n/a" if gpu["source"] is None else \
                f"{gpu['mean'] or 0:.0f}"
            cells += f"{util:>11}"
        for m in modes:
            ps = result.get("proto_share", {}).get(m)
            share = "-" if ps is None else f"{100 * ps['share']:.1f}"
            cells += f"{share:>13}"
        lines.append(f"  {arch:<10}{clients:>8}{cells}")
        for m in modes:
            for reason in sides[m]["cohorts"]["off_reasons"]:
                lines.append(f"    {arch} {m}: one by one: {reason}")
    for arch, clients, why in failed:
        lines.append(f"  {arch:<10}{clients:>8}  failed: {why}")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"arch": a, "clients": c, **r} for a, c, r in rows]
            + [{"arch": a, "clients": c, "failed": why} for a, c, why in failed], indent=1))
    return 1 if failed else 0


def main_args(args: argparse.Namespace) -> int:
    if args.cohort and args.rows:
        defaults(args)
        return rows_main(args)
    cfg = sections(args)
    if args.cohort and not args.export_htfllib:
        if "," in args.cohort or args.cohort == "both" or args.reference == "none":
            return cohort_main(args, cfg)
        cfg["train"]["cohort"] = args.cohort  # one mode beside the reference loop
    if args.export_htfllib:
        folder = Path(args.export_htfllib)
        n = export_htfllib(cfg, folder)
        print(f"wrote {n} clients' train/test splits to {folder} (HtFLlib's layout); from "
              f"HtFLlib/system, with that folder at HtFLlib/dataset/{folder.name} and the "
              "CNN-1 model family added to main.py (see `python -m fedbus.bench.train -h` or "
              "this module's doc):")
        print(f"  python main.py -data {folder.name} -m CNN-1 -algo FedProto -nc {args.clients} "
              f"-gr {args.rounds} -lbs {args.batch_size} -ls 1 -lr 0.01 -lam 1 -eg 1 -fd 512 "
              "-ncl 10 -dev cpu")
        return 0
    if args.data.endswith(".npz") and not Path(args.data).is_file():
        print(f"fedbus bench train: {args.data} not found (--data)")
        return 2
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    threads = args.threads or cores
    styles = list(STYLES) if args.reference == "both" else (
        [] if args.reference == "none" else [args.reference])
    from fedbus.bench.common import out_dir

    out = out_dir(args.out, "train")
    result: dict[str, Any] = {"config": cfg, "cores": cores, "load_before": os.getloadavg(),
                              "reference": {}}
    try:
        from fedbus.node.client_host import node_threads
        from fedbus.node.config import build_config

        result["node_threads"] = node_threads(build_config(cfg))
    except ImportError:  # an older node without the helper: its config's launch.threads
        result["node_threads"] = None
    print(f"fedbus bench train: fedbus run in {out} ...", flush=True)
    result["fedbus"] = fedbus_side(cfg, out)
    for style in styles:
        print(f"fedbus bench train: reference loop ({style}) ...", flush=True)
        result["reference"][style] = reference_side(cfg, args.rounds, style, threads)
    result["load_after"] = os.getloadavg()
    fb = result["fedbus"]
    result["ratio"] = {style: {"median": fb["median_s"] / ref["median_s"],
                               "mean": fb["mean_s"] / ref["mean_s"],
                               "total": fb["total_s"] / ref["total_s"]}
                       for style, ref in result["reference"].items()}
    if result["reference"]:
        ref = next(iter(result["reference"].values()))
        result["same_partition"] = (None if fb["train_sizes"] is None else
                                    fb["train_sizes"] == ref["train_sizes"]
                                    and fb["test_sizes"] == ref["test_sizes"])
    print("\n".join(report(args, result)))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # python -m fedbus.bench.train
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    add_arguments(parser)
    raise SystemExit(main_args(parser.parse_args()))
