"""The protocol surfaces this server speaks, each in one entry: its routes (which of them the
body's `model` routes, and for what the model must do), its JSON error shape and the frame that
ends its broken streams.

Everything else reads them from here: the app's route table, the leasing middleware's routed
paths, `GET /v1`'s endpoint list, and every refusal written outside a handler (the API key, the
body limits, a model that cannot be leased, a worker that died). Adding a protocol is one folder
beside `openai/` (its handlers and wire format) and one entry in `SURFACES` (CONTRIBUTING.md,
"Adding a protocol surface").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from modelhost.server.anthropic import messages as anthropic_messages
from modelhost.server.anthropic.wire import ANTHROPIC_ERRORS
from modelhost.server.decisions import routes as decisions
from modelhost.server.front.worker_proxy import Forwarded
from modelhost.server.http import ErrorShape, EventStreamResponse
from modelhost.server.ollama import generation as ollama
from modelhost.server.ollama import models as ollama_models
from modelhost.server.ollama import pull as ollama_pull
from modelhost.server.ollama import wire as ollama_wire
from modelhost.server.ollama.wire import OLLAMA_ERRORS
from modelhost.server.openai import audio_routes as audio
from modelhost.server.openai import chat as openai_chat
from modelhost.server.openai import completions as openai_completions
from modelhost.server.openai import discovery
from modelhost.server.openai import embedding_routes as embeddings
from modelhost.server.openai.wire import COMPLETION_ERRORS, OPENAI_ERRORS
from modelhost.server.rerank import routes as rerank
from modelhost.server.responses import routes as openai_responses
from modelhost.server.responses.forwarding import forward_turn
from modelhost.server.responses.wire import RESPONSES_ERRORS

Endpoint = Callable[[Request], Awaitable[Response | EventStreamResponse]]
Forward = Callable[[Scope, bytes], Awaitable[Forwarded]]
KeepAlive = Callable[[bytes], float | None]
ModelNames = Callable[[Any, Callable[[str], bool]], str]
Operation = Literal["generate", "embed", "rerank", "transcribe"]
GENERATE: Operation = "generate"


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # a Starlette path template
    endpoint: Endpoint
    # What the model a body's `model` names must do; None: the route is not model-routed.
    operation: Operation | None = None
    # For a surface that keeps state in the front: how a request a worker serves is forwarded.
    forward: Forward | None = None
    # For a surface whose requests say how long their model stays resident: the seconds a
    # buffered body asks for (below 0: pinned; 0: let go after this response), None if none.
    keep_alive: KeepAlive | None = None
    # An operator action on the server (Ollama's pull): guarded as load and unload are, so a
    # --cors-origin page does not reach it (edge/access.py).
    operator: bool = False


@dataclass(frozen=True, slots=True)
class Surface:
    name: str
    routes: tuple[Route, ...]
    errors: ErrorShape = OPENAI_ERRORS
    # For a surface whose clients name models their own way (Ollama's `name:tag`): the local
    # id a body's `model` means, given which ids are local; it raises a RequestError (404 for
    # an unknown name) where other surfaces fall back to the current model.
    model_names: ModelNames | None = None


class Surfaces:
    """The registry: lookups by path over a sequence of surfaces (the first one's routes first)."""

    def __init__(self, surfaces: Sequence[Surface], default_errors: ErrorShape = OPENAI_ERRORS):
        self.surfaces = tuple(surfaces)
        self.default_errors = default_errors
        self._operations = {
            route.path: route.operation
            for route in self.routes()
            if route.operation is not None and route.method == "POST"
        }
        self._keep_alives = {
            route.path: route.keep_alive
            for route in self.routes()
            if route.keep_alive is not None and route.method == "POST"
        }
        self._model_names = {
            route.path: surface.model_names
            for surface in self.surfaces
            for route in surface.routes
            if surface.model_names is not None and route.method == "POST"
        }
        self._forwards = {
            route.path: route.forward
            for route in self.routes()
            if route.forward is not None and route.method == "POST"
        }
        # A path's errors are those of the surface whose route it extends the most: what
        # precedes a route's first parameter, the longest such prefix first.
        prefixes = {
            route.path.partition("{")[0]: surface.errors
            for surface in self.surfaces
            for route in surface.routes
        }
        self._error_prefixes = sorted(prefixes.items(), key=lambda item: -len(item[0]))

    def routes(self) -> Iterator[Route]:
        for surface in self.surfaces:
            yield from surface.routes

    def operation(self, path: str) -> Operation | None:
        """What the model must do for a POST to `path`; None when `path` is not model-routed."""
        return self._operations.get(path)

    def forward(self, path: str) -> Forward | None:
        """How a POST to `path` is forwarded to a worker, when its surface says (else as it is)."""
        return self._forwards.get(path)

    def keep_alive(self, path: str, body: bytes) -> float | None:
        """The keep-alive a POST to `path` asks for its model, in seconds (None: none)."""
        read = self._keep_alives.get(path)
        return read(body) if read is not None else None

    def model_names(self, path: str) -> ModelNames | None:
        """How a POST to `path` names its model, when its surface has its own way."""
        return self._model_names.get(path)

    def routed_paths(self) -> tuple[str, ...]:
        """The model-routed paths, in registry order (what `GET /v1` lists)."""
        return tuple(self._operations)

    def errors_for(self, path: str) -> ErrorShape:
        """The error shape of the surface `path` belongs to (OpenAI's when it belongs to none)."""
        for prefix, errors in self._error_prefixes:
            if path.startswith(prefix):
                return errors
        return self.default_errors


keep = ollama_wire.keep_alive_of

SURFACES = Surfaces(
    (
        Surface(
            "openai-chat",
            (Route("POST", "/v1/chat/completions", openai_chat.create_chat_completion, GENERATE),),
        ),
        Surface(
            "openai-completions",
            (Route("POST", "/v1/completions", openai_completions.create_completion, GENERATE),),
            COMPLETION_ERRORS,
        ),
        Surface(
            "anthropic-messages",
            (
                Route("POST", "/v1/messages", anthropic_messages.create_message, GENERATE),
                Route(
                    "POST", "/v1/messages/count_tokens", anthropic_messages.count_tokens, GENERATE
                ),
            ),
            ANTHROPIC_ERRORS,
        ),
        Surface(
            "openai-responses",
            (
                Route(
                    "POST",
                    "/v1/responses",
                    openai_responses.create_response,
                    GENERATE,
                    forward=forward_turn,
                ),
                Route("GET", "/v1/responses/{response_id}", openai_responses.retrieve_response),
            ),
            RESPONSES_ERRORS,
        ),
        Surface(
            "openai-embeddings",
            (Route("POST", "/v1/embeddings", embeddings.create_embeddings, "embed"),),
        ),
        Surface(
            "rerank",
            (
                Route("POST", "/v1/rerank", rerank.create_rerank, "rerank"),
                Route("POST", "/rerank", rerank.create_rerank, "rerank"),
            ),
        ),
        Surface(
            "decisions",
            (
                Route("POST", "/v1/decisions", decisions.create_decision, GENERATE),
                Route("POST", "/v1/systemone", decisions.create_systemone, GENERATE),
            ),
        ),
        Surface(
            "openai-audio",
            (
                Route("POST", "/v1/audio/transcriptions", audio.create_transcription, "transcribe"),
                Route("POST", "/v1/audio/translations", audio.create_translation, "transcribe"),
            ),
        ),
        Surface(
            "ollama",
            (
                Route("POST", "/api/chat", ollama.create_chat, GENERATE, keep_alive=keep),
                Route("POST", "/api/generate", ollama.create_generation, GENERATE, keep_alive=keep),
                Route("POST", "/api/embed", ollama_models.embed, "embed", keep_alive=keep),
                Route(
                    "POST", "/api/embeddings", ollama_models.embeddings, "embed", keep_alive=keep
                ),
                Route("POST", "/api/show", ollama_models.show),
                Route("GET", "/api/tags", ollama_models.tags),
                Route("GET", "/api/ps", ollama_models.running),
                Route("GET", "/api/version", ollama_models.version),
                Route("POST", "/api/pull", ollama_pull.pull, operator=True),
                *(
                    Route(
                        "DELETE" if path == "/api/delete" else "POST",
                        path,
                        ollama_models.not_offered,
                    )
                    for path in ollama_models.NOT_OFFERED
                ),
            ),
            OLLAMA_ERRORS,
            model_names=ollama_wire.local_id,
        ),
        Surface(
            "discovery",
            (
                Route("GET", "/v1/models", discovery.list_models),
                Route("GET", "/v1/models/{model_id:path}", discovery.retrieve_model),
                Route("GET", "/v1", discovery.index),
                Route("GET", "/health", discovery.health),
                Route("GET", "/stats", discovery.stats),
            ),
        ),
    )
)
