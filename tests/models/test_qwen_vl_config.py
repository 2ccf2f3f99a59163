"""Qwen2.5-VL's config.json as the hub ships it (flat, `rope_scaling` of type mrope) and as
transformers 5 saves it (a nested text_config with `rope_parameters`): one decoder record."""

from __future__ import annotations

from modelhost.models.loading.hf_config import config_from_hf
from modelhost.models.vision.qwen2_5_vl_image import QwenImageConfig

TEXT = dict(
    hidden_size=2048,
    intermediate_size=11008,
    num_hidden_layers=36,
    num_attention_heads=16,
    num_key_value_heads=2,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    vocab_size=151936,
)


def test_a_hub_config_reads_as_a_biased_qwen2_decoder_with_mrope():
    raw = dict(
        TEXT,
        model_type="qwen2_5_vl",
        rope_theta=1_000_000.0,
        rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
        tie_word_embeddings=True,
        vision_config={"depth": 32, "hidden_size": 1280},
    )
    config = config_from_hf(raw)
    assert config.mrope_section == (16, 24, 24)
    assert config.attention_bias is True
    assert config.tie_word_embeddings is True
    assert config.rope_theta == 1_000_000.0
    assert config.head_dim == 128


def test_a_nested_text_config_keeps_the_wrappers_tied_embeddings():
    text = dict(
        TEXT,
        model_type="qwen2_5_vl_text",
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    )
    raw = {"model_type": "qwen2_5_vl", "text_config": text, "tie_word_embeddings": True}
    config = config_from_hf(raw)
    assert config.mrope_section == (16, 24, 24)
    assert config.attention_bias is True
    assert config.tie_word_embeddings is True


def test_old_processor_files_give_the_pixel_budget_as_min_and_max_pixels():
    old = QwenImageConfig.from_processor({"min_pixels": 3136, "max_pixels": 12845056})
    new = QwenImageConfig.from_processor(
        {"size": {"shortest_edge": 3136, "longest_edge": 12845056}}
    )
    assert old == new
    assert (old.min_pixels, old.max_pixels, old.patch, old.merge) == (3136, 12845056, 14, 2)
