"""Image encode time and time to first token for one image on a SmolVLM-shaped model with
random weights (issue 40).

    python benchmarks/vision.py [--shape 256m|500m] [--image 896] [--modes auto none]
        [--repeats 3] [--dir /tmp/smolvlm-256m-random] [--out FILE]

The checkpoint is made once with transformers' own classes at the real architecture's sizes
(HuggingFaceTB/SmolVLM-256M-Instruct's and -500M's config.json: SigLIP-base 768 wide, 12
layers, 512-pixel tiles of 16-pixel patches, pixel shuffle by 4 to 64 tokens a tile; SmolLM2's
decoder shapes), saved as bf16 safetensors with SmolLM2's tokenizer and the image tokens added,
and the processor config (longest edge 2048, tiles of 512). One random `--image`² RGB image:
resized to 2048², 16 tiles and the global image, 17 x 64 = 1,088 image tokens.

For each CPU linear mode: the load, then per repeat the plan (Pillow preprocessing), the encode
(SigLIP over every tile and the connector), and the prefill of the whole prompt with the image
rows in place (one step through the engine's paged KV cache, as the first step of a request
that fits one chunk); TTFT is their sum (the first token's sampling is negligible). Medians.
Prints a table and writes JSON (default benchmarks/results/vision-<time>.json). Run it under
`flock /tmp/bench.lock` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.engine.sequence import Sequence
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

IMAGE_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
VISION = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    image_size=512,
    patch_size=16,
)
TEXT = {
    "256m": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
    ),
    "500m": dict(
        hidden_size=960,
        intermediate_size=2560,
        num_hidden_layers=32,
        num_attention_heads=15,
        num_key_value_heads=5,
    ),
}
PROMPT = "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:"


def make_checkpoint(directory: Path, shape: str) -> Path:
    """The random-weight checkpoint, written once."""
    if (directory / "model.safetensors").is_file():
        return directory
    import transformers
    from tokenizers import Tokenizer as TokenizerBackend

    directory.mkdir(parents=True, exist_ok=True)
    donor = load_model("smollm2-135m-instruct", quantize="none")
    backend = TokenizerBackend.from_str(donor.tokenizer.backend.to_str())
    backend.add_special_tokens(IMAGE_TOKENS)
    backend.save(str(directory / "tokenizer.json"))
    config = transformers.SmolVLMConfig(
        vision_config=VISION,
        text_config=dict(
            TEXT[shape],
            model_type="llama",
            vocab_size=49280,
            rope_theta=100_000.0,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        scale_factor=4,
        image_token_id=backend.token_to_id("<image>"),
    )
    torch.manual_seed(0)
    model = transformers.SmolVLMForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    settings = {"bos_token": "<|im_start|>", "eos_token": "<end_of_utterance>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    processor = dict(
        size={"longest_edge": 2048},
        max_image_size={"longest_edge": 512},
        do_image_splitting=True,
        resample=1,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    (directory / "processor_config.json").write_text(json.dumps({"image_seq_len": 64}))
    return directory


def prefill_s(model: LoadedModel, ids: list[int], rows: torch.Tensor) -> float:
    """Seconds of one prefill step of the whole prompt, the image rows in place."""
    assert model.vision is not None
    engine = Engine(model, EngineConfig(batch=1))
    try:
        seq = Sequence.from_prompt(0, ids, SamplingParams())
        engine.block_manager.append_slots(seq, len(ids))
        batch = engine.runner.build_batch(
            SchedulerOutput(rows=[ScheduledRow(seq, 0, len(ids), True)])
        )
        image_id = model.vision.image_token_id
        batch.embed_override = (torch.tensor([i for i, t in enumerate(ids) if t == image_id]), rows)
        started = time.perf_counter()
        model.network(batch, engine.runner.kv)
        return time.perf_counter() - started
    finally:
        engine.close()


def measure(directory: Path, mode: str, image: Image.Image, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    model = load_model(str(directory), quantize=mode)
    load_s = time.perf_counter() - started
    tower = model.vision
    assert tower is not None
    plans, encodes, prefills = [], [], []
    tokens = image_tokens = 0
    for _ in range(repeats):
        started = time.perf_counter()
        plan = tower.plan(image)
        plans.append(time.perf_counter() - started)
        started = time.perf_counter()
        rows = tower.encode(plan)
        encodes.append(time.perf_counter() - started)
        before, after = PROMPT.split(tower.marker)
        ids = model.tokenizer.encode(before + plan.text + after)
        tokens, image_tokens = len(ids), plan.n_tokens
        prefills.append(prefill_s(model, ids, rows))
    plan_ms = statistics.median(plans) * 1000
    encode_ms = statistics.median(encodes) * 1000
    prefill_ms = statistics.median(prefills) * 1000
    return {
        "mode": mode,
        "load_s": round(load_s, 2),
        "weights_mb": round(model.weights_bytes / 1e6, 1),
        "prompt_tokens": tokens,
        "image_tokens": image_tokens,
        "plan_ms": round(plan_ms, 1),
        "encode_ms": round(encode_ms, 1),
        "prefill_ms": round(prefill_ms, 1),
        "ttft_ms": round(plan_ms + encode_ms + prefill_ms, 1),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(TEXT), default="256m")
    parser.add_argument("--image", type=int, default=896, help="the square image's edge")
    parser.add_argument("--modes", nargs="+", default=["auto"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    directory = make_checkpoint(args.dir or Path(f"/tmp/smolvlm-{args.shape}-random"), args.shape)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (args.image, args.image, 3), dtype=np.uint8))
    results = [measure(directory, mode, image, args.repeats) for mode in args.modes]
    header = f"{'mode':6} {'tokens':>7} {'image':>6} {'plan ms':>8} {'encode ms':>10} "
    print(header + f"{'prefill ms':>11} {'TTFT ms':>8}")
    for r in results:
        print(
            f"{r['mode']:6} {r['prompt_tokens']:7} {r['image_tokens']:6} {r['plan_ms']:8} "
            f"{r['encode_ms']:10} {r['prefill_ms']:11} {r['ttft_ms']:8}"
        )
    out = args.out or Path("benchmarks/results") / f"vision-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"shape": args.shape, "image": args.image, "results": results}
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
