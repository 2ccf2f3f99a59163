"""Rerank documents a second: modelhost's `/v1/rerank` against llama-server's (`--reranking`) on
the same GGUF reranker file, one after the other in one run; with `--embeddings`, the same for
`/v1/embeddings` (llama-server `--embedding`) on an embedding GGUF of the same shape.

The files are random-weight models of ms-marco-MiniLM-L6-v2's shape (BERT, 6 layers, 384 wide,
all-MiniLM-L6-v2's tokenizer), converted with llama.cpp's own convert_hf_to_gguf.py (`--convert`,
kept outside the repository) at F16. A request is one query with 100 documents of about 100
tokens; each server answers it `--repeats` times after a warm-up, and the median is reported.
llama-server scores a BERT pair with token type 0 throughout and without the pooler the
converter drops, so its scores differ from modelhost's (which reads type 1 for the document, as
transformers does); the ranking work is the same.

    .venv/bin/python benchmarks/rerank.py [--documents 100] [--repeats 3] [--embeddings]
        [--llama-server PATH] [--llama-threads 1 2] [--convert PATH/convert_hf_to_gguf.py]
        [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prompt_path import free_port

LLAMA_SERVER = Path("/work/llama-server/bin/llama-server")
CONVERT = Path("/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py")
WORDS = [
    "bamboo",
    "forest",
    "panda",
    "mountain",
    "river",
    "leaves",
    "shoots",
    "habitat",
    "china",
    "climate",
    "species",
]


def make_folder(out: Path, *, reranker: bool) -> Path:
    """A random-weight ms-marco-MiniLM-L6-v2-shaped model with all-MiniLM-L6-v2's tokenizer."""
    import torch
    import transformers

    from modelhost.models.loading.embedded import EMBEDDED_ENCODERS, EMBEDDING_MODEL

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        num_labels=1,
    )
    if reranker:
        transformers.BertForSequenceClassification(config).eval().save_pretrained(out)
    else:
        transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(out)
        source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
        shutil.copy(source / "modules.json", out / "modules.json")
        shutil.copytree(source / "1_Pooling", out / "1_Pooling")
    source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(source / name, out / name)
    return out


def convert(folder: Path, out: Path, script: Path) -> Path:
    command = [sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", "f16"]
    subprocess.run(command, check=True, capture_output=True)
    return out


def documents(count: int) -> list[str]:
    """`count` documents of about 100 tokens each, all different."""
    return [
        " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(95)) + f" document {i}"
        for i in range(count)
    ]


def start(argv: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{argv[0]} did not become ready: {log.read_text()[-2000:]}")


def measure(base: str, route: str, body: dict[str, Any], repeats: int) -> list[float]:
    """Seconds for each of `repeats` requests after a warm-up (which also loads the model)."""
    times = []
    with httpx.Client(base_url=base, timeout=600) as client:
        for attempt in range(repeats + 1):
            began = time.perf_counter()
            response = client.post(route, json=body)
            response.raise_for_status()
            if attempt:
                times.append(time.perf_counter() - began)
    return times


def run_server(
    name: str, file: Path, kind: str, args: argparse.Namespace, work: Path, threads: int = 0
) -> dict[str, Any]:
    port = free_port()
    if name == "modelhost":
        argv = [sys.executable, "-m", "modelhost", "serve", str(file), "--port", str(port)]
    else:
        flag = "--reranking" if kind == "rerank" else "--embedding"
        argv = [str(args.llama_server), "-m", str(file), flag, "--port", str(port)]
        # Eight slots of 1,024 tokens, batched together up to 2,048 tokens a forward (a 16k
        # ubatch with one slot ran a document a second: its graph is sized for the ubatch).
        argv += ["-t", str(threads), "-np", "8", "-c", "8192", "-b", "2048", "-ub", "2048"]
    docs = documents(args.documents)
    if kind == "rerank":
        route = "/v1/rerank"
        body: dict[str, Any] = {
            "model": file.stem,
            "query": "what do pandas eat",
            "documents": docs,
        }
    else:
        route, body = "/v1/embeddings", {"model": file.stem, "input": docs}
    label = f"{name} -t {threads}" if threads else name
    process = start(argv, port, work / f"{label.replace(' ', '')}-{kind}.log")
    try:
        times = measure(f"http://127.0.0.1:{port}", route, body, args.repeats)
    finally:
        process.terminate()
        process.wait(timeout=30)
    median = statistics.median(times)
    return {"server": label, "kind": kind, "seconds": times, "docs_per_s": len(docs) / median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--embeddings", action="store_true")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument(
        "--llama-threads",
        type=int,
        nargs="+",
        default=sorted({1, os.cpu_count() or 1}),
        help="llama-server's -t, one run each (its spinning threads suffer on a loaded machine)",
    )
    parser.add_argument("--convert", type=Path, default=CONVERT)
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/rerank.json"))
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rerank-bench-"))
    kinds = ["rerank", "embed"] if args.embeddings else ["rerank"]
    rows = []
    for kind in kinds:
        file = work / f"minilm-l6-{kind}.gguf"
        if not file.is_file():
            folder = make_folder(work / f"minilm-l6-{kind}", reranker=kind == "rerank")
            convert(folder, file, args.convert)
        rows.append(run_server("modelhost", file, kind, args, work))
        for threads in args.llama_threads:
            rows.append(run_server("llama-server", file, kind, args, work, threads))
    print(f"{'kind':8} {'server':18} {'docs/s':>8}  seconds a request ({args.documents} docs)")
    for row in rows:
        seconds = ", ".join(f"{s:.2f}" for s in row["seconds"])
        print(f"{row['kind']:8} {row['server']:18} {row['docs_per_s']:8.1f}  {seconds}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"documents": args.documents, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
