"""`eval-serve`: perplexity of the served model over a text, and a small multiple-choice check.

Config: `{model?, url?, text?, chunk_chars: 1200, choices: true}`. Perplexity comes from
`/v1/completions` with `echo` and `logprobs`: each chunk of the text is one prompt, scored
token by token (a chunk's first token has no context, so it is not scored). The
multiple-choice check asks `/v1/systemone` a few questions whose answer the state gives away,
so any working model should get them right. Progress arrives as `metric` events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import httpx

from modelhost.jobs import config as check
from modelhost.jobs.bench_serve import target_url
from modelhost.jobs.kinds import Emit, JobContext

FIELDS = ("model", "url", "text", "chunk_chars", "choices")
MAX_TEXT_CHARS = 1_000_000

# Written for this check: plain expository English, the kind of text small models saw a lot of.
SAMPLE_TEXT = """\
The river begins as a thin stream high in the mountains, where snow melts slowly through the
spring. As it runs downhill it gathers water from many small creeks, and by the time it reaches
the valley it is wide enough for boats. Farmers along its banks have used the water for
centuries to grow wheat, barley and vegetables. In the summer the river is calm and children
swim near the shore, but in the autumn heavy rain can make it rise quickly.

A town grew up where the old road crossed the river. At first there was only a wooden bridge,
a mill and a few houses. Traders stopped there to rest their horses, and soon there was a
market every week. The wooden bridge was replaced with a stone one, and the town built a
school, a library and a small hospital. Today most people in the town work in shops, offices
and workshops, and the mill has become a museum that explains how flour was made by hand.

Every year the town holds a festival at the end of the harvest. People bring bread, fruit and
cheese to the square, musicians play in the evening, and there is a boat race on the river.
Visitors come from the nearby cities, and the hotels are full for a week. When the festival is
over, the streets are quiet again, and the town returns to its ordinary life until the next
year.
"""

# (state, question, options, correct label): the state states the answer outright.
CHOICE_ITEMS: tuple[tuple[str, str, dict[str, str], str], ...] = (
    (
        "Paris is the capital of France.",
        "What is the capital of France?",
        {"paris": "Paris", "rome": "Rome", "madrid": "Madrid"},
        "paris",
    ),
    (
        "The sky on a clear day is blue.",
        "What colour is the sky on a clear day?",
        {"green": "green", "blue": "blue", "red": "red"},
        "blue",
    ),
    (
        "Water freezes at zero degrees Celsius.",
        "At what temperature in Celsius does water freeze?",
        {"zero": "0 degrees", "fifty": "50 degrees", "hundred": "100 degrees"},
        "zero",
    ),
    (
        "A week has seven days.",
        "How many days are in a week?",
        {"five": "five", "seven": "seven", "ten": "ten"},
        "seven",
    ),
)


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    check.known_fields(config, FIELDS)
    checked: dict[str, Any] = {
        "chunk_chars": check.int_field(config, "chunk_chars", 1200, 64, 100_000),
        "choices": check.bool_field(config, "choices", True),
    }
    text = check.str_field(config, "text")
    if text is not None:
        if not text.strip():
            raise check.InvalidJob("text must contain words")
        if len(text) > MAX_TEXT_CHARS:
            raise check.InvalidJob(f"text must be at most {MAX_TEXT_CHARS} characters")
        checked["text"] = text
    model = check.str_field(config, "model")
    if model is not None:
        checked["model"] = model
    url = check.url_field(config, "url")
    if url is not None:
        checked["url"] = url
    return checked


def chunks_of(text: str, size: int) -> list[str]:
    """Pieces of about `size` characters, cut at whitespace so no word is split."""
    words = text.split()
    pieces: list[str] = []
    current: list[str] = []
    length = 0
    for word in words:
        if current and length + len(word) + 1 > size:
            pieces.append(" ".join(current))
            current, length = [], 0
        current.append(word)
        length += len(word) + 1
    if current:
        pieces.append(" ".join(current))
    return pieces


async def chunk_logprobs(
    client: httpx.AsyncClient, base: str, text: str, model: str | None
) -> list[float]:
    """The logprob of every token of `text` after its first, as the served model scores it."""
    body: dict[str, Any] = {
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0,
        "echo": True,
        "logprobs": 0,
    }
    if model:
        body["model"] = model
    response = await client.post(f"{base}/v1/completions", json=body)
    answer = response.json()
    if response.status_code != 200:
        raise RuntimeError(f"/v1/completions answered {response.status_code}: {answer}")
    prompt_tokens = int(answer["usage"]["prompt_tokens"])
    values = answer["choices"][0]["logprobs"]["token_logprobs"][:prompt_tokens]
    return [float(v) for v in values[1:] if v is not None]


async def choice_check(
    client: httpx.AsyncClient, base: str, model: str | None
) -> tuple[int, list[dict[str, Any]]]:
    correct = 0
    answers: list[dict[str, Any]] = []
    for state, question, options, expected in CHOICE_ITEMS:
        body: dict[str, Any] = {
            "state": state,
            "questions": {"q": {"type": "choice", "instructions": question, "criteria": options}},
        }
        if model:
            body["model"] = model
        response = await client.post(f"{base}/v1/systemone", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"/v1/systemone answered {response.status_code}: {response.text}")
        chosen = response.json()["answers"]["q"]["choice"]
        correct += chosen == expected
        answers.append({"question": question, "expected": expected, "chosen": chosen})
    return correct, answers


async def run(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    base = target_url(config, context).rstrip("/").removesuffix("/v1")
    model = config.get("model")
    pieces = chunks_of(config.get("text") or SAMPLE_TEXT, config["chunk_chars"])
    share = 0.8 if config["choices"] else 1.0  # of the progress bar, for perplexity
    total_nll = 0.0
    scored = 0
    results: dict[str, Any] = {}
    key = None if config.get("url") else context.api_key
    headers = {"authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(600.0, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
        for index, piece in enumerate(pieces, start=1):
            logprobs = await chunk_logprobs(client, base, piece, model)
            total_nll -= sum(logprobs)
            scored += len(logprobs)
            perplexity = math.exp(total_nll / scored) if scored else float("nan")
            emit(
                {
                    "type": "metric",
                    "kind": "eval",
                    "stage": "perplexity",
                    "progress": share * index / len(pieces),
                    "message": f"chunk {index}/{len(pieces)}: perplexity {perplexity:.3f}",
                    "tokens": scored,
                    "perplexity": perplexity,
                }
            )
        if scored == 0:
            raise RuntimeError("the text has no token to score")
        results["perplexity"] = math.exp(total_nll / scored)
        results["tokens"] = scored
        summary = f"perplexity {results['perplexity']:.3f} over {scored} tokens"
        if config["choices"]:
            emit({"type": "stage", "stage": "choices", "message": "multiple-choice check"})
            correct, answers = await choice_check(client, base, model)
            results["choices"] = {"correct": correct, "total": len(answers), "answers": answers}
            emit(
                {
                    "type": "metric",
                    "kind": "eval",
                    "stage": "choices",
                    "progress": 1.0,
                    "message": f"multiple choice {correct}/{len(answers)}",
                    "correct": correct,
                    "total": len(answers),
                }
            )
            summary += f"; multiple choice {correct}/{len(answers)}"
    return {"summary": summary, "results": results}
