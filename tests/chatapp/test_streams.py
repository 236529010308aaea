"""The shared sync Redis client under threads that all reach for it first at once."""

import sys
import threading

import pytest

from chatapp import streams


@pytest.fixture
def fresh_client(monkeypatch):
    """As in a process that has not used Redis yet; the client made here is closed afterwards."""
    monkeypatch.setattr(streams, "_client", None)
    yield
    if streams._client is not None:
        streams._client.close()


def test_threads_that_start_together_share_one_client_and_none_fails(fresh_client):
    """Twenty threads make their first Redis call together (a burst of logins on a fresh web process).

    A switch interval of a microsecond interleaves them inside the client's creation; with an unlocked
    cache, the clients not kept were collected and closed their pools under their own threads' commands.
    """
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    start = threading.Barrier(20)
    clients: list[int] = []
    errors: list[BaseException] = []

    def first_call(n: int) -> None:
        start.wait()
        try:
            made = streams.client()
            clients.append(id(made))
            pipe = made.pipeline(transaction=True)
            pipe.incr(f"test-streams:burst:{n}")
            pipe.delete(f"test-streams:burst:{n}")
            assert pipe.execute() == [1, 1]
        except BaseException as exc:  # collected for the assertion, with its type
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(n,)) for n in range(20)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        sys.setswitchinterval(before)
    assert errors == []
    assert len(clients) == 20
    assert len(set(clients)) == 1
