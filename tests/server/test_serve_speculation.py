"""Speculation seen from outside: the official `openai` SDK against a real SmolLM2 server
started with `--speculate ngram`, its `speculate: false` opt-out, the counts in the usage,
`/stats` and `/metrics`, and a schema-bound answer guessing under its grammar."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from modelhost.assembly import build_serving
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

MODEL = "smollm2-135m-instruct"
CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""
COPY: list[Any] = [
    {"role": "user", "content": CODE + "\nRename width to w in the code above and print it."}
]


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    settings = ServeSettings(speculate="ngram")
    return module_live_server(build_serving(smollm2, settings, batch=4, max_queue=8))


def speculation(server: Any) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{server.base_url}/stats", timeout=30).json()
    return stats["speculation"]


def test_an_answer_that_guesses_is_the_one_that_does_not_and_stats_count_the_guesses(
    server: Any,
) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    before = speculation(server)
    guessed = client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=60
    )
    after_guessing = speculation(server)
    plain = client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=60, extra_body={"speculate": False}
    )
    after_plain = speculation(server)
    assert guessed.choices[0].message.content == plain.choices[0].message.content
    assert guessed.usage is not None and plain.usage is not None
    assert guessed.usage.completion_tokens == plain.usage.completion_tokens
    assert after_guessing["mode"] == "ngram"
    assert after_guessing["draft_tokens"] > before["draft_tokens"]
    assert after_guessing["accepted_tokens"] > before["accepted_tokens"]
    assert after_plain["draft_tokens"] == after_guessing["draft_tokens"]  # opted out


def test_metrics_count_guessed_and_accepted_tokens(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=COPY, temperature=0, max_tokens=40)
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.labels.get("model") == MODEL
    }
    assert samples["modelhost_spec_draft_tokens_total"] > 0
    assert samples["modelhost_spec_accepted_tokens_total"] > 0
    assert (
        samples["modelhost_spec_accepted_tokens_total"]
        <= samples["modelhost_spec_draft_tokens_total"]
    )


def test_a_speculate_field_that_is_not_a_bool_is_refused_in_openais_shape(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=COPY, max_tokens=4, extra_body={"speculate": "yes"}
        )
    assert caught.value.body["param"] == "speculate"  # type: ignore[index]
    assert "speculate must be of type bool" in caught.value.body["message"]  # type: ignore[index]


def test_usage_counts_the_answers_accepted_and_rejected_guesses(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    before = speculation(server)
    guessed = client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=60
    )
    after = speculation(server)
    assert guessed.usage is not None
    details = guessed.usage.completion_tokens_details
    assert details is not None
    assert (
        details.accepted_prediction_tokens == after["accepted_tokens"] - before["accepted_tokens"]
    )
    assert details.accepted_prediction_tokens > 0
    assert (
        details.accepted_prediction_tokens + (details.rejected_prediction_tokens or 0)
        == after["draft_tokens"] - before["draft_tokens"]
    )
    assert 0 < after["acceptance_rate"] <= 1


def test_an_answer_that_guessed_nothing_has_no_prediction_counts(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    plain = client.chat.completions.create(
        model=MODEL, messages=COPY, temperature=0, max_tokens=20, extra_body={"speculate": False}
    )
    assert plain.usage is not None
    assert plain.usage.completion_tokens_details is None


RECORD = {"name": "Ada Lovelace", "city": "London", "born": 1815, "languages": ["English"]}
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "city": {"type": "string", "maxLength": 12},
        "born": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
    },
    "required": ["name", "city", "born", "languages"],
    "additionalProperties": False,
}


def test_a_schema_bound_answer_is_the_same_with_guesses_and_validates(server: Any) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    ask: list[Any] = [
        {"role": "user", "content": f"Repeat this record as JSON: {json.dumps(RECORD)}"}
    ]
    response_format: Any = {
        "type": "json_schema",
        "json_schema": {"name": "record", "schema": RECORD_SCHEMA},
    }
    answers = []
    for speculate in (True, False):
        before = speculation(server)
        answer = client.chat.completions.create(
            model=MODEL, messages=ask, temperature=0, max_tokens=80,
            response_format=response_format, extra_body={"speculate": speculate},
        )  # fmt: skip
        guessed = speculation(server)["draft_tokens"] - before["draft_tokens"]
        assert (guessed > 0) == speculate  # the grammar-bound row guessed from its prompt
        answers.append(answer.choices[0].message.content or "")
    assert answers[0] == answers[1]
    jsonschema.validate(json.loads(answers[0]), RECORD_SCHEMA)
