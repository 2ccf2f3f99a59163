"""SchedulerOutput -> ForwardBatch -> logits. The runner owns the KV pool and makes no decisions."""

from __future__ import annotations

import torch

from modelhost.engine.block_manager import cdiv
from modelhost.engine.scheduler import SchedulerOutput
from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.loaded import LoadedModel


class ModelRunner:
    def __init__(self, model: LoadedModel, *, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        config = model.config
        # One extra block, zeroed, backs every padded KV position: unwritten pool memory may
        # hold NaNs, and a masked NaN still poisons SDPA's weighted sum (0 * NaN).
        self.pad_slot = num_blocks * block_size
        self.kv = KVCache.allocate(
            num_layers=config.num_layers,
            num_slots=(num_blocks + 1) * block_size,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        for pool in (*self.kv.keys, *self.kv.values):
            pool[self.pad_slot :].zero_()
        self.sliding_window = config.sliding_window

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [S, vocab] for the rows that sample this step, in row order."""
        batch = self.build_batch(out)
        return self.model.network(batch, self.kv)

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        block_size = self.block_size
        rows = out.rows
        starts = [row.start for row in rows]
        counts = [row.num_tokens for row in rows]
        input_ids: list[int] = []
        for row in rows:
            input_ids.extend(row.seq.token_ids[row.start : row.start + row.num_tokens])
        max_q = max(counts)
        max_blocks = max(cdiv(s + n, block_size) for s, n in zip(starts, counts, strict=True))
        tables = torch.zeros((len(rows), max_blocks), dtype=torch.long)
        for index, row in enumerate(rows):
            table = row.seq.block_table[:max_blocks]
            tables[index, : len(table)] = torch.tensor(table, dtype=torch.long)

        start_t = torch.tensor(starts, dtype=torch.long)
        count_t = torch.tensor(counts, dtype=torch.long)
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), count_t)
        offsets = torch.cumsum(count_t, 0) - count_t  # first flat index of each row
        within = torch.arange(len(input_ids)) - offsets[row_of_token]  # query number in its row
        positions = start_t[row_of_token] + within
        slot_mapping = (
            tables[row_of_token, positions // block_size] * block_size + positions % block_size
        )

        q_range = torch.arange(max_q)
        q_valid = q_range[None, :] < count_t[:, None]
        query_index = torch.where(q_valid, offsets[:, None] + q_range[None, :], 0)
        output_index = row_of_token * max_q + within

        slot_in_block = torch.arange(block_size)
        kv_slots = (tables[:, :, None] * block_size + slot_in_block).reshape(len(rows), -1)
        kv_pos = torch.arange(kv_slots.shape[1])
        kv_slots = torch.where(
            kv_pos[None, :] < (start_t + count_t)[:, None], kv_slots, self.pad_slot
        )
        # Padded queries point at position 0 so their softmax row is never empty (no NaNs).
        q_pos = torch.where(q_valid, start_t[:, None] + q_range[None, :], 0)
        distance = q_pos[:, :, None] - kv_pos[None, None, :]
        attn_mask = (distance >= 0)[:, None]
        sliding_mask = None
        if self.sliding_window is not None:
            sliding_mask = ((distance >= 0) & (distance < self.sliding_window))[:, None]

        sample_last = [
            offset + count - 1
            for offset, count, row in zip(offsets.tolist(), counts, rows, strict=True)
            if row.samples
        ]
        device = self.model.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            query_index=query_index.to(device),
            output_index=output_index.to(device),
            kv_slots=kv_slots.to(device),
            attn_mask=attn_mask.to(device),
            sliding_mask=None if sliding_mask is None else sliding_mask.to(device),
            logits_index=torch.tensor(sample_last, dtype=torch.long, device=device),
        )
