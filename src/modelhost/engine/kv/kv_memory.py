"""Memory for a KV pool that grows with use and gives pages back: each layer's pool lives in its
own anonymous private memory map, reserved at its ceiling but committed by the kernel only as
blocks are first written.

Untouched pages of such a map read as zeros, and so do pages given back with
`madvise(MADV_DONTNEED)`: a block is zero the first time it is handed out without a pass over
its bytes (attention gathers whole blocks, masked tails included, and a NaN from unwritten
memory would poison the weighted sum), and the pool's resident size is the blocks written since
the last give-back, not its ceiling. CUDA keeps a preallocated pool (`grows_on`).
"""

from __future__ import annotations

import mmap
import sys

import torch

PAGE_BYTES = mmap.PAGESIZE
_LINUX_MAP_NORESERVE = 0x4000  # Python's mmap module names it only from 3.13
_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", getattr(mmap, "MAP_ANON", 0))
# Reserve address space, not swap: the residency budget, not the kernel's overcommit, bounds use.
_FLAGS |= getattr(mmap, "MAP_NORESERVE", _LINUX_MAP_NORESERVE if sys.platform == "linux" else 0)


def grows_on(device: torch.device) -> bool:
    """Whether a pool on `device` can grow in place: CPU memory where madvise gives pages back."""
    return device.type == "cpu" and hasattr(mmap, "MADV_DONTNEED")


class ReservedPools:
    """`num_layers` pools of shape [num_slots, *slot_shape], each in its own memory map."""

    def __init__(
        self, num_layers: int, num_slots: int, slot_shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        self.slot_bytes = dtype.itemsize
        for dim in slot_shape:
            self.slot_bytes *= dim
        self.num_slots = num_slots
        size = max(PAGE_BYTES, -(-num_slots * self.slot_bytes // PAGE_BYTES) * PAGE_BYTES)
        self._maps = [mmap.mmap(-1, size, flags=_FLAGS) for _ in range(num_layers)]
        # The tensors hold the maps' buffers for as long as they live; the maps are never
        # closed by hand (a map with exported buffers cannot be), only dropped with the pool.
        count = num_slots * self.slot_bytes // dtype.itemsize
        self.pools = [
            torch.frombuffer(m, dtype=dtype, count=count).view(num_slots, *slot_shape)
            for m in self._maps
        ]

    def release_from(self, first_slot: int) -> int:
        """Give back every whole page from slot `first_slot` to the end, in every layer (they
        read as zeros afterwards); a page shared with a slot below it stays. Returns the bytes
        given back per layer."""
        start = -(-first_slot * self.slot_bytes // PAGE_BYTES) * PAGE_BYTES
        end = len(self._maps[0]) if self._maps else 0
        if start >= end:
            return 0
        for m in self._maps:
            m.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start
