"""The waiting set on its own, over real socket pairs: no server, no HTTP.

`Waiting` holds accepted sockets that have sent nothing yet. One that sends (or ends) is
taken out as ready; one that does not is taken out once its deadline has passed, and
only once; the drain takes all that are left. A first connection moves the watcher's
wait to its deadline.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Iterator

import pytest
import trio

from edge.http.waiting import Waiting


@pytest.fixture
def waiting() -> Iterator[Waiting]:
    opened = Waiting.open()
    if opened is None:
        pytest.skip("this platform's selector cannot be waited on")
    yield opened
    opened.close()


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """Three (server side, client side) socket pairs, closed after the test."""
    made = [socket.socketpair() for _ in range(3)]
    yield made
    for server, client in made:
        server.close()
        client.close()


def test_a_connection_that_sends_is_taken_out_ready_and_does_not_expire(
    waiting: Waiting, pairs: list[tuple[socket.socket, socket.socket]]
) -> None:
    (a, a_client), (b, b_client), (c, _) = pairs
    for deadline, sock in ((1.0, a), (2.0, b), (3.0, c)):
        waiting.add(sock, deadline)
    assert len(waiting) == 3
    assert waiting.next_deadline() == 1.0
    assert waiting.take_ready() == []
    a_client.send(b"GET / HTTP/1.1\r\n")
    b_client.close()  # its end counts as something sent
    assert sorted(s.fileno() for s in waiting.take_ready()) == sorted([a.fileno(), b.fileno()])
    assert len(waiting) == 1
    assert waiting.take_expired(2.5) == []  # a and b left the set already
    assert waiting.take_expired(3.0) == [c]
    assert len(waiting) == 0
    assert waiting.next_deadline() == math.inf


def test_the_drain_takes_all_that_are_left(
    waiting: Waiting, pairs: list[tuple[socket.socket, socket.socket]]
) -> None:
    for number, (sock, _) in enumerate(pairs):
        waiting.add(sock, float(number))
    assert sorted(s.fileno() for s in waiting.take_all()) == sorted(s.fileno() for s, _ in pairs)
    assert len(waiting) == 0
    assert waiting.take_ready() == []
    assert waiting.take_expired(math.inf) == []


def test_a_new_connection_brings_the_watchers_wait_forward(
    waiting: Waiting, pairs: list[tuple[socket.socket, socket.socket]]
) -> None:
    waiting.wake = trio.CancelScope(deadline=math.inf)
    (a, _), (b, _), _ = pairs
    waiting.add(a, 5.0)
    assert waiting.wake.deadline == 5.0
    waiting.add(b, 6.0)  # later: the wait is not pushed back
    assert waiting.wake.deadline == 5.0
