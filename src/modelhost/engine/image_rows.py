"""Image embeddings for a step: which of its tokens are image placeholders, and their rows.

A row whose scheduled tokens cover placeholders of its images (`Sequence.images`) gets those
tokens' input embeddings from the vision tower instead of the embedding table
(`ForwardBatch.embed_override`). Whatever computes them — a first prefill, a chunk of a prompt
split across steps (even mid-image), a recompute after preemption — takes the rows of the
placeholders it covers, so each chunk replaces exactly its own tokens.

Each image is encoded once while it is wanted: encodings are kept by content digest in a small
LRU, so the chunks of one prompt, and the next turn about the same image beyond what the
prefix cache holds, encode it once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from modelhost.engine.scheduler import ScheduledRow
from modelhost.engine.sequence import ImageSpan

if TYPE_CHECKING:
    from modelhost.models.vision.tower import VisionTower

ENCODED_IMAGES = 8  # encodings kept: [n_tokens, hidden] each, a few MB at most


class ImageRows:
    def __init__(self, tower: VisionTower, device: torch.device, capacity: int = ENCODED_IMAGES):
        self.tower = tower
        self.device = device
        self.capacity = capacity
        self._encoded: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the tower (cache misses)

    def override(self, rows: Sequence[ScheduledRow]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(indices into the step's tokens, rows) for the image placeholders the step's rows
        compute, in the order the rows lay their tokens out; None when there are none."""
        indices: list[int] = []
        parts: list[torch.Tensor] = []
        offset = 0  # the row's first token among the step's
        for row in rows:
            start, end = row.start, row.start + row.num_tokens
            for span in row.seq.images:
                if not span.overlaps(start, end):
                    continue
                keep = [k for k, position in enumerate(span.positions) if start <= position < end]
                if not keep:
                    continue
                encoded = self.encoded(span)
                indices.extend(offset + span.positions[k] - start for k in keep)
                whole = len(keep) == len(span.positions)
                parts.append(encoded if whole else encoded[keep[0] : keep[-1] + 1])
            offset += row.num_tokens
        if not indices:
            return None
        index = torch.tensor(indices, dtype=torch.long, device=self.device)
        return index, torch.cat(parts).to(self.device)

    def encoded(self, span: ImageSpan) -> torch.Tensor:
        """The image's [n_tokens, hidden] rows, from the cache or the tower."""
        rows = self._encoded.get(span.digest)
        if rows is not None:
            self._encoded.move_to_end(span.digest)
            return rows
        rows = self.tower.encode(span.plan)
        if rows.shape[0] != len(span.positions):
            raise ValueError(
                f"the vision tower encoded {rows.shape[0]} rows for an image of "
                f"{len(span.positions)} placeholder tokens"
            )
        self.num_encoded += 1
        self._encoded[span.digest] = rows
        while len(self._encoded) > self.capacity:
            self._encoded.popitem(last=False)
        return rows
