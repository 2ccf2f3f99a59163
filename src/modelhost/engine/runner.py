"""SchedulerOutput -> ForwardBatch -> logits. The runner owns the KV pool and makes no decisions."""

from __future__ import annotations

from collections.abc import Callable

import torch

from modelhost.engine.image_rows import ImageRows
from modelhost.engine.kv.block_manager import cdiv
from modelhost.engine.kv.kv_memory import ReservedPools
from modelhost.engine.sampling.prompt_logprobs import prompt_logits_index
from modelhost.engine.scheduler import ScheduledRow, SchedulerOutput
from modelhost.models import kv_q8_layout
from modelhost.models.batch import ForwardBatch, KVCache
from modelhost.models.kernels import native
from modelhost.models.loaded import LoadedModel
from modelhost.models.vision.mrope import step_mrope_positions

PROMPT_THREADS_MIN_TOKENS = 64
# Prompts shorter than this take 16-bit activations whole (`_coarse_rows`): their steps are few
# rows, bound by reading the weights rather than by the products 8 bits would halve.
COARSE_MIN_PROMPT_TOKENS = 64
# bf16 rows (--prompt-activations bf16) only from this long a prompt: the bf16 GEMM takes its
# rows in panels of 512 (models/kernels/bf16_linear.py) and dequantizes every weight each
# step, which a shorter prompt's few rows do not pay back.
BF16_MIN_PROMPT_TOKENS = 512


class ModelRunner:
    def __init__(
        self,
        model: LoadedModel,
        *,
        num_blocks: int,
        block_size: int,
        prompt_threads: int | None = None,
        grows: bool = False,
        coarse_prompts: bool = False,
        coarse_bf16: bool = False,
        kv_cache: str = "f16",
    ) -> None:
        self.model = model
        # --prompt-activations 8 or bf16: a prompt's tokens before its last, whose logits
        # nobody reads, run the quantized linears with 8-bit activations, or in bf16
        # (models/kernels/packed.py).
        self.coarse_prompts = coarse_prompts
        self.coarse_bf16 = coarse_bf16
        self.prompt_threads = prompt_threads
        kernels = native.kernels()
        if kernels is not None and prompt_threads is not None:
            # The native weight kernels stream weights from memory in every step, decode
            # included: they run on the prompt-step thread count (models/kernels/native.py).
            kernels.threads = prompt_threads
        # Without them PyTorch's int4/int8 matmuls stream the weights, and a decode step runs
        # 1.6-1.9x faster on two threads than on one (AMD EPYC, AVX2 only): every step then
        # takes the prompt thread count.
        self.threads_every_step = kernels is None
        self.block_size = block_size
        config = model.config
        # One extra block pads every row's block table. The pool reads as zeros where nothing
        # was written (KVCache.allocate zeroes it; a reserved pool's untouched and given-back
        # pages are zero): attention gathers whole blocks, masked tails included, and a masked
        # NaN from unwritten memory would still poison SDPA's weighted sum (0 * NaN); stale
        # values a freed block keeps are finite and masked.
        self.pad_block = num_blocks
        num_slots = (num_blocks + 1) * block_size
        self._reserved: ReservedPools | None = None
        # --kv-cache q8: int8 slots with their scales (models/kv_q8.py), the same layout else.
        dtype, width = model.cache_dtype, config.head_dim
        if kv_cache == "q8":
            dtype, width = torch.int8, kv_q8_layout.slot_width(config.head_dim)
        if grows:  # reserved, committed as blocks are written (engine/kv/kv_memory.py)
            slot_shape = (2, config.num_kv_heads, width)
            self._reserved = ReservedPools(config.num_layers, num_slots, slot_shape, dtype)
            self.kv = KVCache(self._reserved.pools, block_size)
        else:
            self.kv = KVCache.allocate(
                num_layers=config.num_layers,
                num_slots=num_slots,
                num_kv_heads=config.num_kv_heads,
                head_dim=width,
                dtype=dtype,
                device=model.device,
                block_size=block_size,
            )
        self.sliding_window = config.sliding_window
        # A vision model's image placeholders take the tower's rows (engine/image_rows.py).
        self.images = ImageRows(model.vision, model.device) if model.vision is not None else None

    def release_blocks_from(self, block_id: int) -> None:
        """Give back the memory of block `block_id` and every block above it (a growing pool;
        a preallocated one keeps its memory). The blocks read as zeros afterwards."""
        if self._reserved is not None:
            self._reserved.release_from(block_id * self.block_size)

    def execute(
        self, out: SchedulerOutput, before_layers: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """Logits [S, vocab] for the rows that sample this step, in row order. The network
        calls `before_layers` once its layers are about to run."""
        batch = self.build_batch(out)
        adapters = self.model.row_adapters
        if adapters is None:
            return self._forward(batch, before_layers)
        # Each token adds its row's LoRA update (none for the base's rows): tokens are the
        # rows' in row order (models/adapters/row_adapters.py).
        uses = [row.seq.params.adapter for row in out.rows for _ in range(row.num_tokens)]
        with adapters.step(uses, batch.logits_index):
            return self._forward(batch, before_layers)

    def _forward(
        self, batch: ForwardBatch, before_layers: Callable[[], None] | None
    ) -> torch.Tensor:
        few_tokens = batch.input_ids.numel() < PROMPT_THREADS_MIN_TOKENS
        if self.prompt_threads is None or (few_tokens and not self.threads_every_step):
            return self.model.network(batch, self.kv, before_layers)
        # Decode steps on the native kernels stay on the serving thread count: on a shared
        # machine a second intra-op thread slows small matmuls down (a step waits for a
        # preempted thread).
        # This must stay a toggle: PyTorch has no thread count per call. Under its OpenMP
        # backend set_num_threads sets the calling thread's own count (the OpenMP and MKL
        # thread-local settings), so it changes only this engine thread's forwards, which no
        # other thread runs; it also sets the default a thread started meanwhile would take,
        # put back here with the count. Measured: two threads prefill Gemma 3 at 501 tok/s
        # against 363 with one, SmolLM2 382 against 359 (cli/serve_args.py, --prompt-threads).
        threads = torch.get_num_threads()
        torch.set_num_threads(self.prompt_threads)
        try:
            return self.model.network(batch, self.kv, before_layers)
        finally:
            torch.set_num_threads(threads)

    def build_batch(self, out: SchedulerOutput) -> ForwardBatch:
        rows = out.rows
        if all(
            row.num_tokens == 1 + len(row.draft) and row.start >= row.seq.num_prompt_tokens
            for row in rows
        ):
            return self._decode_batch(rows)
        return self._mixed_batch(rows)

    def _block_tables(self, rows: list[ScheduledRow], max_blocks: int) -> list[list[int]]:
        """Each row's first `max_blocks` blocks, padded with the pad block."""
        padded: list[list[int]] = []
        for row in rows:
            table = row.seq.block_table[:max_blocks]
            padded.append(table + [self.pad_block] * (max_blocks - len(table)))
        return padded

    def _decode_batch(self, rows: list[ScheduledRow]) -> ForwardBatch:
        """`_mixed_batch`'s batch where every row computes one generated token (decode steps,
        the common case): built from lists with a few tensor ops instead of ~25.

        A row verifying a speculative draft computes its last token and its guesses: each of
        those positions is a row of this batch of its own, over the row's block table, so it
        runs through exactly the kernels of a one-token decode step (engine/speculation.py)."""
        block_size = self.block_size
        positions: list[int] = []
        token_ids: list[int] = []
        tokens_rows: list[ScheduledRow] = []
        for row in rows:
            positions.extend(range(row.start, row.start + row.num_tokens))
            token_ids.append(row.seq.token_ids[row.start])
            token_ids.extend(row.draft)
            tokens_rows.extend([row] * row.num_tokens)
        max_blocks = max(positions) // block_size + 1
        padded = self._block_tables(tokens_rows, max_blocks)
        slots = [
            table[position // block_size] * block_size + position % block_size
            for table, position in zip(padded, positions, strict=True)
        ]
        position_t = torch.tensor(positions, dtype=torch.long)
        distance = position_t[:, None] - torch.arange(max_blocks * block_size)[None, :]
        attn_mask = (distance >= 0)[:, None, None, :]
        sliding_mask = None
        if self.sliding_window is not None:
            sliding_mask = attn_mask & (distance < self.sliding_window)[:, None, None, :]
        device = self.model.device
        index = torch.arange(len(positions), device=device)
        tables = torch.tensor(padded, dtype=torch.long, device=device)
        # Each token is a row of its own here, so each takes its own row's images.
        mrope = self._mrope_positions(position_t, [1] * len(tokens_rows), tokens_rows)
        return ForwardBatch(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device),
            positions=position_t.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_index=index[:, None],
            output_index=index,
            kv_blocks=tables,
            token_blocks=tables,
            attn_mask=attn_mask.to(device),
            sliding_mask=None if sliding_mask is None else sliding_mask.to(device),
            logits_index=torch.tensor(
                [i for i, row in enumerate(tokens_rows) if row.samples],
                dtype=torch.long,
                device=device,
            ),
            dense=True,
            mrope_positions=mrope,
        )

    def _mixed_batch(self, rows: list[ScheduledRow]) -> ForwardBatch:
        block_size = self.block_size
        starts = [row.start for row in rows]
        counts = [row.num_tokens for row in rows]
        input_ids: list[int] = []
        for row in rows:
            input_ids.extend(row.seq.token_ids[row.start : row.start + row.num_tokens])
        max_q = max(counts)
        max_blocks = max(cdiv(s + n, block_size) for s, n in zip(starts, counts, strict=True))
        tables = torch.tensor(self._block_tables(rows, max_blocks), dtype=torch.long)

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

        kv_pos = torch.arange(max_blocks * block_size)[None, None, :]
        # Padded queries point at position 0 so their softmax row is never empty (no NaNs).
        q_pos = torch.where(q_valid, start_t[:, None] + q_range[None, :], 0)[:, :, None]
        # Compared into bools directly: an int64 [R, max_q, max_kv] distance took ~150 ms a
        # step at 32k of context, 5x the comparisons.
        attn_mask = (kv_pos <= q_pos)[:, None]
        sliding_mask = None
        if self.sliding_window is not None:
            sliding_mask = attn_mask & (kv_pos > q_pos - self.sliding_window)[:, None]

        bidirectional = False
        if self.images is not None and self.images.tower.bidirectional:
            block = self._image_blocks(rows, max_q, max_blocks * block_size)
            if block is not None:  # the step's images attend to their own tokens both ways
                bidirectional = True
                attn_mask = attn_mask | block
                if sliding_mask is not None:
                    sliding_mask = sliding_mask | block

        sample_last = [
            offset + count - 1
            for offset, count, row in zip(offsets.tolist(), counts, rows, strict=True)
            if row.samples
        ]
        # Rows that want prompt logprobs get logits at their prompt positions too, after these.
        sample_last += prompt_logits_index(rows)
        device = self.model.device
        prompt_rows = self._prompt_rows(rows, positions, row_of_token, sample_last)
        if prompt_rows is not None:
            prompt_rows = prompt_rows.to(device)
        coarse = None
        if self.coarse_prompts:
            coarse = self._coarse_rows(rows, positions, row_of_token, sample_last)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            query_index=query_index.to(device),
            output_index=output_index.to(device),
            kv_blocks=tables.to(device),
            token_blocks=tables[row_of_token].to(device),
            attn_mask=attn_mask.to(device),
            sliding_mask=None if sliding_mask is None else sliding_mask.to(device),
            logits_index=torch.tensor(sample_last, dtype=torch.long, device=device),
            dense=len(rows) == 1 or max_q == 1,
            embed_override=self.images.override(rows) if self.images is not None else None,
            mrope_positions=self._mrope_positions(positions, counts, rows),
            bidirectional=bidirectional,
            prompt_rows=prompt_rows,
            coarse_rows=None if coarse is None else coarse.to(device),
            coarse_bf16=coarse is not None and self.coarse_bf16,
        )

    @staticmethod
    def _prompt_rows(
        rows: list[ScheduledRow],
        positions: torch.Tensor,
        row_of_token: torch.Tensor,
        wanted: list[int],
    ) -> torch.Tensor | None:
        """[T] bool: the step's prompt tokens before each prompt's last, less those whose
        logits are wanted (prompt logprobs); None when there are none. Whether a token is one
        depends on its request alone, not on how the prompt was chunked or cached."""
        last = torch.tensor([row.seq.num_prompt_tokens - 1 for row in rows], dtype=torch.long)
        unread = positions < last[row_of_token]
        if wanted:
            unread[torch.tensor(wanted, dtype=torch.long)] = False
        return unread if bool(unread.any()) else None

    def _coarse_rows(
        self,
        rows: list[ScheduledRow],
        positions: torch.Tensor,
        row_of_token: torch.Tensor,
        wanted: list[int],
    ) -> torch.Tensor | None:
        """[T] bool: the step's prompt tokens before the block of each prompt's last token (of
        prompts of COARSE_MIN_PROMPT_TOKENS or more, BF16_MIN_PROMPT_TOKENS in bf16), less those
        whose logits are wanted (prompt logprobs); None when there are none. Whether a token is
        one depends on its request alone, not on how the prompt was chunked or cached.

        A step computing coarse and 16-bit rows reads every weight twice (packed.py computes
        the two sets apart), which a step of few rows, bound by reading its weights, pays in
        full: a cached prompt recomputes its last block (up to block_size tokens, its last one
        sampled at 16 bits), and a short prompt is a few rows whole. So those stay at 16 bits
        and such a step reads its weights once (a 1B file's cached prompt: its first token
        in about one decode step, not two)."""
        bs = self.block_size
        shortest = BF16_MIN_PROMPT_TOKENS if self.coarse_bf16 else COARSE_MIN_PROMPT_TOKENS
        ends = [
            (row.seq.num_prompt_tokens - 1) // bs * bs
            if row.seq.num_prompt_tokens >= shortest
            else 0
            for row in rows
        ]
        coarse = positions < torch.tensor(ends, dtype=torch.long)[row_of_token]
        if wanted:
            coarse[torch.tensor(wanted, dtype=torch.long)] = False
        return coarse if bool(coarse.any()) else None

    @staticmethod
    def _image_blocks(rows: list[ScheduledRow], max_q: int, max_kv: int) -> torch.Tensor | None:
        """[R, 1, max_q, max_kv] True where a query of an image this step computes meets any
        token of the same image (Gemma 3); None when the step computes no image token. The
        scheduler keeps an image's tokens in one step (SchedulerConfig.whole_images), so each
        sees all of its image's, earlier ones from the cache included."""
        block: torch.Tensor | None = None
        for r, row in enumerate(rows):
            start, end = row.start, row.start + row.num_tokens
            for span in row.seq.images:
                if not span.overlaps(start, end):
                    continue
                queries = [p - start for p in span.positions if start <= p < end]
                if block is None:
                    block = torch.zeros(len(rows), 1, max_q, max_kv, dtype=torch.bool)
                keys = torch.tensor(span.positions)
                block[r, 0, torch.tensor(queries)[:, None], keys[None, :]] = True
        return block

    def _mrope_positions(
        self, positions: torch.Tensor, counts: list[int], rows: list[ScheduledRow]
    ) -> torch.Tensor | None:
        """[3, T] M-RoPE positions where a row holds an M-RoPE image (Qwen2.5-VL), else None:
        decode steps after an image keep its shift too (models/vision/mrope.py)."""
        if self.images is None or not any(row.seq.images for row in rows):
            return None
        images = [row.seq.images for row in rows]
        mrope = step_mrope_positions(positions, counts, images)
        return None if mrope is None else mrope.to(self.model.device)
