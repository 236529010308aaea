"""The session KV cache's disk tier: real engines on the real model, writing real files.

A restored session must reply as the same session kept resident does: both hold the same KV cells, bit for
bit. A prompt computed cold is no reference: the session decoded its reply's tokens one row at a time, and
llama.cpp's CPU kernels round a row alone apart from a prompt's chunk, which can flip a greedy near-tie
(seen with the 8-bit SmolLM2; see test_batch_engine's note on the same).
"""

import ctypes
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.batch_engine import BatchEngine
from inference.chat_templates import ChatMessage
from inference.kv_disk import DiskTier
from inference.types import Sampling
from tests.conftest import SMALL_ENGINE
from tests.helpers import wait_until

GREEDY = Sampling(max_tokens=12, temperature=0, top_p=1, repeat_penalty=1.1)
FIRST = ChatMessage("user", "My sister Ana keeps three goats and a very old donkey on her farm near Porto.")
FOLLOW_UP = ChatMessage("user", "What animals does my sister keep?")


@pytest.fixture
def engines(tmp_path: Path) -> Iterator:
    """Start engines on one disk tier (`tmp_path`); each is closed at the end if the test did not."""
    started: list[BatchEngine] = []

    def start(node: str, **settings) -> BatchEngine:
        config = SMALL_ENGINE.replace(KV_DISK_PATH=str(tmp_path), NODE_NAME=node, KV_DISK_IDLE_S=0)
        engine = BatchEngine(config.replace(**settings))
        started.append(engine)
        return engine

    yield start
    for engine in started:
        if engine._thread.is_alive():
            engine.close()


def _conversation(engine: BatchEngine, session: str) -> tuple[list[int], int]:
    """Turn one on `session`; the follow-up turn's prompt, and how many of its tokens the session holds."""
    prompt = engine.chat_format.render([FIRST])
    reply = engine.generate(session_key=session, prompt=prompt, sampling=GREEDY)
    answer = ChatMessage("assistant", reply.text, tuple(reply.token_ids))
    return engine.chat_format.render([FIRST, answer, FOLLOW_UP]), len(prompt) + len(reply.token_ids)


def test_a_restarted_node_restores_from_disk_and_replies_as_if_it_had_kept_the_session(engines):
    first = engines("node-a")
    prompt, held = _conversation(first, "talk")
    _conversation(first, "kept")  # the same turn on a session that stays resident and goes on
    kept = first.generate(session_key="kept", prompt=prompt, sampling=GREEDY)
    first.close()  # a clean shutdown writes the resident sessions

    restarted = engines("node-a")
    assert restarted.stats().disk_sessions == 2
    restored = restarted.generate(session_key="talk", prompt=prompt, sampling=GREEDY)

    assert (restored.cache_source, restored.cached_tokens) == ("disk", held)  # all a resident session reuses
    assert (kept.cache_source, kept.cached_tokens) == ("resident", held)
    assert restored.token_ids == kept.token_ids


def test_a_session_moved_to_a_draining_nodes_neighbour_restores_from_the_shared_tier(engines):
    draining = engines("node-a")
    prompt, held = _conversation(draining, "moving")
    neighbour = engines("node-b")
    _conversation(neighbour, "reference")  # the same turn, on a session the neighbour keeps
    reference = neighbour.generate(session_key="reference", prompt=prompt, sampling=GREEDY)

    draining.set_draining(True)  # as its heartbeat does when the router drains it
    wait_until(lambda: draining.disk.writes and draining.disk.flush(1), 10, "the draining node to write the session")
    moved = neighbour.generate(session_key="moving", prompt=prompt, sampling=GREEDY)

    assert (moved.cache_source, moved.cached_tokens) == ("other_node", held)
    assert moved.token_ids == reference.token_ids


def test_an_idle_session_is_written_behind_and_survives_a_crash(engines):
    """Nothing is written at a crash; the write-behind has the idle session on disk already."""
    node = engines("node-a", KV_DISK_IDLE_S=0.2)
    prompt, _ = _conversation(node, "idle")
    wait_until(lambda: node.disk.writes and node.disk.flush(1), 10, "the idle session to be written")
    assert node.disk.usage().sessions == 1

    writes = len(node.disk.writes)
    time.sleep(0.6)
    assert len(node.disk.writes) == writes, "an unchanged session is written once"

    other = engines("node-b")  # the crashed node's state is all on disk; another node reads it
    assert other.generate(session_key="idle", prompt=prompt, sampling=GREEDY).cache_source == "other_node"


@pytest.mark.parametrize(
    ("changed", "named"),
    [
        ({"N_CTX": 2048}, "n_ctx_seq"),
        # Without flash attention (BATCH_INVARIANT's choice) llama.cpp keeps V transposed in the cache: a state
        # from a context without it does not fit one with it (llama.cpp's choice here). These engines decode
        # one token a step: with BATCH_INVARIANT off (repacked weights), llama.cpp crashed on SmolLM2's first
        # batch of two tokens or more on a CPU with AMX.
        ({"BATCH_INVARIANT": False}, "flash_attn"),
    ],
)
def test_a_state_for_another_context_layout_is_ignored_logged_and_deleted(engines, caplog, changed, named):
    first = engines("node-a")
    prompt, _ = _conversation(first, "relaid")
    first.close()
    path = first.disk.path_for("relaid")
    assert path.exists()

    with caplog.at_level(logging.WARNING, logger="inference.kv_disk"):
        other = engines("node-a", **changed)
    assert not path.exists()
    assert named in caplog.text
    again = other.generate(session_key="relaid", prompt=prompt, sampling=GREEDY)
    assert again.cache_source == "none" and again.cached_tokens == 0


# The tier's files on their own: real files, states as llama.cpp would hand them over (bytes).

FINGERPRINT = {"model_sha256": "a" * 64, "n_ctx_seq": 1024}


def _state(size: int, fill: int = 7) -> ctypes.Array:
    return (ctypes.c_uint8 * size).from_buffer_copy(bytes([fill]) * size)


def _tier(root: Path, budget: int = 10**9, **fingerprint) -> DiskTier:
    return DiskTier(root, budget_bytes=budget, fingerprint=FINGERPRINT | fingerprint, writer="node-a")


def _written(tier: DiskTier, key: str, tokens: list[int], state: ctypes.Array) -> None:
    tier.put(key, tokens, state)
    assert tier.flush(10)


def test_a_stored_state_comes_back_whole_and_says_who_wrote_it(tmp_path):
    tier = _tier(tmp_path)
    _written(tier, "s", [5, 6, 7], _state(1000))
    stored = tier.load("s")
    assert stored is not None
    assert (stored.tokens, bytes(stored.state), stored.writer) == ([5, 6, 7], bytes([7]) * 1000, "node-a")
    assert tier.load("unknown") is None


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda raw: raw[:-10], id="truncated"),
        pytest.param(lambda raw: raw[:-1] + b"\x00", id="flipped-state-byte"),
        pytest.param(lambda raw: b"garbage" + raw[7:], id="bad-magic"),
        pytest.param(lambda raw: raw[:12] + b"[" + raw[13:], id="bad-header"),
        pytest.param(lambda raw: raw[:10], id="cut-in-the-header"),
        pytest.param(lambda raw: raw + b"\0" * 10**6, id="longer-than-its-header-says"),
    ],
)
def test_a_corrupted_file_is_ignored_logged_and_deleted(tmp_path, caplog, damage):
    tier = _tier(tmp_path)
    _written(tier, "s", [1, 2], _state(500))
    path = tier.path_for("s")
    path.write_bytes(damage(path.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="inference.kv_disk"):
        assert tier.load("s") is None
    assert not path.exists()
    assert "ignoring and deleting" in caplog.text


def test_a_file_from_another_model_is_ignored_at_start_and_deleted(tmp_path, caplog):
    _written(_tier(tmp_path), "s", [1, 2], _state(500))
    other_model = _tier(tmp_path, model_sha256="b" * 64)
    with caplog.at_level(logging.WARNING, logger="inference.kv_disk"):
        usage = other_model.scan()
    assert usage.sessions == 0 and not any(tmp_path.iterdir())
    assert "another model_sha256" in caplog.text


def test_a_full_budget_deletes_the_least_recently_used_first(tmp_path):
    sizing = _tier(tmp_path / "sizing")
    _written(sizing, "a", [1], _state(1000))
    tier = _tier(tmp_path / "budgeted", budget=3 * sizing.path_for("a").stat().st_size)  # room for three
    for key in ("a", "b", "c"):
        _written(tier, key, [1], _state(1000))
        time.sleep(0.02)
    assert tier.load("a") is not None  # used: now the most recent
    time.sleep(0.02)
    _written(tier, "d", [1], _state(1000))

    assert {k for k in "abcd" if tier.path_for(k).exists()} == {"a", "c", "d"}
    assert tier.usage().sessions == 3


def test_an_ended_session_is_forgotten_in_the_context_in_ram_and_on_disk(engines):
    engine = engines("node-a", MAX_RESIDENT_SESSIONS=1)
    _conversation(engine, "deleted")
    assert engine.session_places(10) == {"deleted": "resident"}
    _conversation(engine, "kept")  # the only sequence goes to "kept": "deleted" is spilled to RAM, and to disk
    assert engine.session_places(10) == {"kept": "resident", "deleted": "ram"}
    wait_until(lambda: engine.disk.flush(1) and engine.disk.path_for("deleted").exists(), 10, "the spill's write")

    engine.end_session("deleted")

    wait_until(lambda: "deleted" not in engine.session_places(10), 10, "the session to be forgotten")
    assert not engine.disk.path_for("deleted").exists()
    assert engine.sessions.spilled_bytes == 0
    assert engine.session_places(10) == {"kept": "resident"}
    prompt, _ = _conversation(engine, "deleted")  # the key can be used again, from nothing
    assert engine.generate(session_key="deleted", prompt=prompt, sampling=GREEDY).cache_source == "resident"


def test_sessions_that_leave_memory_are_reported_once_for_the_router(engines):
    """With no room in RAM, a session spilled from the context leaves memory at once: the next heartbeat
    names it (its assignment goes cold, and the router may move it for free), and the one after does not."""
    engine = engines("node-a", MAX_RESIDENT_SESSIONS=1, SPILL_BUDGET_MB=0)
    _conversation(engine, "first")
    assert engine.sessions_dropped() == []
    _conversation(engine, "second")  # the only sequence goes to "second": "first" is spilled, and dropped
    assert engine.sessions_dropped() == ["first"]
    assert engine.sessions_dropped() == []
    assert "first" not in engine.session_places(10) or engine.session_places(10)["first"] == "disk"
