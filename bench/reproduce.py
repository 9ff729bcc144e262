"""One reproduction per paper: named recipes, each rerun with one command.

    fedbus bench reproduce list                                   # the recipes and their settings
    fedbus bench reproduce tan-table1 --out runs/repro            # 3 seeds, the recipe's rounds
    fedbus bench reproduce michieli-mnist --out runs/repro --json docs/michieli-mnist.json
    fedbus bench reproduce fedtgp-hetero --scale smoke            # 1 seed, 2 rounds, few clients

A recipe is data (RECIPES below): the paper's setting in words, the config sections
every run shares, its rows (label, algorithm and [algorithm] options, the sections a
row changes, the metric, the paper's numbers with the table and row they come from),
the expected ordering, the differences the paper states, and every change of scale
from the paper's setting to this offline 2-core machine. Each (row, seed) is a real
`fedbus run` (bench/common.run: broker, server, client nodes on the CPU); a row whose
`mean_of` names other rows is derived, per seed, as their mean.

Output, per recipe: row | metric | rounds | the paper's number(s) | ours, mean +- std
over seeds of the run's metric (%) | the per-seed values; then the ordering verdict
for ours and for the paper's own numbers (holds, or which pair fails), the stated
differences beside ours, and the scale changes. --json PATH saves the same as JSON.

Scales: "full" (default) is the recipe as written, sized to finish in well under an
hour on 2 cores with 3 seeds (docs/REPRODUCE.md gives the time of each); "smoke" is 1
seed, 2 rounds, 1 local epoch and the recipe's few-clients overrides: a check that
the recipe runs, not a result. --rounds R sets every run's rounds; --set
SECTION.KEY=VALUE changes every run (e.g. --set model.group='["cnn","resnet8"]').

--out keeps the run directories, named ALGORITHM-DIGEST-sSEED where DIGEST hashes the
run's settings (all but the seed): a run whose summary.json holds every round is
reused, so an interrupted recipe resumes where it stopped, and recipes sharing runs
(michieli-mnist and michieli-partial) share them when given the same --out.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import itertools
import json
import math
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedbus.bench.common import mean_std, run_or_reuse
from fedbus.node.config import ConfigError, _parse_override, build_config

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO.parent / "shared" / "data" / "mnist-10k.npz"
SCALES = ("full", "smoke")
SUBSET_SEED = 0  # the fixed draw of a recipe's MNIST subset (like a downloaded file)


@dataclass(frozen=True)
class P:
    """One number of a paper (%), with where it stands."""
    value: float
    std: float | None = None
    source: str = ""


@dataclass(frozen=True)
class Row:
    label: str
    algorithm: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)  # [algorithm] options
    set: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # section -> keys
    metric: str = ""  # a metrics.jsonl key; "" = the recipe's
    paper: tuple[P | None, ...] = ()  # one per paper column; None = not in the paper
    mean_of: tuple[str, ...] = ()  # derived: per seed, the mean of these rows


@dataclass(frozen=True)
class Gap:
    """A difference the paper states in words: value = row a - row b (points)."""
    a: str
    b: str
    value: float
    source: str


@dataclass(frozen=True)
class Recipe:
    name: str
    title: str
    paper_setting: str
    base: Mapping[str, Mapping[str, Any]]
    rows: tuple[Row, ...]
    paper_columns: tuple[str, ...]
    metric: str
    order: tuple[str, ...]  # chains "A > B > C": every neighbour pair must hold
    scale_changes: tuple[str, ...]
    at: str = "final"  # the "final" evaluation, or the "best" over evaluations
    eval_every: int = 1  # with at = "best": evaluate every this many rounds (and the last)
    gaps: tuple[Gap, ...] = ()
    subset: int = 0  # MNIST digits drawn (seed 0) from --data; 0 = all
    smoke: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


# --- the recipes ------------------------------------------------------------------------
# Paper numbers are copied from ../shared/papers/*.txt; the comment by each names its
# table and row. "{mnist}" in a dataset string is --data (or the recipe's subset of it).

LOCAL_MNIST = "npz:{mnist}"
ATTN = "proto-attention"

TAN = Recipe(
    name="tan-table1",
    title="Tan et al., FedProto (AAAI 2022), Table 1: MNIST, n-way k-shot, n = 3, stdev 2",
    paper_setting=(
        "MNIST, 20 clients, all sampled every round; n-way k-shot: n = 3 classes per client "
        "with stdev 2, k = 100 samples per class on average; FedProto's CNN (2 conv + 2 fc); "
        "1 local epoch, batch 8, SGD lr 0.01, momentum 0.5 (Appendix A); FedProto lambda = 1; "
        "communication rounds to convergence (Table 1): FedProto 100, FedAvg 150, FedProx 110; "
        "the average test accuracy over clients, each on its own classes."),
    base={"federation": {"clients": 20, "fraction": 1.0},
          "data": {"dataset": LOCAL_MNIST, "partition": "nway-kshot", "ways": 3,
                   "ways_std": 2.0, "shots": 60, "shots_std": 10.0},
          "model": {"arch": "cnn"},
          "train": {"epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.5}},
    paper_columns=("Table 1",),
    metric="acc_mean",
    rows=(
        Row("Local", "local", set={"federation": {"rounds": 30}},
            # Table 1, MNIST, Local, stdev 2, n = 3: 94.05±2.93
            paper=(P(94.05, 2.93, "Table 1, MNIST, Local, stdev 2, n = 3"),)),
        Row("FedAvg", "fedavg", set={"federation": {"rounds": 45}},
            # Table 1, MNIST, FedAvg, stdev 2, n = 3: 95.04±6.48 (Table 2 prints 91.40±6.48)
            paper=(P(95.04, 6.48, "Table 1, MNIST, FedAvg, stdev 2, n = 3 "
                     "(Table 2 prints 91.40±6.48 for the same cell)"),)),
        Row("FedProx", "fedprox", set={"federation": {"rounds": 33}},
            # Table 1, MNIST, FedProx, stdev 2, n = 3: 96.26±2.89
            paper=(P(96.26, 2.89, "Table 1, MNIST, FedProx, stdev 2, n = 3"),)),
        Row("FedProto", "fedproto", params={"lam": 1.0}, metric="proto_acc_mean",
            set={"federation": {"rounds": 30}},
            # Table 1, MNIST, FedProto, stdev 2, n = 3: 97.13±0.30
            paper=(P(97.13, 0.30, "Table 1, MNIST, FedProto, stdev 2, n = 3"),)),
        # The reference code's plain mean of the clients' prototypes instead of eq. 6's
        # count-weighted one (docs/FIDELITY.md, fedproto); not a row of the paper.
        Row("FedProto (code's mean)", "fedproto",
            params={"lam": 1.0, "proto_loss": "mse", "aggregate": "mean"},
            metric="proto_acc_mean", set={"federation": {"rounds": 30}}, paper=(None,)),
        Row("FedPer", "fedper", set={"federation": {"rounds": 30}},
            # Table 1, MNIST, FedPer, stdev 2, n = 3: 95.57±2.96 (100 rounds)
            paper=(P(95.57, 2.96, "Table 1, MNIST, FedPer, stdev 2, n = 3"),)),
        Row("FedRep", "fedrep", set={"federation": {"rounds": 30}},
            # Table 1, MNIST, FedRep, stdev 2, n = 3: 94.96±2.78 (100 rounds)
            paper=(P(94.96, 2.78, "Table 1, MNIST, FedRep, stdev 2, n = 3"),)),
    ),
    order=("FedProto > Local", "FedProto > FedAvg", "FedProto > FedProx",
           "FedProto > FedPer", "FedProto > FedRep"),
    scale_changes=(
        "10,000 offline MNIST digits (mnist-10k.npz) instead of MNIST's 70,000",
        ("k = 60 +- 10 samples per class instead of 100: 20 clients' disjoint shots must fit "
         "the 7,500 training digits' class pools (the stdev of k, 10, is ours: the paper "
         "gives only n's)"),
        ("rounds x 0.3 of the paper's rounds to convergence (Table 1): FedProto 100 -> 30, "
         "FedAvg 150 -> 45, FedProx 110 -> 33, FedPer and FedRep 100 -> 30; Local (0 rounds "
         "in the paper) trains 30 rounds of 1 local epoch"),
        ("FedPer and FedRep: Tan et al. give no settings of theirs; fedbus's defaults (FedRep: "
         "10 head epochs before the 1 body epoch, its authors' scripts)"),
        "FedProx mu: not given by Tan et al.; fedbus's default",
        ("only the n = 3 column (n = 4, 5: --set data.ways=4; the paper column then no "
         "longer matches)"),
        ("FedProto's row is its nearest-global-prototype accuracy (eq. 4, proto_acc); the "
         "other rows score their classifier heads"),
        ("each client's test split: 25% of its data, drawn from held-out pools of its own "
         "classes (20 images a class at k = 60); the paper's code takes 40 a class from "
         "MNIST's test set"),
    ),
    notes=(("The paper's stds come from its code's running counters, not per-client stds "
            "(docs/FIDELITY.md (fedproto)): compare the means."),),
    smoke={"federation": {"clients": 4}, "data": {"shots": 20, "shots_std": 5.0}},
)


def _qiao_rows(alpha: float, test: str = "local") -> tuple[Row, ...]:
    part: dict[str, Any] = {"alpha": alpha}
    a = f"α = {alpha:g}"
    if test == "global":  # the same training runs' twins, tested on pooled test splits
        part["test_distribution"] = "global"
        a += ", global test"
    rows = [Row(f"Local, {a}", "local", set={"data": part}),
            Row(f"FedAvg, {a}", "fedavg-proto", set={"data": part}, metric="acc_mean")]
    if test == "local":
        rows.append(Row(f"FedProx, {a}", "fedprox", set={"data": part}))
    rows.append(Row(f"Prototype inference, {a}", "fedavg-proto", set={"data": part},
                    metric="proto_acc_mean"))
    return tuple(rows)


def _qiao_gaps(test: str) -> tuple[Gap, ...]:
    g = ", global test" if test == "global" else ""
    return (
        # Sec. III-C: "our proposal on MNIST outperforms Local and FedAvg by 18.9% and 2.4%
        # in terms of accuracy when alpha = 0.05"
        Gap(f"Prototype inference, α = 0.05{g}", f"Local, α = 0.05{g}", 18.9,
            "Sec. III-C, MNIST"),
        Gap(f"Prototype inference, α = 0.05{g}", f"FedAvg, α = 0.05{g}", 2.4,
            "Sec. III-C, MNIST"),
        # Sec. III-C: "and also outperforms them by 31.5% and 1.0% when alpha = 0.05" (sic:
        # the second of Fig. 2's settings, alpha = 0.1)
        Gap(f"Prototype inference, α = 0.1{g}", f"Local, α = 0.1{g}", 31.5,
            "Sec. III-C, MNIST (printed 'α = 0.05' again; Fig. 2(b) is α = 0.1)"),
        Gap(f"Prototype inference, α = 0.1{g}", f"FedAvg, α = 0.1{g}", 1.0,
            "Sec. III-C, MNIST (printed 'α = 0.05' again; Fig. 2(b) is α = 0.1)"),
    )


QIAO = Recipe(
    name="qiao-proto-helps",
    title="Qiao et al., Prototype Helps FL: MNIST, Dir(0.05) and Dir(0.1), Sec. III-C",
    paper_setting=(
        "MNIST, 20 clients; 5,000 samples drawn from the training set and distributed by "
        "Dir(alpha), alpha = 0.05 and 0.1; a 4-layer CNN (2 conv + 2 fc, as FedProto's); "
        "batch 8, 1 local epoch, lr 0.01; FedAvg training, and in the last round the "
        "clients' prototypes are averaged and every test sample takes the class of the "
        "nearest aggregated prototype. The paper gives differences, not accuracies: "
        "prototype inference beats Local and FedAvg by 18.9 and 2.4 points at alpha = 0.05, "
        "by 31.5 and 1.0 at alpha = 0.1."),
    base={"federation": {"clients": 20, "fraction": 1.0, "rounds": 20},
          "data": {"dataset": LOCAL_MNIST, "partition": "dirichlet", "test_fraction": 0.5},
          "model": {"arch": "cnn"},
          "train": {"epochs": 1, "batch_size": 8, "lr": 0.01, "momentum": 0.5}},
    paper_columns=(),
    metric="acc_mean",
    rows=(_qiao_rows(0.05) + _qiao_rows(0.1)
          + _qiao_rows(0.05, "global") + _qiao_rows(0.1, "global")),
    order=(*(f"Prototype inference, α = {a} > {b}, α = {a}"
             for a in ("0.05", "0.1") for b in ("FedAvg", "FedProx", "Local")),
           *(f"Prototype inference, α = {a}, global test > {b}, α = {a}, global test"
             for a in ("0.05", "0.1") for b in ("FedAvg", "Local"))),
    gaps=_qiao_gaps("local") + _qiao_gaps("global"),
    scale_changes=(
        ("the 10,000 offline MNIST digits split by Dir(alpha), half of each client's share "
         "for training (test_fraction 0.5: ~5,000 training digits, the paper's 5,000 drawn "
         "from MNIST's 60,000) and half for its test split"),
        ("the paper does not say how it tests; the rows run both readings: each client's "
         "test split skewed like its training data (data.test_distribution = local), and "
         "the test splits pooled and dealt back at random (global: every client tested on "
         "the federation's class mix; the same training, seed for seed), which the paper's "
         "+18.9 to +31.5 points over Local suggest"),
        ("the 4-layer CNN read as FedProto's (cnn: conv 10, conv 20, fc 50, fc; the paper "
         "gives no widths and follows FedProto [6]); cnn4 (conv 32, conv 64, fc 512, fc), the "
         "other reading and examples/fedavg-proto-mnist-offline.toml's, costs twice as much "
         "a step here: --set model.arch=cnn4"),
        "rounds: 20 (the paper's text gives none; Fig. 2's axis is lost in our copy)",
        ("momentum 0.5: not stated; FedProto's setting, whose limited-sample setup the paper "
         "follows"),
        ("FedProx (mu: fedbus's default) is not in the paper, whose baselines are Local and "
         "FedAvg; it is here as issue 12 asks"),
        ("the FedAvg row is the classifier-head accuracy of the same runs as the prototype "
         "row (fedavg-proto trains exactly FedAvg and adds prototypes in the last round): "
         "the two rows differ only in the inference rule, the paper's comparison"),
        ("prototypes only after the last round (Algorithm 1); the paper's curves infer "
         "with prototypes every round"),
    ),
    smoke={"federation": {"clients": 4}},
)

_FEDCL_RUN = {"model": {"arch": "mlp-fedcl"},
              "train": {"epochs": 1, "batch_size": 32, "lr": 0.01, "momentum": 0.5}}
_LR_NOTE = ("learning-rate decay 0.95 per round only for MP-FedCL and its variants "
            "(mpfedcl's lr_decay); fedbus's Local, FedAvg, FedProx and FedProto have none "
            "(the paper decays every method's rate)")
_MU_NOTE = ("FedProx mu and FedProto lambda: the paper's grid-searched values are not "
            "given; fedbus's defaults")
_SPLIT_NOTE = ("prototypes are the 512-d encoder output (fedbus's mlp-fedcl splits the "
               "network after its encoder); the paper's are the 256-d input of its decision "
               "layer (Table II; docs/FIDELITY.md (mpfedcl))")


def _fedcl_rows(k: int, rounds: Mapping[str, int], paper: Mapping[str, tuple],
                test: str = "local") -> tuple:
    """The MP-FedCL table's rows; test = "global": their twins tested on pooled test
    splits (data.test_distribution), labelled "..., global test"."""
    suffix = ", global test" if test == "global" else ""

    def r(label: str, algorithm: str, metric: str, **params: Any) -> Row:
        changes: dict[str, dict[str, Any]] = {"federation": {"rounds": rounds[label]}}
        if test == "global":
            changes["data"] = {"test_distribution": "global"}
        return Row(label + suffix, algorithm, params=params, metric=metric, set=changes,
                   paper=paper[label])
    return (r("Local", "local", "acc_mean"), r("FedAvg", "fedavg", "acc_mean"),
            r("FedProx", "fedprox", "acc_mean"), r("FedProto", "fedproto", "proto_acc_mean"),
            r("DP-FedCL", "mpfedcl", "proto_acc_mean", k=k, cluster="dbscan"),
            r("SP-FedCL", "mpfedcl", "proto_acc_mean", k=1),
            r("MP-FedCL", "mpfedcl", "proto_acc_mean", k=k))


def _fedcl_order(suffix: str = "") -> tuple[str, ...]:
    m = f"MP-FedCL{suffix}"
    return (f"{m} > SP-FedCL{suffix} > DP-FedCL{suffix}",
            *(f"{m} > {b}{suffix}" for b in ("FedProto", "FedAvg", "FedProx", "Local")))


_LABEL_ROUNDS = {"Local": 60, "FedAvg": 110, "FedProx": 100, "FedProto": 100,
                 "DP-FedCL": 60, "SP-FedCL": 60, "MP-FedCL": 60}
_LABEL_PAPER = {
    "Local": (None,),  # Table VI has no Local row
    # Table VI, MNIST column, row FedAvg: 66.40(2.89)
    "FedAvg": (P(66.40, 2.89, "Table VI, MNIST, FedAvg"),),
    # Table VI, MNIST column, row FedProx: 64.85(1.88)
    "FedProx": (P(64.85, 1.88, "Table VI, MNIST, FedProx"),),
    # Table VI, MNIST column, row FedProto: 33.27(1.74)
    "FedProto": (P(33.27, 1.74, "Table VI, MNIST, FedProto"),),
    # Table VI, MNIST column, row DP-FedCL: 78.49(3.09)
    "DP-FedCL": (P(78.49, 3.09, "Table VI, MNIST, DP-FedCL"),),
    # Table VI, MNIST column, row SP-FedCL: 79.44(3.48)
    "SP-FedCL": (P(79.44, 3.48, "Table VI, MNIST, SP-FedCL"),),
    # Table VI, MNIST column, row MP-FedCL: 79.95(3.76)
    "MP-FedCL": (P(79.95, 3.76, "Table VI, MNIST, MP-FedCL"),),
}

MPFEDCL_LABEL = Recipe(
    name="mpfedcl-label",
    title="Qiao et al., MP-FedCL (IEEE IoT-J 2024), Table VI: label skew Dir(0.05), MNIST",
    paper_setting=(
        "MNIST, 2,000 samples, 5 clients, label skew Dir(0.05); encoder 784-512-512 and MLP "
        "512-256-10 (Table III), prototypes = the 256-d input of the decision layer (Table "
        "II); SGD lr 0.01 decayed 0.95 "
        "per round, momentum 0.5, batch 32, 1 local epoch, temperature 0.07, k = 2 "
        "prototypes per class on MNIST (Table IV); 3 trials; rounds (Table VI): MP-, SP-, "
        "DP-FedCL 60, FedAvg 110, FedProx and FedProto 100. SP-FedCL = k = 1 (class means); "
        "DP-FedCL = DBSCAN instead of k-means."),
    base={"federation": {"clients": 5, "fraction": 1.0},
          "data": {"dataset": LOCAL_MNIST, "partition": "dirichlet", "alpha": 0.05},
          **_FEDCL_RUN},
    subset=2000,
    paper_columns=("Table VI (MNIST)",),
    metric="proto_acc_mean",
    rows=(_fedcl_rows(2, _LABEL_ROUNDS, _LABEL_PAPER)
          + _fedcl_rows(2, _LABEL_ROUNDS, _LABEL_PAPER, test="global")),
    order=_fedcl_order() + _fedcl_order(", global test"),
    scale_changes=(
        ("2,000 digits drawn (seed 0) from the 10,000 offline MNIST digits, not from MNIST's "
         "70,000; each client tests on 25% of its share"),
        ("the paper does not say how a client's test set is drawn; the rows run both "
         "readings: a client's test split skewed like its training data, and (\"global "
         "test\", data.test_distribution = global) the test splits pooled and dealt back "
         "at random, the same training seed for seed; the paper's FedProto at 33.27, half "
         "of FedAvg's 66.40, suggests the latter (a client's own prototypes cannot name "
         "classes it never saw)"),
        "rounds: the paper's (Table VI); Local 60 (Table VI has no Local row)",
        _LR_NOTE,
        _MU_NOTE,
        ("DP-FedCL: DBSCAN with scikit-learn's defaults (eps 0.5, min_samples 5; the paper "
         "gives none), at most k = 2 clusters kept per class (the wire carries a fixed k)"),
        ("the prototype methods score nearest-prototype inference (proto_acc: Eq. 13 for "
         "MP-FedCL, eq. 4 for FedProto); Local, FedAvg and FedProx their classifier heads"),
        _SPLIT_NOTE,
    ),
    smoke={"federation": {"clients": 3}},
)

MPFEDCL_FEATURE = Recipe(
    name="mpfedcl-feature",
    title=("Qiao et al., MP-FedCL, Tables V and VII: feature skew, five digit domains "
           "(offline Digit-5 stand-in)"),
    paper_setting=(
        "Digit-5 (MNIST, MNIST-M, SVHN, SynthDigits, USPS), 5 clients, one domain each, "
        "labels IID; a ResNet18 encoder pre-trained on DomainNet with the MNIST model's MLP "
        "(512-256-10); k = 4 prototypes per class (Table IV); otherwise as the label-skew "
        "setting (lr 0.01 decayed 0.95, momentum 0.5, batch 32, 1 epoch, tau 0.07); 3 "
        "trials; Table V: the mean over the five domains; Table VII: feature non-IID "
        "column, rounds: MP-, SP-, DP-FedCL 60, FedAvg and FedProto 130."),
    base={"federation": {"clients": 5, "fraction": 1.0},
          "data": {"dataset": "digit5-offline:{mnist}", "partition": "domains",
                   "domain_samples": 1000},
          **_FEDCL_RUN},
    paper_columns=("Table V (Digit-5 avg)", "Table VII (Digit-5, feature)"),
    metric="proto_acc_mean",
    rows=_fedcl_rows(4, {"Local": 30, "FedAvg": 65, "FedProx": 65, "FedProto": 65,
                         "DP-FedCL": 30, "SP-FedCL": 30, "MP-FedCL": 30}, {
        # Table V, Average row: Local 34.20(4.34); Table VII, Digit-5, Local, feature: 33.60(3.25)
        "Local": (P(34.20, 4.34, "Table V, Average, Local"),
                  P(33.60, 3.25, "Table VII, Digit-5, Local, feature non-IID")),
        # Table V, Average: FedAvg 38.87(3.61); Table VII, Digit-5, FedAvg, feature: 43.13(3.67)
        "FedAvg": (P(38.87, 3.61, "Table V, Average, FedAvg"),
                   P(43.13, 3.67, "Table VII, Digit-5, FedAvg, feature non-IID")),
        # Table V, Average: FedProx 51.80(4.75); not in Table VII
        "FedProx": (P(51.80, 4.75, "Table V, Average, FedProx"), None),
        # Table V, Average: FedProto 62.00(2.08); Table VII, Digit-5, FedProto, feature: 63.99(0.38)
        "FedProto": (P(62.00, 2.08, "Table V, Average, FedProto"),
                     P(63.99, 0.38, "Table VII, Digit-5, FedProto, feature non-IID")),
        # not in Table V; Table VII, Digit-5, DP-FedCL, feature: 63.49(2.02)
        "DP-FedCL": (None, P(63.49, 2.02, "Table VII, Digit-5, DP-FedCL, feature non-IID")),
        # not in Table V; Table VII, Digit-5, SP-FedCL, feature: 65.49(1.14)
        "SP-FedCL": (None, P(65.49, 1.14, "Table VII, Digit-5, SP-FedCL, feature non-IID")),
        # Table V, Average: MP-FedCL 64.86(1.19); Table VII, Digit-5, MP-FedCL, feature: 65.08(0.91)
        "MP-FedCL": (P(64.86, 1.19, "Table V, Average, MP-FedCL"),
                     P(65.08, 0.91, "Table VII, Digit-5, MP-FedCL, feature non-IID")),
    }),
    order=("MP-FedCL > SP-FedCL > DP-FedCL", "MP-FedCL > FedProto", "MP-FedCL > FedAvg",
           "MP-FedCL > Local"),
    scale_changes=(
        ("digit5-offline (five 28x28 grayscale domains built from the offline MNIST and "
         "scikit-learn's digits: mnist, inverted, rotated, textured, digits-28; docs/DATA.md) "
         "instead of Digit-5 (32x32 colour: MNIST, MNIST-M, SVHN, SynthDigits, USPS); 1,000 "
         "images a domain (domain_samples; 5,000 in all, of the set's 11,797), 750 training "
         "and 250 test images a client"),
        ("model: MP-FedCL's MNIST network (mlp-fedcl, encoder 784-512-512, MLP 512-256-10) "
         "trained from scratch instead of a ResNet18 encoder pre-trained on DomainNet (no "
         "such weights offline; a ResNet18 step costs ~275x the MLP's on this CPU)"),
        ("rounds x 0.5 of Table VII's: MP-, SP-, DP-FedCL 60 -> 30, FedAvg and FedProto "
         "130 -> 65; FedProx 65 (Table V gives no rounds); Local 30"),
        ("k = 4 (the paper's Digit-5 choice); DP-FedCL keeps at most 4 DBSCAN clusters per "
         "class, DBSCAN at scikit-learn's defaults (the paper gives none)"),
        _LR_NOTE,
        _MU_NOTE,
        ("our metric is the mean over the 5 clients (= domains) of each client's test "
         "accuracy on its own domain, as Table V's Average row"),
        _SPLIT_NOTE,
    ),
    notes=(("The paper's own Table VII puts SP-FedCL (65.49) above MP-FedCL (65.08) on "
            "feature skew: the expected MP > SP does not hold in the paper either."),),
    smoke={"data": {"domain_samples": 60}},
)


_TABLE2_COLUMNS = {"FedAvg": "FedAvg", "FedProx": "FedProx", "FedAtt": "FedAtt",
                   "Attention": "FedProto (proto-attention)"}


def _table2(dataset: str, *cells: tuple[float, float]) -> dict[str, P]:
    """Michieli & Ozay's Table 2, the Accuracy row of `dataset`: (mean, std) of its FedAvg,
    FedProx, FedAtt and FedProto columns, in that order (their FedProto = proto-attention)."""
    return {label: P(m, sd, f"Table 2, Accuracy, {dataset}, {column}")
            for (label, column), (m, sd) in zip(_TABLE2_COLUMNS.items(), cells, strict=True)}


def _delta(d: int) -> dict[str, dict[str, Any]]:
    """δ = d % of the tasks partial (F' ~ U[0, F]): system.partial_fraction."""
    if d == 0:
        return {"system": {"partial_work": False}}
    return {"system": {"partial_work": True, "partial_fraction": d / 100}}


DELTAS = (0, 50, 80)  # Table 3's columns; Table 2 = their mean
DROP = {"partial": "drop"}  # the paper's FedAvg / FedAtt: partial solutions dropped


def _d(d: int) -> str:
    return f"δ = {d}%"


def _michieli_rows(fedprox_mu: float, paper: Mapping[str, P]) -> tuple[Row, ...]:
    rows: list[Row] = []
    algos = (("FedAvg", "fedavg", DROP), ("FedProx", "fedprox", {"mu": fedprox_mu}),
             ("FedAtt", "fedatt", DROP), ("Attention", ATTN, {}))
    for label, algo, params in algos:
        rows += [Row(f"{label}, {_d(d)}", algo, params=params, set=_delta(d)) for d in DELTAS]
    rows += [Row(f"{label}, mean over δ", paper=(paper[label],),
                 mean_of=tuple(f"{label}, {_d(d)}" for d in DELTAS)) for label, _, _ in algos]
    return tuple(rows)


_MICHIELI_TRAIN = {"batch_size": 10, "lr": 0.01, "momentum": 0.0}
_MICHIELI_COMMON = (
    ("batch size 10 (FedProx's, which the paper follows; Table 1's batch column is lost in "
     "our copy)"),
    ("accuracy of the aggregate model pooled over every client's test split "
     "(acc_weighted), as the paper's Sec. 4"),
)
_PARTIAL_NOTES = (  # δ and how each method treats partial work: both MNIST tables
    ("δ, the share of clients doing partial work (F' ~ U[0, F]): each task is partial with "
     "probability δ (system.partial_fraction), so about δ of each round's clients are; "
     "Table 2 = the mean over δ = 0, 50 and 80% (Table 3's Avg column)"),
    ("FedAvg and FedAtt drop partial solutions (algorithm.partial = \"drop\"), the paper's "
     "Table 2 FedAvg = Table 3's 'FedAvg' row, not its 'FedAvg + toleration'; the paper "
     "does not say how its FedAtt treats them (its std, 3.7 on MNIST, is FedAvg's 3.8); "
     "FedProx and attention tolerate them by design"),
)
_MICHIELI_NOTES = (
    *_PARTIAL_NOTES,
    ("FedAtt: fedbus's fedatt (Ji et al., layer-wise attention, epsilon 1: the reference "
     "code's; the paper gives no setting)"),
    *_MICHIELI_COMMON,
)

MICHIELI_SYNTHETIC = Recipe(
    name="michieli-synthetic",
    title=("Michieli & Ozay, Prototype Guided FL (2021), Table 2: Synthetic "
           "(phi1 = phi2 = 1), FedAvg / FedProx / attention"),
    paper_setting=(
        "FedProx's synthetic logistic data with phi1 = phi2 = 1 (S1.1), 30 clients, "
        "power-law sizes (9,600 samples), x in R^60, 10 classes; two dense layers of 128 and "
        "256 units and a softmax layer; 10 clients per round; SGD lr 0.01, F = 20 local "
        "epochs, 200 rounds (Table 1); 80/20 train/test split per client; FedProx mu = 0.1 "
        "(S2); Table 2 = the mean and std over δ in {0, 50, 80}% partial clients."),
    base={"federation": {"clients": 30, "fraction": 1 / 3, "min_clients": 10, "rounds": 30,
                         "sampling": "size"},
          "data": {"dataset": "synthetic", "synthetic_alpha": 1.0, "synthetic_beta": 1.0,
                   "partition": "natural", "test_fraction": 0.2},
          "model": {"arch": "mlp:128", "feature_dim": 256},
          "train": {"epochs": 20, **_MICHIELI_TRAIN}},
    paper_columns=("Table 2",),
    metric="acc_weighted",
    # Table 2, Accuracy, Synthetic: FedAvg 72.3 ± 2.6, FedProx 74.8 ± 1.6, FedAtt 72.1 ± 2.7,
    # FedProto (= fedbus's proto-attention) 78.7 ± 0.2
    rows=_michieli_rows(0.1, _table2("Synthetic", (72.3, 2.6), (74.8, 1.6), (72.1, 2.7),
                                     (78.7, 0.2))),
    order=("Attention, mean over δ > FedProx, mean over δ > FedAvg, mean over δ",),
    scale_changes=(
        "rounds 200 -> 30 (F = 20 local epochs, as the paper)",
        ("FedProx's generator with the seed: each seed draws a new federation (its sizes "
         "follow the generator's lognormal power law, not exactly the paper's 9,600)"),
        *_MICHIELI_NOTES,
    ),
    smoke={"federation": {"clients": 10, "fraction": 0.5, "min_clients": 1}},
)

_MNIST_BASE = {
    "federation": {"clients": 160, "fraction": 10 / 160, "min_clients": 10, "rounds": 25,
                   "sampling": "size"},
    "data": {"dataset": LOCAL_MNIST, "partition": "pathological-powerlaw",
             "classes_per_client": 2, "powerlaw_sigma": 2.0, "min_samples": 10,
             "test_fraction": 0.2},
    "model": {"arch": "cnn4", "feature_dim": 256},
    "train": {"epochs": 2, **_MICHIELI_TRAIN}}
_MNIST_SCALE = (
    ("10,000 offline MNIST digits on 160 clients (62.5 per client, the paper's 61.7) "
     "instead of 61,676 digits on 1,000 clients; 10 clients a round as the paper"),
    ("2 digits per client, power-law sizes (pathological-powerlaw, LogNormal(0, 2) weights, "
     "at least 10 samples a client): sizes' std 120 at seed 0 (the paper's 164.7); the "
     "paper's generator (FedProx's) is not given"),
    ("rounds 200 -> 25 (250 draws for 160 clients; the paper's 2,000 for 1,000), local "
     "epochs F = 20 -> 2: with size sampling a round trains the largest clients (~300 "
     "samples a draw on average), ~2.5 s an epoch here"),
    ("network: cnn4 (5x5 conv 32 and 64, 2x2 max-pool, fc 256 = the prototype layer, "
     "softmax), S1.2's; unpadded convolutions (the paper does not say)"),
)
_SMOKE_MNIST = {"federation": {"clients": 10, "fraction": 0.5, "min_clients": 1}}

MICHIELI_MNIST = Recipe(
    name="michieli-mnist",
    title=("Michieli & Ozay, Prototype Guided FL, Table 2: MNIST (1,000 clients, 2 digits "
           "each), FedAvg / FedProx / attention"),
    paper_setting=(
        "MNIST on 1,000 clients, 2 digits each, power-law sizes (61,676 samples); CNN: 5x5 "
        "conv 32 and 64 with 2x2 max-pool, fc 256, softmax (S1.2); 10 clients per round; "
        "SGD lr 0.01, F = 20, 200 rounds (Table 1); 80/20 split; FedProx mu = 1 (S2); "
        "Table 2 = mean and std over δ in {0, 50, 80}%."),
    base=_MNIST_BASE,
    paper_columns=("Table 2",),
    metric="acc_weighted",
    # Table 2, Accuracy, MNIST: FedAvg 88.8 ± 3.8, FedProx 91.7 ± 0.2, FedAtt 88.4 ± 3.7,
    # FedProto (= fedbus's proto-attention) 93.3 ± 0.2
    rows=_michieli_rows(1.0, _table2("MNIST", (88.8, 3.8), (91.7, 0.2), (88.4, 3.7),
                                     (93.3, 0.2))),
    order=("Attention, mean over δ > FedProx, mean over δ > FedAvg, mean over δ",),
    scale_changes=(*_MNIST_SCALE, *_MICHIELI_NOTES),
    smoke=_SMOKE_MNIST,
)

# Table 3 (MNIST): the row's label, algorithm, params, and its numbers at δ = 0, 50, 80 %
_TABLE3 = (
    ("FedAvg", "fedavg", DROP, (92.7, 88.7, 85.1)),
    ("FedAvg + toleration", "fedavg", {}, (92.7, 90.2, 89.1)),
    ("Attention (LPM only)", ATTN, {"clues": "lpm"}, (91.9, 91.0, 90.6)),
    ("Attention (APM only)", ATTN, {"clues": "apm"}, (93.0, 92.7, 92.6)),
    ("Attention", ATTN, {}, (93.5, 93.4, 93.1)),
)


def _partial_rows() -> tuple[Row, ...]:
    rows = []
    for label, algo, params, numbers in _TABLE3:
        source = f"Table 3, {label.replace('Attention', 'FedProto')}"
        for d, value in zip(DELTAS, numbers, strict=True):
            paper = (P(value, None, f"{source}, {_d(d)}"),)
            if d == 0 and label == "FedAvg + toleration":
                # with no partial solution, toleration changes nothing: FedAvg's own run
                rows.append(Row(f"{label}, {_d(d)}", paper=paper, mean_of=(f"FedAvg, {_d(d)}",)))
            else:
                rows.append(Row(f"{label}, {_d(d)}", algo, params=params, set=_delta(d),
                                paper=paper))
    return tuple(rows)


MICHIELI_PARTIAL = Recipe(
    name="michieli-partial",
    title=("Michieli & Ozay, Prototype Guided FL, Table 3: MNIST under partial workload "
           "δ, with the LPM/APM ablations"),
    paper_setting=(
        "As michieli-mnist; each method at δ = 0, 50 and 80% of clients doing partial work "
        "(F' ~ U[0, F]); 'toleration' = partial solutions are aggregated, plain FedAvg drops "
        "them; the attention built from the local (LPM) or aggregate (APM) prototype margin "
        "alone, or both."),
    base=_MNIST_BASE,
    paper_columns=("Table 3",),
    metric="acc_weighted",
    rows=_partial_rows(),
    order=(*(f"Attention, {_d(d)} > Attention (APM only), {_d(d)} > "
             f"Attention (LPM only), {_d(d)}" for d in DELTAS),
           *(f"Attention, {_d(d)} > FedAvg + toleration, {_d(d)} > FedAvg, {_d(d)}"
             for d in DELTAS[1:]),
           f"Attention, {_d(0)} > FedAvg, {_d(0)}"),
    scale_changes=(*_MNIST_SCALE, *_PARTIAL_NOTES, *_MICHIELI_COMMON),
    notes=(("FedAvg and Attention share their runs with michieli-mnist when both are given "
            "the same --out; 'FedAvg + toleration, δ = 0%' is FedAvg's δ = 0% run (nothing "
            "is partial to tolerate)."),),
    smoke=_SMOKE_MNIST,
)

HTCNN = ["cnn:5", "cnn:10", "cnn", "cnn:40", "cnn:80", "cnn4", "mlp", "mlp-fedcl"]

FEDTGP = Recipe(
    name="fedtgp-hetero",
    title=("Zhang et al., FedTGP (AAAI 2024), Table 2 style: 8 heterogeneous architectures, "
           "MNIST-10k, Dir(0.1)"),
    paper_setting=(
        "20 clients, all every round; practical setting Dir(0.1) (MOON's); client i runs "
        "architecture i mod 8 of the group (HtFE8: 4-layer CNN, GoogLeNet, MobileNetV2, "
        "ResNet18/34/50/101/152 on Cifar/Tiny-ImageNet; HtCNN8: 8 CNNs of 1-2 conv blocks and "
        "1-3 fc layers on FMNIST, Table 9-10), features average-pooled to K = 512; 1 local "
        "epoch, batch 10, lr 0.01, 1,000 rounds; lambda = 0.1, tau = 100, S = 100 server "
        "epochs; 75/25 split per client; the best mean client accuracy over rounds, 3 "
        "trials. Inference by the nearest global prototype."),
    base={"federation": {"clients": 20, "fraction": 1.0, "rounds": 30},
          "data": {"dataset": LOCAL_MNIST, "partition": "dirichlet", "alpha": 0.1},
          "model": {"group": HTCNN, "feature_dim": 512},
          "train": {"epochs": 1, "batch_size": 10, "lr": 0.01, "momentum": 0.0}},
    at="best",
    eval_every=5,
    paper_columns=("Table 10 (FMNIST, HtCNN8)", "Table 2 (Cifar100, HtFE9)"),
    metric="proto_acc_mean",
    rows=(
        Row("Local", "local", metric="acc_mean", paper=(None, None)),
        Row("FedProto", "fedproto", params={"lam": 0.1}, paper=(
            # Table 10, FMNIST, practical setting, FedProto: 97.46±0.01
            P(97.46, 0.01, "Table 10, FMNIST, practical setting, FedProto"),
            # Table 2, HtFE9 column, FedProto: 32.74±0.82
            P(32.74, 0.82, "Table 2, Cifar100, HtFE9, FedProto"))),
        Row("FedTGP", "fedtgp", params={"lam": 0.1, "margin_threshold": 100.0,
                                        "server_epochs": 100}, paper=(
            # Table 10, FMNIST, practical setting, FedTGP: 97.58±0.05
            P(97.58, 0.05, "Table 10, FMNIST, practical setting, FedTGP"),
            # Table 2, HtFE9 column, FedTGP: 48.05±0.19
            P(48.05, 0.19, "Table 2, Cifar100, HtFE9, FedTGP"))),
    ),
    order=("FedTGP > FedProto", "FedTGP > Local"),
    scale_changes=(
        ("the 10,000 offline MNIST digits instead of Cifar100 (Table 2) or FMNIST (Table 10): "
         "the paper has no MNIST experiment; its grayscale one (Table 10, 8 CNN variants) is "
         "the nearest, and Table 2's HtFE9 column is printed for the size of the gap"),
        ("model group: 8 networks of fedbus's zoo a 2-core CPU trains in minutes "
         f"({', '.join(HTCNN)}: 5 widths of FedProto's CNN, the 4-layer CNN, two MLPs), in "
         "the spirit of HtCNN8, instead of HtFE8; ResNets cost 35-115x the CNN's step here "
         "(resnet8 237 ms against cnn 6.7 ms a batch of 10): --set model.group='[...]' to "
         "use them"),
        "rounds 1,000 -> 30 (1 local epoch each, as the paper)",
        "momentum 0 (PFLlib's plain SGD; the paper states none)",
        "Local has no row in the paper's tables",
        ("prototype methods score nearest-global-prototype inference (proto_acc), Local its "
         "head; the best mean over the evaluations, as the paper's best over rounds, but "
         "evaluated every 5 rounds (and the last): an evaluation of the 8 networks costs "
         "half a round here"),
    ),
    smoke={"federation": {"clients": 8}, "data": {"alpha": 1.0}},
)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    TAN, QIAO, MPFEDCL_LABEL, MPFEDCL_FEATURE, MICHIELI_SYNTHETIC, MICHIELI_MNIST,
    MICHIELI_PARTIAL, FEDTGP)}


# --- from a recipe to runs --------------------------------------------------------------

def merge(base: Mapping[str, Mapping[str, Any]],
          *overs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Section-wise update: later mappings win key by key."""
    out = {name: dict(copy.deepcopy(table)) for name, table in base.items()}
    for over in overs:
        for name, table in over.items():
            out.setdefault(name, {}).update(copy.deepcopy(dict(table)))
    return out


def sections(recipe: Recipe, row: Row, seed: int, *, scale: str = "full",
             rounds: int | None = None, extra: Mapping[str, Mapping[str, Any]] | None = None,
             data: str | Path = MNIST) -> dict[str, dict[str, Any]]:
    """The config of one (row, seed): the recipe's base, the row's changes, the scale's,
    --rounds and --set; `data` replaces "{mnist}" (the recipe's subset file when it has
    one). The launch and log sections are the benchmark's (CPU, quiet, no message log)."""
    if row.mean_of:
        raise ValueError(f"row {row.label!r} is derived (mean_of); it has no run")
    smoke = {}
    if scale == "smoke":
        smoke = merge({"federation": {"rounds": 2}, "train": {"epochs": 1}}, recipe.smoke)
    cfg = merge(recipe.base, row.set, smoke, {"federation": {"rounds": rounds}}
                if rounds else {}, extra or {})
    cfg["algorithm"] = {"name": row.algorithm, **row.params, **cfg.get("algorithm", {})}
    ds = cfg.get("data", {}).get("dataset", "")
    if "{mnist}" in ds:
        cfg["data"]["dataset"] = ds.replace("{mnist}", str(Path(data).resolve()))
    fed = cfg["federation"]
    fed.setdefault("rounds", 10)
    fed.update(seed=seed, eval_every=recipe.eval_every if recipe.at == "best"
               else fed["rounds"])
    fed.setdefault("start_timeout_s", 600.0)
    fed.setdefault("hard_deadline_s", 120.0)
    cfg.setdefault("launch", {}).update({"devices": ["cpu"], "threads": 1})
    cfg["launch"].setdefault("nodes", 2)
    cfg["log"] = {"level": "warning", "messages": False, "embeddings": 0}
    return cfg


def run_name(cfg: Mapping[str, Mapping[str, Any]]) -> str:
    """ALGORITHM-DIGEST-sSEED; DIGEST hashes every setting but the seed, the launch and log
    sections and the federation's timeouts, so equal runs of two recipes share a name."""
    keep = {name: dict(table) for name, table in cfg.items() if name not in ("launch", "log")}
    keep["federation"] = {k: v for k, v in keep["federation"].items()
                          if k not in ("seed", "start_timeout_s", "hard_deadline_s")}
    digest = hashlib.sha1(json.dumps(keep, sort_keys=True, default=str).encode())
    return f"{cfg['algorithm']['name']}-{digest.hexdigest()[:10]}-s{cfg['federation']['seed']}"


def metric_value(records: list[Mapping[str, Any]], key: str, at: str = "final") -> float | None:
    """The metric (%) of a run's metrics.jsonl records: the last evaluation's, or the best
    over evaluations; None when no evaluation has it."""
    vals = [float(r[key]) for r in records if r.get(key) is not None
            and not math.isnan(float(r[key]))]
    if not vals:
        return None
    return 100.0 * (max(vals) if at == "best" else vals[-1])


def _records(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(x) for x in lines if x.strip()]


def make_subset(source: Path, n: int, out: Path) -> Path:
    """OUT/data/STEM-N.npz: n samples of the npz at source drawn with seed 0 (written once)."""
    import numpy as np

    path = out / "data" / f"{source.stem}-{n}.npz"
    if not path.exists():
        with np.load(source, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
        if n > len(y):
            raise ValueError(f"subset of {n} samples from {source}, which has {len(y)}")
        idx = np.sort(np.random.default_rng(SUBSET_SEED).permutation(len(y))[:n])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, x=x[idx], y=y[idx])
        tmp.replace(path)
    return path


# --- the table and the verdicts ---------------------------------------------------------

def order_pairs(order: tuple[str, ...] | list[str]) -> list[tuple[str, str]]:
    """["A > B > C", "A > D"] -> [(A, B), (B, C), (A, D)]."""
    pairs = []
    for chain in order:
        labels = [x.strip() for x in chain.split(">")]
        pairs += list(itertools.pairwise(labels))
    return pairs


def judge(pairs: list[tuple[str, str, float | None, float | None]]) -> tuple[str, list[str]]:
    """(verdict, reasons) of "hi > lo" pairs with their values: "does not hold" (the failing
    pairs named) when any judged pair fails, "holds" when every judged pair holds, "not
    judged" when none could be; a pair with a missing value is named and left out."""
    failed, missing, judged = [], [], 0
    for hi, lo, a, b in pairs:
        if a is None or b is None or math.isnan(a) or math.isnan(b):
            missing.append(f"not judged: {hi} or {lo} has no number")
            continue
        judged += 1
        if not a > b:
            failed.append(f"{hi} ({a:.2f}) is not above {lo} ({b:.2f})")
    if failed:
        return "does not hold", failed + missing
    return ("holds" if judged else "not judged"), missing


def verdict(order: tuple[str, ...] | list[str],
            values: Mapping[str, float | None]) -> tuple[str, list[str]]:
    """The expected ordering over values (label -> number; None or nan = none)."""
    return judge([(hi, lo, values.get(hi), values.get(lo)) for hi, lo in order_pairs(order)])


def paper_verdict(recipe: Recipe) -> tuple[str, list[str]]:
    """The expected ordering on the paper's own numbers, each pair in the first paper column
    that has both rows (a pair is never judged across two tables)."""
    rows = {r.label: r for r in recipe.rows}
    pairs = []
    for hi, lo in order_pairs(recipe.order):
        both = [(a.value, b.value) for a, b in zip(rows[hi].paper, rows[lo].paper)
                if a is not None and b is not None]
        pairs.append((hi, lo, *(both[0] if both else (None, None))))
    return judge(pairs)


def row_values(recipe: Recipe, per_run: Mapping[tuple[str, int], float | None],
               seeds: list[int]) -> dict[str, list[float | None]]:
    """label -> the per-seed values; per_run maps (label, seed) of the run rows, and a
    derived row takes, per seed, the mean of its rows (None if any is missing)."""
    out: dict[str, list[float | None]] = {}
    for row in recipe.rows:
        if row.mean_of:
            vals = []
            for i in range(len(seeds)):
                parts = [out[m][i] for m in row.mean_of]
                vals.append(None if any(p is None for p in parts)
                            else sum(parts) / len(parts))
            out[row.label] = vals
        else:
            out[row.label] = [per_run.get((row.label, s)) for s in seeds]
    return out


def _fmt(m: float | None, sd: float | None = None) -> str:
    if m is None or math.isnan(m):
        return "-"
    return f"{m:.2f}" + ("" if sd is None or math.isnan(sd) else f" ± {sd:.2f}")


def report(recipe: Recipe, values: Mapping[str, list[float | None]], *,
           rounds_of: Mapping[str, int] | None = None, seeds: list[int] | None = None,
           scale: str = "full") -> tuple[list[str], dict[str, Any]]:
    """The printed table and its JSON twin."""
    rounds_of = rounds_of or {}
    seeds = seeds if seeds is not None else list(range(max(map(len, values.values()),
                                                           default=0)))
    stats = {label: mean_std(v) for label, v in values.items()}
    means = {label: (s[0] if s[2] else None) for label, s in stats.items()}
    w = max(len(r.label) for r in recipe.rows) + 2
    head = (f"  {'row':<{w}}{'metric':<16}{'rounds':>7}"
            + "".join(f"  {c:>22}" for c in recipe.paper_columns)
            + f"  {'ours (mean ± std)':>18}  per seed ({', '.join(map(str, seeds))})")
    at = "best over rounds" if recipe.at == "best" else "final"
    lines = [f"{recipe.name}: {recipe.title}",
             f"  scale {scale}, {len(seeds)} seed(s); accuracy in %, metric {at}", head]
    rows_json = []
    for row in recipe.rows:
        m, sd, n = stats[row.label]
        per_seed = values[row.label]
        metric = "mean of rows" if row.mean_of else (row.metric or recipe.metric)
        papers = list(row.paper) + [None] * (len(recipe.paper_columns) - len(row.paper))
        lines.append(f"  {row.label:<{w}}{metric:<16}{rounds_of.get(row.label, '')!s:>7}"
                     + "".join(f"  {_fmt(p.value, p.std) if p else '-':>22}" for p in papers)
                     + f"  {_fmt(m if n else None, sd if n > 1 else None):>18}  "
                     + " ".join(_fmt(v) for v in per_seed))
        rows_json.append({
            "label": row.label, "algorithm": row.algorithm or None,
            "params": dict(row.params), "metric": metric, "mean_of": list(row.mean_of),
            "rounds": rounds_of.get(row.label),
            "paper": [None if p is None else {"column": c, "value": p.value, "std": p.std,
                                              "source": p.source}
                      for c, p in zip(recipe.paper_columns, papers)],
            "ours": {"mean": m if n else None, "std": sd if n > 1 else None, "n": n,
                     "per_seed": per_seed}})
    ours_v, ours_why = verdict(recipe.order, means)
    paper_v, paper_why = paper_verdict(recipe) if recipe.paper_columns else ("-", [])
    lines.append(f"expected ordering: {'; '.join(recipe.order)}")
    lines.append(f"  ours:  {ours_v}" + "".join(f"\n         {x}" for x in ours_why))
    if recipe.paper_columns:
        lines.append(f"  paper: {paper_v}" + "".join(f"\n         {x}" for x in paper_why))
    gaps_json = []
    if recipe.gaps:
        lines.append("differences the paper states (points), ours per seed then mean ± std:")
    for g in recipe.gaps:
        diffs = [None if a is None or b is None else a - b
                 for a, b in zip(values.get(g.a, []), values.get(g.b, []))]
        dm, dsd, dn = mean_std(diffs)
        lines.append(f"  {g.a} − {g.b}: paper {g.value:+.1f} ({g.source}); ours "
                     + (f"{dm:+.2f}" + (f" ± {dsd:.2f}" if dn > 1 else "") if dn else "-"))
        gaps_json.append({"a": g.a, "b": g.b, "paper": g.value, "source": g.source,
                          "ours": {"mean": dm if dn else None, "std": dsd if dn > 1 else None,
                                   "per_seed": diffs}})
    lines.append("scale changes (what differs from the paper, and why):")
    lines += [f"  - {c}" for c in recipe.scale_changes]
    lines += [f"note: {x}" for x in recipe.notes]
    doc = {"recipe": recipe.name, "title": recipe.title, "scale": scale, "seeds": seeds,
           "at": recipe.at, "paper_setting": recipe.paper_setting,
           "paper_columns": list(recipe.paper_columns), "rows": rows_json,
           "ordering": {"expected": list(recipe.order),
                        "ours": {"verdict": ours_v, "pairs": ours_why},
                        "paper": {"verdict": paper_v, "pairs": paper_why}},
           "gaps": gaps_json, "scale_changes": list(recipe.scale_changes),
           "notes": list(recipe.notes)}
    return lines, doc


# --- command line -----------------------------------------------------------------------

def describe(recipe: Recipe) -> list[str]:
    """`list`: the recipe's title, paper setting, shared settings and rows."""
    runs = [r for r in recipe.rows if not r.mean_of]
    lines = [f"{recipe.name}: {recipe.title}", f"  paper: {recipe.paper_setting}"]
    base = merge(recipe.base)
    lines.append("  ours: " + "; ".join(
        f"[{name}] " + ", ".join(f"{k} = {v!r}" for k, v in table.items())
        for name, table in base.items()) + (f"; MNIST subset {recipe.subset}"
                                             if recipe.subset else ""))
    for r in runs:
        opts = ", ".join(f"{k} = {v!r}" for k, v in r.params.items())
        changes = "; ".join(f"{k} = {v!r}" for t in r.set.values() for k, v in t.items())
        lines.append(f"    {r.label}: {r.algorithm}" + (f" ({opts})" if opts else "")
                     + (f"; {changes}" if changes else "")
                     + f"; metric {r.metric or recipe.metric}")
    lines.append(f"  {len(runs)} runs a seed; expected: {'; '.join(recipe.order)}")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "recipes:\n" + "\n".join(f"  {n:<20} {r.title}" for n, r in RECIPES.items())
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("recipe", metavar="NAME", choices=["list", *RECIPES],
                   help="a recipe (below), or `list` to print every recipe's settings")
    p.add_argument("--scale", choices=SCALES, default="full",
                   help="full (default): the recipe as written; smoke: 1 seed, 2 rounds, "
                   "1 epoch, few clients (a check that it runs, not a result)")
    p.add_argument("--seeds", type=int, default=None,
                   help="seeds 0..N-1 (default 3; 1 at --scale smoke)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every run (default: each row's, as the recipe says)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="change every run's config (repeatable; the value is read as TOML); "
                   "the runs' names change with it")
    p.add_argument("--only", action="append", default=[], metavar="LABEL",
                   help="run only this row (repeatable; a derived row brings its rows; "
                   "default every row)")
    p.add_argument("--data", default=str(MNIST),
                   help="the offline MNIST npz (default ../shared/data/mnist-10k.npz)")
    p.add_argument("--nodes", type=int, default=2, help="client-node processes per run "
                   "(default 2)")
    p.add_argument("--out", default=None,
                   help="folder for the run directories (kept and reused; default a "
                   "temporary folder)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table as JSON")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run (default 3600)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the runs (name and config) without running them")


def _overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """--set items, parsed by `fedbus run --set`'s own parser, as sections."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        section, key, value = _parse_override(item)
        out.setdefault(section, {})[key] = value
    return out


def plan(recipe: Recipe, args: argparse.Namespace, data: str | Path
         ) -> list[tuple[Row, int, dict[str, dict[str, Any]]]]:
    only = set(args.only)
    seeds = list(range(args.seeds))
    rows = [r for r in recipe.rows if not r.mean_of]
    if only:
        wanted = set(only)
        for r in recipe.rows:
            if r.label in only and r.mean_of:
                wanted |= set(r.mean_of)
        rows = [r for r in rows if r.label in wanted]
    extra = merge(args.extra, {"launch": {"nodes": args.nodes}})
    return [(r, s, sections(recipe, r, s, scale=args.scale, rounds=args.rounds,
                            extra=extra, data=data)) for r in rows for s in seeds]


def run_all(recipe: Recipe, runs: list[tuple[Row, int, dict[str, dict[str, Any]]]],
            out: Path, timeout: float) -> tuple[dict[tuple[str, int], float | None], list[str]]:
    """Run (or reuse) every planned run once; ((label, seed) -> the row's metric, the runs
    that failed). A failed run is reported and its rows left empty; the others go on."""
    per_run: dict[tuple[str, int], float | None] = {}
    done: dict[str, list[dict[str, Any]] | None] = {}  # name -> records (rows share runs)
    failed: list[str] = []
    for i, (row, seed, cfg) in enumerate(runs, 1):
        name = run_name(cfg)
        if name not in done:
            head = f"[{i}/{len(runs)}] {name} ({row.label}, seed {seed})"
            try:
                res = run_or_reuse(cfg, name, out=out, timeout=timeout)
            except (RuntimeError, TimeoutError) as e:
                print(f"{head}: FAILED: {e}", flush=True)
                done[name] = None
                failed.append(name)
            else:
                done[name] = _records(res.run_dir)
                wall = "reused" if res.note == "reused" else f"{res.wall_s:.0f} s"
                note = f"  [{res.note}]" if res.note not in ("", "reused") else ""
                print(f"{head}: {wall}{note}", flush=True)
        records = done[name]
        per_run[(row.label, seed)] = (None if records is None else metric_value(
            records, row.metric or recipe.metric, recipe.at))
    return per_run, failed


def main_args(args: argparse.Namespace) -> int:
    err = "fedbus bench reproduce"
    if args.recipe == "list":
        for r in RECIPES.values():
            print("\n".join(describe(r)) + "\n")
        return 0
    recipe = RECIPES[args.recipe]
    if args.seeds is None:
        args.seeds = 1 if args.scale == "smoke" else 3
    unknown = sorted(set(args.only) - {r.label for r in recipe.rows})
    if unknown:
        print(f"{err}: --only: no row {', '.join(map(repr, unknown))} in {recipe.name}; "
              f"rows are {'; '.join(r.label for r in recipe.rows)}", file=sys.stderr)
        return 2
    try:
        args.extra = _overrides(args.overrides)
    except ValueError as e:
        print(f"{err}: {e}", file=sys.stderr)
        return 2
    needs_mnist = "{mnist}" in str(recipe.base.get("data", {}).get("dataset", ""))
    if needs_mnist and not Path(args.data).exists():
        print(f"{err}: {args.data} not found (--data)", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
    elif args.dry_run:
        out = Path(tempfile.gettempdir()) / "fedbus-reproduce-XXXX"  # not made
    else:
        out = Path(tempfile.mkdtemp(prefix="fedbus-reproduce-"))
    subset = recipe.subset and needs_mnist
    data = (out / "data" / f"{Path(args.data).stem}-{recipe.subset}.npz" if subset
            else Path(args.data))
    runs = plan(recipe, args, data)
    for row, _, cfg in runs:
        try:
            build_config(cfg)
        except ConfigError as e:
            print(f"{err}: {recipe.name}, row {row.label!r}: {e}", file=sys.stderr)
            return 2
    names = {run_name(cfg) for _, _, cfg in runs}  # rows may share a run (other metric)
    print(f"{err} {recipe.name} ({args.scale}): {len(names)} runs "
          f"({len(names) // max(args.seeds, 1)} a seed x {args.seeds} seeds); run dirs in {out}"
          + (" (not made: --dry-run)" if args.dry_run and not args.out else ""), flush=True)
    if args.dry_run:
        for row, seed, cfg in runs:
            print(f"  {run_name(cfg)}  [{row.label}, seed {seed}]  "
                  + json.dumps({k: v for k, v in cfg.items() if k not in ("launch", "log")},
                               default=str))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if subset:
        make_subset(Path(args.data), recipe.subset, out)
    t0 = time.perf_counter()
    per_run, failed = run_all(recipe, runs, out, args.timeout)
    seeds = list(range(args.seeds))
    rounds_of = {row.label: cfg["federation"]["rounds"] for row, _, cfg in runs}
    lines, doc = report(recipe, row_values(recipe, per_run, seeds), rounds_of=rounds_of,
                        seeds=seeds, scale=args.scale)
    doc.update(out=str(out), total_s=round(time.perf_counter() - t0, 1),
               overrides=args.overrides, failed=failed,
               runs={f"{r.label}|{s}": run_name(c) for r, s, c in runs})
    print("\n" + "\n".join(lines))
    if failed:
        print(f"{len(failed)} run(s) failed (their rows are empty): {', '.join(failed)}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1, ensure_ascii=False))
    return 1 if failed else 0


if __name__ == "__main__":  # python -m fedbus.bench.reproduce
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    raise SystemExit(main_args(parser.parse_args()))
