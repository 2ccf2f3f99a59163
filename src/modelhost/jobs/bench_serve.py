"""`bench-serve`: `modelhost bench` against the server's own OpenAI endpoint, as a job.

Config: `{model?, url?, concurrency: [1, 4, 8], prompt_tokens: 128, max_tokens: 64,
requests: 8, ignore_eos: true}` (`requests` per concurrency level; `url` aims it at another
server). Each level's figures arrive as a `metric` event; the `done` event's `summary` is the
table `modelhost bench` prints and `results` its JSON.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from modelhost.bench import BenchConfig, LevelResult, format_table, run_bench
from modelhost.jobs import config as check
from modelhost.jobs.kinds import Emit, JobContext

FIELDS = ("model", "url", "concurrency", "prompt_tokens", "max_tokens", "requests", "ignore_eos")


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    check.known_fields(config, FIELDS)
    checked: dict[str, Any] = {
        "concurrency": check.int_list_field(config, "concurrency", [1, 4, 8], 1, 256),
        "prompt_tokens": check.int_field(config, "prompt_tokens", 128, 1, 131_072),
        "max_tokens": check.int_field(config, "max_tokens", 64, 1, 32_768),
        "requests": check.int_field(config, "requests", 8, 1, 10_000),
        "ignore_eos": check.bool_field(config, "ignore_eos", True),
    }
    for name in ("model", "url"):
        value = check.url_field(config, name) if name == "url" else check.str_field(config, name)
        if value is not None:
            checked[name] = value
    return checked


def target_url(config: Mapping[str, Any], context: JobContext) -> str:
    url = config.get("url") or context.base_url
    if not url:
        raise RuntimeError("the server's own URL is unknown (not listening on TCP); set url")
    return str(url)


async def run(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    bench = BenchConfig(
        url=target_url(config, context),
        concurrency=tuple(config["concurrency"]),
        prompt_tokens=config["prompt_tokens"],
        max_tokens=config["max_tokens"],
        requests=config["requests"],
        ignore_eos=config["ignore_eos"],
        model=config.get("model"),
        api_key=None if config.get("url") else context.api_key,
    )
    levels = len(bench.concurrency)
    emit({"type": "stage", "stage": "warmup", "progress": 0.0, "message": "calibrating prompt"})

    def on_level(level: LevelResult) -> None:
        done = sum(1 for c in bench.concurrency[: bench.concurrency.index(level.concurrency) + 1])
        emit(
            {
                "type": "metric",
                "kind": "bench",
                "progress": done / levels,
                "message": f"c={level.concurrency}: {level.aggregate_tps:.1f} tok/s",
                **level.as_json(),
            }
        )

    report = await run_bench(bench, on_level)
    return {"summary": format_table(report), "results": report.as_json()}
