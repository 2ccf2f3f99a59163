"""Decoder rerankers (Qwen3-Reranker): a causal LM asked whether a document meets a query,
scored by the next-token odds of "yes" against "no".

The prompt and the score are Qwen3-Reranker's own (its model card's reference code): a system
turn that asks for "yes" or "no", then `<Instruct>: {instruction}\\n<Query>: {query}\\n
<Document>: {document}` tokenized as one text and cut to fit, then the assistant's empty
thinking block. The score is softmax([logit(no), logit(yes)]) at the last position: P(yes),
in 0..1; a GGUF (llama.cpp's rank pooling) keeps only those two rows of the LM head, as
`cls.output`. A query's documents run as one forward (whole_prompts.py), each row's last token its
own, without padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch

from modelhost.models.loaded import LoadedModel
from modelhost.models.loading.gguf_header import GGUFFile
from modelhost.models.loading.load_gguf import FileReader, GGUFTensor
from modelhost.models.networks.decoder import DecoderLM
from modelhost.models.retrieval.retrieval_files import RANK_HEAD
from modelhost.models.retrieval.whole_prompts import groups, last_hidden

PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
MAX_LENGTH = 8192  # the reference's window for a whole prompt


def pair_text(query: str, document: str, instruction: str = INSTRUCTION) -> str:
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"


@dataclass(frozen=True, slots=True)
class Prompt:
    input_ids: list[int]


@dataclass(slots=True)
class DecoderReranker:
    """A decoder serving /v1/rerank; the interface RerankStage reads (id, weights_bytes,
    read, score)."""

    id: str
    model: LoadedModel
    tokenizer: tokenizers.Tokenizer
    prefix: list[int]
    suffix: list[int]
    yes_id: int
    no_id: int
    max_length: int
    # [2, hidden] rows (no, yes) of the LM head, where a GGUF keeps only those (cls.output);
    # None: the network's own LM head
    head: torch.Tensor | None = None
    forwards: int = 0  # batched forwards run so far (tests read it)

    @property
    def weights_bytes(self) -> int:
        return self.model.weights_bytes

    def read(self, query: str, documents: Sequence[str]) -> list[Prompt]:
        """Each document's whole prompt."""
        budget = self.max_length - len(self.prefix) - len(self.suffix)
        return [
            Prompt([*self.prefix, *self._tokens(pair_text(query, document))[:budget], *self.suffix])
            for document in documents
        ]

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)  # with its specials, as the reference

    @torch.inference_mode()
    def score(self, prompts: Sequence[Prompt]) -> list[float]:
        """P(yes) of each prompt, in order."""
        network = self.model.network
        assert isinstance(network, DecoderLM)
        scores: list[float] = []
        for start, end in groups([len(p.input_ids) for p in prompts]):
            self.forwards += 1
            rows = [p.input_ids for p in prompts[start:end]]
            hidden = last_hidden(self.model, rows)
            if self.head is not None:
                odds = hidden.float() @ self.head.t()
            else:
                logits = network.logits(hidden)
                odds = torch.stack((logits[:, self.no_id], logits[:, self.yes_id]), dim=1)
            scores.extend(torch.log_softmax(odds, dim=1)[:, 1].exp().tolist())
        return scores


def decoder_reranker(model: LoadedModel, model_id: str) -> DecoderReranker:
    """The reranker of a loaded Qwen3 causal LM whose files say it reranks."""
    tokenizer: tokenizers.Tokenizer = model.tokenizer.backend
    yes_id, no_id = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    if yes_id is None or no_id is None:
        raise ValueError(f"{model_id}: a reranker's vocabulary holds the tokens yes and no")
    return DecoderReranker(
        id=model_id,
        model=model,
        tokenizer=tokenizer,
        prefix=tokenizer.encode(PREFIX, add_special_tokens=False).ids,
        suffix=tokenizer.encode(SUFFIX, add_special_tokens=False).ids,
        yes_id=yes_id,
        no_id=no_id,
        max_length=min(MAX_LENGTH, model.config.context_length),
        head=_rank_head(model) if Path(model.path).suffix == ".gguf" else None,
    )


def _rank_head(model: LoadedModel) -> torch.Tensor:
    """A reranker GGUF's `cls.output` head as rows (no, yes): llama.cpp's converter writes the
    LM head's rows of yes and no, in the order `<arch>.classifier.output_labels` names them."""
    header = GGUFFile(Path(model.path))
    entry = next(t for t in header.tensors if t["name"] == RANK_HEAD)
    rows = GGUFTensor(FileReader(Path(model.path)), RANK_HEAD, entry, None).dense()
    labels = list(header.arch_field("classifier.output_labels") or ("yes", "no"))
    if sorted(labels) != ["no", "yes"]:
        raise ValueError(f"{model.path}: a rank head labelled {labels}, not yes and no")
    return rows[[labels.index("no"), labels.index("yes")]].to(model.device)
