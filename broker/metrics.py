"""Metrics for a monitoring system: `--metrics-port PORT` on `fedbus broker`, `server` and
`relay` serves the Prometheus text format at http://HOST:PORT/metrics, with the maintained
client library (prometheus-client, the `metrics` extra).

Every value is read from the process's own counters when the page is scraped (a collector,
not a second set of counters kept in step): the scrape thread only reads, and a dict that
the process changes during the read is read again. The broker's families are here; the
server's and the relay's are in fedbus.node.metrics (this package imports nothing of
fedbus's others). docs/OPERATIONS.md lists them all.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

EXTRA_HINT = "pip install 'fedbus[metrics]'"


class MetricsUnavailable(RuntimeError):
    """prometheus-client is not installed: the message says how to get it."""


def _prometheus():
    try:
        import prometheus_client
    except ModuleNotFoundError:
        raise MetricsUnavailable(f"--metrics-port needs prometheus-client: {EXTRA_HINT}") \
            from None
    return prometheus_client


class _Collector:
    def __init__(self, families: Callable[[], Iterable[Any]]):
        self.families = families

    def collect(self):
        yield from self.families()


def serve(port: int, families: Callable[[], Iterable[Any]], host: str = "0.0.0.0"):
    """Serve `families()` (prometheus_client metric families) on host:port in a daemon
    thread; returns the HTTP server (shutdown() stops it). MetricsUnavailable without the
    library; OSError when the port is taken."""
    prom = _prometheus()
    registry = prom.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families))
    server, _thread = prom.start_http_server(port, addr=host, registry=registry)
    return server


def snapshot(read: Callable[[], Any], tries: int = 5) -> Any:
    """`read()` retried when the owning thread changed a dict or list while it was read."""
    for _ in range(tries - 1):
        try:
            return read()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return read()


def broker_families(broker) -> list[Any]:
    """The broker's: nodes and clients registered, messages and bytes routed, refused and
    malformed frames (by reason), rate-limited messages, and the queues it holds for nodes
    not taking messages (messages and bytes, per node, and in all)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def read():
        nodes = list(broker.nodes.values())
        return (nodes, len(broker.routes), dict(broker.bad_reasons),
                [(n.name, n.role, len(n.pending), n.pending_bytes) for n in nodes])

    nodes, routes, bad, queues = snapshot(read)
    roles = GaugeMetricFamily("fedbus_broker_nodes", "nodes registered, by role",
                              labels=["role"])
    by_role: dict[str, int] = {}
    for n in nodes:
        by_role[n.role] = by_role.get(n.role, 0) + 1
    for role in ("server", "client"):
        roles.add_metric([role], by_role.pop(role, 0))
    for role, count in sorted(by_role.items()):
        roles.add_metric([role], count)
    out: list[Any] = [roles, GaugeMetricFamily(
        "fedbus_broker_clients", "client addresses routed (beside the nodes)",
        value=max(0, routes - len(nodes)))]
    for name, help_text, value in (
            ("fedbus_broker_messages_routed", "messages routed", broker.n_routed),
            ("fedbus_broker_bytes_routed", "bytes routed", broker.n_bytes),
            ("fedbus_broker_refused", "messages refused (unknown sender, bad route, ...)",
             broker.n_refused),
            ("fedbus_broker_unroutable", "messages for no registered address",
             broker.n_unroutable),
            ("fedbus_broker_rate_limited", "messages dropped over a node's rate limit",
             broker.n_rate_limited)):
        out.append(CounterMetricFamily(name, help_text, value=value))
    frames = CounterMetricFamily("fedbus_broker_bad_frames", "malformed frames, by reason",
                                 labels=["reason"])
    for reason, count in sorted(bad.items()):
        frames.add_metric([str(reason)], count)
    out.append(frames)
    depth = GaugeMetricFamily("fedbus_broker_queue_messages",
                              "messages held for a node not taking them, per node",
                              labels=["node"])
    size = GaugeMetricFamily("fedbus_broker_queue_bytes", "bytes of those messages, per node",
                             labels=["node"])
    for name, _role, held, nbytes in queues:
        depth.add_metric([name], held)
        size.add_metric([name], nbytes)
    out += [depth, size, GaugeMetricFamily(
        "fedbus_broker_queued_messages", "messages held in all (per-node queues and parked)",
        value=sum(q[2] for q in queues) + getattr(broker, "parked_count", 0))]
    return out


def add_metrics_argument(p) -> None:
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (needs the "
                   "metrics extra: " + EXTRA_HINT + "; docs/OPERATIONS.md lists them)")
    p.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                   help="the address --metrics-port listens on (default 0.0.0.0)")


def start_from_args(args, families: Callable[[], Iterable[Any]], who: str):
    """serve() for --metrics-port, or None when it is not given; a one-line error
    (SystemExit 2 with the message) when the library is missing or the port is taken."""
    import sys

    port = getattr(args, "metrics_port", None)
    if port is None:
        return None
    if not 0 < port < 65536:
        print(f"fedbus {who}: --metrics-port must lie in 1..65535", file=sys.stderr)
        raise SystemExit(2)
    try:
        return serve(port, families, args.metrics_host)
    except MetricsUnavailable as err:
        print(f"fedbus {who}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as err:
        print(f"fedbus {who}: --metrics-port {port}: {err.strerror or err}", file=sys.stderr)
        raise SystemExit(2) from None
