"""LoRA adapters per row: an adapter's greedy tokens and logprobs are PEFT's merged model's,
and rows of different adapters (and the bare base) share one batch, each with its own answer."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from tiny_gguf import write_gguf_from_hf, write_gguf_lora_from_peft
from tiny_lora import make_peft_adapter
from tiny_models import make_tiny_checkpoint, reference_model

from modelhost.engine.engine import Engine, EngineConfig
from modelhost.engine.kv.block_manager import block_of
from modelhost.engine.sampling.sampling_params import SamplingParams
from modelhost.engine.sequence import Sequence
from modelhost.models.adapters.adapter_set import AdapterSet
from modelhost.models.adapters.refusals import AdapterRefused, AdaptersBusy
from modelhost.models.adapters.row_adapters import AdapterUse
from modelhost.models.kernels import native
from modelhost.models.kernels.structs import NativeStep
from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.loader import load_model

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
NUM_TOKENS = 8
# fp32 dense linears: the reference maths; the native kernels round activations on the way
# (the bare base's own logprobs there move by ~1e-3 against transformers too).
TOLERANCE = {"hf-dense": 1e-3, "gguf-native": 1e-2}


@pytest.fixture(scope="module")
def world(tmp_path_factory, smollm2):
    """A tiny Llama (folder and F32 GGUF), three PEFT adapters of it and their merged models."""
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama", smollm2, initializer_range=0.3)
    gguf_path = write_gguf_from_hf(base, root / "base.gguf")
    merged = {
        "all": make_peft_adapter(base, root / "all", seed=1),
        "qv": make_peft_adapter(base, root / "qv", seed=2, targets=("q_proj", "v_proj")),
        "mlp": make_peft_adapter(base, root / "mlp", seed=3, targets=("gate_proj", "down_proj")),
    }
    prompt_ids = smollm2.tokenizer.encode(PROMPT)
    return root, base, gguf_path, merged, reference_model(base), prompt_ids


def reference(model: torch.nn.Module, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's logprob from transformers."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), -1)[token])
        for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def run_rows(
    model: LoadedModel, prompt_ids: list[int], uses: list[AdapterUse | None]
) -> list[tuple[list[int], list[float]]]:
    """Each row's greedy tokens and logprobs, all rows submitted together (one batch)."""

    async def run() -> list[tuple[list[int], list[float]]]:
        engine = Engine(model, EngineConfig(block_size=4, batch=8))
        try:

            async def one(use: AdapterUse | None) -> tuple[list[int], list[float]]:
                params = SamplingParams(
                    temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=0,
                    adapter=use, speculate=False,
                )  # fmt: skip
                tokens, logprobs = [], []
                async for event in engine.submit(prompt_ids, params):
                    tokens.extend(event.token_ids)
                    logprobs.extend(entry.logprob for entry in event.logprobs or [])
                return tokens, logprobs

            return list(await asyncio.gather(*(one(use) for use in uses)))
        finally:
            engine.close()

    return asyncio.run(run())


def assert_same(
    ours: tuple[list[int], list[float]], theirs: tuple[list[int], list[float]], tolerance: float
) -> None:
    assert ours[0] == theirs[0]
    for mine, reference_logprob in zip(ours[1], theirs[1], strict=True):
        assert math.isclose(mine, reference_logprob, abs_tol=tolerance)


@pytest.fixture(params=["hf-dense", "gguf-native"])
def served(request, world):
    root, base, gguf_path, merged, bare, prompt_ids = world
    if request.param == "hf-dense":
        model = load_model(str(base), quantize="none")
    else:
        model = load_model(str(gguf_path))
    adapters = AdapterSet(model)
    for name in merged:
        adapters.add(name, str(root / name))
    return model, adapters, world, TOLERANCE[request.param]


def test_an_adapters_greedy_tokens_and_logprobs_equal_pefts_merged_model(served):
    model, adapters, (_, _, _, merged, _, prompt_ids), tolerance = served
    (ours,) = run_rows(model, prompt_ids, [adapters.use("all")])
    assert_same(ours, reference(merged["all"], prompt_ids), tolerance)


def test_three_adapters_and_the_bare_base_in_one_batch_each_give_their_own_answer(served):
    model, adapters, (_, _, _, merged, bare, prompt_ids), tolerance = served
    names = ["qv", None, "all", "mlp"]
    uses = [adapters.use(name) if name else None for name in names]
    answers = run_rows(model, prompt_ids, uses)
    for name, ours in zip(names, answers, strict=True):
        assert_same(ours, reference(merged[name] if name else bare, prompt_ids), tolerance)
    assert len({tuple(tokens) for tokens, _ in answers}) == 4  # each row its own answer


def test_an_adapter_at_scale_zero_answers_as_the_bare_base(served):
    model, adapters, (_, _, _, _, bare, prompt_ids), tolerance = served
    (ours,) = run_rows(model, prompt_ids, [adapters.use("all", 0.0)])
    assert_same(ours, reference(bare, prompt_ids), tolerance)


@pytest.fixture
def native_decode(world, monkeypatch):
    """The GGUF base on the native kernels with the three adapters, and a list that records,
    for each one-call native decode step, whether it carried LoRA updates."""
    if native.kernels() is None:
        pytest.skip("no native kernels here")
    root, _, gguf_path, merged, _, prompt_ids = world
    model = load_model(str(gguf_path))
    adapters = AdapterSet(model)
    for name in merged:
        adapters.add(name, str(root / name))
    fused = model.network.fused_decode()
    assert fused is not None  # every layer runs natively
    calls: list[bool] = []
    decode_layers = fused.kernels.decode_layers

    def recorded(hidden: torch.Tensor, layers: object, step: NativeStep) -> None:
        calls.append(step.lora is not None)
        decode_layers(hidden, layers, step)

    monkeypatch.setattr(fused.kernels, "decode_layers", recorded)
    return model, adapters, prompt_ids, calls


def test_decode_steps_with_adapted_rows_run_in_one_native_call_with_the_module_paths_answers(
    native_decode,
):
    model, adapters, prompt_ids, calls = native_decode
    uses = [adapters.use(name) for name in ("qv", "all", "mlp")] + [adapters.use("all", 0.5)]
    native_answers = run_rows(model, prompt_ids, uses)
    assert len(calls) >= NUM_TOKENS - 1 and all(calls)  # every decode step, with its updates
    taken = len(calls)
    model.network.fuse_decode = False
    try:
        module_answers = run_rows(model, prompt_ids, uses)
    finally:
        model.network.fuse_decode = True
    assert len(calls) == taken  # the module path made no native call
    for ours, theirs in zip(native_answers, module_answers, strict=True):
        # The native call reads the adapters in bf16, the module path in fp32.
        assert_same(ours, theirs, 1e-2)


def test_a_bare_base_row_beside_adapted_rows_in_a_native_decode_step_gets_exactly_its_answer(
    native_decode,
):
    model, adapters, prompt_ids, calls = native_decode
    (alone,) = run_rows(model, prompt_ids, [None])
    calls.clear()
    beside = run_rows(model, prompt_ids, [adapters.use("all"), None, adapters.use("qv")])
    assert calls and all(calls)
    assert beside[1] == alone  # tokens and logprobs, bit for bit


def test_an_adapter_of_another_base_shape_is_refused_with_what_differs(world, tmp_path, smollm2):
    root, *_ = world
    other = make_tiny_checkpoint(tmp_path / "wide", "llama", smollm2, hidden_size=32)
    make_peft_adapter(other, tmp_path / "wide-adapter", seed=4)
    model = load_model(str(root / "base"), quantize="none")
    with pytest.raises(AdapterRefused, match="does not fit this base"):
        AdapterSet(model).add("wide", str(tmp_path / "wide-adapter"))


def test_a_gguf_adapter_made_for_another_architecture_is_refused_though_its_shapes_fit(
    world, tmp_path
):
    root, base, *_ = world
    path = write_gguf_lora_from_peft(root / "qv", base, tmp_path / "qwen.gguf", "qwen2")
    model = load_model(str(Path(base)), quantize="none")
    with pytest.raises(AdapterRefused, match="made for a qwen2 model; this base is llama"):
        AdapterSet(model).add("qwen", str(path))


def test_an_adapter_that_trains_the_lm_head_is_refused_by_name(world, tmp_path):
    root, base, *_ = world
    make_peft_adapter(base, tmp_path / "head", seed=5, targets=("q_proj", "lm_head"))
    model = load_model(str(Path(base)), quantize="none")
    with pytest.raises(AdapterRefused, match="cannot patch .*lm_head"):
        AdapterSet(model).add("head", str(tmp_path / "head"))


def test_a_llama_cpp_gguf_lora_file_answers_as_pefts_merged_model(world, served):
    root, base, *_ = world
    model, adapters, (_, _, _, merged, _, prompt_ids), tolerance = served
    path = write_gguf_lora_from_peft(root / "all", base, root / "all-lora.gguf")
    adapters.add("all-gguf", str(path))
    (ours,) = run_rows(model, prompt_ids, [adapters.use("all-gguf")])
    assert_same(ours, reference(merged["all"], prompt_ids), tolerance)


def cached_tokens_in_turn(
    model: LoadedModel, prompt_ids: list[int], uses: list[AdapterUse | None]
) -> list[int]:
    """Each request's cached prompt tokens, the requests run one after another on one engine."""

    async def run() -> list[int]:
        engine = Engine(model, EngineConfig(block_size=4, batch=8))
        try:
            cached = []
            for use in uses:
                params = SamplingParams(temperature=0, max_tokens=1, adapter=use)
                async for event in engine.submit(prompt_ids, params):
                    if event.usage is not None:
                        cached.append(event.usage.cached_tokens)
            return cached
        finally:
            engine.close()

    return asyncio.run(run())


def test_prefix_blocks_are_reused_only_by_rows_of_the_same_adapter_and_scale(served):
    model, adapters, (_, _, _, _, _, prompt_ids), _ = served
    qv, mlp = adapters.use("qv"), adapters.use("mlp")
    uses = [qv, adapters.use("qv"), mlp, adapters.use("qv", 0.5), None, None]
    cached = cached_tokens_in_turn(model, prompt_ids, uses)
    assert cached[0] == 0 and cached[1] > 0  # the same adapter and scale: shared
    assert cached[2:5] == [0, 0, 0]  # another adapter, another scale, the bare base: never
    assert cached[5] > 0


def test_a_blocks_key_in_the_disk_store_names_its_adapter_and_scale(served):
    model, adapters, *_ = served
    keys = set()
    for use in (None, adapters.use("qv"), adapters.use("qv", 0.5), adapters.use("mlp")):
        seq = Sequence.from_prompt(0, list(range(8)), SamplingParams(adapter=use))
        keys.add(block_of(seq, 0, 4, None)[1])
    same = Sequence.from_prompt(1, list(range(8)), SamplingParams(adapter=adapters.use("qv")))
    assert len(keys) == 4 and block_of(same, 0, 4, None)[1] in keys


def test_past_its_room_a_base_lets_go_of_the_least_recently_used_idle_adapter(world):
    root, base, *_ = world
    model = load_model(str(base), quantize="none")
    adapters = AdapterSet(model, max_loaded=2)
    adapters.add("all", str(root / "all"))
    adapters.add("qv", str(root / "qv"))
    running = adapters.use("all")  # a row runs with it: never let go under it
    adapters.add("mlp", str(root / "mlp"))
    assert [a.name for a in adapters.loaded()] == ["all", "mlp"]
    assert adapters.in_use("all") == 1 and adapters.names() == ["all", "qv", "mlp"]
    again = adapters.use("qv")  # let go, still known: loaded again from its files
    assert [a.name for a in adapters.loaded()] == ["all", "qv"]
    with pytest.raises(AdaptersBusy):  # both loaded ones have rows running
        adapters.use("mlp")
    del running, again
    assert adapters.use("mlp").adapter.name == "mlp"


def test_a_loaded_adapters_bytes_count_until_its_last_row_ends(world):
    root, base, *_ = world
    model = load_model(str(base), quantize="none")
    adapters = AdapterSet(model)
    adapter = adapters.add("qv", str(root / "qv"))
    assert adapters.loaded_bytes() == adapter.nbytes > 0
    running = adapters.use("qv")
    adapters.remove("qv")
    assert adapters.loaded_bytes() == adapter.nbytes  # a row still runs with it
    del running
    assert adapters.loaded_bytes() == 0
