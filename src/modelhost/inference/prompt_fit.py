"""A prompt too long for the window, trimmed to fit as Ollama trims it, for a request that asks
(Ollama's own default; every surface under `--context-overflow truncate`).

- A conversation keeps its system messages and its newest turns: it drops its oldest turns, as
  few as will do. A cut falls before a user message (or before the last message), so no tool
  result loses the call it answers. When only the last message is left and it is still too
  long, its text keeps its end.
- Raw text keeps its tail after the tokenizer's own leading specials (BOS); token ids keep
  their tail (Ollama's runner keeps the end of an over-long input too).
- A prompt with images is not trimmed: dropping turns would move the images' places (it is
  refused as before).

The trimmed prompt leaves the answer room: `max_tokens` where one is set (at most half the
window), else a quarter of the window; a trim that kept the answer one token would answer
nothing useful.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from modelhost.inference.contracts import ChatPrompt, InferenceRequest, TextPrompt, TokenPrompt
from modelhost.inference.prompt import prompt_ids_for
from modelhost.models.loaded import LoadedModel

SYSTEM_ROLES = ("system", "developer")


def answer_room(limit: int, requested: int | None) -> int:
    """The tokens a trimmed prompt leaves for the answer inside `limit`."""
    wanted = requested if requested is not None else limit // 4
    return max(1, min(wanted, limit // 2))


def trimmed_warning(kept: int, original: int) -> str:
    """The Warning a trimmed prompt's answer carries: the client's history was cut."""
    return f"prompt truncated to fit the context window: {kept} of {original} tokens kept"


def fit_prompt(
    model: LoadedModel, request: InferenceRequest, instruction: str | None, *, budget: int
) -> list[int] | None:
    """The ids of `request`'s prompt trimmed to at most `budget` tokens; None when it cannot
    be (images, or what must stay is already longer). Blocking: call it off the event loop."""
    if request.images or budget < 1:
        return None
    prompt = request.prompt
    if isinstance(prompt, TokenPrompt):
        return list(prompt.token_ids[-budget:])
    if isinstance(prompt, TextPrompt):
        return _text_tail(model, prompt.text, budget)
    return _newest_turns(model, request, prompt, instruction, budget)


def _text_tail(model: LoadedModel, text: str, budget: int) -> list[int] | None:
    tokenizer = model.tokenizer
    head = tokenizer.encode("", add_special_tokens=True)  # BOS, where the tokenizer adds one
    ids = tokenizer.encode(text, add_special_tokens=True)
    room = budget - len(head)
    if room < 1:
        return None
    return [*head, *ids[len(head) :][-room:]]


def _newest_turns(
    model: LoadedModel,
    request: InferenceRequest,
    prompt: ChatPrompt,
    instruction: str | None,
    budget: int,
) -> list[int] | None:
    messages = prompt.messages
    turns = [i for i, message in enumerate(messages) if message.get("role") not in SYSTEM_ROLES]
    if not turns:
        return None

    def ids_keeping(first: int, last_content: str | None = None) -> list[int]:
        """The prompt of the system messages and the turns from `turns[first]` on."""
        kept: list[Mapping[str, Any]] = [
            message
            for i, message in enumerate(messages)
            if message.get("role") in SYSTEM_ROLES or i >= turns[first]
        ]
        if last_content is not None:
            kept[-1] = {**kept[-1], "content": last_content}
        trimmed = dataclasses.replace(prompt, messages=tuple(kept))
        return prompt_ids_for(model, dataclasses.replace(request, prompt=trimmed), instruction)

    cuts = [k for k in range(1, len(turns)) if messages[turns[k]].get("role") == "user"]
    if not cuts or cuts[-1] != len(turns) - 1:
        cuts.append(len(turns) - 1)
    found = _first_fitting(cuts, lambda cut: ids_keeping(cut), budget)
    if found is not None:
        return found
    if turns[-1] != len(messages) - 1:
        return None  # a system message after the last turn: its text is not the turn's to cut
    content = messages[turns[-1]].get("content")
    if not isinstance(content, str):
        return None
    lengths = list(range(len(content), -1, -1))  # the longest end of the text first
    return _first_fitting(
        lengths, lambda n: ids_keeping(len(turns) - 1, content[len(content) - n :]), budget
    )


def _first_fitting(
    candidates: Sequence[int], ids_of: Callable[[int], list[int]], budget: int
) -> list[int] | None:
    """The ids of the first candidate whose prompt fits `budget` (each later candidate's is
    no longer than the one before: a binary search, a few renders however long the history)."""
    low, high = 0, len(candidates) - 1
    best: list[int] | None = None
    while low <= high:
        mid = (low + high) // 2
        ids = ids_of(candidates[mid])
        if len(ids) <= budget:
            best, high = ids, mid - 1
        else:
            low = mid + 1
    return best
