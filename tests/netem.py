"""A userspace link impairer: delay, jitter and loss on Ethernet links between namespaces.

Used by tests/netns.py where the kernel has no netem qdisc (sch_netem missing, no modprobe).
Each impaired link is two TAP devices instead of a veth pair: this process opens both (in
the switch namespace it is started in), moves one into its host's namespace as eth0, attaches
the other to the switch's bridge, and forwards every frame between the two file descriptors
after a delay drawn from [delay - jitter, delay + jitter] (uniform, as netem's default
jitter), dropping each frame with probability `loss`. Delays are per frame, so jitter can
reorder frames, as netem does. One process serves every link: a heap of due frames and one
poll() loop. The random stream is seeded, so the same traffic meets the same fate.

    ip netns exec SWITCH python tests/netem.py '{"bridge": "br0", "seed": 1, "delay_ms": 50,
        "jitter_ms": 10, "loss": 0.01, "links": [{"host_ns": NS, "host_dev": "h0",
        "switch_dev": "p0"}, ...]}'

It prints one JSON line {"event": "ready", ...} once every link exists (the caller then
addresses and raises the host side), and on exit (stdin closed, SIGTERM or SIGINT) one line
{"event": "stats", ...} with frames forwarded and dropped per link.
"""
from __future__ import annotations

import errno
import fcntl
import heapq
import itertools
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
MAX_FRAME = 65536  # a TAP hands over one frame per read; GSO is off without IFF_VNET_HDR


def open_tap(name: str) -> int:
    """A TAP device named `name` in this process's namespace; its non-blocking fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


class Link:
    """Both ends of one impaired link and what happened to its frames."""

    def __init__(self, index: int, spec: dict, bridge: str):
        self.host_ns = spec["host_ns"]
        self.name = spec.get("name", self.host_ns)
        # Both devices are created here, in the switch namespace; the host one is then moved:
        # a TAP keeps its file descriptor attached across namespaces.
        self.host_fd = open_tap(spec["host_dev"])
        self.switch_fd = open_tap(spec["switch_dev"])
        ip("link", "set", spec["host_dev"], "netns", self.host_ns)
        ip("-n", self.host_ns, "link", "set", spec["host_dev"], "name", "eth0")
        ip("link", "set", spec["switch_dev"], "master", bridge)
        ip("link", "set", spec["switch_dev"], "up")
        self.index = index
        self.forwarded = 0
        self.lost = 0
        self.undeliverable = 0  # written to a device that was down (a cut link)


class Impairer:
    def __init__(self, cfg: dict):
        self.delay = float(cfg.get("delay_ms", 50.0)) / 1000.0
        self.jitter = float(cfg.get("jitter_ms", 10.0)) / 1000.0
        self.loss = float(cfg.get("loss", 0.01))
        self.rng = random.Random(int(cfg.get("seed", 0)))
        self.links = [Link(i, spec, cfg.get("bridge", "br0"))
                      for i, spec in enumerate(cfg["links"])]
        # fd -> (link, the fd its frames go out on)
        self.route: dict[int, tuple[Link, int]] = {}
        for link in self.links:
            self.route[link.host_fd] = (link, link.switch_fd)
            self.route[link.switch_fd] = (link, link.host_fd)
        self.due: list[tuple[float, int, int, Link, bytes]] = []  # (time, order, fd, link, frame)
        self.order = itertools.count()
        self.stopping = False

    def receive(self, fd: int, now: float) -> None:
        link, out_fd = self.route[fd]
        for _ in range(256):  # bounded, so one busy link cannot starve the others
            try:
                frame = os.read(fd, MAX_FRAME)
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EIO, errno.EBADFD):  # the device is down
                    return
                raise
            if not frame:
                return
            if self.rng.random() < self.loss:
                link.lost += 1
                continue
            at = now + self.delay + self.rng.uniform(-self.jitter, self.jitter)
            heapq.heappush(self.due, (at, next(self.order), out_fd, link, frame))

    def deliver(self, now: float) -> None:
        due = self.due
        while due and due[0][0] <= now:
            _, _, fd, link, frame = heapq.heappop(due)
            try:
                os.write(fd, frame)
                link.forwarded += 1
            except OSError:  # EIO: the device is down; EAGAIN: its queue is full
                link.undeliverable += 1

    def run(self) -> None:
        poller = select.poll()
        for fd in self.route:
            poller.register(fd, select.POLLIN)
        stdin = sys.stdin.fileno()
        poller.register(stdin, select.POLLIN | select.POLLHUP)
        while not self.stopping:
            # at most 0.2 s: a signal handler's stop is seen even when no frame moves
            wait = min(0.2, self.due[0][0] - time.monotonic()) if self.due else 0.2
            events = poller.poll(max(0.0, wait) * 1000.0)
            now = time.monotonic()
            for fd, ev in events:
                if fd == stdin:
                    if not os.read(stdin, 4096):  # the harness is gone: stop
                        self.stopping = True
                    continue
                if ev & select.POLLIN:
                    self.receive(fd, now)
            self.deliver(time.monotonic())

    def stats(self) -> dict:
        return {"event": "stats", "links": {
            link.name: {"forwarded": link.forwarded, "lost": link.lost,
                        "undeliverable": link.undeliverable} for link in self.links}}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    impairer = Impairer(cfg)

    def stop(_signum, _frame):
        impairer.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(json.dumps({"event": "ready", "links": len(impairer.links),
                      "delay_ms": impairer.delay * 1000, "jitter_ms": impairer.jitter * 1000,
                      "loss": impairer.loss}), flush=True)
    try:
        impairer.run()
    finally:
        print(json.dumps(impairer.stats()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
