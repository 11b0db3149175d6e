"""Ports for listeners that another process opens later: below the kernel's ephemeral range,
distinct, and never one that something holds."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from weightsync.glue.ranks import RankSpec
from weightsync.mechanisms import ports


def ephemeral() -> range:
    low, high = (int(n) for n in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


@pytest.fixture
def listeners() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def listen(stack: ExitStack, port: int) -> None:
    sock = stack.enter_context(socket.socket())
    sock.bind(("127.0.0.1", port))
    sock.listen(1)


def test_ports_are_distinct_free_and_outside_the_kernels_own_range() -> None:
    drawn = ports.drawn_range()
    assert drawn, "this machine's ephemeral range leaves no room below it"
    picked = ports.free_ports(7)
    assert len(set(picked)) == 7, picked
    assert all(p in drawn and p not in ephemeral() for p in picked), picked
    with ExitStack() as stack:
        for port in picked:  # each is free: a listener can take it now
            listen(stack, port)


def test_a_held_port_is_never_picked(monkeypatch: pytest.MonkeyPatch, listeners: ExitStack) -> None:
    held, free = ports.free_ports(2)
    listen(listeners, held)
    monkeypatch.setattr(ports, "drawn_range", lambda: range(min(held, free), max(held, free) + 1, abs(free - held)))
    assert {ports.free_port() for _ in range(20)} == {free}


def test_with_every_drawn_port_held_the_kernel_picks(monkeypatch: pytest.MonkeyPatch, listeners: ExitStack) -> None:
    held = ports.free_port()
    listen(listeners, held)
    monkeypatch.setattr(ports, "drawn_range", lambda: range(held, held + 1))
    picked = ports.free_ports(2)
    assert held not in picked and len(set(picked)) == 2 and all(p in ephemeral() for p in picked), picked


def test_a_rank_group_meets_on_a_drawn_port() -> None:
    specs = RankSpec.group(3)
    assert len({s.master_port for s in specs}) == 1 and specs[0].master_port in ports.drawn_range()
    assert [s.rank for s in specs] == [0, 1, 2]


def test_a_program_that_seeds_random_still_draws_other_ports_each_time() -> None:
    random.seed(7)
    first = ports.free_ports(3)
    random.seed(7)
    assert ports.free_ports(3) != first  # two such processes would otherwise collide
