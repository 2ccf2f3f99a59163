"""What `modelhost serve` tells the app: HTTP, admission and sampling defaults, the edge.

The command line reads them (`modelhost.serve_config`); a worker process gets the same ones
from its parent, less the API key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelhost.inference.defaults import ServingDefaults
from modelhost.inference.images import ImageLimits
from modelhost.inference.media import DEFAULT_MAX_AUDIO_BYTES, DEFAULT_MAX_IMAGE_BYTES
from modelhost.server.edge.limits import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_JSON_DEPTH,
    DEFAULT_MAX_JSON_VALUES,
)


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """What `modelhost serve` decides about HTTP, admission and defaults."""

    heartbeat_s: float = 15.0
    memory_budget_gb: float | None = None
    # The residency budget (--model-budget, default 70% of memory): a model's default window is
    # the largest it holds, up to the trained length (assembly.served_window). None: trained.
    model_budget_bytes: int | None = None
    kv_cache: str = "f16"  # --kv-cache: f16 or q8 (engine/kv/kv_format.py)
    context_length: int | None = None  # --context-length: a ceiling below the model's window
    context_overflow: str = "error"  # --context-overflow: refuse a prompt too long, or trim it
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    chunk_tokens: int = 512  # the engine's max_num_batched_tokens (sizes working memory)
    prompt_threads: int | None = None  # --prompt-threads: the engine's prompt-heavy steps
    # --prompt-activations: 8 rounds unread prompt rows to 8 bits, auto where it pays
    prompt_activations: int | str = "auto"
    kv_disk_bytes: int = 0  # --kv-disk: the prefix KV store's budget (0: off)
    # --kv-hold (at least --hold): an idle engine keeps its whole KV pool this long, unless the
    # residency host asks for the room first (engine.py's idle_hold_s)
    kv_hold_s: float = 0.0
    speculate: str = "auto"  # --speculate: the engine's guessing ahead (engine/speculation.py)
    # --draft-model, resolved: the draft's id and its path (a .gguf file or a model folder).
    draft_model_id: str | None = None
    draft_model_path: str | None = None
    # --adapter NAME=PATH, each with the model it adapts: (name, base model id, path). A unit
    # gets its own base's (residency/adapter_catalog.py), the front all of them.
    adapters: tuple[tuple[str, str, str], ...] = ()
    owner: str = "serve"
    close_engine_on_shutdown: bool = True
    # The edge (server/edge/access.py): the bind address the Host guard accepts, the API key
    # (None: open), browser origins allowed through CORS and the guard, and request limits.
    host: str = "127.0.0.1"
    api_key: str | None = field(default=None, repr=False)
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    max_json_values: int = DEFAULT_MAX_JSON_VALUES
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    image_urls: bool = False  # --image-urls: fetch http(s) image URLs (off: no SSRF)
    max_audio_bytes: int = DEFAULT_MAX_AUDIO_BYTES
    log_format: str = "text"  # or "json": one JSON object per log line
    console: bool = True  # the web page at `/` (observability/console.py); --no-console: JSON only

    @property
    def images(self) -> ImageLimits:
        return ImageLimits(max_bytes=self.max_image_bytes, fetch_urls=self.image_urls)

    @property
    def defaults(self) -> ServingDefaults:
        return ServingDefaults(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
