"""Memory quality without a model: does the assembled prompt still hold the turns that answer a question?

Each LoCoMo conversation is stored as a conversation; its questions are then asked one after another at
its end, as new user messages in the same conversation (a day after its last session, in one sitting).
For every strategy and prompt budget, the real strategy code assembles each question's prompt with the
model's tokenizer, and the question records:

- evidence recall: the share of its evidence turns still in the prompt. A turn counts when its text
  (whitespace folded) is in the prompt's text, or when it was folded into a summary segment whose text
  holds the question's answer (normalised as in LoCoMo's scorer);
- prompt tokens, and computed tokens: those not shared with the previous question's prompt plus reply
  (what a warm session cache would still prefill);
- assembly time.

The dataset's answer stands in for the model's reply to each question, so later prompts carry replies of
a plausible length; `--answer` asks the model itself (`answer_sample`).
"""

import random
import re
import string
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from statistics import mean, median

import snowballstemmer
from django.contrib.auth.models import User

from chatapp import services
from chatapp.experiments.locomo import CATEGORIES, LocomoConversation, LocomoQuestion
from chatapp.experiments.model_free import ModelFreeSession
from chatapp.experiments.replay import RunSpec
from chatapp.experiments.report import percentile
from chatapp.memory.assembly import names_of, stored_message
from chatapp.memory.base import AssembledPrompt, StoredMessage
from chatapp.memory.registry import strategy_get
from chatapp.models import Conversation
from inference.chat_format import ChatFormat

# The LoCoMo paper's DRAGON retriever over dialog turns: evidence recall at top-k (Table 4).
DRAGON = {"top-5": 0.567, "top-10": 0.662, "top-25": 0.767, "top-50 (~1,500 tokens)": 0.827}
DRAGON_TOP50_TOKENS = 1500
_porter = snowballstemmer.stemmer("porter")
# The questions come a day after the conversation's last session, a second or two apart: a new sitting.
QUESTIONS_AFTER = timedelta(days=1)


@dataclass(frozen=True)
class StoredLocomo:
    """A LoCoMo conversation as stored: the history (oldest first) and each dia_id's message."""

    source: LocomoConversation
    history: tuple[StoredMessage, ...]
    message_of: dict[str, StoredMessage]
    names: dict[str, str]


def locomo_store(source: LocomoConversation, *, owner: User) -> StoredLocomo:
    """The conversation as stored for `owner`; stored once, then found again by its title."""
    title = f"LoCoMo {source.sample_id}"
    conversation = Conversation.objects.filter(owner=owner, title=title).order_by("-id").first()
    if conversation is None or conversation.messages.count() != len(source.turns):
        conversation = services.conversation_import(
            owner=owner,
            title=title,
            user_name=source.speaker_a,
            assistant_name=source.speaker_b,
            messages=[
                services.ImportedMessage("user" if t.speaker == source.speaker_a else "assistant", t.text, t.when)
                for t in source.turns
            ],
        )
    history = tuple(stored_message(m, model="") for m in conversation.messages.order_by("created_at", "id"))
    message_of = {turn.dia_id: message for turn, message in zip(source.turns, history, strict=True)}
    return StoredLocomo(source, history, message_of, names_of(conversation))


@dataclass
class QuestionResult:
    sample_id: str
    index: int
    category: int
    recall: float | None  # None: none of its evidence ids names a turn
    prompt_tokens: int
    computed_tokens: int
    assembly_ms: float
    failed: bool = False
    prompt: list[int] = field(default_factory=list, repr=False)


def normalize_answer(text: str) -> str:
    """LoCoMo's (and SQuAD's) answer normalisation: lower case, no punctuation, articles or "and"."""
    text = text.replace(",", "").lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the|and)\b", " ", text)
    return " ".join(text.split())


def _folded(text: str) -> str:
    return " ".join(text.split())


def evidence_recall(prompt: AssembledPrompt, evidence: Sequence[StoredMessage], answer: str) -> float | None:
    """The share of `evidence` in the prompt: verbatim, or summarised by a summary that holds the answer."""
    if not evidence:
        return None
    verbatim = _folded("\n".join(m.text for m in prompt.messages()))
    summaries = normalize_answer(" ".join(m.text for s in prompt.segments if s.kind == "summary" for m in s.messages))
    summarized = set(prompt.summarized_ids)
    answer_kept = bool(normalize_answer(answer)) and normalize_answer(answer) in summaries
    found = sum(_folded(m.text) in verbatim or (m.id in summarized and answer_kept) for m in evidence)
    return found / len(evidence)


def run_questions(
    stored: StoredLocomo,
    spec: RunSpec,
    *,
    budget: int,
    fmt: ChatFormat,
    keep_prompts: Iterable[int] = (),
) -> list[QuestionResult]:
    """Ask every question of `stored` in order under one strategy and budget (see the module's docstring);
    the prompts of the questions indexed in `keep_prompts` are kept (for `answer_questions`)."""
    keep = set(keep_prompts)
    strategy = strategy_get(spec.strategy, spec.options)
    run = ModelFreeSession(strategy, fmt, budget, list(stored.history), stored.names)
    next_id = max(m.id for m in stored.history) + 1
    last = stored.history[-1].sent_at
    results = []
    for index, question in enumerate(stored.source.questions):
        sent_at = last + QUESTIONS_AFTER + timedelta(seconds=2 * index) if last else None
        new = StoredMessage(next_id, "user", question.text, sent_at=sent_at)
        answer_ids = tuple(fmt.text_tokens(question.answer))
        reply = StoredMessage(next_id + 1, "assistant", question.answer, answer_ids, sent_at=sent_at)
        next_id += 2
        turn = run.turn(new, reply)
        evidence = [stored.message_of[i] for i in question.evidence if i in stored.message_of]
        result = QuestionResult(stored.source.sample_id, index, question.category, None, 0, 0, turn.assembly_ms)
        if turn.assembled is None:  # the strategy refused (Full over its budget): none of the evidence is sent
            result.failed = True
            result.recall = 0.0 if evidence else None
        else:
            result.recall = evidence_recall(turn.assembled, evidence, question.answer)
            result.prompt_tokens = len(turn.prompt)
            result.computed_tokens = len(turn.prompt) - turn.reusable
            result.prompt = turn.prompt if index in keep else []
        results.append(result)
    return results


def run_summary(label: str, budget: int, results: Sequence[QuestionResult]) -> dict:
    """One strategy at one budget, over every question: recall overall and by category, and costs."""
    scored = [r for r in results if r.recall is not None]
    by_category: dict[str, list[float]] = defaultdict(list)
    for r in scored:
        by_category[CATEGORIES.get(r.category, str(r.category))].append(r.recall or 0.0)
    served = [r for r in results if not r.failed]
    computed = [r.computed_tokens for r in served]
    times = [r.assembly_ms for r in results]
    return {
        "strategy": label,
        "budget": budget,
        "questions": len(results),
        "scored_questions": len(scored),
        "failed": len(results) - len(served),
        "recall": mean_or_none([r.recall or 0.0 for r in scored]),
        "recall_by_category": {
            name: mean_or_none(by_category[name]) for name in CATEGORIES.values() if by_category[name]
        },
        "prompt_tokens_median": median([r.prompt_tokens for r in served]) if served else None,
        "computed_tokens_median": median(computed) if computed else None,
        "computed_share": median(computed) / budget if computed else None,
        "assembly_p50_ms": percentile(times, 50),
        "assembly_p95_ms": percentile(times, 95),
    }


def mean_or_none(values: Sequence[float]) -> float | None:
    return round(mean(values), 4) if values else None


def bench_report(runs: Sequence[dict], budgets: Sequence[int]) -> dict:
    """The JSON report: every run, and for each budget the best strategy (most recall; then least computed)."""
    report: dict = {"runs": list(runs), "dragon_reference": DRAGON}
    for budget in budgets:
        candidates = [r for r in runs if r["budget"] == budget and r["recall"] is not None]
        if not candidates:
            continue
        best = max(candidates, key=lambda r: (r["recall"], -(r["computed_tokens_median"] or 0)))
        report[f"best_strategy_{budget}"] = best["strategy"]
        report[f"best_recall_{budget}"] = best["recall"]
        report[f"computed_share_{budget}"] = best["computed_share"]
        report[f"recall_by_category_{budget}"] = best["recall_by_category"]
        report[f"assembly_p95_ms_{budget}"] = best["assembly_p95_ms"]
    if budgets and f"best_strategy_{budgets[0]}" in report:
        report["assembly_p95_ms"] = report[f"assembly_p95_ms_{budgets[0]}"]
    return report


# Answers, with the model ----------------------------------------------------------


def _stems(text: str) -> list[str]:
    return _porter.stemWords(normalize_answer(text).split())


def token_f1(prediction: str, answer: str) -> float:
    """LoCoMo's answer metric: F1 over normalised, Porter-stemmed tokens."""
    predicted, gold = _stems(prediction), _stems(answer)
    common = sum((Counter(predicted) & Counter(gold)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def answer_f1(prediction: str, question: LocomoQuestion) -> float:
    """As LoCoMo's evaluation scores each category: a multi-hop answer is a list (each part matched to the
    best part of the reply), an open-domain answer is scored on its text before any ';'."""
    if question.category == 1:
        parts = [p for p in prediction.split(",") if p.strip()] or [prediction]
        golds = [g for g in question.answer.split(",") if g.strip()]
        return mean(max(token_f1(p, g) for p in parts) for g in golds) if golds else 0.0
    answer = question.answer.split(";")[0] if question.category == 3 else question.answer
    return token_f1(prediction, answer)


def answer_sample(stored: Sequence[StoredLocomo], count: int, *, seed: int) -> dict[str, set[int]]:
    """`count` answerable questions (categories 1-4) drawn at random (seeded): question indices by sample_id."""
    pool = [
        (s.source.sample_id, i)
        for s in stored
        for i, q in enumerate(s.source.questions)
        if q.category in (1, 2, 3, 4) and q.answer.strip()
    ]
    chosen = random.Random(seed).sample(pool, min(count, len(pool)))  # noqa: S311
    picked: dict[str, set[int]] = defaultdict(set)
    for sample_id, index in chosen:
        picked[sample_id].add(index)
    return picked


def answer_questions(
    engine, label: str, stored: StoredLocomo, results: Sequence[QuestionResult], *, max_tokens: int
) -> list[dict]:
    """The model's replies to the questions whose prompts `results` kept, greedy, each scored by `answer_f1`.
    One engine session per strategy and conversation, so its prefix cache serves as it would live."""
    from inference.types import Sampling

    sampling = Sampling(max_tokens=max_tokens, temperature=0.0, top_p=1.0, repeat_penalty=1.0, seed=0)
    scored = []
    for result in results:
        if not result.prompt:
            continue
        question = stored.source.questions[result.index]
        generation = engine.generate(
            session_key=f"bench_memory:{label}:{stored.source.sample_id}", prompt=result.prompt, sampling=sampling
        )
        reply = generation.text.strip()
        scored.append(
            {
                "sample_id": stored.source.sample_id,
                "question": question.text,
                "answer": question.answer,
                "reply": reply,
                "category": question.category,
                "f1": round(answer_f1(reply, question), 4),
                "recall": result.recall,
            }
        )
    return scored
