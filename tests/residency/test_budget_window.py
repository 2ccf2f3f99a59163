"""A model's default window: the largest its model budget holds, up to its trained length."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tiny_models import make_tiny_checkpoint

from modelhost.assembly import build_stage, served_window
from modelhost.engine.kv.kv_pool_size import BLOCK_TOKENS, default_kv_bytes
from modelhost.inference.admission import budget_window, working_bytes
from modelhost.models.loading.loader import load_model
from modelhost.residency.registry import ModelRegistry, ServingShape
from modelhost.server.settings import ServeSettings

TRAINED = 4096  # the tiny model's trained length


@pytest.fixture(scope="module")
def long_tiny(smollm2, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("window") / "tiny-long"
    return make_tiny_checkpoint(folder, "llama", smollm2, max_position_embeddings=TRAINED)


def needed_bytes(entry_weights: int, config, context: int, token_bytes: int) -> int:
    """What weights, `context` tokens of KV and a step's working memory take (fp32 activations,
    the registry's default shape)."""
    work = working_bytes(config, 4, context, chunk_tokens=512, rows=8)
    return entry_weights + context * token_bytes + work


def entry_under(folder: Path, tmp_path: Path, budget: int | None, **shape: object):
    registry = ModelRegistry(
        [folder.parent],
        home=tmp_path / "home",
        hf_hub=tmp_path / "hub",
        embedded=False,
        shape=ServingShape(model_budget_bytes=budget, **shape),  # type: ignore[arg-type]
    )
    return registry.get(folder.name)


def test_a_budget_that_holds_more_than_the_trained_length_serves_the_trained_length(
    long_tiny: Path, tmp_path: Path
) -> None:
    entry = entry_under(long_tiny, tmp_path, 10**12)
    assert entry is not None and entry.context_length == TRAINED


def test_a_budget_that_holds_less_serves_the_largest_window_it_holds(
    long_tiny: Path, tmp_path: Path
) -> None:
    roomy = entry_under(long_tiny, tmp_path, 10**12)
    assert roomy is not None
    config = load_model(str(long_tiny)).config
    token_bytes = config.kv_bytes_per_token(2)
    budget = needed_bytes(roomy.weights_bytes, config, 1000, token_bytes)
    entry = entry_under(long_tiny, tmp_path, budget)
    assert entry is not None and entry.context_length == 1000


def test_context_length_still_caps_a_window_the_budget_would_allow(
    long_tiny: Path, tmp_path: Path
) -> None:
    entry = entry_under(long_tiny, tmp_path, 10**12, context_length=2000)
    assert entry is not None and entry.context_length == 2000


def test_without_a_budget_the_window_is_the_trained_length(long_tiny: Path) -> None:
    config = load_model(str(long_tiny)).config
    window = budget_window(
        config, weights_bytes=10**6, dtype_bytes=4, kv_token_bytes=100, budget_bytes=None
    )
    assert window == TRAINED


def test_a_budget_too_small_for_the_weights_leaves_the_trained_length_to_the_host(
    long_tiny: Path,
) -> None:
    config = load_model(str(long_tiny)).config
    window = budget_window(
        config, weights_bytes=10**9, dtype_bytes=4, kv_token_bytes=100, budget_bytes=10**6
    )
    assert window == TRAINED


def test_a_budgeted_pool_holds_a_whole_window_beyond_the_default_ceiling() -> None:
    token_bytes = 128 << 10  # an 8B model's fp16 KV a token
    window = 32_768  # 4 GiB of KV
    unbudgeted = default_kv_bytes(token_bytes, window, BLOCK_TOKENS, 8)
    budgeted = default_kv_bytes(token_bytes, window, BLOCK_TOKENS, 8, budgeted=True)
    assert unbudgeted < window * token_bytes  # 1 GiB, at least 8,192 tokens
    assert budgeted == (window + BLOCK_TOKENS) * token_bytes


def test_the_engine_serves_the_window_the_budget_holds(long_tiny: Path) -> None:
    model = load_model(str(long_tiny))
    token_bytes = model.config.kv_bytes_per_token(model.cache_dtype.itemsize)
    settings = ServeSettings(model_budget_bytes=10**12, kv_disk_bytes=0)
    assert served_window(model, settings, rows=2) == TRAINED
    work = working_bytes(model.config, model.dtype.itemsize, 1500, chunk_tokens=512, rows=2)
    tight = replace(settings, model_budget_bytes=model.weights_bytes + 1500 * token_bytes + work)
    stage = build_stage(model, tight, batch=2)
    try:
        assert stage.engine.context_length == 1500
        assert stage.policy.context_window == 1500
    finally:
        stage.close()


def test_a_worker_is_told_the_model_budget_and_the_kv_format() -> None:
    from modelhost.serve_config import WorkerConfig

    config = WorkerConfig(ServeSettings(model_budget_bytes=3 * 10**9, kv_cache="q8"))
    settings = WorkerConfig.from_json(config.to_json()).settings
    assert (settings.model_budget_bytes, settings.kv_cache) == (3 * 10**9, "q8")


def test_serve_reads_the_kv_format_and_the_model_budget_from_its_arguments() -> None:
    import argparse

    from modelhost.cli.serve_args import add_serve_parser
    from modelhost.serve_config import settings_from_args

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--kv-cache", "q8", "--model-budget", "2.5"])
    settings = settings_from_args(args)
    assert (settings.kv_cache, settings.model_budget_bytes) == ("q8", 2_500_000_000)
