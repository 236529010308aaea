"""Lexical ranking of stored messages against a new one: Okapi BM25 over stemmed words, lifted by
neighbouring turns, by the best match in the same session, and by the speaker a question names (the
`recall` add-on's ranker). Pure and deterministic.

Chosen by measuring on LoCoMo (a prototype over the same 1,483 scorable questions, about 1,900 tokens of
turns a question): plain BM25 kept 0.73 of the evidence; the speaker's name indexed with each turn 0.75;
neighbour and session lifts 0.86, the speaker lift 0.87. all-MiniLM-L6-v2 embeddings alone kept 0.68;
adding them to BM25 gained two to three points, for a second model on the node's CPU (and 120 ms a turn
to embed here), so there are no embeddings. Pseudo-relevance feedback (RM3) and other BM25 parameters
moved nothing.
"""

import math
import re
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import snowballstemmer

# Function words that carry no topic (English; the chat's language). Kept short on purpose: question
# words like "when" and "where" are here, names and content words never are.
STOP_WORDS = frozenset(
    """a about above after again against all am an and any are as at be been before being below between both
    but by can could did do does doing down during each few for from further had has have having he her here
    hers herself him himself his how i if in into is it its itself just me more most my myself no nor not now
    of off on once only or other our ours ourselves out over own same she should so some such than that the
    their theirs them themselves then there these they this those through to too under until up very was we
    were what when where which while who whom why will with would you your yours yourself yourselves""".split()  # noqa: SIM905
)
_WORD = re.compile(r"[a-z0-9]+")
_stemmer = snowballstemmer.stemmer("english")


@lru_cache(maxsize=65536)
def terms(text: str) -> tuple[str, ...]:
    """The text's indexable words: lower-cased, apostrophes dropped, stop words out, Snowball-stemmed."""
    words = _WORD.findall(text.lower().replace("'", "").replace("\u2019", ""))
    return tuple(_stemmer.stemWords([w for w in words if w not in STOP_WORDS]))


@lru_cache(maxsize=65536)
def term_counts(text: str) -> Counter[str]:
    """How often each of `terms(text)` occurs (read only: it is shared)."""
    return Counter(terms(text))


@dataclass(frozen=True)
class Document:
    key: int
    text: str  # what is indexed (the speaker's name and the message)
    group: Hashable = None  # turns in one group (a session) lift each other's scores
    speaker: str = ""


def bm25_scores(documents: Sequence[Counter[str]], query: Sequence[str], *, k1: float = 1.2, b: float = 0.75):
    """Okapi BM25 (Robertson and Zaragoza's k1 and b) of each document (its term counts) for `query`.
    Queries are a few words, so this reads each document's counts for them rather than building an index."""
    query = sorted(set(query))
    lengths = [d.total() for d in documents]
    average = sum(lengths) / len(documents)
    df = Counter(t for d in documents for t in query if t in d)
    idf = {t: math.log(1 + (len(documents) - n + 0.5) / (n + 0.5)) for t, n in df.items()}
    scores = []
    for document, length in zip(documents, lengths, strict=True):
        norm = k1 * (1 - b + b * length / average)
        scores.append(sum(idf[t] * document[t] * (k1 + 1) / (document[t] + norm) for t in idf if t in document))
    return scores


def rank(
    query: str, documents: Sequence[Document], *, neighbors: float, session: float, speaker: float = 0.0
) -> list[int]:
    """Keys of `documents` (in conversation order) that share a word with `query`, best first.

    A turn's score is its BM25 score (scaled so the best is 1), plus `neighbors` times each adjacent turn's
    in the same group (an answer often sits next to the turn that matches), plus `session` times the best
    score in its group, plus `speaker` when the query names one speaker and the turn is theirs (a question
    about Melanie is mostly answered by what Melanie said).
    """
    query_terms = terms(query)
    if not documents or not query_terms:
        return []
    raw = bm25_scores([term_counts(d.text) for d in documents], query_terms)
    top = max(raw)
    if top <= 0:
        return []
    raw = [s / top for s in raw]
    best: dict[Hashable, float] = defaultdict(float)
    for document, score in zip(documents, raw, strict=True):
        best[document.group] = max(best[document.group], score)
    words = set(_WORD.findall(query.lower()))
    named = {d.speaker for d in documents if d.speaker and set(_WORD.findall(d.speaker.lower())) <= words}
    about = named.pop() if len(named) == 1 else None
    scored = []
    for i, document in enumerate(documents):
        score = raw[i] + session * best[document.group] + (speaker if about and document.speaker == about else 0)
        for j in (i - 1, i + 1):
            if 0 <= j < len(documents) and documents[j].group == document.group:
                score += neighbors * raw[j]
        if score > 0:
            scored.append((-score, i, document.key))
    return [key for _, _, key in sorted(scored)]
