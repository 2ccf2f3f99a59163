"""Companion models: encoders and transcribers are routed by what the path needs, refused for
what they cannot do, and leased like any model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import LiveServer
from routed_world import FakeRegistry

from modelhost.assembly import build_stage
from modelhost.audio.whisper_files import WHISPER_BASE
from modelhost.models.loading.embedded import EMBEDDING_MODEL
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelEntry, ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress, ResidencyError
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings

ENGLISH = Path(__file__).resolve().parents[1] / "fixtures" / "audio" / "deliver-umbrellas.en.ogg"


def entry(model_id: str, *operations: str) -> ModelEntry:
    path = Path(f"/models/{model_id}")
    return ModelEntry(model_id, path, "safetensors", "x", 1, 1, 1, operations=operations)


def router_over(*entries: ModelEntry, current: str = "chat") -> ModelRouter:
    registry = FakeRegistry({e.id: e for e in entries})

    async def never(entry: ModelEntry, progress: LoadProgress) -> None:
        raise AssertionError("routing loads nothing")

    host: ResidencyHost = ResidencyHost(budget_bytes=10, source=registry.get, load=never)
    return ModelRouter(host, registry, current)


CHAT = entry("chat", "generate")
ENCODER = entry("minilm", "embed")
WHISPER = entry("whisper-base", "transcribe")


def test_embeddings_that_name_no_local_model_go_to_the_first_local_encoder():
    router = router_over(CHAT, ENCODER, WHISPER)
    for named in (None, "text-embedding-3-small"):
        assert router.route(named, "embed") == "minilm"
    assert router.route("minilm", "embed") == "minilm"


def test_transcriptions_go_to_the_local_whisper_model_whatever_the_client_calls_it():
    router = router_over(CHAT, ENCODER, WHISPER)
    assert router.route("whisper-1", "transcribe") == "whisper-base"
    assert router.route(None, "transcribe") == "whisper-base"


def test_a_chat_model_named_for_embeddings_is_refused_with_the_reference_message():
    router = router_over(CHAT, ENCODER)
    with pytest.raises(ResidencyError) as refused:
        router.route("chat", "embed")
    assert refused.value.code == "wrong-operation"
    assert refused.value.message.startswith('served model "chat" is not an embedding model')


def test_an_encoder_named_for_chat_is_refused():
    router = router_over(CHAT, ENCODER)
    with pytest.raises(ResidencyError) as refused:
        router.route("minilm", "generate")
    assert "serves /v1/embeddings only" in refused.value.message


def test_transcription_without_a_local_whisper_model_is_refused():
    router = router_over(CHAT, ENCODER)
    with pytest.raises(ResidencyError) as refused:
        router.route("whisper-1", "transcribe")
    assert "no transcription model is installed" in refused.value.message


def test_chat_naming_no_local_model_still_goes_to_the_current_model():
    router = router_over(CHAT, ENCODER, WHISPER)
    assert router.route("gpt-4", "generate") == "chat"
    assert router.route(None, "generate") == "chat"


@contextmanager
def routed_server(models_dir: Path, home: Path, budget: Callable[[ModelRegistry], int]) -> Any:
    """tiny-a (current), the other tiny model and the embedded models, in-process."""
    registry = ModelRegistry(
        [models_dir], home=home / "home", hf_hub=home / "hub", shape=ServingShape(batch=2)
    )
    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=budget(registry),
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=2)),
    )
    router = ModelRouter(host, registry, current="tiny-a")
    with LiveServer(create_routed_app(router, settings)) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        yield {"client": client, "host": host, "url": server.base_url}
        client.close()
    assert host.resident() == []


def room_for_one(registry: ModelRegistry) -> int:
    """Room for the encoder's estimate, not for it beside a loaded tiny-a (weights and KV)."""
    encoder, tiny = registry.get(EMBEDDING_MODEL), registry.get("tiny-a")
    return encoder.estimate_bytes + tiny.weights_bytes // 2


@pytest.fixture
def served_with_encoder(models_dir, tmp_path) -> Iterator[dict[str, Any]]:
    with routed_server(models_dir, tmp_path, room_for_one) as served:
        yield served


@pytest.mark.slow
def test_the_encoder_is_leased_listed_and_evicted_like_any_model(served_with_encoder):
    client, host = served_with_encoder["client"], served_with_encoder["host"]
    client.chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert [m.id for m in host.resident()] == ["tiny-a"]
    vectors = client.embeddings.create(model="text-embedding-3-small", input=["a cat", "a dog"])
    assert vectors.model == EMBEDDING_MODEL and len(vectors.data[0].embedding) == 384
    assert [m.id for m in host.resident()] == [EMBEDDING_MODEL]  # the budget held one: swapped
    rows = {row.id: row.model_dump() for row in client.models.list().data}
    assert rows[EMBEDDING_MODEL]["embeddings"] is True
    assert rows[EMBEDDING_MODEL]["resident"] is True
    assert rows[EMBEDDING_MODEL]["capabilities"]["chat_completions"] is False
    stats = httpx.get(f"{served_with_encoder['url']}/stats").json()["models"]
    assert [m["id"] for m in stats["resident"]] == [EMBEDDING_MODEL]


@pytest.mark.slow
def test_a_chat_model_asked_for_embeddings_is_refused_before_anything_loads(served_with_encoder):
    client, host = served_with_encoder["client"], served_with_encoder["host"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="tiny-a", input="hello")
    assert 'served model "tiny-a" is not an embedding model' in str(refused.value)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=EMBEDDING_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    assert "serves /v1/embeddings only" in str(refused.value)
    assert host.resident() == []


@pytest.mark.slow
def test_transcriptions_lease_the_whisper_companion_listed_last(models_dir, tmp_path):
    with routed_server(models_dir, tmp_path, lambda registry: 10**12) as served:
        client, host = served["client"], served["host"]
        client.chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        with ENGLISH.open("rb") as audio:
            text = client.audio.transcriptions.create(model="whisper-1", file=audio).text
        assert "umbrellas" in text.lower()
        assert WHISPER_BASE in [m.id for m in host.resident()]
        rows = [row.model_dump() for row in client.models.list().data]
        assert rows[0]["id"] == "tiny-a" and rows[0]["capabilities"]["transcription"] is True
        assert rows[-1]["id"] == WHISPER_BASE and rows[-1]["transcription"] is True
        assert rows[-1]["resident"] is True


async def test_a_chat_model_named_in_an_audio_form_is_refused_before_anything_loads():
    app = create_routed_app(router_over(CHAT, WHISPER), ServeSettings())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        reply = await client.post(
            "/v1/audio/transcriptions",
            data={"model": "chat"},
            files={"file": ("a.ogg", b"OggS", "audio/ogg")},
        )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert (
        error["param"] == "model"
        and 'model "chat" is not a transcription model' in error["message"]
    )
