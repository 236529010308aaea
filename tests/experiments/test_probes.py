"""Planted-fact probes: how they are built and how a reply is scored."""

import io
import json

import pytest
from django.core.management import call_command

from chatapp.experiments.probes import FACTS, make_probes, normalise, recalled
from chatapp.experiments.sources import jsonl_sessions


def test_each_probe_states_a_fact_talks_for_its_distance_then_asks_for_it():
    records = make_probes(distances=[0, 3, 7], per_distance=4, seed=1)
    assert len(records) == 12
    for record in records:
        distance, answer, messages = record["probe"]["distance"], record["probe"]["answer"], record["messages"]
        assert answer in messages[0]["content"] and messages[0]["role"] == "user"
        fillers = messages[2:-1]
        assert len(fillers) == 2 * distance
        assert [m["role"] for m in fillers] == ["user", "assistant"] * distance
        question = messages[-1]["content"]
        assert messages[-1]["role"] == "user" and question in {q for _, q, _ in FACTS}
        assert answer not in question
    assert [r["probe"]["distance"] for r in records] == [0] * 4 + [3] * 4 + [7] * 4


def test_probe_sets_are_reproducible_by_seed():
    assert make_probes(distances=[2], per_distance=3, seed=5) == make_probes(distances=[2], per_distance=3, seed=5)
    assert make_probes(distances=[2], per_distance=3, seed=5) != make_probes(distances=[2], per_distance=3, seed=6)


@pytest.mark.parametrize(
    ("reply", "answer", "expected"),
    [
        ("Your sister lives in Nairobi.", "Nairobi", True),
        ("she lives in NAIROBI!", "Nairobi", True),
        ("You were born in 1987, I think.", "1987", True),
        ("Gate b12, on the left.", "B12", True),
        ("Your dog is called Ziggy-the-great", "Ziggy", True),
        ("Lisbon, if I remember", "Lisbon", True),
        ("You live in Lisboa.", "Lisbon", False),
        ("Gate B120", "B12", False),  # whole words only
        ("I do not know.", "teal", False),
        ("", "teal", False),
    ],
)
def test_recall_is_a_normalised_whole_word_match(reply, answer, expected):
    assert recalled(reply, answer) is expected


def test_normalise_drops_case_accents_and_punctuation():
    assert normalise("  São-Paulo,  CAFÉ! ") == "sao paulo cafe"


def test_make_probes_writes_a_file_the_replay_reads(tmp_path):
    out = tmp_path / "p.jsonl"
    call_command("make_probes", "--distances", "1,2", "--per-distance", "3", "--out", str(out), stdout=io.StringIO())
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and all(json.loads(line)["probe"] for line in lines)
    sessions = jsonl_sessions(out)
    assert [s.probe.distance for s in sessions if s.probe] == [1, 1, 1, 2, 2, 2]
    assert all(len(s.user_messages) == s.probe.distance + 2 for s in sessions if s.probe)
