"""`convert`: a GGUF model → a Hugging Face safetensors directory our loader (and
transformers) reads back.

Config: `{model, dtype: "bf16"|"fp32", output?}`. `model` is an embedded id, a local id or a
.gguf path; the directory goes to `MODELHOST_HOME/models/<model>-hf` unless `output` says
otherwise, which makes it a local model the server routes to by that name.
The weights are those our GGUF loader produces (dequantized, q/k rows in Hugging Face's order),
so the converted model answers exactly as the GGUF does in fp32.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelhost.jobs import config as check
from modelhost.jobs.kinds import Emit, JobContext
from modelhost.paths import modelhost_home

if TYPE_CHECKING:
    from modelhost.models.config import ModelConfig
    from modelhost.models.loaded import LoadedModel

FIELDS = ("model", "dtype", "output")
DTYPES = ("bf16", "fp32")
CONVERTIBLE = ("llama", "qwen2", "qwen3", "gemma3")  # the families hf_config writes


def gguf_source(name: str) -> Path:
    """The .gguf file `name` means: an embedded id, a file in MODELHOST_HOME/models, or a
    path. (No registry scan: a submission must answer quickly.)"""
    from modelhost.models.loading.embedded import EMBEDDED, embedded_path

    if name in EMBEDDED:
        path = embedded_path(name)
        assert path is not None
    else:
        local = modelhost_home() / "models" / f"{name}.gguf"
        path = local if local.is_file() else Path(name).expanduser()
    if not path.is_file():
        raise check.InvalidJob(f"model '{name}' not found")
    if path.suffix != ".gguf":
        raise check.InvalidJob(f"model '{name}' is not a GGUF file")
    return path


def default_output(name: str) -> Path:
    stem = Path(name).name.removesuffix(".gguf")
    return modelhost_home() / "models" / f"{stem}-hf"


def validate(config: Mapping[str, Any]) -> dict[str, Any]:
    check.known_fields(config, FIELDS)
    model = check.str_field(config, "model", required=True)
    assert model is not None
    dtype = config.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise check.InvalidJob('dtype must be "bf16" or "fp32"')
    source = gguf_source(model)
    output_name = check.str_field(config, "output")
    output = Path(output_name).expanduser() if output_name else default_output(model)
    if output.exists() and any(output.iterdir()):
        raise check.InvalidJob(f"output {output} already exists and is not empty")
    return {"model": model, "source": str(source), "dtype": dtype, "output": str(output)}


def hf_config(config: ModelConfig, model: LoadedModel, dtype: str) -> dict[str, Any]:
    """config.json in the shape transformers writes for LlamaForCausalLM / Gemma3ForCausalLM."""
    if config.model_type not in CONVERTIBLE or config.rope_freq_factors is not None:
        # Their rotary variants, fused tensors or multipliers have no field written here.
        raise ValueError(f"converting a {config.model_type} model is not supported")
    tokenizer = model.tokenizer
    eos_ids = sorted(tokenizer.eos_token_ids)
    bos_id = tokenizer.token_id(tokenizer.bos_token) if tokenizer.bos_token else None
    raw: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.context_length,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "bos_token_id": bos_id,
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids,
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
    }
    if config.rope_scaling_factor != 1.0:
        raw["rope_scaling"] = {"rope_type": "linear", "factor": config.rope_scaling_factor}
    if config.architecture == "gemma":
        kinds = [config.is_sliding_layer(i) for i in range(config.num_layers)]
        raw.update(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=config.sliding_window,
            layer_types=["sliding_attention" if s else "full_attention" for s in kinds],
            rope_local_base_freq=config.rope_local_theta,
            query_pre_attn_scalar=_whole(config.query_pre_attn_scalar),
            final_logit_softcapping=config.final_logit_softcapping,
            attn_logit_softcapping=config.attn_logit_softcapping,
        )
    else:
        raw.update(
            architectures=["LlamaForCausalLM"],
            model_type=config.model_type,
            hidden_act="silu",
        )
    return raw


def _whole(value: float | None) -> float | int | None:
    """transformers types some float-valued fields as int: write whole numbers as ints."""
    return int(value) if value is not None and float(value).is_integer() else value


def tokenizer_files(model: LoadedModel, directory: Path) -> None:
    tokenizer = model.tokenizer
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": tokenizer.add_bos_token,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "model_max_length": model.config.context_length,
    }
    if tokenizer.chat_template:
        settings["chat_template"] = tokenizer.chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    special = {k: settings[k] for k in ("bos_token", "eos_token") if settings[k]}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    eos_ids = sorted(tokenizer.eos_token_ids)
    generation = {"eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def hf_state_dict(model: LoadedModel, dtype: str) -> dict[str, Any]:
    import torch

    target = torch.bfloat16 if dtype == "bf16" else torch.float32
    gemma = model.config.architecture == "gemma"
    state: dict[str, torch.Tensor] = {}
    for name, value in model.network.state_dict().items():
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied: transformers and our loader take it from the embedding
        if gemma and name.endswith("norm.weight"):
            value = value - 1.0  # Gemma checkpoints store w for a norm applied as (1 + w)
        state[name] = value.detach().to("cpu", target).contiguous()
    return state


def write_hf_directory(model: LoadedModel, output: Path, dtype: str) -> Path:
    """`model` (loaded unprepared: the checkpoint's own modules) as a Hugging Face directory,
    written under a temporary name and then moved into place."""
    from safetensors.torch import save_file

    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    save_file(
        hf_state_dict(model, dtype), str(partial / "model.safetensors"), metadata={"format": "pt"}
    )
    config = hf_config(model.config, model, dtype)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_files(model, partial)
    if output.exists():
        output.rmdir()  # validated empty
    partial.replace(output)
    return output


def convert(source: Path, output: Path, dtype: str, emit: Emit) -> Path:
    import torch

    from modelhost.models.loading.loader import load_model

    emit({"type": "stage", "stage": "load", "progress": 0.05, "message": f"reading {source}"})
    # prepare=False: Hugging Face's modules, not the fused or quantized ones we run with.
    model = load_model(str(source), device=torch.device("cpu"), prepare=False)
    emit({"type": "stage", "stage": "write", "progress": 0.6, "message": "writing safetensors"})
    return write_hf_directory(model, output, dtype)


async def run(config: dict[str, Any], context: JobContext, emit: Emit) -> dict[str, Any]:
    import asyncio

    source, output = Path(config["source"]), Path(config["output"])
    if output.exists() and any(output.iterdir()):
        raise FileExistsError(f"{output} already exists and is not empty")
    written = await asyncio.to_thread(convert, source, output, config["dtype"], emit)
    size = sum(f.stat().st_size for f in written.iterdir())
    return {
        "output_dir": str(written),
        "model_id": written.name,
        "summary": f"{source.name} → {written} ({config['dtype']}, {size / 1e6:.1f} MB)",
    }
