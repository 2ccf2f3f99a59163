"""`Sequence`: one row of the batch — its token ids, how far its KV is computed, its block table.

No tensors live here. The scheduler moves a sequence between WAITING and RUNNING and finally
FINISHED; the block manager fills its block table; the engine keeps its own per-row state in
`payload` (sampler state, mailbox), which nothing here interprets.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelhost.engine.events import FinishReason
from modelhost.engine.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from modelhost.models.vision.tower import ImagePlan


@dataclass(frozen=True, slots=True, eq=False)
class ImageSpan:
    """One image in a prompt: the placeholder tokens whose input embeddings its encoding
    replaces (`positions`, in order; an image split into tiles has text between its runs),
    the tokens from its first placeholder to its last, and its content's digest."""

    start: int  # the first placeholder's position
    length: int  # up to and including the last placeholder
    digest: bytes  # the image's content hash: KV over its tokens is keyed by it
    plan: ImagePlan = field(repr=False)  # what the tower encodes
    positions: tuple[int, ...] = field(repr=False)  # every placeholder, n_tokens of them

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of its tokens lie in [start, end)."""
        return self.start < end and start < self.start + self.length


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens and bookkeeping; identity equality (two rows are never the same)."""

    seq_id: int
    token_ids: list[int] = field(repr=False)  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams = field(repr=False)
    eos_token_ids: frozenset[int] = frozenset()
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache when first scheduled
    block_table: list[int] = field(default_factory=list, repr=False)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    aborted: bool = False
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # tokens guessed ahead for this row and verified (speculation)
    num_accepted_tokens: int = 0  # of those, the ones kept
    payload: object = field(default=None, repr=False)
    images: tuple[ImageSpan, ...] = field(default=(), repr=False)  # in prompt order

    def __post_init__(self) -> None:
        if not 0 < self.num_prompt_tokens <= len(self.token_ids):
            raise ValueError(
                f"num_prompt_tokens must be in [1, {len(self.token_ids)}], "
                f"got {self.num_prompt_tokens}"
            )

    @classmethod
    def from_prompt(
        cls,
        seq_id: int,
        prompt_ids: Iterable[int],
        params: SamplingParams,
        eos_token_ids: Iterable[int] = (),
        images: tuple[ImageSpan, ...] = (),
    ) -> Sequence:
        token_ids = list(prompt_ids)
        return cls(
            seq_id=seq_id,
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            params=params,
            eos_token_ids=frozenset(eos_token_ids),
            images=images,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_images(self, start: int, end: int) -> bytes:
        """The digests of the images with tokens in [start, end), in order: what a KV block
        over those tokens is keyed by besides them (b"" for text alone)."""
        if not self.images:
            return b""
        return b"".join(span.digest for span in self.images if span.overlaps(start, end))

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
