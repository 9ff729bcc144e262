"""`fedbus bench broker`: fedbus broker throughput against a plain zmq.proxy baseline.

One sender process and one receiver process, each with one raw DEALER socket, exchange
pre-encoded fedbus messages (frame 0 = header, frame 1 = body) through a middle process:

* fedbus:    the real broker (`python -m fedbus.launch broker`). The receiver registers
             as the server (node "bench-server"), the sender as a client node ("bench-client"
             hosting "c0"); every message is an "update" c0 -> server that the broker
             validates, checks against the role rules and routes by client id.
* zmq.proxy: zmq.proxy(frontend ROUTER, backend ROUTER). The sender connects to the
             frontend, the receiver to the backend, both with the routing id "bench-node":
             the frontend prepends the sender's id, the proxy hands [id, header, body] to the
             backend ROUTER, which strips the id and delivers [header, body] to the peer with
             that id -- the receiver -- exactly the frames the broker delivers. The backend has
             ROUTER_MANDATORY on, so a full pipe blocks the proxy (back-pressure, no drops),
             as it does in the broker.

Same sockets, same frames, same counting; only the middle differs. zmq.proxy is this
benchmark's raw-zmq floor: each fedbus rate is also printed as its time a message beside the
proxy's, with their ratio (--json: `floor_ms` and `ratio` on each fedbus result). Cases: a 20 KiB body (a
10 x 512 float32 prototype set) and a 200 B body. Rates are measured at the receiver from its
first to its last counted message. MB/s counts header + body bytes (1 MB = 10^6 B).

--curve: the fedbus broker with CurveZMQ off and on (fresh keys in a temp folder; the broker
allow-lists the two bench nodes), instead of the zmq.proxy baseline; prints the throughput
ratio on/off (the cost of encryption: every frame is encrypted by the sender, decrypted and
re-encrypted by the broker, decrypted by the receiver).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from fedbus.node.lifetime import fedbus_command, python_module

CASES = {
    "20KiB": "20 KiB body (10x512 float32 prototypes)",
    "200B": "200 B body",
}
_ID_PROXY = b"bench-node"
_ID_SERVER = b"bench-server"
_ID_CLIENT = b"bench-client"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="seconds of sending per case and path (default 3)")
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp",
                        help="tcp (loopback) or ipc (unix sockets in a temp dir)")
    parser.add_argument("--curve", action="store_true",
                        help="compare the fedbus broker with CurveZMQ on and off")
    parser.add_argument("--cases", default="20KiB,200B",
                        help="comma-separated subset of: " + ", ".join(CASES))
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_worker":
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(prog="fedbus bench broker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main_args(parser.parse_args(argv))


def main_args(args: argparse.Namespace) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            print(f"unknown case {c!r} (one of {', '.join(CASES)})", file=sys.stderr)
            return 2
    results = []
    tmp = tempfile.mkdtemp(prefix="fedbus-bench-")
    paths = ("fedbus", "zmq.proxy")
    if args.curve:
        from fedbus.broker.auth import write_keypair

        keys = os.path.join(tmp, "keys")
        write_keypair(keys, "broker", "broker")
        write_keypair(keys, _ID_SERVER.decode(), "server")
        write_keypair(keys, _ID_CLIENT.decode(), "client", clients="c0")
        paths = ("fedbus", "fedbus+curve")
    try:
        for case in cases:
            for path in paths:
                r = _run_case(path, case, args.seconds, args.transport, tmp)
                results.append(r)
                print(f"  {CASES[case]:<40} {path:<10} {r['msg_s']:>10,.0f} msg/s "
                      f"{r['mb_s']:>8.1f} MB/s", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _print_table(results, args)
    _print_floor(results)
    if args.json:
        print(json.dumps(results))
    return 0


def _print_table(results: list[dict], args) -> None:
    print(f"fedbus bench broker: transport={args.transport} seconds={args.seconds:g} "
          f"cpus={os.cpu_count()}")
    print(f"{'case':<12}{'path':<12}{'msg/s':>12}{'MB/s':>10}{'msg bytes':>11}")
    for r in results:
        print(f"{r['case']:<12}{r['path']:<12}{r['msg_s']:>12,.0f}{r['mb_s']:>10.1f}"
              f"{r['msg_bytes']:>11}")
    by = {(r["case"], r["path"]): r for r in results}
    ratios = []
    curve = []
    for case in dict.fromkeys(r["case"] for r in results):
        f, b = by.get((case, "fedbus")), by.get((case, "zmq.proxy"))
        if f and b and b["msg_s"] > 0:
            ratios.append(f"{case} {f['msg_s'] / b['msg_s']:.2f}")
        c = by.get((case, "fedbus+curve"))
        if f and c and c["msg_s"] > 0:
            curve.append(f"{case} {c['msg_s'] / f['msg_s']:.2f} "
                         f"(CURVE costs {f['msg_s'] / c['msg_s']:.2f}x)")
    if ratios:
        print("ratio fedbus/baseline (msg/s): " + ", ".join(ratios))
    if curve:
        print("ratio CURVE on/off (msg/s): " + ", ".join(curve))


def _print_floor(results: list[dict]) -> None:
    """The broker's time a message beside zmq.proxy's, the raw-zmq floor of this pattern
    measured in the same run (the DEALER/ROUTER round trip of bench.common.zmq_floor has
    no middle to compare with); adds floor_ms and ratio to each fedbus result."""
    from fedbus.bench.common import FIGURE_HEAD, figure_line

    proxy = {r["case"]: r for r in results if r["path"] == "zmq.proxy" and r["msg_s"] > 0}
    rows = []
    for r in results:
        base = proxy.get(r["case"])
        if r["path"] == "zmq.proxy" or base is None or r["msg_s"] <= 0:
            continue
        r["floor_ms"], ms = 1000 / base["msg_s"], 1000 / r["msg_s"]
        r["ratio"] = ms / r["floor_ms"]
        rows.append(figure_line(f"{r['case']} {r['path']}, time a message", ms, r["floor_ms"]))
    if rows:
        print(FIGURE_HEAD + "   (floor: zmq.proxy, same sockets and frames, this run)")
        print("\n".join(rows))


# ---------------------------------------------------------------------------- orchestration
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _endpoints(transport: str, tmp: str, tag: str) -> tuple[str, str]:
    if transport == "ipc":
        return f"ipc://{tmp}/{tag}-front.ipc", f"ipc://{tmp}/{tag}-back.ipc"
    return f"tcp://127.0.0.1:{_free_port()}", f"tcp://127.0.0.1:{_free_port()}"


def _keys_dir(tmp: str, path: str) -> list[str]:
    return [os.path.join(tmp, "keys")] if path == "fedbus+curve" else []


def _spawn(*argv: str, stdin=None) -> subprocess.Popen:
    cmd = python_module("fedbus.bench.broker", "_worker", *argv)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=stdin, text=True)


def _expect(proc: subprocess.Popen, word: str, what: str) -> str:
    line = proc.stdout.readline()
    if not line.startswith(word):
        raise RuntimeError(f"bench {what} failed (said {line!r}, exit code {proc.poll()})")
    return line


def _run_case(path: str, case: str, seconds: float, transport: str, tmp: str) -> dict:
    tag = f"{case}-{path.replace('.', '')}"
    front, back = _endpoints(transport, tmp, tag)
    procs: list[subprocess.Popen] = []
    try:
        if path.startswith("fedbus"):
            keys = _keys_dir(tmp, path)
            mid = subprocess.Popen(
                # the routing cost is measured, not the per-node rate limits (PROTOCOL §11),
                # which would cap one sender at 20,000 messages a second
                fedbus_command("broker", "--bind", front, "--log-level", "warning",
                               "--peer-msg-rate", "0", "--peer-mb-rate", "0",
                               *(["--curve", "--keys-dir", keys[0]] if keys else [])),
                stdin=subprocess.DEVNULL)
            recv_ep = send_ep = front
        else:
            mid = _spawn("proxy", front, back)
            recv_ep, send_ep = back, front
        procs.append(mid)
        if not path.startswith("fedbus"):
            _expect(mid, "ready", "proxy")
        receiver = _spawn("receiver", path, case, recv_ep, str(seconds), *_keys_dir(tmp, path))
        procs.append(receiver)
        _expect(receiver, "ready", "receiver")
        if not path.startswith("fedbus"):
            _expect(mid, "go", "proxy")
        sender = _spawn("sender", path, case, send_ep, str(seconds), *_keys_dir(tmp, path))
        procs.append(sender)
        _expect(sender, "ready", "sender")
        sent = json.loads(sender.stdout.readline() or "{}")
        res = json.loads(receiver.stdout.readline() or "{}")
        if not res or not res.get("n"):
            raise RuntimeError(f"bench receiver got nothing ({res})")
        sender.wait(30)
        receiver.wait(30)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    dt = max(res["dt"], 1e-9)
    return {
        "case": case,
        "path": path,
        "transport": transport,
        "msg_bytes": res["msg_bytes"],
        "received": res["n"],
        "sent": sent.get("n"),
        "seconds": dt,
        "msg_s": res["n"] / dt,
        "mb_s": res["n"] * res["msg_bytes"] / dt / 1e6,
    }


# ---------------------------------------------------------------------------- workers
def _frames(case: str):
    """The pre-encoded body and a ring of 1024 headers (seq 1..1024) of the update c0->server."""
    import numpy as np

    from fedbus.broker import wire

    if case == "20KiB":
        rng = np.random.default_rng(0)
        body = wire.encode_body({"protos": rng.standard_normal((10, 512)).astype(np.float32)})
    else:
        base = {"round": 1, "n": 600, "metrics": {"loss": 0.25, "acc": 0.91}, "pad": b""}
        pad = 200 - len(wire.encode_body(base))
        body = wire.encode_body({**base, "pad": bytes(max(pad, 0))})
    inc = 12345
    now = time.time()
    headers = [
        wire.encode_header("update", "c0", "server", run="bench", round=1, seq=i + 1, inc=inc,
                           ts=now)
        for i in range(1024)
    ]
    end = wire.encode(wire.Message("shutdown", "c0", "server", {"end": True}, run="bench",
                                   seq=1025, inc=inc, ts=now))
    return body, headers, end


def _register(sock, name: str, role: str, clients: list[str]) -> None:

    from fedbus.broker import wire

    msg = wire.Message("register", name, "broker",
                       {"role": role, "node": name, "clients": clients, "run": "bench"})
    sock.send_multipart(wire.encode(msg))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if sock.poll(1000):
            m = wire.decode(sock.recv_multipart())
            if m.kind == "ready":
                return
            if m.kind == "error":
                raise RuntimeError(f"registration refused: {m.body}")
    raise RuntimeError("no answer from the broker")


def _heartbeat(sock, name: str) -> None:
    from fedbus.broker import wire

    sock.send_multipart(wire.encode(wire.Message("heartbeat", name, "broker", None)))


def _cpu_s() -> float:
    """CPU seconds (user + system) used by this process so far, all threads."""
    t = os.times()
    return round(t.user + t.system, 3)


def _leave(sock, name: str) -> None:
    from fedbus.broker import wire

    sock.send_multipart(wire.encode(wire.Message("leave", name, "broker", None)))


def _worker(argv: list[str]) -> int:
    role = argv[0]
    if role == "proxy":
        return _proxy(*argv[1:])
    if role == "receiver":
        return _receiver(argv[1], argv[2], argv[3], float(argv[4]), *argv[5:])
    if role == "sender":
        return _sender(argv[1], argv[2], argv[3], float(argv[4]), *argv[5:])
    raise SystemExit(f"unknown bench worker {role!r}")


def _proxy(front: str, back: str) -> int:
    import zmq

    ctx = zmq.Context()
    fe = ctx.socket(zmq.ROUTER)
    fe.bind(front)
    be = ctx.socket(zmq.ROUTER)
    be.setsockopt(zmq.ROUTER_MANDATORY, 1)
    be.bind(back)
    print("ready", flush=True)
    be.recv_multipart()  # the receiver's hello: its routing id is now known to the backend
    print("go", flush=True)
    try:
        zmq.proxy(fe, be)
    except (zmq.ContextTerminated, KeyboardInterrupt):
        pass
    return 0


def _use_curve(sock, keys: str | None, name: bytes) -> None:
    """CURVE client options for a bench socket (keys: the temp keys folder, or None)."""
    if not keys:
        return
    import zmq

    from fedbus.broker.auth import load_peer_curve

    c = load_peer_curve(keys, name.decode())
    sock.setsockopt(zmq.CURVE_SERVERKEY, c.broker_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, c.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, c.secret)


def _receiver(path: str, case: str, endpoint: str, seconds: float,
              keys: str | None = None) -> int:
    import zmq

    from fedbus.broker import wire

    body, headers, _end = _frames(case)
    size = len(body)
    msg_bytes = len(headers[0]) + size
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if path.startswith("fedbus"):
        s.setsockopt(zmq.IDENTITY, _ID_SERVER)
        _use_curve(s, keys, _ID_SERVER)
        s.connect(endpoint)
        _register(s, _ID_SERVER.decode(), "server", [])
    else:
        s.setsockopt(zmq.IDENTITY, _ID_PROXY)
        s.connect(endpoint)
        s.send_multipart([b"hello", b""])
    print("ready", flush=True)
    recv = s.recv
    NB = zmq.NOBLOCK
    copy = size < 4096
    n = 0
    t0 = t1 = None
    next_hb = time.monotonic() + 0.5
    deadline = time.monotonic() + seconds + 60
    idle_limit = 5.0  # after the first message, this long without one ends the run
    last_rx = None
    done = False
    clock = time.perf_counter
    while not done and time.monotonic() < deadline:
        if path.startswith("fedbus") and time.monotonic() >= next_hb:
            _heartbeat(s, _ID_SERVER.decode())
            next_hb = time.monotonic() + 0.5
        if not s.poll(200):
            if last_rx is not None and time.monotonic() - last_rx > idle_limit:
                break
            continue
        last_rx = time.monotonic()
        k = n
        for _ in range(512):
            try:
                recv(NB)
            except zmq.Again:
                break
            b = recv(NB, copy=copy)
            if len(b) == size:
                n += 1
            else:
                m = wire.decode_body(b)
                if isinstance(m, dict) and m.get("end"):
                    done = True
                    break
        if n != k:
            t1 = clock()
            if t0 is None:
                t0 = t1
                n0 = n  # the rate counts what arrives after the first batch
    if path.startswith("fedbus"):
        _leave(s, _ID_SERVER.decode())
    counted = n - n0 if t0 is not None else 0
    dt = (t1 - t0) if t0 is not None else 0.0
    print(json.dumps({"n": counted, "dt": dt, "msg_bytes": msg_bytes, "total": n,
                      "cpu_s": _cpu_s()}), flush=True)
    s.close(500)
    ctx.term()
    return 0


def _sender(path: str, case: str, endpoint: str, seconds: float, keys: str | None = None) -> int:
    import zmq

    body, headers, end = _frames(case)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 5000)
    if path.startswith("fedbus"):
        s.setsockopt(zmq.IDENTITY, _ID_CLIENT)
        _use_curve(s, keys, _ID_CLIENT)
        s.connect(endpoint)
        _register(s, _ID_CLIENT.decode(), "client", ["c0"])
    else:
        s.setsockopt(zmq.IDENTITY, _ID_PROXY)
        s.connect(endpoint)
        time.sleep(0.2)  # let the connection come up (messages queue meanwhile anyway)
    print("ready", flush=True)
    copy = len(body) < 4096
    payload = body if copy else zmq.Frame(body)
    send = s.send
    MORE = zmq.SNDMORE
    clock = time.perf_counter
    t_end = clock() + seconds
    i = 0
    while clock() < t_end:
        for h in headers[:256] if i & 256 == 0 else headers[256:512]:
            send(h, MORE)
            send(payload, copy=copy)
        i += 256
    s.send_multipart(end)
    if path.startswith("fedbus"):
        _leave(s, _ID_CLIENT.decode())
    print(json.dumps({"n": i, "cpu_s": _cpu_s()}), flush=True)
    s.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
