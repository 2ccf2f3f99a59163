"""End to end: the official `ollama` Python client against a real server on 127.0.0.1 serving
every embedded model (SmolLM2, Gemma 3, the MiniLM encoder) behind one port."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import ollama
import pytest
from live_server import LiveServer

from modelhost.assembly import build_stage
from modelhost.models.loaded import LoadedModel
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

SMOL = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"
MINILM = "all-minilm-l6-v2"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def served(
    smollm2: LoadedModel, gemma3: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ResidencyHost[InProcessUnit]]]:
    root = tmp_path_factory.mktemp("ollama")
    registry = ModelRegistry([], home=root / "home", hf_hub=root / "hub")
    loaded = {SMOL: smollm2, GEMMA: gemma3}
    from modelhost.models.loading.loader import load_model

    def load(path: str, progress: Any = None) -> LoadedModel:
        # The session's models where they are loaded already (the encoder loads itself).
        for model_id, model in loaded.items():
            entry = registry.get(model_id)
            if entry is not None and str(entry.path) == path:
                return model
        return load_model(path, progress=progress)

    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=4 << 30,
        source=registry.get,
        load=in_process_loader(load, lambda m: build_stage(m, settings, batch=2)),
    )
    router = ModelRouter(host, registry, current=SMOL)
    with LiveServer(create_routed_app(router, settings)) as server:
        yield server.base_url, host


@pytest.fixture
def client(served: tuple[str, Any]) -> Iterator[ollama.Client]:
    with ollama.Client(host=served[0], timeout=120) as client:
        yield client


def resident(host: ResidencyHost[Any]) -> dict[str, Any]:
    return {m.id: m for m in host.resident() if m.state != "draining"}


# ---------------------------------------------------------------------------------------------
# Models


def test_version_is_a_dotted_number(served: tuple[str, Any]) -> None:
    version = httpx.get(f"{served[0]}/api/version").json()["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)


def test_list_names_every_local_model_with_its_details(client: ollama.Client) -> None:
    models = {m.model: m for m in client.list().models}
    assert {f"{SMOL}:latest", f"{GEMMA}:latest", f"{MINILM}:latest"} <= set(models)
    smol = models[f"{SMOL}:latest"]
    assert smol.details is not None
    assert (smol.details.format, smol.details.family) == ("gguf", "llama")
    assert smol.details.families == ["llama"]
    assert smol.details.quantization_level == "Q4_1"
    assert smol.details.parameter_size == "135M"
    assert smol.size and smol.size > 50_000_000
    assert re.fullmatch(r"[0-9a-f]{64}", smol.digest or "")
    assert smol.modified_at is not None
    assert models[f"{GEMMA}:latest"].details.quantization_level == "Q4_K_M"  # type: ignore[union-attr]


def test_show_says_what_a_chat_model_can_do(client: ollama.Client) -> None:
    shown = client.show(SMOL)
    assert shown.capabilities == ["completion", "tools"]  # no thinking, vision or insert
    assert shown.template and "message" in shown.template
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 8192
    assert shown.modelinfo["general.parameter_count"] > 100_000_000
    assert shown.details is not None and shown.details.family == "llama"


def test_show_says_an_encoder_only_embeds(client: ollama.Client) -> None:
    assert client.show(f"{MINILM}:latest").capabilities == ["embedding"]


def test_show_of_an_unknown_model_is_a_404_naming_it(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.show("llama9:70b")
    assert raised.value.status_code == 404
    assert "llama9:70b" in raised.value.error


# ---------------------------------------------------------------------------------------------
# Chat and generate


def test_chat_streams_the_same_greedy_text_it_answers_whole(client: ollama.Client) -> None:
    whole = client.chat(model=SMOL, messages=ASK, options=GREEDY, stream=False)
    parts = list(client.chat(model=f"{SMOL}:latest", messages=ASK, options=GREEDY, stream=True))
    assert whole.message.content.strip()
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    final = parts[-1]
    assert final.done_reason == whole.done_reason == "length"  # num_predict 4 ran out
    assert final.eval_count == whole.eval_count == 4
    assert final.prompt_eval_count == whole.prompt_eval_count and whole.prompt_eval_count > 5
    for reply in (whole, final):
        assert reply.total_duration and reply.total_duration > 0
        assert reply.eval_duration and reply.eval_duration > 0
        assert reply.prompt_eval_duration is not None and reply.load_duration is not None
        assert reply.total_duration >= reply.eval_duration


def test_generate_streams_and_answers_with_a_system_prompt(client: ollama.Client) -> None:
    kwargs: dict[str, Any] = {"model": SMOL, "prompt": "Name a colour.", "system": "Be brief."}
    whole = client.generate(**kwargs, options=GREEDY)
    parts = list(client.generate(**kwargs, options=GREEDY, stream=True))
    assert whole.response.strip() and whole.done
    assert "".join(p.response for p in parts) == whole.response
    assert parts[-1].done and parts[-1].eval_count == whole.eval_count


def test_generate_raw_sends_the_prompt_without_the_template(client: ollama.Client) -> None:
    templated = client.generate(model=SMOL, prompt="The sky is", options=GREEDY)
    raw = client.generate(model=SMOL, prompt="The sky is", raw=True, options=GREEDY)
    assert raw.prompt_eval_count is not None and templated.prompt_eval_count is not None
    assert raw.prompt_eval_count < templated.prompt_eval_count


def test_the_same_seed_samples_the_same_answer(client: ollama.Client) -> None:
    options = {"temperature": 1.0, "top_p": 0.95, "seed": 7, "num_predict": 8}
    first = client.chat(model=SMOL, messages=ASK, options=options)
    again = client.chat(model=SMOL, messages=ASK, options=options)
    assert first.message.content and first.message.content == again.message.content


def test_logprobs_come_with_each_token_streamed_and_not(client: ollama.Client) -> None:
    asked: dict[str, Any] = {"options": GREEDY, "logprobs": True, "top_logprobs": 3}
    whole = client.chat(model=SMOL, messages=ASK, **asked)
    parts = list(client.chat(model=SMOL, messages=ASK, stream=True, **asked))
    assert whole.logprobs is not None and len(whole.logprobs) == 4
    assert "".join(lp.token for lp in whole.logprobs) == whole.message.content
    for lp in whole.logprobs:
        assert lp.top_logprobs is not None and len(lp.top_logprobs) == 3
        assert lp.logprob == pytest.approx(lp.top_logprobs[0].logprob)  # greedy: the likeliest
    streamed = [lp for p in parts for lp in p.logprobs or []]
    assert [lp.token for lp in streamed] == [lp.token for lp in whole.logprobs]
    assert client.chat(model=SMOL, messages=ASK, options=GREEDY).logprobs is None


def test_options_stop_ends_the_answer_at_the_stop_string(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 24, "stop": ["."]}
    reply = client.chat(model=SMOL, messages=ASK, options=options)
    assert "." not in reply.message.content
    assert reply.done_reason == "stop"


def test_a_json_schema_format_is_followed(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    reply = client.chat(
        model=SMOL, messages=ASK, format=schema, options={"temperature": 0, "num_predict": 64}
    )
    answer = json.loads(reply.message.content)
    assert set(answer) == {"city", "country"}


def test_format_json_gives_a_json_object(client: ollama.Client) -> None:
    reply = client.generate(
        model=SMOL,
        prompt="A city and its country as JSON.",
        format="json",
        options={"temperature": 0, "num_predict": 64},
    )
    assert isinstance(json.loads(reply.response), dict)


# ---------------------------------------------------------------------------------------------
# keep_alive


def test_keep_alive_minus_one_pins_the_model(client: ollama.Client, served: Any) -> None:
    client.chat(model=GEMMA, messages=ASK, options=GREEDY, keep_alive=-1)
    assert resident(served[1])[GEMMA].pinned
    [row] = [m for m in client.ps().models if m.model == f"{GEMMA}:latest"]
    assert row.expires_at is not None and row.expires_at.year == 9999
    assert row.size_vram == 0 and row.size and row.size > 0


def test_keep_alive_duration_holds_the_model_that_long(client: ollama.Client, served: Any) -> None:
    client.generate(model=GEMMA, prompt="Hi", options=GREEDY, keep_alive="10m")
    model = resident(served[1])[GEMMA]
    assert not model.pinned and model.hold_s == 600
    [row] = [m for m in client.ps().models if m.model == f"{GEMMA}:latest"]
    assert row.expires_at is not None
    left = row.expires_at - datetime.now(UTC)
    assert timedelta(minutes=9) < left <= timedelta(minutes=10)


def test_keep_alive_zero_with_an_empty_prompt_unloads_the_model(
    client: ollama.Client, served: Any
) -> None:
    client.generate(model=GEMMA, prompt="Hi", options=GREEDY, keep_alive=-1)
    reply = client.generate(model=GEMMA, keep_alive=0)
    assert reply.done and reply.done_reason == "unload" and reply.response == ""
    for _ in range(200):  # the drain runs after the response has ended
        if GEMMA not in resident(served[1]):
            break
        time.sleep(0.05)
    assert GEMMA not in resident(served[1])
    assert f"{GEMMA}:latest" not in [m.model for m in client.ps().models]


def test_load_duration_counts_loading_a_model_that_was_not_resident(
    client: ollama.Client, served: Any
) -> None:
    client.generate(model=GEMMA, keep_alive=0)
    for _ in range(200):  # the drain runs after the response has ended
        if GEMMA not in resident(served[1]):
            break
        time.sleep(0.05)
    reply = client.generate(model=GEMMA, prompt="Hi", options=GREEDY)
    unit = served[1].peek(GEMMA)
    assert unit is not None and unit.load_ms > 0
    assert reply.load_duration is not None and reply.load_duration >= unit.load_ms * 1_000_000
    assert reply.total_duration is not None and reply.total_duration >= reply.load_duration


def test_keep_alive_zero_with_a_prompt_answers_then_unloads_the_model(
    client: ollama.Client, served: Any
) -> None:
    reply = client.generate(model=GEMMA, prompt="Hi", options=GREEDY, keep_alive=0)
    assert reply.done and reply.eval_count == 4 and reply.response
    for _ in range(200):  # the drain runs after the response has ended
        if GEMMA not in resident(served[1]):
            break
        time.sleep(0.05)
    assert GEMMA not in resident(served[1])


def test_an_empty_chat_loads_the_model(client: ollama.Client, served: Any) -> None:
    reply = client.chat(model=GEMMA, messages=[])
    assert reply.done and reply.done_reason == "load"
    assert GEMMA in resident(served[1])


# ---------------------------------------------------------------------------------------------
# Embeddings


def test_embed_answers_unit_vectors_for_each_input(client: ollama.Client) -> None:
    reply = client.embed(model=MINILM, input=["A cat sat.", "Stocks fell."])
    assert len(reply.embeddings) == 2
    for vector in reply.embeddings:
        assert len(vector) == 384
        assert math.isclose(math.sqrt(sum(x * x for x in vector)), 1.0, abs_tol=1e-4)
    assert reply.prompt_eval_count and reply.prompt_eval_count > 2


def test_the_older_embeddings_route_answers_one_vector(client: ollama.Client) -> None:
    one = client.embeddings(model=f"{MINILM}:latest", prompt="A cat sat.")
    both = client.embed(model=MINILM, input="A cat sat.")
    assert max(abs(a - b) for a, b in zip(one.embedding, both.embeddings[0], strict=True)) < 1e-5


# ---------------------------------------------------------------------------------------------
# Refusals, in Ollama's shape


def test_chat_with_an_unknown_model_is_a_404_naming_it(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.chat(model="mistral:7b", messages=ASK)
    assert raised.value.status_code == 404 and "mistral:7b" in raised.value.error


def test_a_bad_json_body_is_a_400_in_ollamas_shape(served: Any) -> None:
    response = httpx.post(f"{served[0]}/api/chat", content=b"{not json")
    assert response.status_code == 400
    assert set(response.json()) == {"error"}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"options": {"temperature": "hot"}}, "temperature"),
        ({"options": "hot"}, "options"),
        ({"keep_alive": "soon"}, "keep_alive"),
        ({"format": "yaml"}, "format"),
        ({"messages": "hi"}, "messages"),
        ({"think": True}, "thinking"),
        ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
        ({"options": {"mirostat": 2}}, "mirostat"),
    ],
)
def test_bad_chat_fields_are_400s_that_name_them(
    served: Any, body: dict[str, Any], words: str
) -> None:
    request = {"model": SMOL, "messages": ASK, "stream": False, **body}
    response = httpx.post(f"{served[0]}/api/chat", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"suffix": "end"}, "insert"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"context": [1, 2, 3]}, "context"),
    ],
)
def test_generate_refuses_what_it_cannot_honour(
    served: Any, body: dict[str, Any], words: str
) -> None:
    request = {"model": SMOL, "prompt": "Hi", "stream": False, **body}
    response = httpx.post(f"{served[0]}/api/generate", json=request, timeout=60)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]


def test_embedding_with_an_unknown_model_is_a_404_naming_it(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.embed(model="nomic-embed-text", input="hi")
    assert raised.value.status_code == 404 and "nomic-embed-text" in raised.value.error


def test_embedding_with_a_chat_model_is_a_400(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.embed(model=SMOL, input="hi")
    assert raised.value.status_code == 400


def test_pulling_an_ollama_library_name_is_a_400_asking_for_a_hub_repo(
    client: ollama.Client,
) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.pull("llama3.2")
    assert raised.value.status_code == 400 and "USER/REPO[:QUANT]" in raised.value.error


def test_push_is_not_offered(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.push("smollm2-135m-instruct")
    assert raised.value.status_code == 501 and "not offered" in raised.value.error


def test_an_unknown_model_in_a_stream_is_refused_before_it_opens(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        list(client.generate(model="nope", prompt="hi", stream=True))
    assert raised.value.status_code == 404


def test_show_of_a_local_model_that_cannot_chat_or_embed_says_why(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client.show("whisper-base")  # a transcriber: listed by `modelhost ls` where it is local
    if raised.value.status_code == 404:
        pytest.skip("no local Whisper model on this machine")
    assert raised.value.status_code == 400 and "cannot be served" in raised.value.error
