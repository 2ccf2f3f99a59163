"""`modelhost serve`'s arguments, apart from the serving code: every other command parses
them too, and must not import PyTorch and the server to do so."""

from __future__ import annotations

import argparse
import os

from modelhost.models.modes import HELP as QUANTIZE_HELP
from modelhost.models.modes import MODES

PROMPT_ACTIVATIONS = (
    "auto",
    "8",
    "16",
    "bf16",
)  # engine/prompt_activations.py's choices, as spelled

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8080
# As long as Ollama keeps a model by default: an agent waiting on a person or a slow tool finds
# its prompt in memory; the budget takes it back sooner when it needs the room.
DEFAULT_KV_HOLD_S = 300.0


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over OpenAI-compatible HTTP",
        description="Serve local models behind one port, routed by the request body's `model`.",
    )
    parser.add_argument(
        "models", nargs="*", metavar="MODEL",
        help="model ids or paths; the first is current and loads at start (default: SmolLM2); "
        "any local model (see `modelhost ls`) loads when a request's `model` names it",
    )  # fmt: skip
    parser.add_argument(
        "--model-budget", type=float, default=None, metavar="GB",
        help="decimal GB for all resident models (default: 70%% of RAM, or of GPU memory)",
    )  # fmt: skip
    parser.add_argument(
        "--hold", type=float, default=5.0, metavar="S",
        help="seconds a model stays un-evictable after a response ends",
    )  # fmt: skip
    parser.add_argument(
        "--kv-hold", type=float, default=DEFAULT_KV_HOLD_S, metavar="S",
        help="seconds an idle model keeps its whole KV cache in memory after a response (at "
        "least --hold), so an agent's next turn finds its prompt there; given back sooner when "
        "another model or request needs the room (default: %(default)s)",
    )  # fmt: skip
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--workers", dest="workers", action="store_true", default=True,
        help="run each resident model in its own worker process on a private Unix socket "
        "(the default)",
    )  # fmt: skip
    mode.add_argument(
        "--in-process", dest="workers", action="store_false",
        help="load models in the serving process (debugging; tests that need speed)",
    )  # fmt: skip
    parser.add_argument(
        "--no-spare-worker", dest="spare_worker", action="store_false",
        help="keep no spare worker process warm (PyTorch imported) for the next model to load: "
        "saves its memory (a few hundred MB), and every switch then starts Python afresh",
    )  # fmt: skip
    parser.add_argument(
        "--no-fork-server", dest="fork_server", action="store_false",
        help="fork no worker from a warm fork server: every worker and spare starts Python "
        "and imports PyTorch afresh (the fork server needs Linux)",
    )  # fmt: skip
    parser.add_argument(
        "--whisper-resident", action="store_true",
        help="load the Whisper companion at start and pin it (never evicted)",
    )  # fmt: skip
    parser.add_argument(
        "--mmproj", default=None, metavar="FILE",
        help="the first model's vision projector (a llama.cpp mmproj GGUF), where no "
        "mmproj*.gguf sits beside it",
    )  # fmt: skip
    parser.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: loopback)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--batch", type=int, default=8, help="rows decoded together")
    parser.add_argument("--max-queue", type=int, default=64, help="waiting rows before 429")
    parser.add_argument(
        "--memory-budget", type=float, default=None, metavar="GB",
        help="decimal GB for weights + KV + working memory; caps the safe context",
    )  # fmt: skip
    parser.add_argument(
        "--kv-disk", type=float, default=None, metavar="GB",
        help="decimal GB of disk for the prefix KV store under MODELHOST_HOME/kv, which keeps "
        "prompts' KV across model switches and restarts (default: 8, at most a tenth of the "
        "free disk; 0 turns it off)",
    )  # fmt: skip
    parser.add_argument(
        "--context-length", type=int, default=None, metavar="N",
        help="a ceiling on every model's window (default: the largest the model budget holds, "
        "up to the model's trained length)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache", choices=("f16", "q8"), default="f16",
        help="how the KV cache holds keys and values: f16 (default: 16 bits; fp32 with "
        "--quantize none) or q8 (int8 with a scale per token and head: about half the bytes a "
        "token, so twice the context in the same memory)",
    )  # fmt: skip
    parser.add_argument(
        "--context-overflow", choices=("error", "truncate"), default="error",
        help="a prompt that leaves no room to generate: error (default: a 400 in each client's "
        "own words, which coding agents read as a cue to compact) or truncate (drop the oldest "
        "turns, keeping system messages, as Ollama does; for clients that cannot recover). "
        "Ollama's routes trim unless a request says \"truncate\": false",
    )  # fmt: skip
    parser.add_argument("--quantize", choices=MODES, default=None, help=QUANTIZE_HELP)
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N")
    parser.add_argument("--temperature", "--temp", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument(
        "--heartbeat", type=float, default=15.0, metavar="S",
        help="seconds between SSE keep-alive comments on a quiet stream",
    )  # fmt: skip
    parser.add_argument(
        "--shutdown-timeout", type=float, default=10.0, metavar="S",
        help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are cut",
    )  # fmt: skip
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--log-format", choices=("text", "json"), default="text",
        help="one line per request as text, or every log line as a JSON object",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=None, metavar="KEY",
        help="require `Authorization: Bearer KEY` or `x-api-key: KEY` on every route but "
        "/health (default: $MODELHOST_API_KEY; none: open)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", default=None, metavar="PATH",
        help="read the API key from this file (keeps it out of the process list)",
    )  # fmt: skip
    parser.add_argument(
        "--cors-origin", action="append", default=[], metavar="ORIGIN",
        help="a browser origin allowed to call the API (repeatable; e.g. http://localhost:3000)",
    )  # fmt: skip
    parser.add_argument(
        "--image-urls", action="store_true",
        help="fetch http(s) image URLs in requests (10 s and 20 MB at most); off by "
        "default: the server would request whatever a client names (SSRF)",
    )  # fmt: skip
    parser.add_argument(
        "--no-console", action="store_true",
        help="no web console at / (browsers get the same JSON as other clients)",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-mb", type=float, default=None, metavar="MB",
        help="largest request body in MiB; bigger ones get 413 (default: 32)",
    )  # fmt: skip
    # Prompt-heavy steps are large matmuls with nothing else to do in their process: two
    # threads prefilled Gemma 3 at 501 tok/s against 363 with one (SmolLM2 382 against 359).
    parser.add_argument(
        "--prompt-threads", type=int, default=os.cpu_count() or 1,
        help="CPU threads for engine steps that compute many prompt tokens, and for the native "
        "weight kernels of every step (default: all cores)",
    )  # fmt: skip
    # A prompt's linears are bound by integer products: 8-bit activations (llama.cpp's) do half
    # of them; benchmarks/README.md has the speed and the perplexity each costs (docs/engine.md).
    parser.add_argument(
        "--prompt-activations", choices=PROMPT_ACTIVATIONS, default="auto",
        metavar="{auto,8,16,bf16}",
        help="how the linears compute prompt tokens whose logits are not read: 16 (16-bit "
        "activations, every token alike), 8 (one scale each 32 inputs, as llama.cpp: faster "
        "prompts, a little less precise; generated tokens and sampled rows stay at 16), bf16 "
        "(PyTorch's bf16 GEMM, on AMX tiles where the CPU has them), or auto (default: bf16 on "
        "a CPU with AMX for models of hidden size 512 and up; else 8 for quantized weights on "
        "models of hidden size 1536 and up, where it is measured faster; else 16)",
    )  # fmt: skip
    # Where a decode step has spare rows, guessed tokens ride in them for little more than the
    # weights' read (engine/speculation.py); exact either way.
    parser.add_argument(
        "--speculate", choices=("auto", "ngram", "draft", "none"), default="auto",
        help="guess tokens ahead and verify them in one step: auto (from each answer's own "
        "context, else from --draft-model, where a step's measured cost says they pay), ngram "
        "(context guesses for every decoding row), draft (--draft-model's guesses for every "
        "decoding row), none (default: auto; answers are the same either way)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-model", default=None, metavar="ID",
        help="a small local model with the served models' tokenizer that guesses tokens "
        "ahead for them (loaded beside each one and counted in its memory; a model with "
        "another tokenizer is refused when it loads)",
    )  # fmt: skip
    parser.add_argument(
        "--adapter", action="append", default=[], metavar="NAME=PATH",
        help="serve a LoRA adapter of the first model under NAME (repeatable): a PEFT folder "
        "(adapter_config.json + adapter_model.safetensors) or a llama.cpp GGUF LoRA file; "
        "requests name it as their model, its rows share the base's batch",
    )  # fmt: skip
    cluster = parser.add_argument_group("cluster (needs `pip install 'modelhost[cluster]'`)")
    cluster.add_argument(
        "--cluster", default=None, metavar="HEAD:PORT",
        help="serve the models of every node of this Ray cluster (`ray start --head` made it; "
        "`ray start --address HEAD:PORT` joins a machine to it)",
    )  # fmt: skip
    cluster.add_argument(
        "--node-budget", type=float, default=None, metavar="GB",
        help="decimal GB for the models of each node that advertises no modelhost_budget_mb "
        "resource (default: 70%% of its RAM, or of its GPU memory)",
    )  # fmt: skip
    cluster.add_argument(
        "--replicas", action="append", default=[], metavar="MODEL=N",
        help="keep N copies of MODEL on distinct nodes (repeatable)",
    )  # fmt: skip
    cluster.add_argument(
        "--cluster-token-file", default=None, metavar="PATH",
        help="the secret every request to a node's worker carries (a 0600 file; default: one "
        "the cluster's first front made, kept in the cluster's key-value store)",
    )  # fmt: skip
    return parser
