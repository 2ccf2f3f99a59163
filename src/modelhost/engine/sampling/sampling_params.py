"""Per-request decoding knobs, frozen and validated at construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from modelhost.engine.sampling.grammar_close import ClosePlan
    from modelhost.models.adapters.row_adapters import AdapterUse


class InvalidSamplingParams(ValueError):
    """A knob is out of range; the message names the field."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # 1 means off
    top_k: int = 0  # 0 means off
    min_p: float = 0.0  # 0 means off
    repetition_penalty: float = 1.0  # 1 means off; applied over the whole context
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0  # both applied over generated tokens only
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None  # None: a fresh seed per request
    max_tokens: int = 256
    stop: tuple[str, ...] = ()  # matched on decoded text, never emitted
    stop_token_ids: tuple[int, ...] = ()  # extra ids that end generation, besides EOS
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; N >= 0: chosen token's logprob plus N alternatives
    # Typed decisions read these ids' raw logprobs, in this order, instead of top alternatives.
    readout_token_ids: tuple[int, ...] = ()
    # Score every prompt token too (perplexity, `echo`); `logprobs` alternatives for each.
    prompt_logprobs: bool = False
    # Constrains every sampled token (greedy rows too); compiled for this model's vocabulary.
    grammar: CompiledGrammar | None = field(default=None, compare=False, repr=False)
    # With `grammar`: how its value closes within max_tokens; None: no closing guarantee.
    grammar_close: ClosePlan | None = field(default=None, compare=False, repr=False)
    # False: this row never guesses ahead (engine/speculation.py); its tokens are the same.
    speculate: bool = True
    # The LoRA adapter (and scale) this row runs with, over the shared base weights; None:
    # the bare base (models/adapters/row_adapters.py). Its KV is its own (engine/kv).
    adapter: AdapterUse | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise InvalidSamplingParams("temperature must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidSamplingParams("top_k must be >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams("min_p must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise InvalidSamplingParams("repetition_penalty must be > 0")
        if self.max_tokens < 1:
            raise InvalidSamplingParams("max_tokens must be >= 1")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidSamplingParams("logprobs must be in [0, 20]")
        if any(token_id < 0 for token_id in self.readout_token_ids):
            raise InvalidSamplingParams("readout_token_ids must be >= 0")
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
