"""End to end: the official `openai` SDK and raw httpx against a real server over SmolLM2.

The servers are what `modelhost serve` builds (`build_serving` + `server/http_server`'s uvicorn)
on a free loopback port, over the suite's shared `smollm2` model: one roomy server for the
protocol tests, and one tight server (`--batch 1 --max-queue 1`, a small `--memory-budget`, a
short heartbeat) for admission, queueing and heartbeats.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from modelhost.assembly import build_serving
from modelhost.inference.admission import BYTES_PER_GB, working_bytes
from modelhost.models.loaded import LoadedModel
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
TIGHT_CONTEXT = 128  # tokens the tight server's memory budget should leave room for
# A request that holds the tight server's one row for all the context it has left (~90 tokens):
# stopped early by EOS, it could finish before a second request has waited a heartbeat.
HOG = {"messages": ASK, "max_tokens": 1000, "temperature": 0.8, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    app = build_serving(smollm2, ServeSettings(), batch=4, max_queue=8)
    return module_live_server(app)


@pytest.fixture(scope="module")
def tight_server(smollm2: LoadedModel, module_live_server: Any) -> Any:
    config = smollm2.config
    dtype_bytes = smollm2.dtype.itemsize
    need = (
        smollm2.weights_bytes
        + TIGHT_CONTEXT * config.kv_bytes_per_token(smollm2.cache_dtype.itemsize)
        + working_bytes(config, dtype_bytes, TIGHT_CONTEXT, chunk_tokens=512, rows=1)
    )
    settings = ServeSettings(memory_budget_gb=need / BYTES_PER_GB, heartbeat_s=0.2)
    app = build_serving(smollm2, settings, batch=1, max_queue=1)
    return module_live_server(app)


@pytest.fixture
def client(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def stats(server: Any) -> dict[str, Any]:
    return httpx.get(f"{server.base_url}/stats", timeout=10).json()


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def sse_data(line: str) -> Any:
    data = line.removeprefix("data: ")
    return data if data == "[DONE]" else json.loads(data)


# ---- the OpenAI SDK ---------------------------------------------------------------------------


def test_sdk_chat_answers_the_question_and_usage_adds_up(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=ASK, max_tokens=12, temperature=0
    )
    assert answer.model == "smollm2-135m-instruct"
    assert "Paris" in (answer.choices[0].message.content or "")
    usage = answer.usage
    assert usage is not None
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert 0 < usage.completion_tokens <= 12


def test_sdk_chat_stream_carries_the_same_text_as_the_json_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": ASK, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_sdk_max_tokens_ends_the_answer_with_length(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="m", messages=ASK, max_tokens=3, temperature=0)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 3


def test_sdk_stop_string_cuts_the_answer_and_finishes_with_stop(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=16, temperature=0, stop=[" Paris"]
    )
    content = answer.choices[0].message.content or ""
    assert answer.choices[0].finish_reason == "stop"
    assert "Paris" not in content
    assert content.startswith("The capital of France")


def test_sdk_same_seed_reproduces_a_sampled_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "messages": ASK, "max_tokens": 12}
    first = client.chat.completions.create(**kwargs, temperature=1.0, seed=1234)
    second = client.chat.completions.create(**kwargs, temperature=1.0, seed=1234)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_sdk_chat_logprobs_have_one_entry_per_token_with_alternatives(
    client: openai.OpenAI,
) -> None:
    answer = client.chat.completions.create(
        model="m", messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert answer.usage is not None and len(logprobs.content) == answer.usage.completion_tokens
    for entry in logprobs.content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
    joined = "".join(entry.token for entry in logprobs.content)
    assert joined == answer.choices[0].message.content


def test_sdk_text_completion_json_and_stream_agree(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {"model": "m", "prompt": "The sky is", "max_tokens": 6}
    whole = client.completions.create(**kwargs, temperature=0, logprobs=2)
    assert whole.object == "text_completion"
    assert whole.choices[0].logprobs is not None
    assert len(whole.choices[0].logprobs.tokens or []) == 6
    streamed = list(client.completions.create(**kwargs, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == whole.choices[0].text


def test_sdk_token_array_prompt_is_answered_as_the_text_it_encodes(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    ids = smollm2.tokenizer.encode("The sky is", add_special_tokens=True)
    kwargs: dict[str, Any] = {"model": "m", "max_tokens": 6, "temperature": 0}
    as_text = client.completions.create(**kwargs, prompt="The sky is")
    as_ids = client.completions.create(**kwargs, prompt=ids)
    as_batch_of_one = client.completions.create(**kwargs, prompt=[ids])
    assert as_ids.choices[0].text == as_batch_of_one.choices[0].text == as_text.choices[0].text
    assert as_ids.usage is not None and as_ids.usage.prompt_tokens == len(ids)


def test_sdk_token_array_prompt_echoes_its_decoded_text(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    ids = smollm2.tokenizer.encode("The sky is", add_special_tokens=False)
    echoed = client.completions.create(model="m", prompt=ids, max_tokens=2, echo=True)
    assert echoed.choices[0].text.startswith("The sky is")


def test_sdk_token_id_outside_the_vocabulary_is_a_400_naming_it(
    client: openai.OpenAI, smollm2: LoadedModel
) -> None:
    outside = smollm2.config.vocab_size
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="m", prompt=[[464, 2068, outside]], max_tokens=2)
    assert refused.value.param == "prompt"
    assert f"prompt[0][2] is {outside}, not a token id of this model" in refused.value.message


def test_sdk_sees_a_501_for_several_prompts_in_one_request(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model="m", prompt=[[464, 2068], [464, 2069]], max_tokens=2)
    assert refused.value.status_code == 501
    assert "multi-prompt-batch-unsupported" in refused.value.message


def test_sdk_models_list_and_retrieve_name_the_served_model(client: openai.OpenAI) -> None:
    listed = client.models.list()
    assert [row.id for row in listed.data] == ["smollm2-135m-instruct"]
    assert client.models.retrieve("smollm2-135m-instruct").id == "smollm2-135m-instruct"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_sdk_sees_a_501_for_n_above_one(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="m", messages=ASK, n=2)
    assert refused.value.status_code == 501


# ---- raw HTTP -----------------------------------------------------------------------------------


def test_raw_sse_frames_come_in_order_and_end_with_done(server: Any) -> None:
    body = {"messages": ASK, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    frames = [sse_data(f) for f in response.text.split("\n\n") if f.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = frames[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["lane"] == "batched"


def test_n_above_one_is_a_json_501_even_when_streaming(server: Any) -> None:
    body = {"messages": ASK, "n": 2, "stream": True}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 501
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["code"] == "unsupported_execution"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "invalid JSON body"),
        (b"[]", "invalid JSON body"),
        (b"{}", "messages required"),
        (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}',
         "max_tokens must be of type int"),
    ],
)  # fmt: skip
def test_malformed_bodies_are_openai_shaped_400s(server: Any, raw: bytes, message: str) -> None:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["message"] == message
    assert error["type"] == "invalid_request_error"
    assert {"code", "param"} <= set(error)


def test_closing_a_stream_frees_its_row(server: Any) -> None:
    body = {"messages": ASK, "max_tokens": 500, "stream": True, "temperature": 0.8}
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        deltas = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                deltas += 1
            if deltas >= 3:
                break
    assert wait_until(lambda: stats(server)["batch"]["active_rows"] == 0)
    assert stats(server)["batch"]["pending_rows"] == 0


def test_abandoning_a_json_request_frees_its_row(server: Any) -> None:
    body = {"messages": ASK, "max_tokens": 500, "temperature": 0.8, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1.0)
    assert wait_until(lambda: stats(server)["batch"]["active_rows"] == 0)


# ---- admission on the tight server ---------------------------------------------------------------


def test_a_prompt_that_fills_the_memory_budget_is_a_400_context_length_exceeded(
    tight_server: Any, smollm2: LoadedModel
) -> None:
    limit = stats(tight_server)["admission"]["enforced_context_tokens"]
    prompt = prompt_of(smollm2, limit)
    response = httpx.post(
        f"{tight_server.base_url}/v1/completions", json={"prompt": prompt}, timeout=60
    )
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"This model's maximum context length is {limit} tokens. However, your "
        f"prompt resulted in {limit} tokens. Please reduce the length of the prompt.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }


def test_a_request_over_the_memory_budget_is_clamped_to_the_room_left(
    tight_server: Any, smollm2: LoadedModel
) -> None:
    limit = stats(tight_server)["admission"]["enforced_context_tokens"]
    prompt = prompt_of(smollm2, limit - 4)
    body = {"prompt": prompt, "max_tokens": 1000, "temperature": 0}
    response = httpx.post(f"{tight_server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200
    assert "warning" not in response.headers
    answer = response.json()
    assert answer["usage"]["prompt_tokens"] == limit - 4
    assert answer["usage"]["completion_tokens"] <= 4
    if answer["usage"]["completion_tokens"] == 4:
        assert answer["choices"][0]["finish_reason"] == "length"


def test_a_third_concurrent_request_is_a_429_with_batch_1_and_max_queue_1(
    tight_server: Any,
) -> None:
    statuses: list[int] = []

    def ask() -> None:
        response = httpx.post(f"{tight_server.base_url}/v1/chat/completions", json=HOG, timeout=120)
        statuses.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "queue_full"

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(statuses) == [200, 200, 429]


def test_a_queued_stream_gets_keep_alive_comments_while_it_waits(tight_server: Any) -> None:
    hog = threading.Thread(
        target=httpx.post,
        args=(f"{tight_server.base_url}/v1/chat/completions",),
        kwargs={"json": HOG, "timeout": 120},
    )
    hog.start()
    assert wait_until(lambda: stats(tight_server)["batch"]["active_rows"] == 1)
    body = {"messages": ASK, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.Client(base_url=tight_server.base_url, timeout=120) as http:
        text = http.post("/v1/chat/completions", json=body).text
    hog.join(timeout=120)
    frames = [frame for frame in text.split("\n\n") if frame]
    first_token = next(
        i
        for i, frame in enumerate(frames)
        if frame.startswith("data: {") and sse_data(frame)["choices"][0]["delta"].get("content")
    )
    assert ": keep-alive" in frames[1:first_token]
    assert frames[-1] == "data: [DONE]"


def test_an_engine_that_stops_mid_stream_ends_it_with_one_error_frame(
    smollm2: LoadedModel, live_server: Any
) -> None:
    app = build_serving(smollm2, ServeSettings(), batch=1, max_queue=1)
    server = live_server(app)
    body = {"messages": ASK, "max_tokens": 500, "temperature": 0.8, "stream": True}
    lines: list[str] = []
    with (
        httpx.Client(base_url=server.base_url, timeout=120) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line:
                lines.append(line)
            if len(lines) == 3:
                app.state.stage.engine.close()
    assert sum('"error"' in line for line in lines) == 1
    assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "closed"
    assert "data: [DONE]" not in lines


def prompt_of(model: LoadedModel, num_tokens: int) -> str:
    """A raw prompt that tokenizes to exactly `num_tokens` tokens."""
    words = ["hello"] * num_tokens
    while len(model.tokenizer.encode(" ".join(words))) > num_tokens:
        words.pop()
    prompt = " ".join(words)
    while len(model.tokenizer.encode(prompt)) < num_tokens:
        prompt += " hello"
    assert len(model.tokenizer.encode(prompt)) == num_tokens
    return prompt
