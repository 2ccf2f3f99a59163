"""The outer shape every decoder-only architecture shares: embed, layers, norm, LM head."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.config import ModelConfig
from modelhost.models.kernels.fused_decode import FusedDecode
from modelhost.models.kernels.packed import coarse_rows
from modelhost.models.networks.layers import Attention, GatedMLP, RMSNorm, Rotary
from modelhost.models.networks.moe import SparseMoE


def attention_for(config: ModelConfig, layer: int) -> Attention:
    """Layer `layer`'s attention as the config describes it, whichever the family: biases,
    q/k norms, scale, sliding window and score cap are all fields of the config."""
    return Attention(
        layer=layer,
        hidden=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        bias=config.attention_bias,
        qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
        scale=config.attention_scale(),
        window=config.sliding_window if config.is_sliding_layer(layer) else None,
        softcap=config.attn_logit_softcapping,
    )


class DecoderBlock(nn.Module):
    """What every architecture's layer offers: attention, a gated MLP, and its norms in the
    order models/kernels/fused_decode.py reads them; its forward takes (x, rope, batch, kv)."""

    self_attn: Attention
    mlp: GatedMLP | SparseMoE  # a mixture of experts in sparse layers (models/networks/moe.py)

    def native_norms(self) -> tuple[RMSNorm | None, ...]:
        """Norms at (input, attention output, MLP input, MLP output); None where none."""
        raise NotImplementedError


class DecoderBody(nn.Module):
    """`model.*` of a checkpoint: the embedding, the layers and the final norm."""

    def __init__(self, config: ModelConfig, layers: Sequence[DecoderBlock]) -> None:
        super().__init__()
        self.embed_tokens: nn.Module = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def blocks(self) -> list[DecoderBlock]:
        return [cast(DecoderBlock, layer) for layer in self.layers]


class DecoderLM(nn.Module):
    """Parameter names follow Hugging Face's (`model.layers.N...`, `lm_head`), so safetensors
    checkpoints load without a mapping; GGUF names are mapped by the GGUF loader."""

    def __init__(
        self, config: ModelConfig, layers: Sequence[DecoderBlock], embed_scale: float = 1.0
    ) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config, layers)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            head.weight = cast(nn.Embedding, self.model.embed_tokens).weight
        self.lm_head: nn.Module = head
        self.embed_scale = embed_scale * config.embedding_multiplier
        self.rotaries = {
            "global": Rotary(
                config.head_dim,
                config.rope_theta,
                config.rope_scaling_factor,
                freq_factors=config.rope_freq_factors,
                rope_dim=config.rope_dim,
                attention_factor=config.rope_attention_factor,
            ),
            "local": Rotary(
                config.head_dim,
                config.rope_local_theta or config.rope_theta,
                rope_dim=config.rope_dim,
            ),
            "none": Rotary(config.head_dim, 1.0, identity=True),
        }
        self.rotary_long: Rotary | None = None
        if config.rope_long_freq_factors is not None:
            self.rotary_long = Rotary(
                config.head_dim,
                config.rope_theta,
                freq_factors=config.rope_long_freq_factors,
                rope_dim=config.rope_dim,
                attention_factor=config.rope_attention_factor,
            )
        # The kinds some layer uses: each costs its cos and sin every step.
        self.rope_kinds = sorted({config.rope_kind(i) for i in range(config.num_layers)})
        self.fuse_decode = True  # tests compare against the module-by-module path
        self._fused: FusedDecode | None = None
        self._fused_described = False

    def fused_decode(self) -> FusedDecode | None:
        """The one-call decode path, described on first use (once the weights are in);
        None where some layer cannot take it."""
        if not self.fuse_decode:
            return None
        if not self._fused_described:
            self._fused, self._fused_described = FusedDecode.for_network(self), True
        return self._fused

    def _longrope(
        self, short: tuple[torch.Tensor, torch.Tensor], batch: ForwardBatch, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Longrope's tables: each token takes the long factors once its row, with this
        step's tokens, is longer than the original context (as transformers decides per
        forward; a prompt prefilled in several chunks switches at the chunk that crosses)."""
        assert self.rotary_long is not None and self.config.rope_original_context is not None
        positions = batch.positions
        rows = batch.output_index // batch.query_index.shape[1]
        ends = torch.zeros(int(rows.max()) + 1, dtype=positions.dtype, device=positions.device)
        ends = ends.scatter_reduce(0, rows, positions, "amax")
        long = (ends[rows] + 1 > self.config.rope_original_context)[:, None, None]
        if not bool(long.any()):
            return short
        cos, sin = self.rotary_long.cos_sin(positions, dtype)
        return torch.where(long, cos, short[0]), torch.where(long, sin, short[1])

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        before_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Next-token logits [S, vocab] for the tokens in `batch.logits_index`.
        `before_layers` runs once the layers are about to start: their kernels let go of the
        GIL for most of the step, and the engine hands its last step's tokens out then."""
        return self.logits(self.final_hidden(batch, kv, before_layers))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 next-token logits [S, vocab] of final hidden states [S, hidden]."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    @torch.inference_mode()
    def final_hidden(
        self,
        batch: ForwardBatch,
        kv: KVCache,
        before_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """The hidden states [S, hidden] after the final norm (before the LM head) of the
        tokens in `batch.logits_index`: what decoder embedders pool (models/retrieval/)."""
        hidden = self.model.embed_tokens(batch.input_ids)
        if self.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        if batch.embed_override is not None:  # image rows, already in embedding space
            at, rows = batch.embed_override
            hidden = hidden.index_copy(0, at.to(hidden.device), rows.to(hidden))
        ropes = {
            kind: self.rotaries[kind].cos_sin(batch.positions, hidden.dtype)
            for kind in self.rope_kinds
        }
        sections = self.config.mrope_section
        if sections is not None and batch.mrope_positions is not None and "global" in ropes:
            # An image's tokens (and the text after it) rotate by their M-RoPE positions.
            rotary = self.rotaries["global"]
            ropes["global"] = rotary.cos_sin_sections(batch.mrope_positions, sections, hidden.dtype)
        if self.rotary_long is not None and "global" in ropes:
            ropes["global"] = self._longrope(ropes["global"], batch, hidden.dtype)
        fused = self.fused_decode()
        if fused is not None and fused.can_run(batch, kv):
            hidden = fused.run(hidden, ropes, batch, kv, before_layers)[batch.logits_index]
        else:
            if before_layers is not None:
                before_layers()
            blocks = self.model.blocks()
            # Prompt tokens whose logits nobody reads may take 8-bit activations or bf16
            # (--prompt-activations, models/kernels/packed.py); the kept rows stay at 16.
            with coarse_rows(batch.coarse_rows, batch.coarse_bf16):
                for index, layer in enumerate(blocks):
                    # The last layer stores every token's keys and values but goes on (output
                    # projection, MLP) only with the tokens whose logits are wanted: a prompt's
                    # other tokens would be dropped after it (1/layers of a prompt's work saved).
                    keep = batch.logits_index if index == len(blocks) - 1 else None
                    hidden = layer(hidden, ropes[self.config.rope_kind(index)], batch, kv, keep)
        normed: torch.Tensor = self.model.norm(hidden)
        return normed
