"""TCP ports for listeners that another process opens later.

A rank's rendezvous store, a vLLM server and a Ray head are each told a port by one process
and listen on it in another, seconds later (a process starts, a model loads). A port that
``bind(port 0)`` returns is drawn from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), the range it also draws from for every other
``bind(0)`` and for the local end of every outgoing connection on the machine: in those
seconds it can hand the same port to another process, and the peers then reach a stranger
(``EADDRINUSE`` at the listener, a failed handshake at the others). :func:`free_ports`
draws at random from the ports below that range, which the kernel never hands out on its
own, and keeps only ports that nothing holds now. What is left is another program picking
the same port in the same seconds.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: The lowest port drawn: above Ray's default worker ports (10002-19999) and the ports
#: common services are configured on.
LOWEST = 20000
_TRIES = 200
#: Not the module-level generator: a program that seeds it (an RL loop usually does) would
#: draw the same ports in every process it starts.
_DRAW = random.SystemRandom()


def drawn_range() -> range:
    """The ports :func:`free_ports` draws from: from :data:`LOWEST` up to the kernel's
    ephemeral range; empty where that range starts lower or cannot be read."""
    try:
        first = int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return range(0)
    return range(LOWEST, max(LOWEST, first))


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that nothing on ``host`` holds now, for listeners that other
    processes open later; drawn outside the kernel's ephemeral range where it leaves room
    (:func:`drawn_range`), else from the kernel (``bind(0)``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports: list[int] = []
    with contextlib.ExitStack() as held:  # every port stays bound until all are picked: distinct
        candidates = drawn_range()
        for _ in range(_TRIES if candidates else 0):
            if len(ports) == count:
                break
            port = _DRAW.choice(candidates)
            sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            try:
                sock.bind((host, port))
            except OSError:
                continue  # held by a listener or a connection now
            ports.append(port)
        while len(ports) < count:
            sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    """One port that nothing on ``host`` holds now (:func:`free_ports`)."""
    return free_ports(1, host)[0]
