"""Run configuration: TOML, validated on load, every option defaulted.

A config is a set of sections; each key has a default, a type and (where it
makes sense) a set of allowed values. `--set section.key=value` overrides any
key. Errors name the bad key and what is allowed, so a typo never silently
falls back to a default. The `[algorithm]` section is validated against the
parameters the chosen algorithm declares (see fedbus.algorithms).
"""
from __future__ import annotations

import copy
import difflib
import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from fedbus.algorithms.core.params import Opt  # declared with the algorithms; the name stays here


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key."""


class ConfigWarning(UserWarning):
    """A config that runs but holds something the user likely did not mean (a key that the
    chosen partition ignores): load_config keeps each in Config.notes, and the preflight
    warns with them once every input has passed, so that an error stays one line."""


SCHEMA: dict[str, dict[str, Opt]] = {
    "federation": {
        "clients": Opt(10, "number of federated clients", min=1),
        "rounds": Opt(10, "rounds (sync) or aggregations (async)", min=1),
        "fraction": Opt(1.0, "fraction of live clients sampled per round", min=0.0, max=1.0),
        "min_clients": Opt(1, "sample at least this many clients per round", min=1),
        "sampling": Opt("uniform", "how a round's clients are drawn: uniform, or size "
                        "(probability proportional to the training-set size, without "
                        "replacement: FedProx's and Michieli & Ozay's Alg. 1)",
                        ("uniform", "size")),
        "min_updates": Opt(1, "a round closes at its deadline only with this many updates", min=1),
        "deadline_s": Opt(0.0, "round deadline in seconds; 0 waits for every sampled client",
                          min=0.0),
        "start_timeout_s": Opt(60.0, "start once every client is live, or after this long "
                               "with at least min_clients", min=0.0),
        "hard_deadline_s": Opt(600.0, "close a round after this long even with fewer than "
                               "min_updates updates", min=0.0),
        "mode": Opt("sync", "sync rounds or async buffered aggregation", ("sync", "async")),
        "late": Opt("drop", "what happens to an update that misses its round", ("drop", "fold")),
        "quorum": Opt(0, "sync: a round closes as soon as this many of its sampled clients "
                      "have sent their update, the rest marked late (dropped or folded, per "
                      "late); closing on that event, not a clock, makes who is late the same "
                      "on every machine; 0 = every sampled client (or the deadline); not "
                      "under secure aggregation", min=0),
        "concurrency": Opt(0, "async: clients kept busy at once (0 = all)", min=0),
        "buffer": Opt(0, "async: aggregate every this many updates (0 = concurrency)", min=0),
        "max_staleness": Opt(20, "updates staler than this are dropped", min=0),
        "eval_every": Opt(1, "evaluate on every client every this many rounds", min=1),
        "eval_clients": Opt(0, "evaluate this many live clients, drawn anew at each "
                            "evaluation from the seed (0 = every live client): a federation "
                            "of 100,000 clients need not build every one to score it", min=0),
        "target_acc": Opt(0.0, "report the first round reaching this mean accuracy (0 = off)",
                          min=0.0, max=1.0),
        "seed": Opt(0, "seed of partitions, sampling, initialisation and training"),
    },
    "data": {
        "dataset": Opt("digits", "digits, npz:PATH, mnist, fmnist, emnist, femnist, cifar10, "
                       "cifar100, synthetic, mnist1d, digit5-offline:PATH, digit5, office10"),
        "data_dir": Opt("", "download/cache folder for online datasets (default ~/.cache/fedbus)"),
        "partition": Opt("nway-kshot", "nway-kshot, dirichlet, pathological, "
                         "pathological-powerlaw, powerlaw, iid, natural, domains, "
                         "domains-dirichlet or file:PATH.json"),
        "test_fraction": Opt(0.25, "per-client test share", min=0.0, max=0.9),
        "test_distribution": Opt("local", "each client's test split: local = from its own "
                                 "share (skewed like its training data); global = every "
                                 "client's test samples pooled and dealt back at random",
                                 ("local", "global")),
        "ways": Opt(3, "nway-kshot: mean classes per client", min=1),
        "ways_std": Opt(2.0, "nway-kshot: stdev of classes per client", min=0.0),
        "shots": Opt(100, "nway-kshot: mean samples per class", min=1),
        "shots_std": Opt(10.0, "nway-kshot: stdev of samples per class", min=0.0),
        "alpha": Opt(0.5, "dirichlet and domains-dirichlet concentration", min=0.0),
        "min_samples": Opt(10, "dirichlet, domains-dirichlet, powerlaw, "
                           "pathological-powerlaw: fewest samples per client", min=0),
        "classes_per_client": Opt(2, "pathological, pathological-powerlaw: classes per "
                                  "client", min=1),
        "powerlaw_sigma": Opt(2.0, "powerlaw, pathological-powerlaw: lognormal sigma of "
                               "client sizes", min=0.0),
        "synthetic_alpha": Opt(0.5, "FedProx synthetic: model heterogeneity", min=0.0),
        "synthetic_beta": Opt(0.5, "FedProx synthetic: data heterogeneity", min=0.0),
        "image_size": Opt(0, "digit5, office10: image side in pixels (0 = 32); shapes-seg "
                          "(0 = 64), voc2012 (0 = 128)", min=0),
        "domain_samples": Opt(0, "digit5, office10, digit5-offline: at most this many samples "
                              "per domain, a fixed random subset (0 = all); shapes-seg: "
                              "images generated (0 = 2000); voc2012: at most this many "
                              "images", min=0),
    },
    "model": {
        "arch": Opt("cnn", "network for every client (see fedbus.models.ARCHS; "
                    "frozen:ARCH@SOURCE[+...] = fixed backbones pre-trained on SOURCE, digits "
                    "or PATH.npz, or frozen:FILE.pt, with a trainable projection: "
                    "fedbus.models.frozen)"),
        "group": Opt([], "model group: client i runs group[i % len(group)]"),
        "feature_dim": Opt(0, "prototype dimension; 0 = the architecture's own", min=0),
        "pretrained": Opt(False, "load ImageNet weights where torchvision has them locally"),
    },
    "algorithm": {
        "name": Opt("fedproto", "registered algorithm name"),
    },
    "train": {
        "epochs": Opt(1, "local epochs F per task", min=0),
        "batch_size": Opt(32, "local minibatch size", min=1),
        "lr": Opt(0.01, "local learning rate", min=0.0),
        "momentum": Opt(0.5, "SGD momentum", min=0.0, max=1.0),
        "weight_decay": Opt(0.0, "SGD weight decay", min=0.0),
        "lr_decay": Opt(1.0, "every client optimizer's learning rate at a task of round r "
                        "is multiplied by lr_decay^r (1 = off), on top of an algorithm's own "
                        "schedule (MP-FedCL's and FedNH's lr_decay: set theirs to 1 to give "
                        "every method this one)", min=0.0, max=1.0),
        "optimizer_state": Opt("fresh", "what a client's optimizers (their momentum buffers) "
                               "hold when a local run starts: fresh = nothing, a new "
                               "optimizer per task (FedProto's and HtFLlib's code; the "
                               "papers are silent); persist = carried over from the "
                               "client's previous task", ("fresh", "persist")),
        "budget_s": Opt(0.0, "time budget per task in seconds; 0 = none", min=0.0),
        "cohort": Opt("auto", "a node's tasks of one round for clients of one architecture "
                      "trained as one vectorised cohort (torch.func vmap over the clients; "
                      "fedbus.algorithms.core.cohort), equal to one by one up to float32 "
                      "rounding: on = wherever the algorithm and model support it (else one "
                      "by one, the reason logged); off = one by one; auto = on where "
                      "measured faster: every supported model on CUDA, models without "
                      "convolutions (MLPs) on the CPU", ("auto", "on", "off")),
    },
    "system": {
        "slow_fraction": Opt(0.0, "fraction of clients that are slow", min=0.0, max=1.0),
        "slow_clients": Opt([], "client ids that are slow, besides slow_fraction"),
        "slow_factor": Opt(1.0, "slow clients take this many times longer", min=1.0),
        "hold_clients": Opt([], "client ids whose node holds each update until its next "
                            "message of a later round (a task or eval) arrives: a straggler "
                            "late by events, not seconds, whatever the machine's speed; with "
                            "federation.quorum (so the round closes without it) its update "
                            "is late in every round and folded into the next (late = fold)"),
        "drop_prob": Opt(0.0, "probability that a client silently drops a task", min=0.0,
                         max=1.0),
        "drop_clients": Opt([], "client ids that drop every task they get, besides "
                            "drop_prob"),
        "drop_stage": Opt("task", "when a dropping client drops out under secure "
                          "aggregation: task (on receipt), shares (after sending its keys "
                          "and shares, before its masked input) or input (after its masked "
                          "input, before unmasking); without it a drop is on receipt",
                          ("task", "shares", "input")),
        "partial_work": Opt(False, "clients run F' ~ U[0, F] epochs (FedProx-style)"),
        "partial_fraction": Opt(1.0, "partial_work: each task is partial with this probability "
                                "(FedProx's stragglers, Michieli & Ozay's delta)",
                                min=0.0, max=1.0),
    },
    "privacy": {
        "clip_norm": Opt(0.0, "clip each uploaded prototype to this L2 norm (0 = off)", min=0.0),
        "noise_sigma": Opt(0.0, "Gaussian noise added to uploaded prototypes (0 = off)",
                           min=0.0),
        "withhold_counts": Opt(False, "upload class presence (0/1) instead of sample counts"),
        "secure_aggregation": Opt(False, "the server learns only the sum of a round's updates "
                                  "(SecAgg+, fedbus.node.privacy.secagg; sync runs of algorithms "
                                  "that declare a merge rule)"),
        "secagg_neighbours": Opt(0, "secure aggregation: peers each client shares its mask "
                                 "seeds with (0 = auto: every other client of a cohort up "
                                 "to 20, else the even number >= 3 log2(cohort))", min=0),
        "secagg_dropout": Opt(0.3, "secure aggregation: the fraction of a client's peers that "
                              "may drop out after sending their keys and still be recovered "
                              "(sets the Shamir threshold)", min=0.0, max=0.5),
        "secagg_range": Opt(65536.0, "secure aggregation: a client's summed values are "
                            "clipped to [-range, range] before fixed-point encoding",
                            min=1e-6),
        "secagg_frac_bits": Opt(16, "secure aggregation: fractional bits of the fixed-point "
                                "encoding (quantisation step 2^-bits)", min=0, max=40),
        "secagg_timeout_s": Opt(30.0, "secure aggregation: how long the server waits for "
                                "keys, shares and the unmasking answers of a round", min=0.1),
        "dp": Opt("off", "differential privacy with an accountant: record (each training "
                  "sample's feature clipped, per-class sums and counts noised: prototype "
                  "algorithms), client (each weight delta clipped, the sum noised: "
                  "weight-sharing algorithms) or sgd (DP-SGD with Opacus in local training: "
                  "each sample's gradient clipped, each step noised; weight-sharing "
                  "algorithms); fedbus.node.privacy.dp", ("off", "record", "client", "sgd")),
        "dp_extractor": Opt("plain", "dp = record: how the feature extractor the prototypes "
                            "are computed with is trained on the client's data: plain (without "
                            "DP: admitted only with train.epochs = 0, an extractor never trained "
                            "on the client's data) or sgd (DP-SGD with Opacus, same dp_clip and "
                            "dp_noise_multiplier, its steps composed with the prototype "
                            "releases); fedbus.node.privacy.dp", ("plain", "sgd")),
        "dp_clip": Opt(1.0, "dp: the L2 clip C of a sample's feature (record), of a "
                       "client's update (client) or of a sample's gradient (sgd)", min=1e-9),
        "dp_noise_multiplier": Opt(1.0, "dp: Gaussian noise std over the clip (z; the noise "
                                   "std is z C)", min=1e-6),
        "delta": Opt(1e-5, "dp: the delta at which epsilon is reported", min=1e-12, max=0.1),
        "target_epsilon": Opt(0.0, "dp: stop a client's (record, sgd) or the run's (client) "
                              "participation before epsilon passes this (0 = no budget)",
                              min=0.0),
        "dp_accountant": Opt("rdp", "dp: the dp-accounting accountant (rdp or pld)",
                             ("rdp", "pld")),
        "dp_noise": Opt("secret", "dp: where the noise comes from: secret (the client's OS "
                        "entropy; the server's own secret seed, kept in RUN/noise_seed, for "
                        "client-level noise), or seeded (from the run's seed, which the "
                        "server and every node know: reproducible, but whoever knows the "
                        "seed can recompute and remove the noise, so the guarantee does "
                        "not hold against them: for simulations), or distributed (dp = "
                        "client under secure_aggregation: each client adds its share of "
                        "Skellam noise in the masking ring, the server none, so it never "
                        "sees a noiseless sum; fedbus.node.privacy.ddp)",
                        ("secret", "seeded", "distributed")),
    },
    "security": {
        "max_proto_norm": Opt(0.0, "the server refuses an uploaded prototype longer than this "
                              "(L2); 0 = auto: privacy.clip_norm plus its noise's allowance "
                              "when clipping, else 1e4", min=0.0),
        "max_update_norm": Opt(1e4, "the server refuses an update whose other float arrays "
                               "(a weight delta, a head, logits) have a larger L2 norm "
                               "together; 0 = unbounded", min=0.0),
    },
    "bus": {
        "broker": Opt("", "broker address; empty lets `fedbus run` start one on loopback"),
        "transport": Opt("tcp", "transport for a local run", ("tcp", "ipc")),
        "heartbeat_s": Opt(1.0, "heartbeat interval", min=0.01),
        "liveness": Opt(3, "missed heartbeats before a peer counts as dead", min=1),
        "max_frame_mb": Opt(64, "largest accepted frame in MiB", min=1),
        "curve": Opt(False, "encrypt and authenticate with CurveZMQ"),
        "keys_dir": Opt("", "CurveZMQ keys folder (see `fedbus keygen`)"),
        "batch": Opt("auto", "auto: a round's tasks for one node leave as one `tasks` message "
                     "and an evaluation's requests as one `evals` message, the shared payload "
                     "encoded once, to each node that says it takes them, and the node "
                     "answers the tasks with `updates` messages, one a round (PROTOCOL.md "
                     "§4.3); results are bit-identical to off. Secure aggregation runs stay "
                     "unbatched", ("off", "auto")),
    },
    "launch": {
        "nodes": Opt(2, "client-node processes for a local run", min=1),
        "devices": Opt(["auto"], "devices for nodes, round-robin: auto, cpu, cuda, cuda:N"),
        "node_memory_mb": Opt(1024.0, "memory budget per node for materialised clients "
                              "(their weights, gradients, optimizer and extra state, "
                              "measured); the least recently used beyond it are evicted "
                              "(fedbus.node.pool)", min=0.0),
        "max_resident": Opt(0, "also keep at most this many clients materialised per node "
                            "(0 = only the memory budget decides)", min=0),
        "evict_to": Opt("memory", "where evicted clients go: their state packed into one "
                        "buffer each, in memory or in a file", ("memory", "disk")),
        "threads": Opt(0, "torch threads per node process (0 = auto: the cores shared among "
                       "launch.nodes nodes, at least 1)", min=0),
        "start": Opt("auto", "how `fedbus run` starts its processes: fork them from a launcher "
                     "that loaded torch and the data once (auto: on Linux with no GPU node), "
                     "or exec a fresh interpreter each", ("auto", "fork", "exec")),
    },
    "log": {
        "level": Opt("info", "log level", ("debug", "info", "warning", "error")),
        "messages": Opt(True, "server writes the message log (needed by `fedbus replay`)"),
        "client_messages": Opt(False, "client nodes write their own message logs"),
        "embeddings": Opt(200, "test embeddings per client saved at the end for plots "
                          "(plaintext, uncovered by secure aggregation and DP: 0 when "
                          "privacy.secure_aggregation is on and this key is not set)", min=0),
        "embedding_clients": Opt(50, "clients asked for those embeddings, evenly spaced over "
                                 "the evaluated ones (0 = every client)", min=0),
        "tensorboard": Opt(False, "server writes RUN/tensorboard/: scalars and participation "
                                  "per round (pip install 'fedbus[tensorboard]')"),
        "ffd_reference": Opt("", "run directory of a reference model (a `central` run; "
                             "in a CONFIG file relative to its folder): each evaluation records "
                             "FFD, the MMD between the global model's and the reference's "
                             "features on every client's data (simulation only; "
                             "fedbus.analysis.ffd)"),
        "ffd_split": Opt("train", "FFD: the client split the features are taken on",
                         ("train", "test")),
        "ffd_samples": Opt(500, "FFD: at most this many samples per client, a fixed random "
                           "subset (0 = all)", min=0),
    },
}


class Section(dict):
    """A config section: a dict that also reads as attributes (cfg.train.lr)."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class Config:
    def __init__(self, sections: dict[str, dict[str, Any]],
                 origins: Mapping[str, str] | None = None):
        self._sections = {name: Section(values) for name, values in sections.items()}
        # "section.key" -> how a relative path in it was resolved, for a not-found error
        self.origins = dict(origins or {})
        self.notes: list[str] = []  # ConfigWarning lines (load_config)

    def origin(self, dotted: str) -> str:
        """How the path in key `dotted` was read (" (relative to ...)"), or ""."""
        note = self.origins.get(dotted)
        return f" ({note})" if note else ""

    def __getattr__(self, name: str) -> Section:
        try:
            return self.__dict__["_sections"][name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {name: dict(sec) for name, sec in self._sections.items()}

    def __repr__(self) -> str:
        return f"Config({self.to_dict()!r})"


def _type_ok(default: Any, value: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list):
        return isinstance(value, list)
    return True


def _check(section: str, key: str, opt: Opt, value: Any) -> Any:
    name = f"{section}.{key}"
    if not _type_ok(opt.default, value):
        raise ConfigError(f"{name} = {value!r}: expected {type(opt.default).__name__} "
                          f"(default {opt.default!r})")
    if isinstance(opt.default, float):
        value = float(value)
        if not math.isfinite(value):  # nan passes every comparison below; inf every max
            raise ConfigError(f"{name} = {value!r}: must be a finite number")
    if opt.choices is not None and value not in opt.choices:
        allowed = ", ".join(map(str, opt.choices))
        raise ConfigError(f"{name} = {value!r}: allowed values are {allowed}")
    if opt.min is not None and value < opt.min:
        raise ConfigError(f"{name} = {value!r}: must be >= {opt.min}")
    if opt.max is not None and value > opt.max:
        raise ConfigError(f"{name} = {value!r}: must be <= {opt.max}")
    return value


def _parse_override(text: str) -> tuple[str, str, Any]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    section, key = dotted.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as fedavg or npz:/data/x.npz
    return section, key, value


def algorithm_params(name: str) -> dict[str, Opt]:
    from fedbus.algorithms import get_algorithm  # the registry knows each algorithm's params

    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name = {name!r}: a name is a string (fedbus algorithms "
                          "lists them)")
    try:
        server_cls = get_algorithm(name).server
    except KeyError as err:
        raise ConfigError(f"algorithm.name = {name!r}: {err.args[0]}") from None
    return {k: v if isinstance(v, Opt) else Opt(v) for k, v in server_cls.PARAMS.items()}


def build_config(raw: Mapping[str, Any], overrides: Sequence[str] = ()) -> Config:
    """Validate a parsed TOML mapping plus --set overrides into a Config."""
    merged: dict[str, dict[str, Any]] = {}
    for section, table in raw.items():
        if section not in SCHEMA:
            raise ConfigError(f"unknown section [{section}]{did_you_mean_section(section)}; "
                              f"sections are {', '.join(SCHEMA)}")
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        merged[section] = dict(table)
    for text in overrides:
        section, key, value = _parse_override(text)
        if section not in SCHEMA:
            raise ConfigError(f"--set {text!r}: unknown section {section!r}"
                              f"{did_you_mean_section(section)}; sections are "
                              f"{', '.join(SCHEMA)}")
        merged.setdefault(section, {})[key] = value

    out: dict[str, dict[str, Any]] = {}
    for section, opts in SCHEMA.items():
        table = merged.get(section, {})
        if section == "algorithm":
            opts = {**opts, **algorithm_params(table.get("name", opts["name"].default))}
        unknown = sorted(set(table) - set(opts))
        if unknown:
            from fedbus.algorithms.core.robust import unsupported_hint

            key = unknown[0]
            hint = unsupported_hint(section, key) or (
                _other_algorithms_hint(key, table.get("name", opts["name"].default))
                if section == "algorithm" else "")
            raise ConfigError(f"unknown key {section}.{key}{did_you_mean(section, key, opts)}"
                              f"; [{section}] keys are {', '.join(sorted(opts))}{hint}")
        out[section] = {key: _check(section, key, opt, table[key]) if key in table
                        else copy.deepcopy(opt.default) for key, opt in opts.items()}
    if out["privacy"]["secure_aggregation"] and "embeddings" not in merged.get("log", {}):
        # plaintext test-set embeddings would leave beside the masked updates: only if asked
        out["log"]["embeddings"] = 0
    _check_consistency(out)
    return Config(out)


def did_you_mean(section: str, key: str, keys: Iterable[str]) -> str:
    """" (did you mean SECTION.KEY?)" for an unknown key: the closest key of its section
    (a typo: federation.round), else a key of that name in another section (lr under
    [federation] is train.lr); "" when nothing is close."""
    close = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.6)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    elsewhere = [name for name, opts in SCHEMA.items() if name != section and key in opts]
    return f" (did you mean {elsewhere[0]}.{key}?)" if elsewhere else ""


def did_you_mean_section(section: str) -> str:
    close = difflib.get_close_matches(section, list(SCHEMA), n=1, cutoff=0.6)
    return f" (did you mean [{close[0]}]?)" if close else ""


def _other_algorithms_hint(key: str, name: Any) -> str:
    """For an [algorithm] key the chosen algorithm lacks: which algorithms have it (a key
    kept from another method's config, as when a sweep's grid switches algorithm.name)."""
    from fedbus.algorithms import available, get_algorithm

    owners = []
    for other in available():
        try:
            params = get_algorithm(other).server.PARAMS
        except Exception:  # noqa: BLE001, S112 - a broken plugin must not hide the unknown key
            continue
        if key in params:
            owners.append(other)
    if not owners:
        return ""
    return f" ({key} is a parameter of {', '.join(owners)}, not of {name})"


def _check_consistency(cfg: dict[str, dict[str, Any]]) -> None:
    fed = cfg["federation"]
    if fed["min_clients"] > fed["clients"]:
        raise ConfigError(f"federation.min_clients = {fed['min_clients']} exceeds "
                          f"federation.clients = {fed['clients']}")
    if fed["concurrency"] > fed["clients"]:
        raise ConfigError(f"federation.concurrency = {fed['concurrency']} exceeds "
                          f"federation.clients = {fed['clients']}")
    if fed["buffer"] > max(fed["concurrency"] or fed["clients"], 1):
        raise ConfigError("federation.buffer must not exceed federation.concurrency")
    _check_dp_claims(cfg)
    _check_backbone_sources(cfg)


def _check_dp_claims(cfg: dict[str, dict[str, Any]]) -> None:
    """DP settings whose epsilon would have no basis (fedbus.node.privacy.dp, module doc)."""
    privacy, fed, train = cfg["privacy"], cfg["federation"], cfg["train"]
    if privacy["dp"] == "record" and privacy["dp_extractor"] == "plain" and train["epochs"] > 0 \
            and _admits_record(cfg["algorithm"]["name"]):  # else the preflight says it cannot
        raise ConfigError(
            "privacy.dp = record: the prototypes' feature extractor is trained without DP on "
            "the same data (one sample can move every feature); set privacy.dp_extractor = "
            "sgd (DP-SGD, composed) or train.epochs = 0 (an extractor never trained on the "
            "client's data, e.g. model.arch = frozen:...)")
    if privacy["dp"] == "record" and privacy["dp_extractor"] == "sgd":
        from fedbus.node.privacy.dp import sgd_refusal  # torch, opacus: only when asked for

        why = sgd_refusal(str(cfg["algorithm"]["name"]), "privacy.dp_extractor = sgd")
        if why is not None:
            raise ConfigError(why)
    if privacy["dp_noise"] == "distributed":
        why = _distributed_refusal(privacy)
        if why is not None:
            raise ConfigError(why)
    if privacy["dp"] == "client" and fed["sampling"] != "uniform":
        raise ConfigError(
            f"federation.sampling = {fed['sampling']} with privacy.dp = client: the accountant "
            "assumes every client is sampled with the same probability; set sampling = uniform")
    if privacy["dp"] == "client" and fed["fraction"] <= 0:
        raise ConfigError("federation.fraction = 0 with privacy.dp = client: each client is "
                          "sampled with probability fraction, which must be > 0")


def _admits_record(name: Any) -> bool:
    from fedbus.algorithms import get_algorithm
    from fedbus.node.privacy.dp import dp_levels  # dp_accounting: only under dp = record

    try:
        return "record" in dp_levels(get_algorithm(name).server)
    except (KeyError, ImportError, TypeError, AttributeError):
        return False


def _check_backbone_sources(cfg: dict[str, dict[str, Any]]) -> None:
    """A frozen backbone (model.arch or model.group = frozen:...) that fedbus pre-trains must
    learn from data disjoint from the federation's: not the dataset the clients hold."""
    model, dataset = cfg["model"], str(cfg["data"]["dataset"])
    archs = [("model.arch", model["arch"])] + [(f"model.group[{i}]", a)
                                              for i, a in enumerate(model["group"])]
    archs = [(k, a) for k, a in archs if isinstance(a, str) and a.strip().startswith("frozen:")]
    if not archs:
        return
    from fedbus.models.frozen import training_sources  # torch: only for a frozen backbone

    prefix, _, rest = dataset.partition(":")
    own = {"digits"} if dataset == "digits" else set()
    if prefix in ("npz", "digit5-offline") and rest:
        own.add(os.path.abspath(os.path.expanduser(rest)))
    if prefix == "digit5-offline":
        own.add("digits")  # its fifth domain is sklearn's digits, upsampled
    for key, arch in archs:
        try:
            sources = training_sources(arch.strip().partition(":")[2])
        except ValueError as err:
            raise ConfigError(f"{key} = {arch!r}: {err}") from None
        for source in sources:
            if source in own:
                raise ConfigError(
                    f"{key} = {arch!r}: a backbone pre-trained on {source}, the federation's "
                    f"own data (data.dataset = {dataset!r}); pre-train it on data disjoint "
                    f"from the federation's (another dataset, e.g. ARCH@PATH/mnist-10k.npz for "
                    f"digits, ARCH@digits for an MNIST federation) or load a backbone file")


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "launch" / "default.toml"


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Load CONFIG.toml (None = the embedded default) and apply --set overrides."""
    source = Path(path) if path is not None else DEFAULT_CONFIG
    if path is None:
        from importlib import resources

        text = resources.files("fedbus.launch").joinpath("default.toml").read_text()
    else:
        try:
            text = source.read_bytes().decode("utf-8")  # TOML is UTF-8 whatever the locale
        except FileNotFoundError:
            where = "" if source.is_absolute() else f" (looked at {os.path.abspath(source)})"
            raise ConfigError(f"config file not found: {source}{where}") from None
        except OSError as err:
            raise ConfigError(f"config file {source} cannot be read: {err.strerror or err}"
                              ) from None
        except UnicodeDecodeError as err:
            raise ConfigError(f"{source}: not valid TOML: not UTF-8 text (byte "
                              f"{err.start})") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{source}: not valid TOML: {err}") from None
    origins: dict[str, str] = {}
    notes: list[str] = []
    if path is not None:
        raw = paths_from(raw, source.resolve().parent, origins, notes)
    cfg = build_config(raw, overrides)
    for text in overrides:  # a --set value replaces the file's, and how it was read
        origins.pop(".".join(_parse_override(text)[:2]), None)
    origins.update(_override_origins(overrides))
    cfg.origins = origins
    # the embedded default's own keys are not the user's doing: only --set counts there
    chosen = _keys_given(raw if path is not None else {}, overrides)
    cfg.notes = notes + inapplicable_keys(cfg, chosen)
    return cfg


def _keys_given(raw: Mapping[str, Any], overrides: Sequence[str]) -> set[str]:
    given = {f"{section}.{key}" for section, table in raw.items()
             if isinstance(table, dict) for key in table}
    return given | {".".join(_parse_override(text)[:2]) for text in overrides}


def inapplicable_keys(cfg: Config, given: Iterable[str]) -> list[str]:
    """One line for the [data] keys a config sets, to other than their defaults, that its
    partition does not read (ways and shots kept from an nway-kshot example under
    dirichlet); [] when there are none. Which keys a partition reads is the partitioner's
    own table, fedbus.node.data.partition.PARAMS."""
    from fedbus.node.data.partition import PARAMS  # numpy only

    scheme = str(cfg.data.partition).strip()
    reads = PARAMS.get("file" if scheme.startswith("file:") else scheme)
    if reads is None:  # an unknown partition is the partitioner's error to report
        return []
    partition_keys = {key for keys in PARAMS.values() for key in keys}
    # a key at its default changes nothing (a --print-config copy lists every key)
    ignored = sorted(key for key in partition_keys - set(reads) if f"data.{key}" in given
                     and cfg.data[key] != SCHEMA["data"][key].default)
    if not ignored:
        return []
    users = sorted({p for p, keys in PARAMS.items() for key in ignored if key in keys})
    one = len(ignored) == 1
    line = (f"data.{', data.'.join(ignored)} {'is' if one else 'are'} set but data.partition = "
            f"{scheme!r} does not read {'it' if one else 'them'} "
            f"({'it is' if one else 'they are'} for {', '.join(users)}); ignored")
    return [line]


# Keys that name a file or folder, with the prefix their value may carry before it.
PATH_KEYS = {("data", "dataset"): ("npz:", "digit5-offline:"), ("data", "partition"): ("file:",),
             ("data", "data_dir"): ("",), ("log", "ffd_reference"): ("",),
             ("bus", "keys_dir"): ("",)}


def _relative_path(section: str, key: str, value: Any) -> tuple[str, str] | None:
    """(prefix, path) of a path key's value when the path is relative, else None."""
    prefixes = PATH_KEYS.get((section, key))
    if prefixes is None or not isinstance(value, str) or not value:
        return None
    prefix = next((x for x in prefixes if x and value.startswith(x)), "")
    if prefix == "" and "" not in prefixes:
        return None
    rest = value[len(prefix):]
    if not rest or Path(os.path.expanduser(rest)).is_absolute():
        return None
    return prefix, rest


def paths_from(raw: dict[str, Any], folder: Path, origins: dict[str, str] | None = None,
               notes: list[str] | None = None) -> dict[str, Any]:
    """A CONFIG file's relative paths made absolute against the file's own folder, where
    the file or folder they name is found there: a config then means the same from any
    working directory, and the run's config.json (what replay reads) holds absolute paths.
    A path found only relative to the working directory (the old reading) is left as it
    is, with a note (for a ConfigWarning) giving the path relative to the file; one found
    nowhere is left as it is too (an npz is also looked for under data.data_dir).
    `origins` receives, per key, how its path was read, for the not-found error to say
    where it looked."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    origins = {} if origins is None else origins
    notes = [] if notes is None else notes
    for section, key in PATH_KEYS:
        table = out.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        split = _relative_path(section, key, value)
        if split is None:
            continue
        prefix, rest = split
        candidate = os.path.normpath(folder / Path(os.path.expanduser(rest)))
        from_cwd = os.path.abspath(os.path.expanduser(rest))
        dotted = f"{section}.{key}"
        if os.path.exists(candidate):
            table[key] = prefix + candidate
            origins[dotted] = f"read relative to the config file's folder, {folder}"
        elif os.path.exists(from_cwd):
            origins[dotted] = (f"found from the working directory, {from_cwd}, not beside "
                               f"the config file")
            beside = os.path.relpath(from_cwd, folder)
            notes.append(f"{dotted} = {value!r} is found only from the working directory "
                         f"({from_cwd}); a config's paths are read relative to its own "
                         f"folder: write {prefix + beside!r} to mean the same from anywhere")
        else:
            origins[dotted] = (f"a config file's path, read relative to its folder: not at "
                               f"{candidate}, nor from the working directory at {from_cwd}")
    return out


def _override_origins(overrides: Sequence[str]) -> dict[str, str]:
    """How each relative path given with --set is read: from the working directory."""
    origins = {}
    for text in overrides:
        section, key, value = _parse_override(text)
        split = _relative_path(section, key, value)
        if split is not None:
            where = os.path.abspath(os.path.expanduser(split[1]))
            origins[f"{section}.{key}"] = (f"a --set path, read relative to the working "
                                           f"directory: {where}")
    return origins


def describe_options(values: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Every option, for `fedbus run --help-config`: with `values` (a resolved config's
    sections) the value a run would use, and the schema default beside it where the two
    differ (a key a CONFIG leaves out gets the schema default; the embedded default
    federation, launch/default.toml, sets some keys); without, the schema defaults."""
    lines = []
    for section, opts in SCHEMA.items():
        lines.append(f"[{section}]")
        for key, opt in opts.items():
            extra = f" (one of {', '.join(map(str, opt.choices))})" if opt.choices else ""
            value = opt.default
            if values is not None and key in values.get(section, {}):
                value = values[section][key]
            if value != opt.default:
                extra += f" [left out of a CONFIG: {opt.default!r}]"
            lines.append(f"  {key} = {value!r}  # {opt.help}{extra}")
    return "\n".join(lines)


def to_toml(sections: Mapping[str, Mapping[str, Any]]) -> str:
    """A config's sections as TOML text that load_config reads back to the same config
    (strings, numbers, booleans and lists of them: the schema's value types)."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, float) and not math.isfinite(v):
            return "inf" if v > 0 else ("-inf" if v < 0 else "nan")
        return repr(v)

    out = []
    for name, table in sections.items():
        out += [f"[{name}]", *(f"{k} = {value(v)}" for k, v in table.items()), ""]
    return "\n".join(out)


def _distributed_refusal(privacy: Mapping[str, Any]) -> str | None:
    """Why privacy.dp_noise = "distributed" cannot run with these settings, or None. Kept
    here, not in node/privacy/ddp.py: reading a config must not import secure aggregation
    (and through its identities, the bus)."""
    if privacy.get("dp_noise") != "distributed":
        return None
    if privacy.get("dp") != "client":
        return (f"privacy.dp_noise = distributed needs privacy.dp = client (the clients' "
                f"noise shares sum to the client-level mechanism's), got dp = "
                f"{privacy.get('dp')}; record and sgd levels already noise on the client")
    if not privacy.get("secure_aggregation"):
        return ("privacy.dp_noise = distributed needs privacy.secure_aggregation = true: "
                "without masking each client's noise share alone would be far too small to "
                "protect its update")
    if float(privacy.get("target_epsilon", 0.0)) > 0:
        return ("privacy.target_epsilon with dp_noise = distributed is not supported yet: "
                "the epsilon a round spends depends on its survivors, known only after it")
    return None
