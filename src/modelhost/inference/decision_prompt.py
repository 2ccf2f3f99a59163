"""Typed decisions, protocol-neutral: the questions, their answer keys and their prompts.

Every question is answered by reading the next-token distribution once, restricted to one token
per option. An option is read through a *key*: its own label when every label of the question is
one distinct token, otherwise a letter (choices), a digit (score levels) or Yes/No (binary
questions). The prompt lists the keys so the model knows the menu it is answering from. A key is
read through its bare token and, where the tokenizer has one, its space-prefixed token, because a
model may start its reply either way.

Each question's prompt is `prefix + tail`: the prefix (template start and the state) is the same
token ids for every question of a request, so the engine's prefix cache prefills it once.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from modelhost.inference.contracts import InvalidRequest
from modelhost.models.loaded import LoadedModel
from modelhost.text.tokenizer import ChatTemplateError, Tokenizer

QuestionKind = Literal["binary", "choice", "score"]

MAX_QUESTIONS = 64
MIN_CHOICES, MAX_CHOICES = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10

_BINARY_KEYS = (("Yes", "No"), ("yes", "no"), ("Y", "N"), ("A", "B"))
_LETTER_KEYS = tuple(string.ascii_uppercase + string.ascii_lowercase)
_DIGIT_KEYS = tuple(string.digits)
_STATE_HEADER = "State:\n"


@dataclass(frozen=True, slots=True)
class Option:
    label: str
    description: str | None = None


@dataclass(frozen=True, slots=True)
class DecisionQuestion:
    """One question; a binary question's options are (true, false), a score's are its levels
    from low to high. `field` is where the client wrote it, for errors that name it."""

    kind: QuestionKind
    name: str | None
    instructions: str
    options: tuple[Option, ...]
    field: str = "questions"


@dataclass(frozen=True, slots=True)
class DecisionRequest:
    request_id: str
    state: str
    questions: tuple[DecisionQuestion, ...]


@dataclass(frozen=True, slots=True)
class KeyedQuestion:
    """A question with the key shown for each option and the token ids each key is read by."""

    question: DecisionQuestion
    keys: tuple[str, ...]
    key_token_ids: tuple[tuple[int, ...], ...]

    @property
    def readout_token_ids(self) -> tuple[int, ...]:
        return tuple(t for ids in self.key_token_ids for t in ids)


@dataclass(frozen=True, slots=True)
class DecisionPrompts:
    prefix_ids: list[int]  # shared by every question
    tails: list[list[int]]  # one per question, in order
    questions: tuple[KeyedQuestion, ...]


def build_prompts(model: LoadedModel, request: DecisionRequest) -> DecisionPrompts:
    """Token ids of the shared prefix and of each question's tail; InvalidRequest when a
    question has more options than this tokenizer has single-token keys."""
    tokenizer = model.tokenizer
    keyed = tuple(assign_keys(tokenizer, question) for question in request.questions)
    state_block = f"{_STATE_HEADER}{request.state}"
    texts = [_render(tokenizer, state_block, question_text(q)) for q in keyed]
    prefix_text = _shared_prefix(texts, state_block)
    prefix_ids = tokenizer.encode(prefix_text, add_special_tokens=not tokenizer.has_chat_template)
    tails = [tokenizer.encode(text[len(prefix_text) :], add_special_tokens=False) for text in texts]
    return DecisionPrompts(prefix_ids=prefix_ids, tails=tails, questions=keyed)


def assign_keys(tokenizer: Tokenizer, question: DecisionQuestion) -> KeyedQuestion:
    labels = [option.label for option in question.options]
    if question.kind == "binary":
        candidates: list[tuple[str, ...]] = [tuple(keys) for keys in _BINARY_KEYS]
    elif question.kind == "score":
        candidates = [_DIGIT_KEYS[: len(labels)], _LETTER_KEYS[: len(labels)]]
    else:
        candidates = [tuple(labels), _LETTER_KEYS[: len(labels)], _DIGIT_KEYS[: len(labels)]]
    for keys in candidates:
        if len(keys) != len(labels):
            continue  # too few letters or digits for this many options
        token_ids = _key_token_ids(tokenizer, keys)
        if token_ids is not None:
            return KeyedQuestion(question, tuple(keys), token_ids)
    raise InvalidRequest(
        f"{question.field} has {len(labels)} options, more than this model can read as "
        f"single-token answer keys",
        param=question.field,
    )


def _key_token_ids(
    tokenizer: Tokenizer, keys: tuple[str, ...]
) -> tuple[tuple[int, ...], ...] | None:
    """Per key, its bare token and its space-prefixed token; None when a key is not one token
    or two keys share a token (the readout could not tell them apart)."""
    seen: set[int] = set()
    result: list[tuple[int, ...]] = []
    for key in keys:
        bare = tokenizer.encode(key, add_special_tokens=False)
        if len(bare) != 1 or bare[0] in seen:
            return None
        ids = [bare[0]]
        spaced = tokenizer.encode(f" {key}", add_special_tokens=False)
        if len(spaced) == 1 and spaced[0] not in seen and spaced[0] != bare[0]:
            ids.append(spaced[0])
        seen.update(ids)
        result.append(tuple(ids))
    return tuple(result)


def question_text(keyed: KeyedQuestion) -> str:
    question = keyed.question
    lines = [f"Question: {question.instructions}"]
    if question.kind == "binary":
        yes, no = keyed.keys
        true, false = question.options
        if true.description:
            lines.append(f"Answer {yes} if: {true.description}")
        if false.description:
            lines.append(f"Answer {no} if: {false.description}")
        lines.append(f"Reply with {yes} or {no} only.")
        return "\n".join(lines)
    lines.append("Levels, from lowest to highest:" if question.kind == "score" else "Options:")
    for key, option in zip(keyed.keys, question.options, strict=True):
        shown = option.label if key == option.label else f"{key}: {option.label}"
        lines.append(f"{shown} - {option.description}" if option.description else shown)
    lines.append("Reply with the key of one option only.")
    return "\n".join(lines)


def _render(tokenizer: Tokenizer, state_block: str, question: str) -> str:
    content = f"{state_block}\n\n{question}"
    if not tokenizer.has_chat_template:
        return f"{content}\nAnswer:"
    try:
        return tokenizer.render_chat([{"role": "user", "content": content}])
    except ChatTemplateError as exc:
        raise InvalidRequest(f"prompt build failed: {exc}") from exc


def _shared_prefix(texts: list[str], state_block: str) -> str:
    """The text up to the end of the state: identical for every question by construction."""
    first = texts[0]
    end = first.find(state_block)
    if end < 0:  # the template rewrote the content; share nothing rather than guess
        return ""
    prefix = first[: end + len(state_block)]
    return prefix if all(text.startswith(prefix) for text in texts) else ""
