"""A load generator for any OpenAI-compatible server: streamed chat completions from N
concurrent clients, timed per token.

For each concurrency level it sends `requests` streaming requests (at least one per client)
and measures, from the client's side:
- TTFT: request sent to first content token;
- inter-token latency (ITL): the gaps between content tokens of one stream, pooled;
- per-stream decode rate: (tokens - 1) / (last token - first token), averaged over streams;
- aggregate throughput: all completion tokens of the level / the level's wall time.
Prompts are ~`prompt_tokens` tokens of plain words, calibrated against the server's own
`usage.prompt_tokens` with two warm-up requests, and drawn afresh per request so no two share a
cached prefix. `ignore_eos` asks the server to generate all `max_tokens` (llama-server, vLLM
and modelhost accept it). Used by `modelhost bench` and by the `bench-serve` job.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

# Common English words: about one token each in most vocabularies.
_WORD_TEXT = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point number group problem fact water room mother area money story month lot right "
    "study book job word issue side kind head house service friend father power hour game line "
    "end member law car city name team minute idea kid body back parent face level office door "
    "health art war history party result change morning reason research girl guy moment air"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class BenchConfig:
    url: str  # the server's base URL, with or without /v1
    concurrency: tuple[int, ...] = (1, 4, 8)
    prompt_tokens: int = 128
    max_tokens: int = 64
    requests: int | None = None  # per level; None: one per client
    ignore_eos: bool = True
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass(slots=True)
class StreamTiming:
    """One request as the client saw it."""

    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive content tokens
    tokens: int = 0  # completion tokens (usage when the server sends it, else content chunks)
    prompt_tokens: int | None = None
    total_s: float = 0.0
    error: str | None = None

    @property
    def decode_tps(self) -> float | None:
        span = sum(self.gaps_s)
        return len(self.gaps_s) / span if span > 0 else None


@dataclass(frozen=True, slots=True)
class LevelResult:
    concurrency: int
    requests: int
    ok: int
    errors: list[str]
    prompt_tokens: float | None  # mean, as the server counted
    completion_tokens: int
    wall_s: float
    ttft_ms_p50: float | None
    ttft_ms_p95: float | None
    itl_ms_p50: float | None
    itl_ms_p95: float | None
    stream_tps: float | None  # mean per-stream decode rate
    aggregate_tps: float  # completion tokens per second of wall time, all streams together

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class BenchReport:
    config: BenchConfig
    prompt_words: int
    levels: list[LevelResult]

    def as_json(self) -> dict[str, Any]:
        config = asdict(self.config)
        config.pop("api_key", None)
        config["concurrency"] = list(self.config.concurrency)
        return {
            "config": config,
            "prompt_words": self.prompt_words,
            "levels": [level.as_json() for level in self.levels],
        }


def chat_url(url: str) -> str:
    base = url.rstrip("/")
    if base.endswith("/chat/completions"):
        return base
    if not base.endswith("/v1"):
        base += "/v1"
    return base + "/chat/completions"


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank-interpolated percentile (`q` in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def prompt_text(words: int, rng: random.Random) -> str:
    picked = [rng.choice(_WORDS) for _ in range(max(1, words))]
    return " ".join(picked)


def _body(config: BenchConfig, prompt: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.model:
        body["model"] = config.model
    return body


async def stream_once(
    client: httpx.AsyncClient, config: BenchConfig, prompt: str, max_tokens: int
) -> StreamTiming:
    """One streamed chat completion, timed at every content chunk."""
    timing = StreamTiming()
    started = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream(
            "POST", chat_url(config.url), json=_body(config, prompt, max_tokens)
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:200]
                timing.error = f"HTTP {response.status_code}: {detail}"
                return timing
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("error"):
                    timing.error = str(payload["error"].get("message", payload["error"]))
                    return timing
                usage = payload.get("usage")
                if usage:
                    timing.tokens = int(usage.get("completion_tokens") or 0)
                    timing.prompt_tokens = usage.get("prompt_tokens")
                for choice in payload.get("choices") or ():
                    delta = choice.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        now = time.perf_counter()
                        if last is None:
                            timing.ttft_s = now - started
                        else:
                            timing.gaps_s.append(now - last)
                        last = now
                        chunks += 1
    except (httpx.HTTPError, ValueError) as exc:
        timing.error = f"{type(exc).__name__}: {exc}"
        return timing
    timing.total_s = time.perf_counter() - started
    if not timing.tokens:
        timing.tokens = chunks
    return timing


async def run_level(
    client: httpx.AsyncClient, config: BenchConfig, concurrency: int, prompt_words: int, seed: int
) -> LevelResult:
    """`concurrency` clients draining one shared count of requests."""
    total = max(config.requests or concurrency, concurrency)
    remaining = iter(range(total))
    timings: list[StreamTiming] = []

    async def client_loop() -> None:
        for index in remaining:
            rng = random.Random(seed * 100_003 + index)
            prompt = prompt_text(prompt_words, rng)
            timings.append(await stream_once(client, config, prompt, config.max_tokens))

    started = time.perf_counter()
    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    wall_s = time.perf_counter() - started
    return summarize(concurrency, timings, wall_s)


def summarize(concurrency: int, timings: list[StreamTiming], wall_s: float) -> LevelResult:
    ok = [t for t in timings if t.error is None]
    ttfts = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    gaps = [gap * 1000 for t in ok for gap in t.gaps_s]
    rates = [rate for t in ok if (rate := t.decode_tps) is not None]
    prompts = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    tokens = sum(t.tokens for t in ok)
    return LevelResult(
        concurrency=concurrency,
        requests=len(timings),
        ok=len(ok),
        errors=sorted({t.error for t in timings if t.error is not None}),
        prompt_tokens=statistics.fmean(prompts) if prompts else None,
        completion_tokens=tokens,
        wall_s=wall_s,
        ttft_ms_p50=percentile(ttfts, 50),
        ttft_ms_p95=percentile(ttfts, 95),
        itl_ms_p50=percentile(gaps, 50),
        itl_ms_p95=percentile(gaps, 95),
        stream_tps=statistics.fmean(rates) if rates else None,
        aggregate_tps=tokens / wall_s if wall_s > 0 else 0.0,
    )


async def calibrate(client: httpx.AsyncClient, config: BenchConfig) -> int:
    """Words per prompt for ~`prompt_tokens` tokens, template included: two warm-up requests
    (one word, then `prompt_tokens` words) give the template's overhead and tokens per word.
    The word count itself when the server reports no usage."""
    words = config.prompt_tokens
    counts = []
    for size in (1, words):
        timing = await stream_once(client, config, prompt_text(size, random.Random(-size)), 1)
        if timing.error is not None:
            raise BenchError(f"warm-up request failed: {timing.error}")
        counts.append(timing.prompt_tokens)
    one, many = counts
    if not one or not many or words < 2 or many <= one:
        return words
    per_word = (many - one) / (words - 1)
    overhead = one - per_word
    return max(1, round((config.prompt_tokens - overhead) / per_word))


class BenchError(RuntimeError):
    """The server refused the warm-up request: nothing would be measured."""


async def run_bench(
    config: BenchConfig, on_level: Callable[[LevelResult], None] | None = None
) -> BenchReport:
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=max(config.concurrency) + 4)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        words = await calibrate(client, config)
        levels: list[LevelResult] = []
        for seed, concurrency in enumerate(config.concurrency, start=1):
            level = await run_level(client, config, concurrency, words, seed)
            levels.append(level)
            if on_level is not None:
                on_level(level)
    return BenchReport(config, words, levels)


def _cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(report: BenchReport) -> str:
    """One line per concurrency level; times in milliseconds, rates in tokens per second."""
    header = (
        "conc", "reqs", "ok", "prompt", "ttft p50", "ttft p95", "itl p50", "itl p95",
        "tok/s/stream", "tok/s total",
    )  # fmt: skip
    rows = [header]
    for level in report.levels:
        rows.append(
            (
                str(level.concurrency),
                str(level.requests),
                str(level.ok),
                _cell(level.prompt_tokens, 0),
                _cell(level.ttft_ms_p50),
                _cell(level.ttft_ms_p95),
                _cell(level.itl_ms_p50),
                _cell(level.itl_ms_p95),
                _cell(level.stream_tps),
                _cell(level.aggregate_tps),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
             for row in rows]  # fmt: skip
    config = report.config
    title = (
        f"{config.url}  model={config.model or '(default)'}  prompt~{config.prompt_tokens} tok  "
        f"max_tokens={config.max_tokens}  ignore_eos={config.ignore_eos}"
    )
    errors = [f"  c={lv.concurrency}: {e}" for lv in report.levels for e in lv.errors]
    return "\n".join([title, *lines, *(["errors:", *errors] if errors else [])])
