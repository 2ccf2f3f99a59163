"""Resolving, loading and caching models; tokenizers and chat templates from their files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from synthetic_files import write_tiny
from tiny_models import make_tiny_checkpoint

from modelhost.models.families import GEMMA_TEMPLATE
from modelhost.models.loading import loader
from modelhost.models.loading.embedded import DEFAULT_MODEL
from modelhost.models.loading.loader import ModelNotFound, load_model, resolve


def test_loader_resolves_the_default_model_when_no_name_is_given():
    source = resolve(None)
    assert source.id == DEFAULT_MODEL == "smollm2-135m-instruct"
    assert source.path.suffix == ".gguf"


def test_loader_refuses_an_unknown_model_name_before_loading_anything():
    with pytest.raises(ModelNotFound, match="no-such-model"):
        resolve("no-such-model")


def test_loader_warm_load_uses_the_cache_without_parsing_the_gguf(smollm2, monkeypatch):
    def parse_refused(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(loader, "GGUFFile", parse_refused)
    again = load_model(DEFAULT_MODEL)
    assert again.config == smollm2.config
    assert again.tokenizer.encode("Hello there") == smollm2.tokenizer.encode("Hello there")


@pytest.mark.parametrize("model_id", [DEFAULT_MODEL, "gemma-3-270m"])
def test_a_gguf_tokenizer_is_the_one_transformers_builds_from_the_file(model_id):
    from transformers import AutoTokenizer

    from modelhost.models.loading.embedded import embedded_path

    path = embedded_path(model_id)
    built = loader._gguf_tokenizer(path)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert json.loads(built.to_str()) == json.loads(reference.backend_tokenizer.to_str())


def test_smollm2_renders_its_own_chatml_template(smollm2):
    text = smollm2.tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2.tokenizer.eos_token_ids == {smollm2.tokenizer.token_id("<|im_end|>")}


def test_gemma_uses_the_family_template_because_its_gguf_carries_none(gemma3):
    assert gemma3.tokenizer.chat_template == GEMMA_TEMPLATE
    text = gemma3.tokenizer.render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_gemma_stops_at_end_of_turn_as_well_as_eos(gemma3):
    ids = gemma3.tokenizer.eos_token_ids
    assert gemma3.tokenizer.token_id("<end_of_turn>") in ids
    assert gemma3.tokenizer.token_id("<eos>") in ids


def test_gemma_prompts_start_with_bos_and_chat_prompts_hold_exactly_one(gemma3):
    bos = gemma3.tokenizer.bos_token_id
    assert gemma3.tokenizer.encode("Hello")[0] == bos
    chat = gemma3.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    assert chat.count(bos) == 1


def test_loader_takes_sampling_defaults_from_generation_config(tmp_path, smollm2):
    make_tiny_checkpoint(tmp_path, "llama", smollm2)
    generation = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    model = load_model(str(tmp_path))
    assert model.gen_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0}
    assert model.id == tmp_path.name


def test_loading_leaves_no_threads_behind_to_compete_with_the_engines_own(tmp_path):
    # An OpenMP team started by the loading thread would stay parked beside the engine
    # thread's team; with more OpenMP threads than cores libgomp stops spinning between
    # parallel regions, and every decode step then waits on sleeping threads.
    path = write_tiny(tmp_path / "tiny-q4_k_m.gguf", "Q4_K_M")
    script = (
        "import os, sys\n"
        "from modelhost.models.kernels import native\n"
        "from modelhost.models.loading.loader import load_model\n"
        "native.kernels()\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "load_model(sys.argv[1])\n"
        "print(before, len(os.listdir('/proc/self/task')))\n"
    )
    # Without the packed-weights writer, a thread of its own that ends once the file is kept.
    env = {**os.environ, "MODELHOST_WEIGHTS_CACHE_GB": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300,
        env=env,
    )  # fmt: skip
    before, after = done.stdout.split()
    assert after == before
