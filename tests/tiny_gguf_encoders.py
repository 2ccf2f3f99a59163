"""GGUF encoders written from tiny Hugging Face folders as llama.cpp's convert_hf_to_gguf.py
writes them (its BertModel / XLMRobertaModel / NomicBertModel classes): architecture "bert" (or
"nomic-bert" with its rotary base), tensors under the gguf package's own name map, RoBERTa's
position rows before the padding index cut off, the BERT pooler dropped, a classifier's
projection as `cls.output`, the pooling from modules.json, and the vocabulary as "bert"
(WordPiece, phantom-space pieces) or "t5" (Unigram pieces and scores) with the special ids gguf's
SpecialVocab reads from the tokenizer's files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
from safetensors.torch import load_file

_POOLING = {
    "mean": gguf.PoolingType.MEAN,
    "cls": gguf.PoolingType.CLS,
    "lasttoken": gguf.PoolingType.LAST,
}


def write_encoder_gguf(folder: Path, out: Path) -> Path:
    """`folder` (a BERT or XLM-R model, an embedder or a one-label classifier) as a GGUF."""
    raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    xlmr = raw["model_type"] == "xlm-roberta"
    classifier = any(a.endswith("ForSequenceClassification") for a in raw["architectures"])
    offset = raw["pad_token_id"] + 1 if xlmr else 0
    nomic = raw["model_type"] == "nomic_bert"
    arch = gguf.MODEL_ARCH.NOMIC_BERT if nomic else gguf.MODEL_ARCH.BERT
    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    if nomic:
        writer.add_rope_freq_base(raw["rope_parameters"]["rope_theta"])
    writer.add_context_length(raw["max_position_embeddings"] - offset)
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_head_count(raw["num_attention_heads"])
    writer.add_layer_norm_eps(raw["layer_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_causal_attention(False)
    pooling = _pooling_mode(folder)
    if pooling is not None:
        writer.add_pooling_type(_POOLING[pooling])
    if classifier:
        writer.add_classifier_output_labels([v for _, v in sorted(raw["id2label"].items())])
    (_t5_vocab if xlmr else _bert_vocab)(folder, writer, raw)
    names = gguf.get_tensor_name_map(arch, raw["num_hidden_layers"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        name = name.removeprefix("bert.").removeprefix("roberta.")
        if name in ("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias"):
            continue
        if classifier and name in ("classifier.weight", "classifier.bias"):
            name = name.replace("classifier.", "classifier.out_proj.")
        if name == "embeddings.position_embeddings.weight":
            tensor = tensor[offset:]
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert mapped is not None, name
        writer.add_tensor(mapped, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _pooling_mode(folder: Path) -> str | None:
    modules = folder / "modules.json"
    if not modules.is_file():
        return None
    for module in json.loads(modules.read_text()):
        if module["type"].endswith("Pooling"):
            config = json.loads((folder / module["path"] / "config.json").read_text())
            if isinstance(config.get("pooling_mode"), str):
                return str(config["pooling_mode"])
            flags = {"mean_tokens": "mean", "cls_token": "cls", "lasttoken": "lasttoken"}
            return next(mode for flag, mode in flags.items() if config.get(f"pooling_mode_{flag}"))
    return None


def _tokenizer_json(folder: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((folder / "tokenizer.json").read_text())
    return loaded


def _bert_vocab(folder: Path, writer: gguf.GGUFWriter, raw: dict[str, Any]) -> None:
    tokenizer = _tokenizer_json(folder)
    by_id = {i: tok for tok, i in tokenizer["model"]["vocab"].items()}
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    tokens, types = [], []
    for i in range(len(by_id)):
        tok = by_id[i]
        if i in special:
            tokens.append(tok)
            types.append(gguf.TokenType.CONTROL)
        else:  # convert_hf_to_gguf.py's "phantom space" pieces
            tokens.append(tok[2:] if tok.startswith("##") else "\u2581" + tok)
            types.append(gguf.TokenType.NORMAL)
    writer.add_token_type_count(raw.get("type_vocab_size", 1))
    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, n_vocab=len(tokens)).add_to_gguf(writer)


def _t5_vocab(folder: Path, writer: gguf.GGUFWriter, raw: dict[str, Any]) -> None:
    tokenizer = _tokenizer_json(folder)
    pieces = tokenizer["model"]["vocab"]
    unk = tokenizer["model"]["unk_id"]
    special = {t["id"] for t in tokenizer["added_tokens"] if t["special"]}
    types = [
        gguf.TokenType.UNKNOWN
        if i == unk
        else gguf.TokenType.CONTROL
        if i in special
        else gguf.TokenType.NORMAL
        for i in range(len(pieces))
    ]
    writer.add_tokenizer_model("t5")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([piece for piece, _ in pieces])
    writer.add_token_scores([float(score) for _, score in pieces])
    writer.add_token_types(types)
    writer.add_add_space_prefix(True)
    writer.add_token_type_count(raw.get("type_vocab_size", 1))
    writer.add_remove_extra_whitespaces(True)
    gguf.SpecialVocab(folder, n_vocab=len(pieces)).add_to_gguf(writer)
