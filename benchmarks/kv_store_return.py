"""Time to first token of a long prompt, cold and after its model came back, with the prefix KV
store on disk (issue 35, part 1).

    python benchmarks/kv_store_return.py [MODEL] [--prompt-tokens 3000] [--json PATH]
        [--home DIR] [--serve-args "..."]

Starts `modelhost serve MODEL` (worker processes) over a fresh MODELHOST_HOME (the suite's
conversion cache linked in when --home is not given), then, with one streamed chat request each:
1. cold: a prompt of about --prompt-tokens tokens no server has seen;
2. after unload: the model unloaded and loaded again (`POST /api/models/{id}/unload`, then
   `.../load`, timed apart), the same prompt again;
3. after restart: the server stopped and started again on the same home, the same prompt.
Reports each TTFT (client clock, from sending to the first content chunk), prompt tokens and
`cached_tokens`, and the ratios to the cold TTFT; writes JSON (default
benchmarks/results/kv-store-return-<time>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup

from modelhost.bench import prompt_text
from modelhost.paths import modelhost_home

WORDS_PER_TOKEN = 1.0  # bench's words come out near one token each


def start(model: str, home: Path, port: int, log: Path, extra: list[str]) -> ServerTree:
    argv = [sys.executable, "-m", "modelhost", "serve", model, "--port", str(port), *extra]
    tree = ServerTree(argv, {**os.environ, "MODELHOST_HOME": str(home)}, log)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if not tree.alive():
            raise SystemExit(f"the server exited:\n{tree.log_tail()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return tree
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    tree.stop()
    raise SystemExit("the server did not answer")


def current_model(url: str) -> str:
    """The id the server gave the model it was started with (a file's differs from its path)."""
    rows = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return str(next(row["id"] for row in rows if row.get("current")))


def ask(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft = None
    text = ""
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=1800) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    ttft = ttft if ttft is not None else time.perf_counter() - sent
                    text += content
            usage = chunk.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": ttft,
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", 0),
        "text": text,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--home", type=Path, default=None)
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument("--serve-args", default="", help="more `modelhost serve` arguments")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    install_cleanup()
    scratch = Path(tempfile.mkdtemp(prefix="kv-store-return-"))
    home = args.home or scratch / "home"
    home.mkdir(parents=True, exist_ok=True)
    if args.home is None and (modelhost_home() / "cache").exists():
        (home / "cache").symlink_to(modelhost_home() / "cache")
    url = f"http://127.0.0.1:{args.port}"
    rng = random.Random(time.time_ns())
    prompt = prompt_text(int(args.prompt_tokens * WORDS_PER_TOKEN), rng)
    extra = shlex.split(args.serve_args)
    log = scratch / "serve-1.log"
    results: dict[str, Any] = {}
    tree = start(args.model, home, args.port, log, extra)
    try:
        model_id = current_model(url)
        results["cold"] = ask(url, model_id, prompt)
        unloaded = httpx.post(f"{url}/api/models/{model_id}/unload", timeout=120)
        unloaded.raise_for_status()
        # Loaded before it is asked: its TTFT is the prompt's, not the worker's start.
        started = time.perf_counter()
        httpx.post(f"{url}/api/models/{model_id}/load", timeout=900).raise_for_status()
        results["reload_s"] = time.perf_counter() - started
        results["after_unload"] = ask(url, model_id, prompt)
        results["kv_store"] = httpx.get(f"{url}/stats", timeout=30).json().get("kv_store")
    finally:
        tree.stop()
    tree = start(args.model, home, args.port, scratch / "serve-2.log", extra)
    try:
        results["after_restart"] = ask(url, model_id, prompt)
    finally:
        tree.stop()
    cold = results["cold"]["ttft_s"]
    for phase in ("after_unload", "after_restart"):
        ttft = results[phase]["ttft_s"]
        results[phase]["ttft_vs_cold"] = ttft / cold if ttft and cold else None
        results[phase]["same_answer"] = results[phase]["text"] == results["cold"]["text"]
    for phase in ("cold", "after_unload", "after_restart"):
        row = results[phase]
        print(
            f"{phase:14} TTFT {row['ttft_s']:.2f} s  prompt {row['prompt_tokens']}  "
            f"cached {row['cached_tokens']}"
            + (f"  ({row['ttft_vs_cold']:.1%} of cold)" if "ttft_vs_cold" in row else "")
        )
    report = {"model": model_id, "prompt_tokens_asked": args.prompt_tokens, **results}
    path = (
        args.json or Path(__file__).parent / "results" / f"kv-store-return-{int(time.time())}.json"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
