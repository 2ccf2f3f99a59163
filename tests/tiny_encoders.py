"""Tiny random XLM-R encoders made with transformers' own classes: an XLMRobertaModel sentence
encoder in sentence-transformers' layout (a Pooling module of a chosen mode, Normalize or not) and
an XLMRobertaForSequenceClassification reranker, each with an XLM-R-style tokenizer.json (a
Unigram model trained here on a few sentences, `<s> a </s></s> b </s>` framing: what XLM-R's
tokenizer.json says; XLM-R's real 250k-piece file is not among the embedded models)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # XLM-R's ids 0..3, then <mask>
CORPUS = [
    "the giant panda eats bamboo almost exclusively",
    "paris is the capital of france and a city of museums",
    "stock markets fell on tuesday after the announcement",
    "a man is playing a guitar on the stage tonight",
    "what does a giant panda eat in the wild forests of china",
    "document number about bamboo shoots and leaves",
] * 4


def xlmr_tokenizer(path: Path) -> None:
    """tokenizer.json and tokenizer_config.json of an XLM-R-style Unigram tokenizer."""
    tokenizer = tokenizers.Tokenizer(models.Unigram())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>")
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)],
    )
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "cls_token": "<s>",
        "sep_token": "</s>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "mask_token": "<mask>",
        "model_max_length": 64,  # the positions after the padding index
        "model_input_names": ["input_ids", "attention_mask"],
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _xlmr_config(vocab_size: int, **config: Any) -> Any:
    import transformers

    return transformers.XLMRobertaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=66,  # 64 positions after the padding index's two
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        type_vocab_size=1,
        **config,
    )


def make_xlmr_encoder(path: Path, *, pooling: str = "cls", normalize: bool = True) -> Path:
    """An XLMRobertaModel sentence encoder (bge-m3's layout: CLS pooling, normalised)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    xlmr_tokenizer(path)
    vocab = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    config = _xlmr_config(vocab, initializer_range=0.3)
    transformers.XLMRobertaModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    sentence_modules(path, pooling, normalize=normalize)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 48}))
    return path


_FLAG = {"cls": "cls_token", "mean": "mean_tokens", "max": "max_tokens", "lasttoken": "lasttoken"}


def make_xlmr_reranker(path: Path) -> Path:
    """An XLMRobertaForSequenceClassification with one label (bge-reranker-base / v2-m3's
    shape)."""
    import torch
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    xlmr_tokenizer(path)
    vocab = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()
    torch.manual_seed(0)
    config = _xlmr_config(vocab, num_labels=1, initializer_range=0.3)
    model = transformers.XLMRobertaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    return path


def make_bert_encoder(path: Path, *, pooling: str = "mean") -> Path:
    """A BertModel sentence encoder (all-MiniLM-L6-v2's layout and tokenizer, random weights)."""
    import shutil

    import torch
    import transformers
    from tiny_reranker import TOKENIZER_FILES

    from modelhost.models.loading.embedded import EMBEDDED_ENCODERS, EMBEDDING_MODEL

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    transformers.BertModel(config, add_pooling_layer=False).eval().save_pretrained(path)
    source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    sentence_modules(path, pooling, normalize=True)
    return path


def sentence_modules(path: Path, pooling: str, *, normalize: bool) -> None:
    kinds = ["Transformer", "Pooling", *(["Normalize"] if normalize else [])]
    folders = ["", "1_Pooling", "2_Normalize"]
    modules = [
        {"idx": i, "name": str(i), "path": folders[i], "type": f"sentence_transformers.models.{k}"}
        for i, k in enumerate(kinds)
    ]
    if normalize:
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": 32, f"pooling_mode_{_FLAG[pooling]}": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))


def make_nomic_encoder(path: Path) -> Path:
    """A NomicBertModel sentence encoder (nomic-embed-text's layout: mean pooling, normalised;
    all-MiniLM-L6-v2's tokenizer, random weights)."""
    import shutil

    import torch
    import transformers
    from tiny_reranker import TOKENIZER_FILES

    from modelhost.models.loading.embedded import EMBEDDED_ENCODERS, EMBEDDING_MODEL

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.NomicBertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    transformers.NomicBertModel(config).eval().save_pretrained(path)
    source = EMBEDDED_ENCODERS[EMBEDDING_MODEL]()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    sentence_modules(path, "mean", normalize=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 40}))
    return path
