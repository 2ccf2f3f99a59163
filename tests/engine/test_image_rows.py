"""Rows with images in the engine: the tower's rows replace the placeholders' embeddings in
whatever chunk computes them, and KV over an image is reused only for the same image (in
memory and through the disk store)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from vision_fake import data_url, image_bytes, vision_model

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.events import EngineEvent
from modelhost.engine.kv.block_manager import BlockManager
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import ImageSpan, Sequence
from modelhost.inference.contracts import ChatPrompt, ImagePart, InferenceRequest
from modelhost.inference.image_prompt import BuiltPrompt, build_prompt
from modelhost.models.loaded import LoadedModel
from modelhost.residency.kv.kv_model_identity import prefix_store_opener
from modelhost.residency.kv.kv_store import KVDiskStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
KV_BYTES = 32 << 20
QUESTION = "Say the word you see:"  # SmolLM2 answers `The word "red" is ...`


@pytest.fixture(scope="module")
def vlm(smollm2: LoadedModel) -> LoadedModel:
    return vision_model(smollm2)


def prompt(model: LoadedModel, *colours: str, fmt: str = "PNG") -> BuiltPrompt:
    content: list[dict[str, str]] = [{"type": "text", "text": QUESTION}]
    parts = []
    for colour in colours:
        content.append({"type": "image"})
        parts.append(ImagePart("messages[0].content[1]", data_url(image_bytes(colour, fmt))))
    request = InferenceRequest(
        request_id="t",
        method="chat",
        prompt=ChatPrompt(messages=({"role": "user", "content": content},)),
        has_media=True,
        media=frozenset({"image"}),
        images=tuple(parts),
    )
    return build_prompt(model, request)


def engine_over(model: LoadedModel, store: KVDiskStore | None = None, chunk: int = 512) -> Engine:
    opener = prefix_store_opener(model, store) if store is not None else None
    config = EngineConfig(batch=4, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=chunk)
    return Engine(model, config, prefix_store=opener)


async def run(engine: Engine, built: BuiltPrompt) -> tuple[list[int], EngineEvent]:
    events = [event async for event in engine.submit(built.ids, GREEDY, built.images)]
    return [token for event in events for token in event.token_ids], events[-1]


def test_an_image_becomes_its_placeholders_in_order_split_into_tiles(vlm: LoadedModel) -> None:
    built = prompt(vlm, "red", "blue")
    first, second = built.images
    assert first.digest != second.digest
    assert len(first.positions) == len(second.positions) == 6
    assert first.positions[2] + 2 == first.positions[3]  # a separator between the two tiles
    assert first.start + first.length <= second.start
    assert all(built.ids[p] == vlm.vision.image_token_id for p in first.positions)  # type: ignore[union-attr]


async def test_the_image_decides_the_answer_and_the_same_image_answers_the_same(
    vlm: LoadedModel,
) -> None:
    engine = engine_over(vlm)
    try:
        red, _ = await run(engine, prompt(vlm, "red"))
        blue, _ = await run(engine, prompt(vlm, "blue"))
        red_again, _ = await run(engine, prompt(vlm, "red", fmt="WEBP"))
    finally:
        engine.close()
    assert red != blue
    assert red_again == red  # another file of the same colour reads the same


async def test_a_prefill_chunked_through_an_image_gives_the_same_tokens(vlm: LoadedModel) -> None:
    built = prompt(vlm, "green")
    span = built.images[0]
    whole = engine_over(vlm)
    try:
        expected, _ = await run(whole, built)
    finally:
        whole.close()
    chunked = engine_over(vlm, chunk=span.start + 2)  # the first chunk ends inside the image
    tower = vlm.vision
    try:
        before = tower.encoded  # type: ignore[union-attr]
        tokens, _ = await run(chunked, built)
        assert tower.encoded == before + 1  # type: ignore[union-attr]  # once, for both chunks
        assert chunked.block_manager.num_used_blocks == 0  # every block back
    finally:
        chunked.close()
    assert tokens == expected


async def test_kv_over_an_image_is_reused_for_the_same_image_only(vlm: LoadedModel) -> None:
    engine = engine_over(vlm)
    try:
        red = prompt(vlm, "red")
        span = red.images[0]
        _, first = await run(engine, red)
        _, again = await run(engine, red)
        _, other = await run(engine, prompt(vlm, "blue"))
    finally:
        engine.close()
    assert first.usage is not None and first.usage.cached_tokens == 0
    assert again.usage is not None and again.usage.cached_tokens >= span.start + span.length
    assert other.usage is not None and other.usage.cached_tokens <= span.start


async def test_the_disk_store_keeps_kv_over_an_image_under_the_image(
    vlm: LoadedModel, tmp_path: Path
) -> None:
    store = KVDiskStore(tmp_path / "kv", budget_bytes=1 << 30)
    red = prompt(vlm, "red")
    span = red.images[0]
    first = engine_over(vlm, store)
    try:
        expected, _ = await run(first, red)
    finally:
        first.close()  # writes every cached block
    second = engine_over(vlm, store)
    try:
        tokens, same = await run(second, red)
        _, other = await run(second, prompt(vlm, "yellow"))
    finally:
        second.close()
    assert tokens == expected
    assert same.usage is not None and same.usage.cached_tokens >= span.start + span.length
    assert other.usage is not None and other.usage.cached_tokens <= span.start


def test_blocks_with_the_same_tokens_and_another_image_have_other_keys() -> None:
    manager = BlockManager(num_blocks=16, block_size=4)

    def seq(seq_id: int, digest: bytes) -> Sequence:
        span = ImageSpan(5, 2, digest, plan=None, positions=(5, 6))  # type: ignore[arg-type]
        row = Sequence.from_prompt(seq_id, [1, 2, 3, 4, 9, 16, 16, 9, 5, 6], GREEDY)
        row.images = (span,)
        return row

    first = seq(1, b"a" * 32)
    manager.allocate_prompt(first)
    manager.append_slots(first, first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.commit_full_blocks(first)
    manager.free(first)
    assert manager.allocate_prompt(seq(2, b"a" * 32)) == 8  # both full blocks
    assert manager.allocate_prompt(seq(3, b"b" * 32)) == 4  # the text block before the image


async def test_image_and_text_rows_batched_and_preempted_give_the_tokens_of_each_alone(
    vlm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_bytes = vlm.config.kv_bytes_per_token(vlm.cache_dtype.itemsize)
    config = EngineConfig(batch=4, kv_cache_bytes=7 * 8 * token_bytes)  # 7 blocks of 8
    engine = Engine(vlm, config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = BuiltPrompt(vlm.tokenizer.encode("Name three colours of the rainbow:"))
    rows = [prompt(vlm, "red"), text, prompt(vlm, "blue")]
    preempted: list[Sequence] = []
    preempt = engine.scheduler._preempt
    monkeypatch.setattr(
        engine.scheduler, "_preempt", lambda seq: (preempted.append(seq), preempt(seq))
    )

    async def tokens(built: BuiltPrompt) -> list[int]:
        stream = engine.submit(built.ids, params, built.images)
        return [token async for event in stream for token in event.token_ids]

    try:
        alone = [await tokens(built) for built in rows]
        assert not preempted
        together = await asyncio.gather(*(tokens(built) for built in rows))
        engine.block_manager.check_invariants()
        assert engine.block_manager.num_used_blocks == 0
    finally:
        engine.close()
    assert preempted  # the pool could not hold all three: a row was recomputed
    assert list(together) == alone
