"""Image encode time and time to first token for one 896x896 image, modelhost beside
llama-server on the same random-weight files (issue 40).

    python benchmarks/vision.py [--pairs 256m 500m gemma3-4b] [--images 896] [--mode auto]
        [--repeats 1] [--dir /tmp/vision-pairs] [--folder] [--llama-server PATH] [--out FILE]

The pairs (benchmarks/vision_pair.py, written once into --dir, each in a folder of its own), all
three in one run by default: SmolVLM-256M- and 500M-shaped text GGUFs (Q8_0) with their idefics3
mmproj (F16) beside them, and a Gemma-3-4B-shaped gemma3 text GGUF (Q4_K_M) with its gemma3
mmproj (F16; SigLIP-so400m at 896², 256 soft tokens), as llama.cpp's converter writes them. One
random image per repeat, the same for both servers:

- modelhost, in process: the load, then the plan (Pillow; SmolVLM: resized to 2048², 16 tiles
  of 512 and the global one, 17 x 64 = 1,088 image tokens; Gemma 3: one 896² square, 256 soft
  tokens), then the prompt through the engine as the server runs it (chunked prefill, the
  image's rows in place; max_tokens 1): TTFT is the plan plus the engine's time to its first
  token, `encode` the tower's share of it (wall and CPU seconds), `prefill` the rest.
  `--folder` also measures a transformers-made bf16 SmolVLM folder of the same shapes.
- llama-server (`-m MODEL --mmproj MMPROJ -t <torch's threads>`), over HTTP: one OpenAI chat
  request with the image as a PNG data URL, max_tokens 1, no prompt cache; TTFT its wall
  time, `prompt_ms` its own timing of the prompt, image slices included (it encodes and
  decodes slice by slice: 17 slices for SmolVLM's image, as modelhost's tiles).

Prints a table and writes JSON (default benchmarks/results/vision-<time>.json), rewritten after
each pair so a run cut short keeps what it measured. Run it under `flock /tmp/bench.lock` on a
shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import io
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from PIL import Image

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import ImageSpan
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.models.vision.tower import ImagePlan, VisionTower

sys.path.append(str(Path(__file__).resolve().parent))  # its sibling modules, shadowing nothing
from server_tree import ServerTree, install_cleanup  # noqa: E402
from user_sized import free_port, git_commit  # noqa: E402
from vision_pair import write_gemma3_pair, write_smolvlm_pair  # noqa: E402

LLAMA_SERVER = Path(
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)

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
# Each pair's prompt as its chat template renders one image and a question (the marker is
# what the tower expands).
PROMPTS = {
    "smolvlm": "<|im_start|>User:<image>Describe this image.<end_of_utterance>\nAssistant:",
    "gemma3": "<start_of_turn>user\n<start_of_image>Describe this image.<end_of_turn>\n"
    "<start_of_turn>model\n",
}
PAIRS = ("256m", "500m", "gemma3-4b")


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


class TimedTower:
    """A model's tower whose encodes are timed (wall and CPU seconds), as the engine calls it."""

    def __init__(self, tower: VisionTower) -> None:
        self.tower = tower
        self.marker, self.image_token_id = tower.marker, tower.image_token_id
        self.bidirectional = tower.bidirectional
        self.encodes: list[tuple[float, float]] = []

    def plan(self, image: Image.Image) -> ImagePlan:
        return self.tower.plan(image)

    def encode(self, plan: ImagePlan) -> torch.Tensor:
        started, cpu = time.perf_counter(), time.process_time()
        rows = self.tower.encode(plan)
        self.encodes.append((time.perf_counter() - started, time.process_time() - cpu))
        return rows


async def first_token_s(model: LoadedModel, ids: list[int], span: ImageSpan) -> float:
    """Seconds from submitting the prompt to the engine (a fresh one: nothing cached) to its
    first token: the image encoded and the prompt prefilled in chunks, as the server runs it."""
    engine = Engine(model, EngineConfig(batch=1))
    try:
        started = time.perf_counter()
        async for _event in engine.submit(ids, SamplingParams(max_tokens=1), (span,)):
            break
        return time.perf_counter() - started
    finally:
        engine.close()


def random_image(edge: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (edge, edge, 3), dtype=np.uint8))


def measure_modelhost(
    path: Path, prompt: str, mode: str, edges: list[int], repeats: int, **load: Any
) -> list[dict[str, Any]]:
    """In process: the load, then per image edge and repeat the plan and the engine's first
    token, the tower's encode timed within it (a fresh image each repeat, as llama-server
    gets)."""
    started = time.perf_counter()
    loaded = load_model(str(path), quantize=mode, **load)
    load_s = time.perf_counter() - started
    assert loaded.vision is not None, f"{path.name} reads no images"
    tower = TimedTower(loaded.vision)
    model = dataclasses.replace(loaded, vision=tower)
    results = []
    for edge in edges:
        plans, firsts = [], []
        tower.encodes.clear()
        tokens = image_tokens = 0
        for repeat in range(repeats):
            image = random_image(edge, repeat)
            started = time.perf_counter()
            plan = tower.plan(image)
            plans.append(time.perf_counter() - started)
            before, after = prompt.split(tower.marker)
            ids = model.tokenizer.encode(before + plan.text + after, add_special_tokens=False)
            at = tuple(i for i, t in enumerate(ids) if t == tower.image_token_id)
            span = ImageSpan(at[0], at[-1] - at[0] + 1, f"{edge}-{repeat}".encode(), plan, at)
            tokens, image_tokens = len(ids), plan.n_tokens
            firsts.append(asyncio.run(first_token_s(model, ids, span)))
        assert len(tower.encodes) == repeats, "the engine encoded each image once"
        plan_ms = statistics.median(plans) * 1000
        encode_ms = statistics.median(wall for wall, _ in tower.encodes) * 1000
        first_ms = statistics.median(firsts) * 1000
        results.append(
            {
                "server": "modelhost (in process)",
                "file": path.name,
                "mode": mode,
                "image": edge,
                "load_s": round(load_s, 2),
                "weights_mb": round(loaded.weights_bytes / 1e6, 1),
                "prompt_tokens": tokens,
                "image_tokens": image_tokens,
                "plan_ms": round(plan_ms, 1),
                "encode_ms": round(encode_ms, 1),
                "encode_cpu_s": round(statistics.median(cpu for _, cpu in tower.encodes), 2),
                "prefill_ms": round(first_ms - encode_ms, 1),
                "ttft_ms": round(plan_ms + first_ms, 1),
                "threads": torch.get_num_threads(),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


ENCODED = re.compile(r"image slice encoded in (\d+) ms")
DECODED = re.compile(r"image decoded \(batch \d+/\d+\) in (\d+) ms")


def measure_llama_server(
    binary: Path, model: Path, mmproj: Path, edges: list[int], repeats: int, threads: int
) -> list[dict[str, Any]]:
    """Over HTTP: one OpenAI chat request a repeat (a fresh PNG as a data URL, max_tokens 1, no
    prompt cache), TTFT its wall time; the image encode and decode times from the server's log,
    the prompt from its `timings`."""
    port = free_port()
    argv = [str(binary), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-t", str(threads), "-c", "8192", "-np", "1", "--no-ui"]
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    url = f"http://127.0.0.1:{port}"
    results = []
    with ServerTree(argv, dict(os.environ), log) as tree:
        started = time.perf_counter()
        while True:
            if not tree.alive():
                raise RuntimeError(f"llama-server ended: {tree.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"llama-server did not start: {tree.log_tail()}")
            time.sleep(0.5)
        load_s = time.perf_counter() - started
        for edge in edges:
            runs = []
            for repeat in range(repeats):
                buffer = io.BytesIO()
                random_image(edge, repeat).save(buffer, format="PNG")
                data = base64.b64encode(buffer.getvalue()).decode()
                content = [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                    {"type": "text", "text": "Describe this image."},
                ]
                body = {
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 1,
                    "temperature": 0,
                    "cache_prompt": False,
                }
                offset = log.stat().st_size
                started = time.perf_counter()
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=1800)
                wall = time.perf_counter() - started
                reply.raise_for_status()
                answer = reply.json()
                with open(log, "rb") as handle:
                    handle.seek(offset)
                    text = handle.read().decode(errors="replace")
                timings = answer.get("timings", {})
                encoded, decoded = ENCODED.findall(text), DECODED.findall(text)
                runs.append(
                    {
                        "ttft_ms": wall * 1000,
                        # mtmd logs these at its info level; absent, they are not reported
                        "encode_ms": sum(int(m) for m in encoded) if encoded else None,
                        "image_decode_ms": sum(int(m) for m in decoded) if decoded else None,
                        "slices": len(encoded),
                        "prompt_tokens": answer.get("usage", {}).get("prompt_tokens"),
                        "prompt_ms": timings.get("prompt_ms"),
                    }
                )
            results.append(
                {
                    "server": "llama-server (HTTP)",
                    "file": model.name,
                    "image": edge,
                    "load_s": round(load_s, 2),
                    "peak_rss_mb": round(tree.peak_rss / 1e6, 1),
                    "slices": runs[-1]["slices"] or None,
                    "prompt_tokens": runs[-1]["prompt_tokens"],
                    **{
                        key: round(statistics.median(r[key] for r in runs), 1)
                        for key in ("encode_ms", "image_decode_ms", "prompt_ms", "ttft_ms")
                        if all(r[key] is not None for r in runs)
                    },
                    "threads": threads,
                }
            )
            print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", choices=PAIRS, default=list(PAIRS))
    parser.add_argument("--images", nargs="+", type=int, default=[896])
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/vision-pairs"))
    parser.add_argument("--folder", action="store_true", help="also the SmolVLM folders")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    install_cleanup()
    threads = torch.get_num_threads()
    out = args.out or Path("benchmarks/results") / f"vision-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        "pairs": args.pairs,
        "commit": git_commit(),
        "cpu": platform.processor() or platform.machine(),
        "load_average_at_start": os.getloadavg()[0],
        "results": [],
    }
    results: list[dict[str, Any]] = summary["results"]
    for name in args.pairs:
        # each pair in a folder of its own: modelhost pairs a GGUF with the first mmproj beside it
        if name.startswith("gemma3"):
            pair, prompt = write_gemma3_pair(args.dir / name), PROMPTS["gemma3"]
        else:
            pair, prompt = (
                write_smolvlm_pair(args.dir / f"smolvlm-{name}", name),
                PROMPTS["smolvlm"],
            )
        mmproj = pair.with_name(f"mmproj-{pair.name}")
        rows = measure_modelhost(pair, prompt, args.mode, args.images, args.repeats, mmproj=mmproj)
        if args.folder and not name.startswith("gemma3"):
            folder = make_checkpoint(args.dir / f"smolvlm-{name}-folder", name)
            rows += measure_modelhost(folder, prompt, args.mode, args.images, args.repeats)
        if args.llama_server.exists():
            rows += measure_llama_server(
                args.llama_server, pair, mmproj, args.images, args.repeats, threads
            )
        results.extend({"pair": name, **row} for row in rows)
        summary["load_average_now"] = os.getloadavg()[0]
        out.write_text(json.dumps(summary, indent=2))
    header = f"{'pair':10} {'server':24} {'image':>5} {'tokens':>6} {'encode ms':>10}"
    print(header + f" {'prefill ms':>10} {'TTFT ms':>9}")
    for r in results:
        prefill = r.get("prefill_ms", r.get("prompt_ms", "-"))
        print(
            f"{r['pair']:10} {r['server']:24} {r['image']:5} {r['prompt_tokens']:6} "
            f"{r.get('encode_ms', '-'):>10} {prefill:>10} {r.get('ttft_ms', '-'):>9}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
