"""Which files of a hub repo a pull means, from the repo's file list alone."""

from __future__ import annotations

import pytest

from modelhost.residency.pull.plan import HubFile, plan_files
from modelhost.residency.pull.reference import HubReference, PullError

COMMIT = "c" * 40


def files(*names: str) -> list[HubFile]:
    return [HubFile(name, 100, "ab" * 32 if name.endswith((".gguf", ".safetensors")) else None,
                    "b" * 40) for name in names]  # fmt: skip


def chosen(repo_files: list[HubFile], quant: str | None = None) -> list[str]:
    plan = plan_files(HubReference("org/repo", quant), COMMIT, repo_files)
    return [f.name for f in plan.files]


GGUF_REPO = files(
    "Model-Q4_K.gguf", "Model-Q4_K_M.gguf", "Model-q8_0.gguf", "mmproj-Model-F16.gguf", "README.md"
)


def test_the_quantization_is_matched_whole_and_in_any_case():
    assert chosen(GGUF_REPO, "q4_k_m") == ["Model-Q4_K_M.gguf"]
    assert chosen(GGUF_REPO, "Q4_K") == ["Model-Q4_K.gguf"]
    assert chosen(GGUF_REPO, "Q8_0") == ["Model-q8_0.gguf"]


def test_no_quantization_means_q4_k_m_or_the_only_gguf():
    assert chosen(GGUF_REPO) == ["Model-Q4_K_M.gguf"]
    assert chosen(files("Only-IQ3_M.gguf", "mmproj-F16.gguf")) == ["Only-IQ3_M.gguf"]


def test_a_vision_projector_is_never_the_model():
    with pytest.raises(PullError, match="no F16 GGUF file"):
        chosen(GGUF_REPO, "F16")


def test_a_split_gguf_is_refused_with_what_to_do():
    repo = files("big/Big-Q4_K_M-00001-of-00002.gguf", "big/Big-Q4_K_M-00002-of-00002.gguf")
    with pytest.raises(PullError, match="split into 2 parts.*gguf-split --merge") as error:
        chosen(repo)
    assert error.value.status == 400


def test_a_safetensors_repo_fetches_weights_first_and_config_last():
    repo = files(
        "config.json", "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
        "generation_config.json", "README.md", "onnx/model.safetensors", "original/model.pth",
    )  # fmt: skip
    assert chosen(repo) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "config.json",
    ]


def test_a_quantization_on_a_repo_without_gguf_is_a_404_that_says_so():
    with pytest.raises(PullError, match="has no GGUF files") as error:
        chosen(files("config.json", "model.safetensors"), "Q4_K_M")
    assert error.value.status == 404


def test_a_repo_of_neither_kind_is_refused():
    with pytest.raises(PullError, match="neither GGUF files nor a safetensors model"):
        chosen(files("README.md", "pytorch_model.bin", "config.json"))
