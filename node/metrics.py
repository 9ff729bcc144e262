"""The server's and the relay's metric families for `--metrics-port` (served by
fedbus.broker.metrics.serve; docs/OPERATIONS.md lists them). Read from the engine's
totals and records, and the relay's stats, when the page is scraped."""
from __future__ import annotations

from typing import Any

from fedbus.broker.metrics import snapshot

# round durations, seconds: from a no-op round on one machine to a slow device's
ROUND_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def server_families(server) -> list[Any]:
    """Rounds done and asked for, clients live and sampled in the round in progress,
    updates accepted (per aggregation's participants), task failures by reason (the
    records' `failures`: late, timed_out, dropped, dead, rejected, error, secagg), late
    updates folded or discarded, messages refused, bytes and parameters up and down, and
    a histogram of round durations."""
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )

    engine = server.engine
    written = getattr(getattr(server, "run", None), "records", [])

    def read():
        # the server moves the engine's records to the run's (metrics.jsonl) as it writes
        # them: both, each record once (the same dict, seen in both mid-move)
        pending = list(engine.records)
        done = list(written)
        seen = {id(r) for r in done}
        return (engine.version, len(engine.live), dict(engine.totals),
                done + [r for r in pending if id(r) not in seen], engine.round)

    version, live, totals, records, open_round = snapshot(read)
    sampled = len(open_round.members) if open_round is not None else 0
    accepted, failures, durations = 0, {}, []
    for rec in records:
        if "participants" not in rec:
            continue
        accepted += len(rec["participants"])
        for why in (rec.get("failures") or {}).values():
            failures[why] = failures.get(why, 0) + 1
        if isinstance(rec.get("round_s"), (int, float)):
            durations.append(float(rec["round_s"]))
    out: list[Any] = [
        GaugeMetricFamily("fedbus_rounds_completed", "rounds (sync) or aggregations (async) "
                          "done", value=version),
        GaugeMetricFamily("fedbus_rounds_planned", "federation.rounds",
                          value=engine.rounds),
        GaugeMetricFamily("fedbus_clients_live", "clients whose node is registered",
                          value=live),
        GaugeMetricFamily("fedbus_clients_sampled", "clients sampled in the round in "
                          "progress (sync; 0 between rounds and in async mode)",
                          value=sampled),
        CounterMetricFamily("fedbus_updates_accepted", "updates aggregated", value=accepted),
    ]
    failed = CounterMetricFamily("fedbus_task_failures", "sampled clients' tasks that "
                                 "brought no update, by reason", labels=["reason"])
    for why, count in sorted(failures.items()):
        failed.add_metric([why], count)
    out.append(failed)
    late = CounterMetricFamily("fedbus_late_updates", "updates that missed their round, by "
                               "fate", labels=["fate"])
    late.add_metric(["folded"], totals.get("late_folded", 0))
    late.add_metric(["discarded"], totals.get("late_dropped", 0))
    out.append(late)
    refused = CounterMetricFamily("fedbus_messages_refused", "messages the server refused, "
                                  "by kind", labels=["kind"])
    refused.add_metric(["update"], totals.get("rejected", 0))
    refused.add_metric(["other"], totals.get("refused", 0))
    out.append(refused)
    for name, key, help_text in (("fedbus_bytes_up", "bytes_up", "bytes of updates received"),
                                 ("fedbus_bytes_down", "bytes_down", "bytes of tasks sent"),
                                 ("fedbus_params_up", "params_up", "parameters received"),
                                 ("fedbus_params_down", "params_down", "parameters sent")):
        out.append(CounterMetricFamily(name, help_text, value=totals.get(key, 0)))
    buckets, total = [], 0
    for bound in ROUND_BUCKETS:
        total = sum(1 for d in durations if d <= bound)
        buckets.append((repr(bound), total))
    buckets.append(("+Inf", len(durations)))
    out.append(HistogramMetricFamily("fedbus_round_duration_seconds", "seconds a round (or "
                                     "an async aggregation window) took", buckets=buckets,
                                     sum_value=sum(durations)))
    return out


def relay_families(relay) -> list[Any]:
    """The relay's: nodes below it and their clients, and its stats (merged updates sent
    and the clients they carried, updates forwarded one by one, tasks passed down, members
    refused, messages that failed)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def read():
        return dict(relay.stats), {k: len(v) for k, v in relay.nodes.items()}

    stats, nodes = snapshot(read)
    out: list[Any] = [
        GaugeMetricFamily("fedbus_relay_nodes", "nodes registered below the relay",
                          value=len(nodes)),
        GaugeMetricFamily("fedbus_relay_clients", "their clients", value=sum(nodes.values())),
    ]
    for key, value in sorted(stats.items()):
        out.append(CounterMetricFamily(f"fedbus_relay_{key}", f"relay: {key.replace('_', ' ')}",
                                       value=value))
    return out
