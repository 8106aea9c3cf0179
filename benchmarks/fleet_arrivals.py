"""The fleet benchmark's arrival driver for ``router_fleet.py --arrivals socket`` (its default): a
process of its own that sends each request's number over a Unix datagram socket at the request's
arrival time, as a client's request reaches a router replica over the network.

Why a process and a socket. The replica's event loop wakes the moment a socket it watches becomes
readable, so each request reaches it at its own time. The two other drivers each add something of
their own to the figure: a coroutine in the replica's loop sleeps with the loop's timers, which wake
on the millisecond (epoll's timeout is rounded up to it), so it hands over each millisecond's
arrivals together (~14 % of them within 0.1 ms of the one before, against 2.5 % for Poisson arrivals
at 250/s) and they queue behind each other; a thread in the replica's process must take the GIL from
the loop to hand a request over. This process holds no lock of the replica's and sleeps until 0.2 ms
before each arrival, then spins to it (on the SIMULATED fleet's core, not the router's), with a
timer slack of 1 ns and, where allowed, a real-time priority. How late it sent each request is
reported back and counted in the latency, which runs from the arrival time.

Right after each send it reads the replica's event-loop thread's ``schedstat`` (``SPEC.json``'s
``schedstat``: that thread's CPU time and time runnable but waiting for a core, in ns, kept by the
kernel), so the replica can split each request's wait into the loop's own work, waiting for the core,
and neither (asleep, or held off the CPU by something the kernel does not count as either).

Usage (by router_fleet.py): ``python fleet_arrivals.py SPEC.json FD``; SPEC.json holds ``t0_s``
(``time.perf_counter()``, which is CLOCK_MONOTONIC, the same clock in every process), ``offsets_s``,
``cpus`` and ``schedstat``; FD is the inherited socket's descriptor. Prints one JSON line with
``lateness_s``, ``loop_cpu_ns`` and ``loop_run_delay_ns``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import struct
import sys
import time

#: prctl(2): this thread's timer slack, in ns.
_PR_SET_TIMERSLACK = 29
#: Sleep until this long before an arrival, then spin.
_SPIN_S = 0.0002


def main(argv: list[str]) -> int:
    spec_path, fd = argv[0], int(argv[1])
    with open(spec_path) as f:
        spec = json.load(f)
    t0_s: float = spec["t0_s"]
    offsets_s: list[float] = spec["offsets_s"]
    if spec.get("cpus"):
        os.sched_setaffinity(0, set(spec["cpus"]))
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1)
    with contextlib.suppress(OSError, AttributeError):  # root only; without it the wake-ups are later
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    sock = socket.socket(fileno=fd)
    schedstat = os.open(spec["schedstat"], os.O_RDONLY) if spec.get("schedstat") else -1
    lateness_s: list[float] = []
    loop_cpu_ns: list[int] = []
    loop_run_delay_ns: list[int] = []
    for index, offset_s in enumerate(offsets_s):
        arrival_s = t0_s + offset_s
        while (delay_s := arrival_s - time.perf_counter()) > _SPIN_S:
            time.sleep(delay_s - _SPIN_S)
        while time.perf_counter() < arrival_s:
            pass
        sock.send(struct.pack("<I", index))
        lateness_s.append(time.perf_counter() - arrival_s)
        if schedstat >= 0:
            cpu_ns, run_delay_ns = os.pread(schedstat, 128, 0).split()[:2]
            loop_cpu_ns.append(int(cpu_ns))
            loop_run_delay_ns.append(int(run_delay_ns))
    sock.close()
    out = {"lateness_s": lateness_s, "loop_cpu_ns": loop_cpu_ns, "loop_run_delay_ns": loop_run_delay_ns}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
