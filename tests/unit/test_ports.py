"""stack.ports.free_port: distinct ports, none in use, outside the kernel's ephemeral range."""

from __future__ import annotations

import socket

from stack import ports


def test_never_hands_out_a_port_twice():
    got = [ports.free_port() for _ in range(300)]
    assert len(set(got)) == len(got)


def test_ports_lie_below_the_ephemeral_range():
    low = ports._ephemeral_low()
    for _ in range(50):
        p = ports.free_port()
        assert ports.LOW <= p < low


def test_skips_a_port_something_listens_on(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr(ports, "_ephemeral_low", lambda default=32768: 65536)
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(picks))
        assert ports.free_port() != busy


def test_a_run_of_ports_is_free_below_the_ephemeral_range_and_never_given_again():
    low = ports._ephemeral_low()
    bases = [ports.free_port_run(3) for _ in range(30)]
    given = [b + i for b in bases for i in range(3)]
    assert len(set(given)) == len(given)
    assert all(ports.LOW <= p < low for p in given)
    singles = {ports.free_port() for _ in range(100)}
    assert not singles & set(given)


def test_a_run_skips_a_base_whose_next_port_is_taken(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy - 1, busy - 1, busy + 1])
        monkeypatch.setattr(ports, "_ephemeral_low", lambda default=32768: 65536)
        monkeypatch.setattr(ports._rng, "randint", lambda a, b: next(picks))
        assert ports.free_port_run(2) == busy + 1
