"""Where a prompt's time goes in the engine: each native kernel's share of one prompt's time
to first token (linears by format and shape, with the GOPS they reached; attention; norms;
gated activations) and what ran outside them (PyTorch's attention past 256 tokens of context,
gathers, Python).

    python benchmarks/prompt_profile.py MODEL [--tokens 1200] [--chunk 512] [--warm 0]
        [--prompt-activations 16]

MODEL: a GGUF path or an embedded model's name. The kernels' entry points are wrapped with
timers (a few microseconds a call); a linear's GOPS count a multiply-add as 2. Compare them
with benchmarks/machine_peaks.cpp's: at 16 bits (two int8 halves) a linear's ceiling is half
the vpdpbusd figure, at `--prompt-activations 8` the whole of it. The process's CPU time (user
+ system) is printed beside the wall time: on a shared machine it is the steadier figure.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.models.kernels import native
from modelhost.models.loading.loader import load_model

seconds: dict[str, float] = collections.defaultdict(float)
cpu_seconds: dict[str, float] = collections.defaultdict(float)  # the process's, all threads
work: dict[str, float] = collections.defaultdict(float)
calls: collections.Counter[str] = collections.Counter()


def timed(key: Callable[..., str], call: Callable[..., Any], ops: Callable[..., float] | None):
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started, cpu_started = time.perf_counter(), time.process_time()
        result = call(*args, **kwargs)
        name = key(*args)
        seconds[name] += time.perf_counter() - started
        cpu_seconds[name] += time.process_time() - cpu_started
        calls[name] += 1
        if ops is not None:
            work[name] += ops(*args)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=1200)
    parser.add_argument("--chunk", type=int, default=512, help="prompt tokens a step")
    parser.add_argument("--warm", type=int, default=0, help="prompts run first, unmeasured")
    parser.add_argument(
        "--prompt-activations", type=int, choices=(8, 16), default=16,
        help="bits of the prompt rows' activations whose logits are not read",
    )  # fmt: skip
    args = parser.parse_args()
    share_the_gil_with_the_engine()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) - 1))
    model = load_model(args.model)
    kernels = native.kernels()
    assert kernels is not None, "the native kernels do not run here"
    k: Any = kernels
    k.qmatmul = timed(
        lambda x, w, y, c: f"linear format {w.format} {w.out}x{w.padded}",
        kernels.qmatmul,
        lambda x, w, y, c: 2.0 * x.shape[0] * w.out * w.padded,
    )
    k.paged_attention = timed(lambda *a: "attention (native)", kernels.paged_attention, None)
    if hasattr(kernels, "prompt_attention"):  # an older tree's kernels have none
        k.prompt_attention = timed(lambda *a: "attention (tiled)", kernels.prompt_attention, None)
    k.rms_norm = timed(lambda *a: "rms_norm", kernels.rms_norm, None)
    k.gated_activation = timed(lambda *a: "gated activation", kernels.gated_activation, None)
    vocab = model.config.vocab_size
    config = EngineConfig(
        batch=16,
        max_num_batched_tokens=args.chunk,
        prompt_threads=os.cpu_count() or 1,
        prompt_activations=args.prompt_activations,
    )
    engine = Engine(model, config)

    async def first_token(variant: int, length: int) -> float:
        ids = [100 + (variant * 7919 + i * 31) % (vocab - 200) for i in range(length)]
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        started = time.perf_counter()
        async for event in engine.submit(ids, params):
            if event.token_ids:
                break
        return time.perf_counter() - started

    try:
        asyncio.run(first_token(0, 32))
        for variant in range(args.warm):
            asyncio.run(first_token(2 + variant, args.tokens))
        seconds.clear(), cpu_seconds.clear(), work.clear(), calls.clear()
        cpu_before = os.times()
        total = asyncio.run(first_token(1, args.tokens))
        cpu_after = os.times()
    finally:
        engine.close()
    cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    print(
        f"{args.model} at {args.prompt_activations} bits: {args.tokens} tokens, {total:.3f} s"
        f" ({args.tokens / total:.1f} tok/s), CPU {cpu:.2f} s"
        f" ({args.tokens / cpu * (os.cpu_count() or 1):.1f} tok/s on all cores at this CPU time)"
    )
    print(f"  {'':<34} {'wall':>9} {'share':>6}  {'CPU':>7} {'share':>6}")
    for name in sorted(cpu_seconds, key=lambda n: -cpu_seconds[n]):
        rate = f"  {work[name] / cpu_seconds[name] / 1e9:7.1f} GOPS/CPU-s" if work[name] else ""
        print(
            f"  {name:<34} {seconds[name]:7.3f} s {100 * seconds[name] / total:5.1f}%"
            f"  {cpu_seconds[name]:7.3f} s {100 * cpu_seconds[name] / cpu:5.1f}%"
            f"  {calls[name]} calls{rate}"
        )
    outside = total - sum(seconds.values())
    cpu_outside = cpu - sum(cpu_seconds.values())
    print(
        f"  {'outside the kernels':<34} {outside:7.3f} s {100 * outside / total:5.1f}%"
        f"  {cpu_outside:7.3f} s {100 * cpu_outside / cpu:5.1f}%"
    )


if __name__ == "__main__":
    main()
