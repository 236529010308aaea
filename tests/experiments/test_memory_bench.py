"""bench_memory on the real tokenizer: the LoCoMo loader, the evidence-recall measure on hand-made cases,
computed-token accounting, LoCoMo's answer F1, and the command's report."""

import json
from datetime import UTC, datetime

import pytest
from django.core.management import CommandError, call_command

from chatapp import services
from chatapp.experiments.locomo import DEFAULT_FILE, evidence_ids, locomo_read, parse_when
from chatapp.experiments.memory_bench import (
    answer_f1,
    evidence_recall,
    locomo_store,
    run_questions,
    token_f1,
)
from chatapp.experiments.replay import parse_strategies, replay_user
from chatapp.experiments.sources import SourceError
from chatapp.memory.base import AssembledPrompt, Segment, StoredMessage
from chatapp.models import Conversation
from chatapp.validation import TurnRejected
from inference.chat_format import ChatFormat
from inference.chat_templates import ChatMessage
from inference.session_cache import common_prefix
from tests.experiments.locomo_sample import locomo_record


@pytest.fixture
def locomo_file(tmp_path):
    path = tmp_path / "locomo.json"
    path.write_text(json.dumps([locomo_record()]))
    return path


@pytest.fixture(scope="module")
def fmt(chat_format: ChatFormat) -> ChatFormat:
    return chat_format


# The loader -----------------------------------------------------------------------


def test_the_loader_keeps_speakers_dates_captions_and_evidence(locomo_file):
    [conversation] = locomo_read(locomo_file)
    assert (conversation.sample_id, conversation.speaker_a, conversation.speaker_b) == (
        "conv-test",
        "Caroline",
        "Melanie",
    )
    assert len(conversation.turns) == 3 + 30 + 1 + 30
    painted = conversation.turns[1]
    assert painted.dia_id == "D1:2" and painted.session == 1
    assert (
        painted.text
        == "That's great! I painted a sunrise last week. [shares a photo: a painting of a sunrise over a lake]"
    )
    assert painted.when == datetime(2023, 5, 8, 13, 56, 1, tzinfo=UTC)  # the session's time, a second a turn
    assert conversation.turns[33].when == datetime(2023, 5, 25, 10, 0, tzinfo=UTC)
    questions = conversation.questions
    assert questions[2].evidence == ("D1:3", "D2:1") and questions[2].category == 1
    assert questions[3].answer == "A sunrise"  # adversarial questions carry their answer under another key


def test_evidence_quirks_and_dates_are_read_as_what_they_name():
    assert evidence_ids("D8:6; D9:17") == ["D8:6", "D9:17"]
    assert evidence_ids("D:11:26") == ["D11:26"]
    assert evidence_ids("D30:05") == ["D30:5"]
    assert evidence_ids("D9:1 D4:4") == ["D9:1", "D4:4"]
    assert parse_when("10:04 am on 19 January, 2023") == datetime(2023, 1, 19, 10, 4, tzinfo=UTC)


def test_unreadable_files_are_refused_with_the_reason(tmp_path):
    with pytest.raises(SourceError, match="no such file"):
        locomo_read(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('[{"sample_id": "x"}]')
    with pytest.raises(SourceError, match="not a LoCoMo file"):
        locomo_read(bad)


@pytest.mark.skipif(not DEFAULT_FILE.exists(), reason="the shared LoCoMo data is not beside this checkout")
def test_the_shared_locomo_file_loads_whole():
    conversations = locomo_read(DEFAULT_FILE)
    assert len(conversations) == 8
    assert sum(len(c.questions) for c in conversations) == 1487
    assert all(369 <= len(c.turns) <= 689 for c in conversations)


def test_a_stored_conversation_keeps_its_times_and_names_and_is_stored_once(db, locomo_file):
    [source] = locomo_read(locomo_file)
    stored = locomo_store(source, owner=replay_user())
    again = locomo_store(source, owner=replay_user())
    assert Conversation.objects.filter(title="LoCoMo conv-test").count() == 1
    assert again.history == stored.history
    conversation = Conversation.objects.get(title="LoCoMo conv-test")
    assert (conversation.user_name, conversation.assistant_name) == ("Caroline", "Melanie")
    first, second = stored.history[:2]
    assert (first.role, second.role) == ("user", "assistant")
    assert first.sent_at == datetime(2023, 5, 8, 13, 56, tzinfo=UTC)
    assert stored.message_of["D2:1"].text == "My kids loved the camping trip to the mountains."


def test_an_import_with_a_bad_message_stores_nothing(db):
    when = datetime(2023, 5, 8, tzinfo=UTC)
    messages = [services.ImportedMessage("user", "Hello", when), services.ImportedMessage("user", " \x00 ", when)]
    with pytest.raises(TurnRejected, match="Message 2: The message is empty"):
        services.conversation_import(owner=replay_user(), title="bad", messages=messages)
    with pytest.raises(TurnRejected, match="role must be user or assistant"):
        services.conversation_import(
            owner=replay_user(), title="bad", messages=[services.ImportedMessage("system", "Hi", when)]
        )
    assert not Conversation.objects.filter(title="bad").exists()


# The recall measure ------------------------------------------------------------------

SISTER = StoredMessage(1, "user", "My sister lives in Nairobi.")
JOB = StoredMessage(2, "assistant", "You said you work as a nurse.")


def prompt_of(*segments: Segment, summarized: tuple[int, ...] = ()) -> AssembledPrompt:
    return AssembledPrompt(segments=segments, kept_ids=(), dropped_ids=(), summarized_ids=summarized)


def test_recall_counts_evidence_whose_text_is_in_the_prompt():
    block = ChatMessage("user", "Earlier in this conversation:\nUser: My  sister lives in\nNairobi.")
    prompt = prompt_of(Segment("recalled", (block,)), Segment("verbatim", (ChatMessage("user", "Hi"),)))
    assert evidence_recall(prompt, [SISTER], "Nairobi") == 1.0  # whitespace is folded
    assert evidence_recall(prompt, [SISTER, JOB], "Nairobi") == 0.5
    assert evidence_recall(prompt_of(Segment("verbatim", (ChatMessage("user", "Hi"),))), [SISTER], "x") == 0.0
    assert evidence_recall(prompt, [], "Nairobi") is None  # no evidence turn to look for: not scored


def test_a_summary_counts_only_for_the_turns_it_folded_and_only_if_it_kept_the_answer():
    summary = Segment("summary", (ChatMessage("system", "Summary: the user's sister lives in Nairobi, Kenya."),))
    assert evidence_recall(prompt_of(summary, summarized=(1,)), [SISTER], "Nairobi") == 1.0
    assert evidence_recall(prompt_of(summary, summarized=(1,)), [SISTER], "Mombasa") == 0.0
    assert evidence_recall(prompt_of(summary, summarized=()), [SISTER], "Nairobi") == 0.0


# Computed tokens and whole runs -------------------------------------------------------


def test_computed_tokens_are_what_the_previous_prompt_and_reply_do_not_cover(db, locomo_file, fmt):
    [source] = locomo_read(locomo_file)
    stored = locomo_store(source, owner=replay_user())
    [spec] = parse_strategies("recall_cached")
    results = run_questions(stored, spec, budget=600, fmt=fmt, keep_prompts=range(4))
    previous: list[int] = []
    for result, question in zip(results, source.questions, strict=True):
        assert result.prompt_tokens == len(result.prompt) <= 600 + fmt.overhead
        assert result.computed_tokens == len(result.prompt) - common_prefix(previous, result.prompt)
        previous = [*result.prompt, *fmt.text_tokens(question.answer)]
    assert results[0].computed_tokens == results[0].prompt_tokens  # a cold first question
    assert any(r.computed_tokens < r.prompt_tokens / 2 for r in results[1:])  # the block before it stays put
    assert results[3].recall is None  # its evidence names no turn


def test_recall_finds_the_evidence_a_window_has_dropped(db, locomo_file, fmt):
    [source] = locomo_read(locomo_file)
    stored = locomo_store(source, owner=replay_user())
    [window] = parse_strategies("window:exchanges=2")
    [recall] = parse_strategies("recall")
    assert [r.recall for r in run_questions(stored, window, budget=600, fmt=fmt)][:3] == [0.0, 0.0, 0.0]
    found = run_questions(stored, recall, budget=600, fmt=fmt)
    assert [r.recall for r in found][:3] == [1.0, 1.0, 1.0]
    assert all(r.assembly_ms > 0 for r in found)
    [full] = parse_strategies("full")
    refused = run_questions(stored, full, budget=600, fmt=fmt)
    assert all(r.failed and r.prompt_tokens == 0 for r in refused)
    assert [r.recall for r in refused] == [0.0, 0.0, 0.0, None]


# LoCoMo's answer metric ----------------------------------------------------------------


def test_answer_f1_normalises_and_stems_like_locomo(locomo_file):
    assert token_f1("A sunrise.", "sunrise") == 1.0  # articles and punctuation go
    assert token_f1("She was painting", "paint") == pytest.approx(0.5)  # "paint" matches; "she", "was" do not
    assert token_f1("", "sunrise") == 0.0
    [conversation] = locomo_read(locomo_file)
    multi_hop = conversation.questions[2]
    assert answer_f1("the mountains, adoption agencies", multi_hop) == 1.0  # each part finds its best match
    assert answer_f1("adoption agencies", multi_hop) == 0.5


# The command ----------------------------------------------------------------------------


def test_bench_memory_reports_each_strategy_and_budget_with_charts(db, locomo_file, tmp_path, capsys):
    out = tmp_path / "out"
    call_command(
        "bench_memory",
        "--file",
        str(locomo_file),
        "--strategies",
        "window,recall,recall_cached",
        "--budgets",
        "400,800",
        "--out",
        str(out),
        "--json",
    )
    report = json.loads(capsys.readouterr().out)
    assert len(report["runs"]) == 6
    # Both recall strategies keep all the evidence; the one that computes less wins the tie.
    assert report["best_strategy_400"] == "recall_cached" and report["best_recall_400"] == 1.0
    assert report["best_recall_800"] == 1.0 and report["computed_share_400"] > 0
    assert set(report["recall_by_category_400"]) == {"temporal", "single-hop", "multi-hop"}
    assert report["assembly_p95_ms"] == report["assembly_p95_ms_400"] > 0
    assert report["dragon_reference"]["top-50 (~1,500 tokens)"] == 0.827
    assert {p.name for p in out.iterdir()} == {"report.json", "recall_by_budget.png", "recall_by_computed.png"}
    assert (out / "recall_by_budget.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_memory_refuses_bad_arguments(db, locomo_file, tmp_path):
    with pytest.raises(CommandError, match="no such file"):
        call_command("bench_memory", "--file", str(tmp_path / "none.json"))
    with pytest.raises(CommandError, match="Unknown memory strategy"):
        call_command("bench_memory", "--file", str(locomo_file), "--strategies", "nope")
    with pytest.raises(CommandError, match="at least one budget"):
        call_command("bench_memory", "--file", str(locomo_file), "--budgets", "10")
    with pytest.raises(CommandError, match="no conversation to measure"):
        call_command("bench_memory", "--file", str(locomo_file), "--conversations", "0")


def test_bench_memory_has_the_model_answer_a_sample_and_scores_it(db, locomo_file, tmp_path, capsys):
    out = tmp_path / "answers"
    call_command(
        "bench_memory",
        *("--file", str(locomo_file), "--strategies", "recall", "--budgets", "600"),
        *("--answer", "2", "--answer-tokens", "8", "--out", str(out), "--json"),
    )
    [run] = json.loads(capsys.readouterr().out)["runs"]
    answers = json.loads((out / "answers.json").read_text())
    assert run["answered"] == len(answers) == 2
    assert all(a["strategy"] == "recall" and a["category"] in (1, 2, 3, 4) for a in answers)
    assert all(0.0 <= a["f1"] <= 1.0 and isinstance(a["reply"], str) for a in answers)
    assert run["answer_f1"] == pytest.approx(sum(a["f1"] for a in answers) / 2, abs=1e-4)
