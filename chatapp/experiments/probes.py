"""Planted facts: a fact stated in a session's first message, ordinary conversation from the dataset in
between, then a question whose answer is the fact. A reply recalls it if it contains the fact's value
after normalisation (case, accents and punctuation ignored)."""

import json
import random
import re
import unicodedata
from pathlib import Path

from chatapp.datasets import chitchat_conversations

# (how the fact is stated, the question that asks for it, values it can take)
FACTS: list[tuple[str, str, list[str]]] = [
    ("my sister lives in {}", "Which city does my sister live in?", ["Nairobi", "Lisbon", "Osaka", "Toronto", "Lima"]),
    ("my dog is called {}", "What is my dog called?", ["Biscuit", "Pepper", "Rocket", "Mango", "Ziggy"]),
    ("my favourite colour is {}", "What is my favourite colour?", ["teal", "orange", "purple", "yellow", "maroon"]),
    ("I work as a {}", "What do I do for a living?", ["nurse", "carpenter", "pilot", "librarian", "chemist"]),
    ("my flight leaves from gate {}", "Which gate does my flight leave from?", ["B12", "C7", "A31", "D4", "E19"]),
    ("I was born in {}", "What year was I born in?", ["1987", "1993", "1979", "2001", "1965"]),
    ("my car is a {}", "What car do I drive?", ["Volvo", "Toyota", "Peugeot", "Subaru", "Fiat"]),
    ("my brother's name is {}", "What is my brother's name?", ["Tariq", "Mateo", "Henrik", "Kofi", "Dmitri"]),
]
ACKNOWLEDGEMENT = "Got it, I will remember that."


def normalise(text: str) -> str:
    decomposed = unicodedata.normalize("NFKD", text)
    plain = "".join(c for c in decomposed if not unicodedata.combining(c)).lower()
    return " ".join(re.findall(r"[a-z0-9]+", plain))


def recalled(reply: str, answer: str) -> bool:
    """Whether the reply contains the answer as whole words, after normalisation."""
    return f" {normalise(answer)} " in f" {normalise(reply)} "


def make_probes(*, distances: list[int], per_distance: int, seed: int) -> list[dict]:
    """Probe sessions as JSONL records (see `sources.jsonl_sessions`): for each distance, `per_distance`
    facts, each followed by that many exchanges of real conversation and then its question."""
    rng = random.Random(seed)  # noqa: S311 (sampling, not security)
    fillers = list(chitchat_conversations(min_messages=4))
    records = []
    for distance in distances:
        for k in range(per_distance):
            statement, question, values = FACTS[rng.randrange(len(FACTS))]
            answer = rng.choice(values)
            messages = [
                {"role": "user", "content": f"Hi! Before we chat, you should know that {statement.format(answer)}."},
                {"role": "assistant", "content": ACKNOWLEDGEMENT},
                *_filler(rng, fillers, distance),
                {"role": "user", "content": question},
            ]
            records.append(
                {
                    "id": f"probe:d{distance}:{k}",
                    "messages": messages,
                    "probe": {"answer": answer, "distance": distance},
                }
            )
    return records


def _filler(rng: random.Random, conversations: list[list[str]], exchanges: int) -> list[dict]:
    """`exchanges` user/assistant pairs of real conversation, drawn from as many dataset conversations as needed."""
    pairs: list[tuple[str, str]] = []
    while len(pairs) < exchanges:
        conversation = conversations[rng.randrange(len(conversations))]
        pairs += zip(conversation[0::2], conversation[1::2], strict=False)
    return [
        message
        for user, reply in pairs[:exchanges]
        for message in ({"role": "user", "content": user}, {"role": "assistant", "content": reply})
    ]


def write_probes(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
