"""`fedbus log`: the per-message payload summaries, read from real message logs of real
federations (broker, server and node processes, training on scikit-learn's digits), and
checked against the logged bodies themselves; `--json` parsed line by line; rounds and
clients the run does not have are errors naming the valid range.

(The round-outcome lines and the filters on a killed node's run are in test_replay.py.)"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, SMALL, fedbus, merged, run_federation, write_config

from fedbus.broker.wire import decode
from fedbus.record.msglog import read_log

# FedProto, sync: prototypes and class counts up, global prototypes down, each task and
# update its own message (bus.batch = "off": the summaries below are a single message's;
# the batched run's lines are checked at the end of this file).
PROTO = merged(SMALL, federation={"clients": 4, "rounds": 2}, algorithm={"name": "fedproto"},
               bus={"batch": "off"})

# FedAvg with partial work (F' ~ U[0, F]): weight deltas up, weights down, every task
# asks for fewer epochs than F.
PARTIAL = merged(SMALL, federation={"clients": 3, "rounds": 2}, train={"epochs": 2},
                 system={"partial_work": True}, bus={"batch": "off"})


@pytest.fixture(scope="module")
def proto_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("proto"), PROTO)
    return run


@pytest.fixture(scope="module")
def partial_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("partial"), PARTIAL)
    return run


def log(run, *args: str, check: bool = True):
    return fedbus("log", str(run), *args, check=check)


def json_lines(run, *args: str) -> list[dict]:
    proc = log(run, "--json", *args)
    return [json.loads(line) for line in proc.stdout.splitlines()]  # every line, or it fails


def bodies(run) -> dict[int, object]:
    """Each logged message's decoded body, by record index: the truth to check against."""
    return {r.index: decode(r.frames).body for r in read_log(run)
            if r.direction in ("in", "out")}


def index(run) -> list[dict]:
    return [json.loads(line) for line in (run / "messages.jsonl").read_text().splitlines()]


def kind(line: str) -> str:
    """The kind column of a text line (a round outcome line has none)."""
    fields = line.split()
    return fields[2] if len(fields) > 2 and fields[1] in ("<-", "->", "x-", "..") else ""


def norms(protos: np.ndarray, present: np.ndarray) -> np.ndarray:
    return np.linalg.norm(protos[present].astype(np.float64), axis=1)


# --- --json: pure JSON lines, the index with a summary ---

def test_json_is_json_lines_only_the_index_lines_with_a_summary_then_the_outcomes(proto_run):
    lines = json_lines(proto_run)
    messages = [ln for ln in lines if "kind" in ln]
    outcomes = [ln["outcome"] for ln in lines if "outcome" in ln]
    assert len(messages) + len(outcomes) == len(lines)
    assert [{k: v for k, v in m.items() if k != "summary"} for m in messages] == index(proto_run)
    assert all(isinstance(m["summary"], dict) for m in messages)
    assert [o["round"] for o in outcomes] == [0, 1]
    assert all(o["sampled"] == o["answered"] == [0, 1, 2, 3] and o["failures"] == {}
               for o in outcomes)
    one = json_lines(proto_run, "--round", "1", "--client", "2")
    assert one[-1] == {"outcome": {"round": 1, "client": 2, "state": "answered"}}
    assert all(m["round"] == 1 and "c2" in (m["src"], m["dst"]) for m in one[:-1])


# --- the summaries say what the bodies hold ---

def test_update_summaries_are_the_work_counts_and_prototype_norms_sent(proto_run):
    truth = bodies(proto_run)
    updates = [m for m in json_lines(proto_run, "--kind", "update") if "kind" in m]
    assert len(updates) == 2 * 4
    for m in updates:
        body, s = truth[m["i"]], m["summary"]
        assert s["task"] == body["task"] and s["num_samples"] == body["num_samples"]
        assert s["work"] == body["work"]
        counts, protos = body["payload"]["counts"], body["payload"]["protos"]
        present = counts > 0
        assert s["payload"]["counts"]["by_class"] == {str(c): int(counts[c])
                                                      for c in np.flatnonzero(present)}
        assert s["payload"]["counts"]["total"] == int(counts.sum())
        p = s["payload"]["protos"]
        assert (p["classes"], p["of"], p["dim"]) == (int(present.sum()), 10, protos.shape[1])
        assert p["norm_mean"] == pytest.approx(norms(protos, present).mean(), rel=1e-12)
        assert p["norm_max"] == pytest.approx(norms(protos, present).max(), rel=1e-12)


def test_task_eval_and_eval_result_summaries(proto_run):
    truth = bodies(proto_run)
    lines = json_lines(proto_run, "--kind", "task", "--kind", "eval", "--kind", "eval_result")
    for m in lines:
        if "kind" not in m:
            continue
        body, s = truth[m["i"]], m["summary"]
        if m["kind"] == "task":
            assert (s["task"], s["version"], s["epochs"]) == \
                (body["task"], body["version"], body["epochs"])
            has = body["payload"]["has"]
            assert s["payload"]["protos"]["classes"] == int(has.sum())
            assert s["payload"]["has"] == {"classes": int(has.sum()), "of": 10}
        elif m["kind"] == "eval":
            assert (s["eval"], s["version"]) == (body["eval"], body["version"])
        else:
            assert s["metrics"] == {k: v for k, v in body["metrics"].items()}
            assert {"acc", "proto_acc", "loss", "num_test"} <= set(s["metrics"])


def test_text_lines_summarise_each_kind(proto_run):
    truth = bodies(proto_run)
    entries = {e["i"]: e for e in index(proto_run)}
    proc = log(proto_run, "--round", "1", "--client", "2")
    by_kind = {}
    for ln in proc.stdout.splitlines():
        if kind(ln):
            by_kind.setdefault(kind(ln), []).append(ln)
    assert set(by_kind) == {"task", "update", "eval", "eval_result"}, proc.stdout

    update = by_kind["update"][0]
    i = next(e["i"] for e in entries.values() if e["kind"] == "update" and e["src"] == "c2"
             and e["round"] == 1)
    body = truth[i]
    w, counts = body["work"], body["payload"]["counts"]
    summary = update.split(f"seq {entries[i]['seq']}", 1)[1].strip()
    assert summary.startswith(
        f"task {body['task']}: {w['epochs_done']:g}/{w['epochs_asked']} epochs, "
        f"{w['steps']} steps, {w['samples']} samples seen (train set {body['num_samples']})"
        f" | protos {int((counts > 0).sum())}/10 classes, mean |v| "), update
    assert summary.endswith(" | counts " + " ".join(f"{c}:{counts[c]}"
                                                   for c in np.flatnonzero(counts))), update

    result = by_kind["eval_result"][0]
    metrics = next(truth[e["i"]]["metrics"] for e in entries.values()
                   if e["kind"] == "eval_result" and e["src"] == "c2" and e["round"] == 1)
    assert f"acc {metrics['acc']:.3g}" in result and f"({metrics['num_test']} test)" in result
    assert re.search(r"task \d+ v1: epochs 1 \| protos \d+/10 classes", by_kind["task"][0])


def test_weight_deltas_and_partial_work(partial_run):
    truth = bodies(partial_run)
    lines = [m for m in json_lines(partial_run, "--kind", "task", "--kind", "update")
             if "kind" in m]
    tasks = [m for m in lines if m["kind"] == "task"]
    updates = [m for m in lines if m["kind"] == "update"]
    assert len(tasks) == len(updates) == 2 * 3
    for m in tasks:
        body, s = truth[m["i"]], m["summary"]
        assert s["epochs_to_run"] == body["sim"]["epochs_to_run"] < body["epochs"] == 2
        weights = body["payload"]["weights"]
        assert s["payload"]["weights"]["params"] == sum(a.size for a in weights.values())
    for m in updates:
        body, s = truth[m["i"]], m["summary"]
        assert s["work"]["stopped"] == "partial"
        delta = body["payload"]["delta"]
        floats = [a for a in delta.values() if a.dtype.kind == "f"]
        norm = np.sqrt(sum(np.sum(a.astype(np.float64) ** 2) for a in floats))
        assert s["payload"]["delta"]["norm"] == pytest.approx(norm, rel=1e-9)
        assert s["payload"]["delta"]["tensors"] == len(delta)
    text = log(partial_run, "--kind", "task", "--kind", "update", "--round", "0").stdout
    assert all(re.search(r"epochs 2, runs [\d.]+ of them \| weights \|w\| [\d.]+ \([\d,]+ "
                         r"params\)$", ln) for ln in text.splitlines() if kind(ln) == "task"), text
    assert all(re.search(r"stopped: partial \| delta \|d\| [\d.e-]+ \([\d,]+ params\)$", ln)
               for ln in text.splitlines() if kind(ln) == "update"), text


# --- only what is shown is read ---

def test_only_the_records_shown_are_read(proto_run, tmp_path):
    """A damaged record of round 0 is named on its own line when round 0 is shown, and
    never read when only round 1 is: the summaries come from the shown records alone."""
    run = tmp_path / "run"
    shutil.copytree(proto_run, run, ignore=shutil.ignore_patterns("logs", "*.sock"))
    damaged = next(e for e in index(run) if e["kind"] == "update" and e["round"] == 0)
    data = bytearray((run / "messages.bin").read_bytes())
    data[damaged["off"] + 8 + 100] ^= 0xFF  # inside the payload: the checksum fails
    (run / "messages.bin").write_bytes(bytes(data))

    later = log(run, "--round", "1")
    assert "unreadable" not in later.stdout and not later.stderr
    shown = log(run, "--round", "0", "--kind", "update").stdout.splitlines()
    bad = [ln for ln in shown if "unreadable" in ln]
    assert len(bad) == 1 and f" seq {damaged['seq']} " in bad[0], shown
    assert (f"record {damaged['i']} at offset {damaged['off']}: cut short or checksum "
            "mismatch") in bad[0]
    assert sum("samples seen" in ln for ln in shown) == 3


# --- rounds, clients and kinds the run does not have ---

@pytest.mark.parametrize("args, says", [
    (("--round", "7"), "--round 7: the log holds rounds 0-1"),
    (("--round", "-1"), "--round -1: the log holds rounds 0-1"),
    (("--client", "4"), "--client 4: this run has clients 0-3"),
    (("--round", "0", "--client", "9"), "--client 9: this run has clients 0-3"),
])
def test_a_round_or_client_the_run_does_not_have_is_an_error_naming_the_range(
        proto_run, args, says):
    proc = log(proto_run, *args, check=False)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr == f"fedbus log: {says}\n"


def test_the_shutdown_round_shows_the_shutdown_and_unknown_kinds_are_refused(proto_run):
    lines = log(proto_run, "--round", "2").stdout.splitlines()  # 2 rounds: shutdown is r2
    assert len(lines) == 1 and " shutdown " in lines[0] and lines[0].endswith("run complete")
    proc = log(proto_run, "--kind", "updatez", check=False)
    assert proc.returncode == 2 and "invalid choice: 'updatez'" in proc.stderr


# --- a failure: the error's code and reason ---

FAILING_PLUGIN = '''
from fedbus.algorithms import Algorithm
from fedbus.algorithms.fedavg import FedAvgClient, FedAvgServer


class FailingClient(FedAvgClient):
    def train(self, task, run):
        if self.ctx.client == 1:
            raise ValueError("client 1 cannot train today")
        return super().train(task, run)


ALGORITHM = Algorithm("fails-one", FedAvgServer, FailingClient, "FedAvg whose client 1 fails")
'''


def test_an_error_shows_its_code_and_reason(tmp_path):
    (tmp_path / "fails_one.py").write_text(FAILING_PLUGIN)
    info = tmp_path / "fails_one-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fails-one\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[fedbus.algorithms]\nfails-one = fails_one:ALGORITHM\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
        str(tmp_path), os.environ.get("PYTHONPATH")]))}
    cfg = write_config(tmp_path / "cfg.toml", merged(
        SMALL, federation={"clients": 3, "rounds": 1}, algorithm={"name": "fails-one"}))
    subprocess.run([sys.executable, "-m", "fedbus.launch", "run", str(cfg), "--out",
                    str(tmp_path / "run"), "--quiet"], env=env, cwd=REPO, check=True,
                   timeout=300)
    run = tmp_path / "run"
    errors = [m for m in json_lines(run, "--kind", "error") if "kind" in m]
    assert len(errors) == 1 and errors[0]["src"] == "c1"
    assert errors[0]["summary"]["code"] == "handler_failed"
    assert errors[0]["summary"]["reason"] == "ValueError('client 1 cannot train today')"
    line = log(run, "--kind", "error").stdout.splitlines()[0]
    assert line.endswith("handler_failed: ValueError('client 1 cannot train today')"), line
    assert "round 0: sampled 0,1,2  answered 0,2  error: 1" in log(run, "--outcomes-only").stdout


# --- batched tasks and updates (bus.batch = "auto", PROTOCOL.md §4.3) ---

BATCHED = merged(PROTO, bus={"batch": "auto"})


@pytest.fixture(scope="module")
def batched_run(tmp_path_factory):
    run, _ = run_federation(tmp_path_factory.mktemp("batched"), BATCHED)
    return run


def test_a_batch_is_one_line_naming_its_members_and_client_finds_its_member(batched_run):
    """A `tasks` or `updates` batch shows its members' clients and task ids, checked
    against the logged bodies; --client shows that client's member of each batch as its
    own task or update would be shown; the round outcomes name the batches' clients."""
    truth = bodies(batched_run)
    lines = json_lines(batched_run)
    batches = [m for m in lines if m.get("kind") in ("tasks", "updates")]
    assert {m["kind"] for m in batches} == {"tasks", "updates"}, "the run batched nothing"
    for m in batches:
        body, s = truth[m["i"]], m["summary"]
        key = "to" if m["kind"] == "tasks" else "from"
        assert s["clients"] == [b[key] for b in body["members"]]
        assert s["tasks"] == [b["task"] for b in body["members"]]
        assert s["members"] == len(body["members"]) >= 1
        if m["kind"] == "tasks":
            assert s["payloads"] == len(body["payloads"]) < s["members"] or s["members"] == 1
    text = log(batched_run, "--kind", "tasks").stdout.splitlines()
    assert any("tasks for clients" in ln and "payload(s) sent once" in ln for ln in text), text
    # --client 2: every batch holding c2's member, shown as that member
    mine = [m for m in json_lines(batched_run, "--client", "2") if "kind" in m]
    held = [m for m in batches if "c2" in m["summary"]["clients"]]
    assert [m["i"] for m in mine if m["kind"] in ("tasks", "updates")] == [m["i"] for m in held]
    for m in mine:
        if m["kind"] in ("tasks", "updates"):
            body = truth[m["i"]]
            key = "to" if m["kind"] == "tasks" else "from"
            member = next(b for b in body["members"] if b[key] == "c2")
            assert m["summary"]["task"] == member["task"]
            assert m["summary"]["batch"] == len(body["members"])
    shown = log(batched_run, "--client", "2").stdout
    assert "in the batch) task " in shown, shown
    # --kind task (update) takes the tasks (updates) batches: their members are tasks
    as_task = [m for m in json_lines(batched_run, "--kind", "task", "--client", "2")
               if "kind" in m]
    assert [m["i"] for m in as_task] == [m["i"] for m in held if m["kind"] == "tasks"]
    assert all(m["summary"]["task"] is not None for m in as_task)
    as_update = [m["i"] for m in json_lines(batched_run, "--kind", "update") if "kind" in m]
    assert as_update == [m["i"] for m in batches if m["kind"] == "updates"]
    outcomes = [m["outcome"] for m in lines if "outcome" in m]
    assert outcomes and all(o["sampled"] == [0, 1, 2, 3] for o in outcomes), outcomes
    # an evaluation's `evals` batch: one line naming its members' clients and eval ids;
    # --kind eval --client 2 shows c2's member of each as its own `eval` would be shown
    evals = [m for m in lines if m.get("kind") == "evals"]
    assert len(evals) == 2 * 2, evals  # 2 rounds, 2 nodes of 2 clients
    for m in evals:
        body = truth[m["i"]]
        assert m["summary"]["clients"] == [b["to"] for b in body["members"]]
        assert m["summary"]["tasks"] == [b["eval"] for b in body["members"]]
    as_eval = [m for m in json_lines(batched_run, "--kind", "eval", "--client", "2")
               if "kind" in m and m["dir"] == "out"]
    assert [m["i"] for m in as_eval] == [m["i"] for m in evals if "c2" in m["summary"]["clients"]]
    assert [m["summary"]["eval"] for m in as_eval] == [1, 2]
    text = log(batched_run, "--kind", "evals").stdout
    assert "2 evals for clients" in text and "(evals " in text, text
