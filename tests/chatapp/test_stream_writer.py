"""The node's batched token appends, on the real Redis: order kept per turn, each append answered as
`streams.publish` answers, and a Redis that forgot the script (a restart) written to all the same."""

import uuid

from chatapp import streams
from chatapp.stream_writer import Appends, StreamWriter


def _turn() -> str:
    return f"test-writer-{uuid.uuid4().hex}"


def test_interleaved_turns_keep_their_order_and_each_append_is_answered():
    writer = StreamWriter()
    turns = [Appends(_turn(), attempt=0) for _ in range(3)]
    for n in range(20):
        for appends in turns:
            writer.append(appends, {"type": "token", "text": f"{n} "})
    for appends in turns:
        assert appends.wait_written(timeout=10)
        assert appends.queued == 0 and appends.answer is streams.Appended.WRITTEN
        events = streams.read_all(appends.turn_key)
        assert [e["text"] for e in events] == [f"{n} " for n in range(20)]
        assert {e["attempt"] for e in events} == {0}


def test_an_answer_says_a_stop_was_asked_or_a_later_attempt_owns_the_stream():
    writer = StreamWriter()
    stopped, replaced = Appends(_turn(), attempt=0), Appends(_turn(), attempt=0)
    streams.request_cancel(stopped.turn_key)
    streams.fence(replaced.turn_key, 1)
    writer.append(stopped, {"type": "token", "text": "a"})
    writer.append(replaced, {"type": "token", "text": "stale"})
    assert stopped.wait_written(timeout=10) and replaced.wait_written(timeout=10)
    assert stopped.answer is streams.Appended.STOP_ASKED
    assert replaced.answer is streams.Appended.SUPERSEDED
    assert streams.read_all(replaced.turn_key) == []


def test_a_redis_that_forgot_the_script_is_written_to_after_loading_it_again():
    writer = StreamWriter()
    appends = Appends(_turn(), attempt=0)
    writer.append(appends, {"type": "token", "text": "before "})
    assert appends.wait_written(timeout=10)
    streams.client().script_flush()  # what a restarted Redis remembers
    writer.append(appends, {"type": "token", "text": "after"})
    assert appends.wait_written(timeout=10)
    assert [e["text"] for e in streams.read_all(appends.turn_key)] == ["before ", "after"]
