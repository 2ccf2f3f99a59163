"""Images end to end on REAL (tiny, random-weight) vision towers, through the official clients:
SmolVLM from its Hugging Face folder in process (OpenAI chat streamed and not, Anthropic image
blocks, Ollama images), and Qwen2.5-VL as llama.cpp writes it (a qwen2vl GGUF with its mmproj
beside it) and Gemma 3 (a gemma3 GGUF and its mmproj, named by --mmproj or found beside a GGUF
that carries no template) served by `modelhost serve` in its worker process. Each answer is the
engine's greedy answer for the same prompt and image; a second turn about the image is served
from the prefix cache; a text-only model keeps its typed refusal."""

from __future__ import annotations

import asyncio
import contextlib
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
from live_server import free_port
from PIL import Image
from test_serve_process import SERVE, wait_for_health
from tiny_gemma3_vl import GEMMA3_CHAT_TEMPLATE, make_tiny_gemma3_vl, write_gemma3_vl_gguf
from tiny_qwen_vl import make_tiny_qwen_vl, write_qwen_vl_gguf
from tiny_vision import make_tiny_smolvlm
from vision_fake import base64_of, data_url

from modelhost.assembly import build_serving
from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.inference.contracts import ChatPrompt, ImagePart, InferenceRequest
from modelhost.inference.image_prompt import build_prompt
from modelhost.models.families import QWEN_VL_TEMPLATE
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.server.settings import ServeSettings

pytestmark = pytest.mark.slow

ASK = "What is in the picture?"
MAX_TOKENS = 8


def picture(seed: int, size: tuple[int, int] = (90, 120)) -> bytes:
    """PNG bytes of random pixels (lossless: the server decodes exactly these)."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, format="PNG")
    return out.getvalue()


def plain(seed: int, size: tuple[int, int] = (90, 120)) -> bytes:
    """PNG bytes of one random colour (Gemma 3 pools its patches: random pixels average out to
    nearly the same soft tokens, colours do not)."""
    colour = np.random.default_rng(seed).integers(0, 256, (1, 1, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(np.broadcast_to(colour, (*size, 3)).copy(), "RGB").save(out, format="PNG")
    return out.getvalue()


def image_request(image: bytes, image_first: bool = False) -> InferenceRequest:
    """ASK about `image` as the surfaces hand it on: the text part, then the image part
    (OpenAI, Anthropic, as sent), or the image first (Ollama shows a message's images before its
    text)."""
    content = [{"type": "text", "text": ASK}, {"type": "image"}]
    if image_first:
        content.reverse()
    return InferenceRequest(
        request_id="expected",
        method="chat",
        prompt=ChatPrompt(messages=({"role": "user", "content": content},)),
        has_media=True,
        media=frozenset({"image"}),
        images=(ImagePart(f"messages[0].content[{int(not image_first)}]", data_url(image)),),
    )


def engine_answer(model: LoadedModel, image: bytes, image_first: bool = False) -> str:
    """The engine's greedy answer to ASK about `image`, the prompt built as the server builds
    it: the text part, then the image part (OpenAI, Anthropic, as sent), or the image first
    (Ollama shows a message's images before its text)."""
    built = build_prompt(model, image_request(image, image_first))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    eos = frozenset(model.tokenizer.eos_token_ids)

    async def run() -> list[int]:
        engine = Engine(model, EngineConfig(batch=1, kv_cache_bytes=16 << 20))
        try:
            events = [e async for e in engine.submit(built.ids, greedy, built.images)]
        finally:
            engine.close()
        return [t for e in events for t in e.token_ids if t not in eos]

    return model.tokenizer.decode(asyncio.run(run()))


def openai_user(image: bytes, text: str = ASK) -> dict[str, Any]:
    url = {"url": data_url(image)}
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": url}]
    return {"role": "user", "content": parts}


def second_turn_caches_the_image(client: openai.OpenAI, model: str, image: bytes) -> None:
    first = client.chat.completions.create(
        model=model, messages=[openai_user(image)], max_tokens=MAX_TOKENS, temperature=0
    )  # type: ignore[list-item]
    follow: Any = [
        openai_user(image),
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And again?"},
    ]
    second = client.chat.completions.create(
        model=model, messages=follow, max_tokens=2, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens  # type: ignore[union-attr]
    # Whole KV blocks of the first turn's prompt come back, the image's among them.
    assert cached >= first.usage.prompt_tokens - 16  # type: ignore[union-attr]


# ---------------------------------------------------------------------------------------------
# SmolVLM from its folder, in process


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> LoadedModel:
    folder = make_tiny_smolvlm(tmp_path_factory.mktemp("smolvlm-wire"), smollm2)
    return load_model(str(folder), quantize="none")


@pytest.fixture(scope="module")
def server(smolvlm: LoadedModel, module_live_server: Any) -> Any:
    return module_live_server(build_serving(smolvlm, ServeSettings(), batch=2))


@pytest.fixture
def oai(server: Any) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    ) as client:
        yield client


def answers_each_surface_as_the_engine_does(
    client: openai.OpenAI, model: LoadedModel, name: str, image: bytes
) -> None:
    """OpenAI chat (whole and streamed), Anthropic image blocks and Ollama images all answer
    as the engine does on the same image."""
    expected = engine_answer(model, image)
    ask: Any = [openai_user(image)]
    whole = client.chat.completions.create(
        model=name, messages=ask, max_tokens=MAX_TOKENS, temperature=0
    )
    assert whole.choices[0].message.content == expected
    chunks = client.chat.completions.create(
        model=name, messages=ask, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected

    base_url = str(client.base_url).removesuffix("/").removesuffix("/v1")
    source = {"type": "base64", "media_type": "image/png", "data": base64_of(image)}
    blocks: Any = [{"type": "text", "text": ASK}, {"type": "image", "source": source}]
    with anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0) as claude:
        message = claude.messages.create(
            model=name,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": blocks}],
            extra_body={"temperature": 0},
        )
    assert message.content[0].text == expected  # type: ignore[union-attr]
    with ollama.Client(host=base_url, timeout=120) as local:
        answer = local.chat(
            model=name,
            messages=[{"role": "user", "content": ASK, "images": [image]}],
            options={"temperature": 0, "num_predict": MAX_TOKENS},
        )
    assert answer.message.content == engine_answer(model, image, image_first=True)


def test_smolvlm_answers_each_surface_as_the_engine_does(
    smolvlm: LoadedModel, oai: openai.OpenAI
) -> None:
    image = picture(1)
    assert engine_answer(smolvlm, image) != engine_answer(smolvlm, picture(2))  # the image decides
    answers_each_surface_as_the_engine_does(oai, smolvlm, smolvlm.id, image)


def test_smolvlm_second_turn_about_an_image_is_served_from_the_cache(
    smolvlm: LoadedModel, oai: openai.OpenAI
) -> None:
    second_turn_caches_the_image(oai, smolvlm.id, picture(3))


# ---------------------------------------------------------------------------------------------
# Qwen2.5-VL as a GGUF + mmproj pair, served by `modelhost serve` (worker process), the mmproj
# kept elsewhere and named by --mmproj


@pytest.fixture(scope="module")
def qwen_gguf(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> tuple[Path, Path]:
    """The text GGUF, and its mmproj moved out of its folder."""
    root = tmp_path_factory.mktemp("qwen-vl-wire")
    checkpoint = root / "checkpoint"
    checkpoint.mkdir()
    make_tiny_qwen_vl(checkpoint, smollm2)
    # With Qwen's template, as a real Qwen2.5-VL GGUF carries (the donor's reads no images).
    model = write_qwen_vl_gguf(checkpoint, root / "pair", chat_template=QWEN_VL_TEMPLATE)
    (root / "projectors").mkdir()
    mmproj = (model.parent / "mmproj-tiny-qwen-vl.gguf").rename(root / "projectors" / "vl.gguf")
    return model, mmproj


def test_qwen_vl_gguf_served_by_a_worker_with_its_named_mmproj_answers_as_the_engine_does(
    qwen_gguf: tuple[Path, Path], tmp_path: Path
) -> None:
    model_path, mmproj = qwen_gguf
    image = picture(4, (200, 150))
    ours = load_model(str(model_path), quantize="none", mmproj=mmproj)
    expected = engine_answer(ours, image)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [str(model_path), "--mmproj", str(mmproj), "--port", str(port), "--batch", "2"]
    argv += ["--quantize", "none"]
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stdout=log, stderr=log)
    try:
        wait_for_health(base_url, process)
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        with openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            whole = client.chat.completions.create(
                model=model, messages=[openai_user(image)], max_tokens=MAX_TOKENS, temperature=0
            )  # type: ignore[list-item]
            assert whole.choices[0].message.content == expected
            second_turn_caches_the_image(client, model, image)
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(
                    model="smollm2-135m-instruct", messages=[openai_user(image)], max_tokens=2
                )  # type: ignore[list-item]
            assert "model has no vision sidecar" in str(refused.value)
    finally:
        process.terminate()
        process.wait(timeout=60)


# ---------------------------------------------------------------------------------------------
# Gemma 3 as llama.cpp writes it (a gemma3 GGUF and its gemma3 mmproj), served by `modelhost
# serve` (worker process): with its projector named by --mmproj, and found beside the GGUF.


@pytest.fixture(scope="module")
def gemma_checkpoint(tmp_path_factory: pytest.TempPathFactory, smollm2: LoadedModel) -> Path:
    return make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3-vl-wire"), smollm2)


@contextlib.contextmanager
def served(argv: list[str], log_path: Path) -> Iterator[tuple[openai.OpenAI, str]]:
    """`modelhost serve ARGV` on a free port, its OpenAI client and its one model's id."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [*argv, "--port", str(port), "--batch", "2", "--quantize", "none"]
    with log_path.open("wb") as log:
        process = subprocess.Popen([sys.executable, "-c", SERVE, *argv], stdout=log, stderr=log)
    try:
        wait_for_health(base_url, process)
        model = httpx.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        with openai.OpenAI(
            base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120
        ) as client:
            yield client, model
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_gemma3_gguf_served_with_its_named_mmproj_answers_each_surface_as_the_engine_does(
    gemma_checkpoint: Path, tmp_path: Path
) -> None:
    model_path = write_gemma3_vl_gguf(
        gemma_checkpoint, tmp_path / "pair", chat_template=GEMMA3_CHAT_TEMPLATE
    )
    (tmp_path / "projectors").mkdir()
    mmproj = model_path.with_name("mmproj-tiny-gemma3-vl.gguf")
    mmproj = mmproj.rename(tmp_path / "projectors" / "gemma3-vision.gguf")
    image = plain(5, (200, 150))
    ours = load_model(str(model_path), quantize="none", mmproj=mmproj)
    expected = engine_answer(ours, image)
    assert expected != engine_answer(ours, plain(6, (200, 150)))  # the image decides it
    argv = [str(model_path), "--mmproj", str(mmproj)]
    with served(argv, tmp_path / "serve.log") as (client, model):
        answers_each_surface_as_the_engine_does(client, ours, model, image)
        second_turn_caches_the_image(client, model, image)


def test_gemma3_gguf_without_a_template_finds_its_mmproj_beside_it_and_places_the_image(
    gemma_checkpoint: Path, tmp_path: Path
) -> None:
    """No --mmproj (the mmproj beside the GGUF is its projector) and no template in the file:
    the family's Gemma template writes the image as Gemma 3's own does, so the answer is the one
    the same weights give with Gemma 3's template."""
    own = write_gemma3_vl_gguf(
        gemma_checkpoint, tmp_path / "own", chat_template=GEMMA3_CHAT_TEMPLATE
    )
    bare = write_gemma3_vl_gguf(gemma_checkpoint, tmp_path / "bare", chat_template="")
    image = plain(7, (120, 160))
    with_own_template = load_model(str(own), quantize="none")
    expected = engine_answer(with_own_template, image)
    own_prompt = build_prompt(with_own_template, image_request(image))
    with served([str(bare)], tmp_path / "serve.log") as (client, model):
        whole = client.chat.completions.create(
            model=model, messages=[openai_user(image)], max_tokens=MAX_TOKENS, temperature=0
        )  # type: ignore[list-item]
        assert whole.choices[0].message.content == expected
        assert whole.usage is not None and whole.usage.prompt_tokens == len(own_prompt.ids)
