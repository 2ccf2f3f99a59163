"""The prompt path beside llama-server, one run (issues 35 and 37): prefill and a short prompt's
first token on the same GGUF files.

    python benchmarks/prompt_path.py [MODEL ...] [--prefill 512 1200] [--short 12] [--repeats 3]
        [--llama-server PATH] [--json PATH] [--prompt-activations 16 8]

MODEL: a GGUF path or an embedded model's name (default: smollm2-135m-instruct and the
synthetic 1B and 3B Q4_K_M files under /tmp/synth-models). For each model, modelhost's engine
runs in this process (no HTTP: the prompt path alone, greedy, one token), then llama-server
(`-t <cores> -c 4096 -np 1`) is started on the same file and sent the same token ids through
`/completion` (`cache_prompt` false, `n_predict` 1). Prefill: prompt tokens over the time to the
first token (modelhost) and over llama-server's own `timings.prompt_ms`; the short prompt: the
median time to the first token, client-side for both (llama-server's includes its HTTP round
trip, a millisecond or two). Every prompt starts with a different token: no prefix cache helps.
`--prompt-activations 16 8` runs modelhost's engine once at each (`modelhost serve
--prompt-activations`: the bits of a prompt's unread rows' activations), reported as
`modelhost` (16) and `modelhost_8bit_prompts`, with their ratio.
Writes JSON (default benchmarks/results/prompt-path-<time>.json). Shared machines are noisy:
compare the ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.loading.loader import load_model, resolve

LLAMA_SERVER = Path(
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)
DEFAULT_MODELS = [
    "smollm2-135m-instruct",
    "/tmp/synth-models/1b-q4_k_m.gguf",
    "/tmp/synth-models/3b-q4_k_m.gguf",
]


def prompt_ids(length: int, variant: int, vocab: int) -> list[int]:
    """`length` token ids, the first one different for each variant (no shared prefix)."""
    return [100 + (variant * 7919 + i * 31) % (vocab - 200) for i in range(length)]


async def modelhost_first_token(engine: Engine, ids: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    async for event in engine.submit(ids, params):
        if event.token_ids:
            return time.perf_counter() - started
    return time.perf_counter() - started


def measure_modelhost(name: str, args: argparse.Namespace, bits: int = 16) -> dict[str, Any]:
    model = load_model(name)
    vocab = model.config.vocab_size
    cores = os.cpu_count() or 1
    config = EngineConfig(
        batch=16, max_num_batched_tokens=512, prompt_threads=cores, prompt_activations=bits
    )
    engine = Engine(model, config)
    result: dict[str, Any] = {}
    variant = 1
    try:

        def first(length: int) -> float:
            nonlocal variant
            variant += 1
            return asyncio.run(modelhost_first_token(engine, prompt_ids(length, variant, vocab)))

        first(32)  # warm-up
        for length in args.prefill:
            times = [first(length) for _ in range(args.repeats)]
            result[f"prefill_{length}_tok_s"] = length / statistics.median(times)
        first(args.short)
        times = [first(args.short) for _ in range(2 * args.repeats + 1)]
        result[f"ttft_{args.short}_ms"] = 1000 * statistics.median(times)
    finally:
        engine.close()
    return result


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far, all its threads (Linux's /proc; None
    elsewhere): a steadier figure than the wall clock on a shared machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def repeats_of(length: int, args: argparse.Namespace) -> int:
    """How many times a prompt of `length` is timed (the median kept): `args.repeats`, or
    `args.short_repeats` for prompts up to `args.short_limit` tokens where those are given."""
    if length <= getattr(args, "short_limit", 0):
        return int(args.short_repeats)
    return int(args.repeats)


def measure_llama(
    path: Path, vocab: int, args: argparse.Namespace, context: int = 4096
) -> dict[str, Any]:
    port = free_port()
    cores = str(os.cpu_count() or 1)
    argv = [str(args.llama_server), "-m", str(path), "--port", str(port), "-t", cores]
    argv += ["-tb", cores, "-c", str(context), "-np", "1", "--no-warmup", "-b", "2048"]
    argv += ["-ub", "512"]
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    result: dict[str, Any] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=3600) as client:  # a 3B's 16k prompt: ~20 min on 2 cores
            deadline = time.monotonic() + 300
            while True:
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not start")
                time.sleep(0.1)
            variant = 1

            def complete(length: int) -> tuple[float, float]:
                nonlocal variant
                variant += 1
                body = {
                    "prompt": prompt_ids(length, variant, vocab),
                    "n_predict": 1,
                    "cache_prompt": False,
                    "temperature": 0.0,
                }
                started = time.perf_counter()
                reply = client.post(f"{url}/completion", json=body)
                elapsed = time.perf_counter() - started
                reply.raise_for_status()
                return elapsed, float(reply.json()["timings"]["prompt_ms"]) / 1000

            complete(32)  # warm-up
            for length in args.prefill:
                repeats = repeats_of(length, args)
                before = process_cpu_seconds(process.pid)
                own = [complete(length)[1] for _ in range(repeats)]
                after = process_cpu_seconds(process.pid)
                result[f"prefill_{length}_tok_s"] = length / statistics.median(own)
                if before is not None and after is not None:
                    result[f"prefill_{length}_cpu_s"] = (after - before) / repeats
            complete(args.short)
            times = [complete(args.short)[0] for _ in range(2 * args.repeats + 1)]
            result[f"ttft_{args.short}_ms"] = 1000 * statistics.median(times)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=DEFAULT_MODELS)
    parser.add_argument("--prefill", nargs="+", type=int, default=[512, 1200])
    parser.add_argument("--short", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--no-llama", action="store_true", help="modelhost alone")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--prompt-activations", nargs="+", type=int, choices=(8, 16), default=[16],
        help="the engine's bits for unread prompt rows, one run each (default: 16)",
    )  # fmt: skip
    args = parser.parse_args()
    share_the_gil_with_the_engine()  # as `modelhost serve` does where engines run
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    report: dict[str, Any] = {"meta": {"cores": os.cpu_count(), "args": vars(args)}, "models": {}}
    report["meta"]["args"] = {k: str(v) for k, v in vars(args).items()}
    for name in args.models:
        row: dict[str, Any] = {}
        for bits in args.prompt_activations:
            key = "modelhost" if bits == 16 else f"modelhost_{bits}bit_prompts"
            row[key] = measure_modelhost(name, args, bits)
        if "modelhost" in row and "modelhost_8bit_prompts" in row:
            row["ratio_8bit_to_16bit"] = {
                key: row["modelhost_8bit_prompts"][key] / row["modelhost"][key]
                for key in row["modelhost"]
            }
        if not args.no_llama:
            path = resolve(name).path
            vocab = load_model(name).config.vocab_size
            row["llama-server"] = measure_llama(Path(path), vocab, args)
            for key in [k for k in row if k.startswith("modelhost")]:
                suffix = key.removeprefix("modelhost")
                row[f"ratio{suffix}"] = {
                    name: row[key][name] / row["llama-server"][name] for name in row[key]
                }
        report["models"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    report["meta"]["loadavg_end"] = os.getloadavg()
    out = args.json or Path(__file__).parent / "results" / f"prompt-path-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
