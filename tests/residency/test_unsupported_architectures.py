"""A model of an architecture (or rotary variant) modelhost has no exact implementation of is
refused when it is registered: listed with the reason, never loaded into wrong answers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import anthropic
import gguf
import numpy as np
import openai
import pytest
from live_server import LiveServer
from tiny_models import make_tiny_checkpoint

from modelhost.assembly import build_stage
from modelhost.cli.main import main
from modelhost.models.loading.loader import load_model
from modelhost.residency.host import ResidencyHost
from modelhost.residency.inprocess import InProcessUnit, in_process_loader
from modelhost.residency.registry import ModelEntry, ModelRegistry, ServingShape
from modelhost.residency.router import ModelRouter
from modelhost.server.app import create_routed_app
from modelhost.server.settings import ServeSettings


@pytest.fixture(scope="module")
def models(smollm2, tmp_path_factory) -> Path:
    """tiny-llama (served), tiny-rwkv (a folder of an architecture no family covers),
    tiny-yarn (Qwen 2 with a rotary scaling not implemented) and tiny-mamba.gguf."""
    root = tmp_path_factory.mktemp("models")
    llama = make_tiny_checkpoint(root / "tiny-llama", "llama", smollm2)
    for name, change in {
        "tiny-rwkv": {"model_type": "rwkv7", "architectures": ["RWKV7ForCausalLM"]},
        "tiny-yarn": {"model_type": "qwen2", "rope_scaling": {"rope_type": "yarn", "factor": 4}},
    }.items():
        shutil.copytree(llama, root / name)
        config = json.loads((root / name / "config.json").read_text())
        (root / name / "config.json").write_text(json.dumps({**config, **change}))
    writer = gguf.GGUFWriter(root / "tiny-mamba.gguf", "mamba")
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return root


def entries(models: Path, tmp_path: Path) -> dict[str, ModelEntry]:
    registry = ModelRegistry(
        [models], home=tmp_path / "home", hf_hub=tmp_path / "hub", embedded=False
    )
    return {entry.id: entry for entry in registry.entries()}


def test_a_model_of_an_unknown_architecture_is_listed_refused_naming_it_and_the_supported_ones(
    models, tmp_path
):
    listed = entries(models, tmp_path)
    for model_id, architecture in (("tiny-rwkv", "rwkv7"), ("tiny-mamba", "mamba")):
        entry = listed[model_id]
        assert entry.architecture == architecture
        assert entry.refusal is not None
        assert f"architecture '{architecture}' is not supported" in entry.refusal
        assert "qwen3" in entry.refusal and "gemma2" in entry.refusal  # the supported list
    assert listed["tiny-llama"].refusal is None


def test_a_supported_architecture_with_a_rotary_scaling_not_implemented_is_refused(
    models, tmp_path
):
    entry = entries(models, tmp_path)["tiny-yarn"]
    assert entry.refusal == "rotary scaling 'yarn' is not supported"


def test_ls_shows_each_models_architecture_and_whether_it_is_supported(
    models, capsys: pytest.CaptureFixture[str]
):
    assert main(["ls", str(models), "--url", "http://127.0.0.1:9"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[2:4] == ["ARCH", "SUPPORTED"]
    rows = {line.split()[0]: line.split() for line in lines[1 : lines.index("")]}
    assert rows["tiny-llama"][2:4] == ["llama", "yes"]
    assert rows["tiny-rwkv"][2:4] == ["rwkv7", "no"]
    assert rows["tiny-mamba"][2:4] == ["mamba", "no"]
    reason = "tiny-rwkv cannot be served: architecture 'rwkv7' is not supported"
    assert any(line.startswith(reason) for line in lines)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory) -> Iterator[str]:
    home = tmp_path_factory.mktemp("home")
    registry = ModelRegistry(
        [models], home=home, hf_hub=home / "hub", embedded=False, shape=ServingShape(batch=1)
    )
    settings = ServeSettings()
    host: ResidencyHost[InProcessUnit] = ResidencyHost(
        budget_bytes=1 << 34,
        source=registry.get,
        load=in_process_loader(load_model, lambda m: build_stage(m, settings, batch=1)),
    )
    router = ModelRouter(host, registry, current="tiny-llama")
    with LiveServer(create_routed_app(router, settings)) as live:
        yield live.base_url
    assert host.resident() == []


def test_a_request_for_an_unsupported_architecture_gets_a_400_naming_it(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="tiny-rwkv", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported-model"
    assert "architecture 'rwkv7' is not supported (supported: " in error["message"]
    answer = client.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert answer.choices[0].finish_reason in ("stop", "length")  # the rest still serve
    client.close()


def test_an_anthropic_client_gets_the_refusal_in_its_own_error_shape(server):
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(
            model="tiny-mamba", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert "architecture 'mamba' is not supported" in body["error"]["message"]
    client.close()
