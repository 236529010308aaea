"""The node's batched token appends, on the real Redis: order kept per turn, each append answered as
`streams.publish` answers, the texts of an interval joined into one entry (a reply's first text and a
flush sent at once), a watched attempt told of a stop before it has text, and a Redis that forgot the
script (a restart) written to all the same."""

import time
import uuid

from chatapp import streams
from chatapp.stream_writer import STOP_CHECK_S, Appends, StreamWriter


def _turn() -> str:
    return f"test-writer-{uuid.uuid4().hex}"


def test_interleaved_turns_keep_their_order_and_each_append_is_answered():
    writer = StreamWriter(interval_s=0)
    turns = [Appends(_turn(), attempt=0) for _ in range(3)]
    for n in range(20):
        for appends in turns:
            writer.append(appends, f"{n} ")
    for appends in turns:
        assert appends.wait_written(timeout=10)
        assert appends.queued == 0 and appends.answer is streams.Appended.WRITTEN
        events = streams.read_all(appends.turn_key)
        assert "".join(e["text"] for e in events) == "".join(f"{n} " for n in range(20))
        assert {e["type"] for e in events} == {"token"} and {e["attempt"] for e in events} == {0}


def test_the_texts_of_an_interval_go_as_one_entry_but_a_first_text_and_a_flush_go_at_once():
    writer = StreamWriter(interval_s=60)  # nothing here may wait it out: each wait below gives up after 10 s
    one, two = Appends(_turn(), attempt=0), Appends(_turn(), attempt=0)
    writer.append(one, "a")
    assert one.wait_written(timeout=10)  # the first send
    writer.append(one, "b")
    writer.append(two, "x")  # another reply's first text: sent at once, with what waited
    assert two.wait_written(timeout=10) and one.queued == 0
    for text in "cde":
        writer.append(one, text)
    assert one.queued == 3
    assert writer.flush(one, timeout=10)  # its end: at once
    assert [e["text"] for e in streams.read_all(one.turn_key)] == ["a", "b", "cde"]
    assert [e["text"] for e in streams.read_all(two.turn_key)] == ["x"]


def test_an_answer_says_a_stop_was_asked_or_a_later_attempt_owns_the_stream():
    writer = StreamWriter(interval_s=0)
    stopped, replaced = Appends(_turn(), attempt=0), Appends(_turn(), attempt=0)
    streams.request_cancel(stopped.turn_key)
    streams.fence(replaced.turn_key, 1)
    writer.append(stopped, "a")
    writer.append(replaced, "stale")
    assert stopped.wait_written(timeout=10) and replaced.wait_written(timeout=10)
    assert stopped.answer is streams.Appended.STOP_ASKED and stopped.stopped.is_set()
    assert replaced.answer is streams.Appended.SUPERSEDED and replaced.stopped.is_set()
    assert streams.read_all(replaced.turn_key) == []


def test_a_watched_attempt_with_no_text_yet_learns_of_a_stop_from_the_writer():
    writer = StreamWriter(interval_s=60)
    waiting, other = Appends(_turn(), attempt=0), Appends(_turn(), attempt=0)
    writer.watch(waiting)
    writer.watch(other)
    streams.request_cancel(waiting.turn_key)
    assert waiting.stopped.wait(timeout=10)
    assert not other.stopped.is_set() and waiting.answer is None  # a read of the flag, not an append
    assert streams.read_all(waiting.turn_key) == []
    writer.unwatch(other)
    streams.request_cancel(other.turn_key)
    time.sleep(5 * STOP_CHECK_S)
    assert not other.stopped.is_set()  # no longer read


def test_a_redis_that_forgot_the_script_is_written_to_after_loading_it_again():
    writer = StreamWriter(interval_s=0)
    appends = Appends(_turn(), attempt=0)
    writer.append(appends, "before ")
    assert appends.wait_written(timeout=10)
    streams.client().script_flush()  # what a restarted Redis remembers
    writer.append(appends, "after")
    assert appends.wait_written(timeout=10)
    assert [e["text"] for e in streams.read_all(appends.turn_key)] == ["before ", "after"]
