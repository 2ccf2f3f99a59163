"""The `convert` job: a GGUF becomes a Hugging Face directory that loads back and answers the
same."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from job_helpers import submit, wait_for
from live_server import LiveServer
from safetensors import safe_open
from tiny_models import make_tiny_checkpoint, reference_model

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.jobs.convert import write_hf_directory
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model
from modelhost.residency.registry import ModelRegistry

PROMPT = "The three primary colours are"


async def _greedy(model: LoadedModel, tokens: int = 8) -> list[int]:
    engine = Engine(model, EngineConfig(batch=1))
    try:
        ids = model.tokenizer.encode(PROMPT)
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        return [t async for event in engine.submit(ids, params) for t in event.token_ids]
    finally:
        engine.close()


async def test_a_converted_gguf_loads_back_and_answers_the_same(
    server: LiveServer, smollm2: LoadedModel, home: Path
) -> None:
    config = {"model": "smollm2-135m-instruct", "dtype": "fp32"}
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        job = wait_for(client, submit(client, "convert", config), timeout_s=180)
    assert job["status"] == "done", job["error"]
    output = home / "models" / "smollm2-135m-instruct-hf"
    assert job["output_path"] == str(output)
    assert {p.name for p in output.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }
    config = json.loads((output / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == smollm2.config.num_layers
    with safe_open(str(output / "model.safetensors"), framework="pt") as weights:
        assert "model.layers.0.self_attn.q_proj.weight" in weights.keys()  # noqa: SIM118
        assert weights.get_tensor("model.norm.weight").dtype == torch.float32
    converted = load_model(str(output))
    assert await _greedy(converted) == await _greedy(smollm2)
    assert converted.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert converted.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids
    entry = ModelRegistry(embedded=False, hf_hub=home / "no-hub").get(output.name)
    assert entry is not None and entry.format == "safetensors"


def test_converting_onto_an_existing_directory_is_refused(
    server: LiveServer, tmp_path: Path
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "config.json").write_text("{}")
    config = {"model": "smollm2-135m-instruct", "output": str(taken)}
    with httpx.Client(base_url=server.base_url) as client:
        response = client.post("/api/jobs", json={"kind": "convert", "config": config})
    assert response.status_code == 400
    assert "already exists" in response.json()["error"]


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_written_directory_is_read_by_transformers_as_the_same_model(
    architecture: str, smollm2: LoadedModel, tmp_path: Path
) -> None:
    original = make_tiny_checkpoint(tmp_path / "original", architecture, smollm2)
    model = load_model(str(original), prepare=False)
    written = write_hf_directory(model, tmp_path / "written", "fp32")
    ids = torch.tensor([smollm2.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        expected = reference_model(original)(ids).logits
        actual = reference_model(written)(ids).logits
    torch.testing.assert_close(actual, expected)


def test_a_bf16_directory_holds_bf16_weights_under_hugging_face_names(
    smollm2: LoadedModel, tmp_path: Path
) -> None:
    original = make_tiny_checkpoint(tmp_path / "original", "llama", smollm2)
    written = write_hf_directory(load_model(str(original), prepare=False), tmp_path / "w", "bf16")
    with safe_open(str(written / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())  # noqa: SIM118 - safe_open is not a mapping
        assert weights.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "model.layers.2.mlp.gate_proj.weight" in names
    assert "lm_head.weight" not in names  # tied to the embedding
    assert json.loads((written / "config.json").read_text())["torch_dtype"] == "bfloat16"
