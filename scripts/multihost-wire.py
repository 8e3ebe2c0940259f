#!/usr/bin/env python3
"""A host's link to the switch, in user space, with a delay and a loss rate: the
multi-host scripts' stand-in for `tc qdisc ... netem` on kernels built without netem
(scripts/multihost.sh uses netem when the kernel has it).

    ip netns exec HOST multihost-wire.py SWITCH_NS PORT CONTROL_FILE
    multihost-wire.py rtt-server PORT          (answers one round-trip client)
    multihost-wire.py rtt ADDRESS PORT N       (median TCP round trip, 1 byte, in us)

Run inside the host's namespace, it opens a TAP device `eth0` there, then a TAP device
PORT in the switch's namespace (named by `ip netns`), prints `ready`, and copies every
frame from one to the other, each direction delayed by the delay and dropped with the
loss probability. CONTROL_FILE holds `DELAY_US LOSS_PERCENT` and is read again every
0.1 s. Both devices vanish when this process ends.
"""

import ctypes
import fcntl
import os
import random
import select
import socket
import struct
import sys
import time
from collections import deque

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def enter_netns(name):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns {name}")
    os.close(fd)


def read_control(path, current):
    try:
        with open(path) as f:
            delay_us, loss = f.read().split()[:2]
        return float(delay_us) / 1e6, float(loss) / 100.0
    except (OSError, ValueError):
        return current


def rtt_server(port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", int(port)))
    s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(64)
        if not d:
            return
        c.sendall(d)


def rtt(address, port, n):
    c = socket.create_connection((address, int(port)))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    times = []
    for _ in range(int(n)):
        t = time.perf_counter()
        c.sendall(b"x")
        c.recv(64)
        times.append(time.perf_counter() - t)
    times.sort()
    print(f"{times[len(times) // 2] * 1e6:.1f}")


def main():
    if sys.argv[1] == "rtt-server":
        return rtt_server(sys.argv[2])
    if sys.argv[1] == "rtt":
        return rtt(*sys.argv[2:5])
    switch_ns, port, control = sys.argv[1:4]
    host_fd = open_tap("eth0")
    enter_netns(switch_ns)
    port_fd = open_tap(port)
    print("ready", flush=True)
    delay, loss = read_control(control, (0.0, 0.0))
    next_control = time.monotonic() + 0.1
    # Frames in flight, per direction, in order: (due, frame).
    queues = {host_fd: deque(), port_fd: deque()}
    other = {host_fd: port_fd, port_fd: host_fd}
    while True:
        now = time.monotonic()
        if now >= next_control:
            delay, loss = read_control(control, (delay, loss))
            next_control = now + 0.1
        # Deliver what is due.
        for dst, q in queues.items():
            while q and q[0][0] <= now:
                try:
                    os.write(dst, q.popleft()[1])
                except OSError:
                    pass  # the device is down: the frame is lost
        dues = [q[0][0] for q in queues.values() if q]
        # select: microsecond timeouts (poll and epoll round up to milliseconds).
        timeout = 0.1
        if dues:
            timeout = max(0.0, min(dues) - now)
        ready, _, _ = select.select([host_fd, port_fd], [], [], timeout)
        for fd in ready:
            while True:
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError:
                    break
                if loss > 0.0 and random.random() < loss:
                    continue
                q = queues[other[fd]]
                due = time.monotonic() + delay
                if q and q[-1][0] > due:
                    due = q[-1][0]  # never reorder
                q.append((due, frame))


if __name__ == "__main__":
    main()
