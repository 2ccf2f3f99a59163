"""POST /v1/decisions and /v1/systemone: wire validation and answer shapes over the scripted
engine, then label readouts on the real SmolLM2 (one batched step for all questions)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.assembly import build_app
from modelhost.engine.engine import Engine, EngineConfig
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

TICKET = "Customer: my card was charged twice for the same order and I want a refund now!"
OPENAI_QUESTIONS: list[dict[str, Any]] = [
    {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for money?"},
    {
        "type": "choice",
        "name": "team",
        "instructions": "Which team handles it?",
        "choices": [{"value": "billing"}, {"value": "shipping"}, {"value": "other"}],
    },
    {
        "type": "score",
        "name": "tone",
        "instructions": "How upset is the customer?",
        "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}],
    },
]
SYSTEMONE_QUESTIONS: dict[str, Any] = {
    "urgent": {"type": "noul", "instructions": "Needs a reply within the hour?"},
    "team": {
        "type": "choice",
        "instructions": "Which team?",
        "criteria": {"billing": "payments and refunds", "shipping": None},
    },
    "tone": {"type": "score", "instructions": "How upset?", "criteria": ["calm", "angry"]},
}


def decisions_body(**changes: Any) -> dict[str, Any]:
    return {"model": "x", "input": TICKET, "questions": OPENAI_QUESTIONS, **changes}


async def error_of(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# ---- wire shapes over the scripted engine -----------------------------------------------------


async def test_decisions_answer_in_question_order_with_openai_answer_shapes(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/decisions", json=decisions_body())
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "decision"
    assert body["model"] == "scripted-model"
    predicate, choice, score = body["answers"]
    assert set(predicate) == {"type", "name", "probability"}
    assert (predicate["type"], predicate["name"]) == ("predicate", "refund")
    assert choice["type"] == "choice" and choice["name"] == "team"
    assert [p["value"] for p in choice["probabilities"]] == ["billing", "shipping", "other"]
    assert score["type"] == "score"
    assert [(p["value"], p["label"]) for p in score["probabilities"]] == [
        (0, "calm"),
        (1, "annoyed"),
        (2, "furious"),
    ]


async def test_choice_probabilities_sum_to_one_and_confidence_is_the_winning_share(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.post("/v1/decisions", json=decisions_body())).json()
    choice = body["answers"][1]
    shares = [p["probability"] for p in choice["probabilities"]]
    assert math.isclose(sum(shares), 1.0, rel_tol=1e-9)
    assert choice["confidence"] == max(shares)
    # The scripted readout prefers earlier keys, so the first option wins.
    assert choice["choice"] == "billing"


async def test_score_is_the_expected_level_under_its_probabilities(
    client: httpx.AsyncClient,
) -> None:
    score = (await client.post("/v1/decisions", json=decisions_body())).json()["answers"][2]
    expected = sum(p["value"] * p["probability"] for p in score["probabilities"])
    assert math.isclose(score["score"], expected, rel_tol=1e-9)


async def test_an_unnamed_question_answers_with_a_null_name(client: httpx.AsyncClient) -> None:
    question = {"type": "predicate", "instructions": "Is it about money?"}
    body = (await client.post("/v1/decisions", json=decisions_body(questions=[question]))).json()
    assert body["answers"][0]["name"] is None


async def test_decisions_usage_counts_input_tokens_and_no_output(
    client: httpx.AsyncClient,
) -> None:
    usage = (await client.post("/v1/decisions", json=decisions_body())).json()["usage"]
    assert usage["input_tokens"] > len(TICKET)  # the state, once, plus every question
    assert usage["output_tokens"] == 0
    assert usage["total_tokens"] == usage["input_tokens"]


async def test_every_question_row_reads_out_one_token_and_shares_the_state_prefix(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post("/v1/decisions", json=decisions_body())
    state, *rows = engine.submissions
    assert state.params.readout_token_ids == ()
    assert len(rows) == 3
    for row in rows:
        assert row.params.max_tokens == 1 and row.params.readout_token_ids
        assert row.prompt_ids[: len(state.prompt_ids)] == state.prompt_ids


async def test_labels_that_are_not_single_tokens_are_read_through_letter_keys_shown_in_the_prompt(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post("/v1/decisions", json=decisions_body(questions=OPENAI_QUESTIONS[1:2]))
    prompt = engine.submissions[-1].prompt_ids
    text = scripted_model().tokenizer.decode(prompt, skip_special_tokens=False)
    assert "A: billing" in text and "B: shipping" in text and "C: other" in text


async def test_systemone_answers_by_name_in_typesafe_shapes(client: httpx.AsyncClient) -> None:
    body = {"model": "x", "state": {"ticket": TICKET}, "questions": SYSTEMONE_QUESTIONS}
    response = await client.post("/v1/systemone", json=body)
    assert response.status_code == 200
    answers = response.json()["answers"]
    assert set(answers["urgent"]) == {"type", "noul"}
    assert 0.0 <= answers["urgent"]["noul"] <= 1.0
    assert set(answers["team"]["probabilities"]) == {"billing", "shipping"}
    assert math.isclose(sum(answers["team"]["probabilities"].values()), 1.0)
    assert answers["tone"]["legend"] == {"0": "calm", "1": "angry"}
    assert set(response.json()["usage"]) == {"input_tokens", "output_tokens"}


# ---- validation -------------------------------------------------------------------------------


async def test_a_choice_with_one_option_is_refused_naming_the_field(
    client: httpx.AsyncClient,
) -> None:
    question = {**OPENAI_QUESTIONS[1], "choices": [{"value": "billing"}]}
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[question]))
    assert error["param"] == "questions[0].choices"


async def test_a_choice_with_256_options_is_refused(client: httpx.AsyncClient) -> None:
    choices = [{"value": f"option {i}"} for i in range(256)]
    question = {**OPENAI_QUESTIONS[1], "choices": choices}
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[question]))
    assert error["param"] == "questions[0].choices"


async def test_a_score_with_eleven_levels_is_refused(client: httpx.AsyncClient) -> None:
    levels = [{"label": f"level {i}"} for i in range(11)]
    question = {**OPENAI_QUESTIONS[2], "levels": levels}
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[question]))
    assert error["param"] == "questions[0].levels"


async def test_duplicate_question_names_are_refused(client: httpx.AsyncClient) -> None:
    questions = [OPENAI_QUESTIONS[0], {**OPENAI_QUESTIONS[0]}]
    error = await error_of(client, "/v1/decisions", decisions_body(questions=questions))
    assert error["param"] == "questions[1].name"


async def test_duplicate_choice_values_are_refused(client: httpx.AsyncClient) -> None:
    question = {**OPENAI_QUESTIONS[1], "choices": [{"value": "a"}, {"value": "a"}]}
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[question]))
    assert error["param"] == "questions[0].choices"


async def test_an_unknown_question_type_is_refused_naming_the_type(
    client: httpx.AsyncClient,
) -> None:
    question = {"type": "box", "instructions": "Where?"}
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[question]))
    assert error["param"] == "questions[0].type"


async def test_decisions_without_questions_are_refused(client: httpx.AsyncClient) -> None:
    error = await error_of(client, "/v1/decisions", decisions_body(questions=[]))
    assert error["param"] == "questions"


async def test_decisions_without_input_are_refused(client: httpx.AsyncClient) -> None:
    body = decisions_body()
    del body["input"]
    assert (await error_of(client, "/v1/decisions", body))["param"] == "input"


async def test_an_image_in_decision_input_is_refused_as_the_model_has_no_vision(
    client: httpx.AsyncClient,
) -> None:
    content = [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]
    body = decisions_body(input=[{"role": "user", "content": content}])
    error = await error_of(client, "/v1/decisions", body)
    assert error["message"] == "model has no vision sidecar"


async def test_systemone_without_state_is_refused(client: httpx.AsyncClient) -> None:
    body = {"questions": SYSTEMONE_QUESTIONS}
    assert (await error_of(client, "/v1/systemone", body))["param"] == "state"


async def test_a_systemone_score_with_one_level_is_refused_naming_its_criteria(
    client: httpx.AsyncClient,
) -> None:
    questions = {"tone": {"type": "score", "instructions": "How upset?", "criteria": ["calm"]}}
    body = {"state": TICKET, "questions": questions}
    error = await error_of(client, "/v1/systemone", body)
    assert error["param"] == "questions.tone.criteria"


async def test_a_systemone_choice_with_one_option_is_refused(client: httpx.AsyncClient) -> None:
    questions = {"team": {"type": "choice", "instructions": "Which?", "criteria": {"a": None}}}
    error = await error_of(client, "/v1/systemone", {"state": TICKET, "questions": questions})
    assert error["param"] == "questions.team.criteria"


async def test_validation_runs_before_anything_is_submitted(
    client: httpx.AsyncClient, engine: ScriptedEngine
) -> None:
    await client.post("/v1/decisions", json=decisions_body(questions=[]))
    assert engine.submissions == []


# ---- the real SmolLM2 -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_engine(smollm2: LoadedModel) -> Iterator[Engine]:
    engine = Engine(smollm2, EngineConfig(batch=8))
    yield engine
    engine.close()


@pytest.fixture
def real_client(real_engine: Engine, smollm2: LoadedModel, client_of: Any) -> httpx.AsyncClient:
    app = build_app(real_engine, smollm2, ServeSettings(close_engine_on_shutdown=False))
    client: httpx.AsyncClient = client_of(app)
    return client


@pytest.mark.slow
async def test_an_obvious_predicate_reads_yes_on_smollm2(real_client: httpx.AsyncClient) -> None:
    # SmolLM2-135M separates little; arithmetic it has seen is the case it reads reliably.
    question = {"type": "predicate", "instructions": "Is 2 + 2 equal to 4?"}
    body = {"input": "2 + 2 = 4", "questions": [question]}
    response = await real_client.post("/v1/decisions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["answers"][0]["probability"] > 0.5


@pytest.mark.slow
async def test_smollm2_probabilities_sum_to_one(real_client: httpx.AsyncClient) -> None:
    response = await real_client.post("/v1/decisions", json=decisions_body())
    assert response.status_code == 200, response.text
    for answer in response.json()["answers"][1:]:
        total = sum(p["probability"] for p in answer["probabilities"])
        assert math.isclose(total, 1.0, rel_tol=1e-6)


@pytest.mark.slow
async def test_all_questions_are_answered_in_one_step_after_the_shared_state_prefill(
    real_client: httpx.AsyncClient, real_engine: Engine
) -> None:
    state = " ".join([TICKET] * 6)  # several KV blocks, all under one prefill chunk
    before = real_engine.stats()
    response = await real_client.post("/v1/decisions", json=decisions_body(input=state))
    assert response.status_code == 200, response.text
    after = real_engine.stats()
    assert after.steps - before.steps == 2  # the state's prefill, then every question at once
    assert response.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
