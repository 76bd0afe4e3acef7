"""Free loopback ports, for the servers tests start (Redis, Sentinel, uvicorn, `atrium up`).
Nothing here imports the project, so the end-to-end tests and the benchmarks may use it.

The ports come from below the kernel's ephemeral range (where every outgoing connection
takes its local port, so a port found free there can be taken by a client before the
server binds it), and each pytest-xdist worker has its own part of that span, given out
in turn: no two workers, and no two callers in one process, are handed the same port.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from pathlib import Path

SPAN = 12_000  # ports below the ephemeral range, shared out among the workers
WORKERS = 3  # the most platform/atrium/testing.py allows


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _worker_ports() -> range:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    low = max(1024, _ephemeral_low() - SPAN)
    share = (_ephemeral_low() - low) // WORKERS
    return range(low + worker * share, low + (worker + 1) * share)


_PORTS = _worker_ports()
# A start of its own for each process (benchmarks run beside a test session's worker 0).
_next = itertools.count(random.randrange(len(_PORTS)))


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports nothing listens on now, none handed out
    before by this process. NOTE: free when asked; the callers start their servers at once."""
    for _ in range(len(_PORTS)):
        first = next(_next) % len(_PORTS)
        if first + count > len(_PORTS):
            continue
        ports = [_PORTS[first + i] for i in range(count)]
        for _ in range(count - 1):
            next(_next)  # the others are this caller's too
        if all(_bindable(port) for port in ports):
            return ports[0]
    raise RuntimeError(f"no {count} consecutive free ports in {_PORTS}")


def free_port() -> int:
    """A port nothing listens on now, none handed out before by this process."""
    return free_ports(1)
