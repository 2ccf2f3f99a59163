"""Time decode steps with the engine loop bypassed: ms per step at R rows, one mode.

    .venv/bin/python benchmarks/step.py MODEL MODE ROWS STEPS      (THREADS=1 by default)

Rows are admitted, prefilled and warmed up for 4 steps, then `Engine._step()` runs STEPS times
on the calling thread (greedy, EOS ignored). MODE is a CPU linear mode (loading/quant.py). Pair it
with `py-spy record -f raw` to profile one decode step.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from modelhost.engine.engine import Engine, EngineConfig, share_the_gil_with_the_engine
from modelhost.engine.row_output import RowOutput
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence
from modelhost.models.loading.loader import load_model


def main() -> None:
    name, mode, rows, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    model = load_model(name, quantize=mode)
    share_the_gil_with_the_engine()
    engine = Engine(model, EngineConfig(batch=max(16, rows)))
    engine.close()  # no engine thread: this thread drives the scheduler
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(rows):
        ids = model.tokenizer.encode(f"{i} The quick brown fox jumps over the lazy dog")
        seq = Sequence.from_prompt(i + 1, ids, params, model.tokenizer.eos_token_ids)
        seq.payload = RowOutput(seq, model.tokenizer, lambda event: None)
        engine.scheduler.add(seq)
        engine._live[seq.seq_id] = seq
    with torch.inference_mode():
        for _ in range(4):
            engine._step()
        started = time.perf_counter()
        for _ in range(steps):
            engine._step()
        per_step = (time.perf_counter() - started) / steps
    print(f"{name} {mode} rows={rows} {per_step * 1e3:.2f} ms/step {rows / per_step:.1f} tok/s")


if __name__ == "__main__":
    main()
