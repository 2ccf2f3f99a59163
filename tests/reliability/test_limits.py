"""Request limits: the body cap (413), JSON nesting and size caps (400), media caps (400), and
`model` values that name paths never reach the disk."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from reliability_support import HELLO, AppFactory, ClientFactory
from scripted_engine import ScriptedEngine, scripted_model

from modelhost.inference.stage import InferenceStage
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit
from modelhost.residency.registry import ModelEntry, ModelRegistry
from modelhost.residency.router import ModelRouter
from modelhost.residency.unit import LoadProgress
from modelhost.server.app import create_routed_app
from modelhost.server.edge.limits import BodyLimits, json_shape_problem
from modelhost.server.settings import ServeSettings
from modelhost.server.surfaces import SURFACES

KiB = 1024


async def test_a_body_over_the_cap_gets_413_in_the_callers_protocol_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_body_bytes=4 * KiB))
    big = {**HELLO, "messages": [{"role": "user", "content": "x" * 8 * KiB}]}
    openai_answer = await client.post("/v1/chat/completions", json=big)
    assert openai_answer.status_code == 413
    assert openai_answer.json()["error"]["code"] == "request_too_large"
    anthropic_answer = await client.post("/v1/messages", json={**big, "max_tokens": 8})
    assert anthropic_answer.status_code == 413
    assert anthropic_answer.json()["type"] == "error"
    assert anthropic_answer.json()["error"]["type"] == "request_too_large"


async def test_a_body_under_the_cap_is_served(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_body_bytes=4 * KiB))
    assert (await client.post("/v1/chat/completions", json=HELLO)).status_code == 200


class Recorder:
    """An ASGI peer: serves a body in chunks, collects what the app sends back."""

    def __init__(self, chunks: int, chunk_bytes: int) -> None:
        self.left, self.chunk = chunks, b"x" * chunk_bytes
        self.received = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.received += 1
        self.left -= 1
        return {"type": "http.request", "body": self.chunk, "more_body": self.left > 0}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return int(self.sent[0]["status"])


def scope_for(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    path = "/v1/chat/completions"
    return {"type": "http", "method": "POST", "path": path, "headers": headers}


async def never_called(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the app must not see a refused body")


async def test_a_declared_length_over_the_cap_is_refused_before_reading_a_byte() -> None:
    peer = Recorder(chunks=1, chunk_bytes=1)
    limits = BodyLimits(never_called, SURFACES, max_body_bytes=1000)
    await limits(scope_for([(b"content-length", b"5000000")]), peer.receive, peer.send)
    assert peer.status == 413
    assert peer.received == 0


async def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap() -> None:
    peer = Recorder(chunks=1000, chunk_bytes=100)
    limits = BodyLimits(never_called, SURFACES, max_body_bytes=1000)
    await limits(scope_for([]), peer.receive, peer.send)
    assert peer.status == 413
    assert peer.received == 11  # 1,100 bytes: one chunk past the cap, and no more


async def test_a_deeply_nested_body_gets_400_not_a_parser_crash(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app())
    bomb = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await client.post("/v1/chat/completions", content=bomb)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "json_too_complex"
    assert "deeper than 64" in error["message"]


async def test_a_body_with_too_many_values_gets_400(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_json_values=1000))
    body = {**HELLO, "stop": ["s"] * 2000}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "json_too_complex"


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = b'{"content": "' + b"[[[[{{{{" * 100 + b'", "escaped": "\\"[[[["}'
    assert json_shape_problem(text, max_depth=4, max_values=100) is None


def test_nesting_past_the_depth_is_found_without_parsing() -> None:
    assert json_shape_problem(b"[" * 65, max_depth=64, max_values=1000) is not None
    assert json_shape_problem(b"[" * 64 + b"]" * 64, max_depth=64, max_values=1000) is None


def data_url(num_bytes: int, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(b"\0" * num_bytes).decode()


async def test_an_inline_image_over_its_cap_gets_400_image_too_large(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_image_bytes=10 * KiB))
    part = {"type": "image_url", "image_url": {"url": data_url(20 * KiB)}}
    body = {**HELLO, "messages": [{"role": "user", "content": [part]}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "image_too_large"


async def test_an_anthropic_base64_image_over_its_cap_gets_400_in_anthropic_shape(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_image_bytes=10 * KiB))
    data = base64.b64encode(b"\0" * 20 * KiB).decode()
    source = {"type": "base64", "media_type": "image/png", "data": data}
    content = [{"type": "image", "source": source}, {"type": "text", "text": "what is it?"}]
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": content}]}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "image_too_large"


async def test_inline_audio_over_its_cap_gets_400_audio_too_large(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_audio_bytes=10 * KiB))
    audio = {"data": base64.b64encode(b"\0" * 20 * KiB).decode(), "format": "wav"}
    part = {"type": "input_audio", "input_audio": audio}
    body = {**HELLO, "messages": [{"role": "user", "content": [part]}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "audio_too_large"


async def test_media_under_its_cap_reaches_the_models_own_check(
    make_app: AppFactory, client_of: ClientFactory
) -> None:
    client = client_of(make_app(max_image_bytes=10 * KiB))
    part = {"type": "image_url", "image_url": {"url": data_url(1 * KiB)}}
    body = {**HELLO, "messages": [{"role": "user", "content": [part]}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "model has no vision sidecar"


# ---------------------------------------------------------------------------------------------
# Model ids that look like paths


CURRENT = "current-model"


@dataclass
class RegistryWithCurrent:
    """The real registry over `models`, plus one startup entry that needs no file."""

    disk: ModelRegistry
    current: ModelEntry

    def get(self, model_id: str) -> ModelEntry | None:
        return self.current if model_id == self.current.id else self.disk.get(model_id)

    def entries(self) -> list[ModelEntry]:
        return [self.current, *self.disk.entries()]


@pytest.fixture
def escaping_world(tmp_path: Path) -> dict[str, Any]:
    """A routed app over a real registry whose models folder holds only a symlink to a model
    file outside it (`outside/real.gguf`); loads are recorded, each a scripted engine."""
    outside = tmp_path / "outside"
    outside.mkdir()
    real = outside / "real.gguf"
    real.write_bytes(b"GGUF")
    models = tmp_path / "models"
    models.mkdir()
    (models / "escape.gguf").symlink_to(real)
    disk = ModelRegistry([models], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False)
    current = ModelEntry(CURRENT, tmp_path / "current", "safetensors", "llama", 1, 1, 1)
    registry = RegistryWithCurrent(disk, current)
    loads: list[str] = []

    async def load(entry: Any, progress: LoadProgress) -> InProcessUnit:
        loads.append(entry.id)
        return InProcessUnit(InferenceStage(ScriptedEngine(), scripted_model(entry.id)))

    host: ResidencyHost[Any] = ResidencyHost(budget_bytes=10**12, source=registry.get, load=load)
    router = ModelRouter(host, registry, current=CURRENT)
    app = create_routed_app(router, ServeSettings())
    return {"app": app, "loads": loads, "registry": registry, "real": real}


@pytest.mark.parametrize(
    "model",
    ["../../etc/passwd", "/etc/passwd", "escape", "../outside/real", "models/escape.gguf"],
)
async def test_a_model_that_names_a_path_loads_nothing_and_the_current_model_answers(
    escaping_world: dict[str, Any], client_of: ClientFactory, model: str
) -> None:
    client = client_of(escaping_world["app"])
    body = {**HELLO, "model": model}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert response.json()["model"] == CURRENT
    assert escaping_world["loads"] == [CURRENT]
    assert escaping_world["registry"].get(model) is None


async def test_an_absolute_path_to_a_real_model_file_is_not_a_model_id(
    escaping_world: dict[str, Any], client_of: ClientFactory
) -> None:
    client = client_of(escaping_world["app"])
    body = {**HELLO, "model": str(escaping_world["real"])}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.json()["model"] == CURRENT
    assert escaping_world["loads"] == [CURRENT]


def test_a_symlink_out_of_the_models_folder_is_not_a_local_model(
    escaping_world: dict[str, Any],
) -> None:
    assert [entry.id for entry in escaping_world["registry"].entries()] == [CURRENT]


async def test_a_nesting_bomb_is_refused_before_model_routing_parses_it(
    escaping_world: dict[str, Any], client_of: ClientFactory
) -> None:
    client = client_of(escaping_world["app"])
    bomb = b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    response = await client.post("/v1/chat/completions", content=bomb)
    assert response.status_code == 400
    assert escaping_world["loads"] == []
