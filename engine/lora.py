"""Per-step LoRA state for the model: which token segments use which adapter slot.

The runner groups a step's tokens by adapter slot, so one SGMV launch per linear covers every
adapter in the batch (Punica-style). Base-model tokens form segments with slot -1, which the
kernels leave untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from adapters.slots import SlotBuffers
from kernels.sgmv import sgmv_expand, sgmv_shrink


class AdapterSlots(Protocol):
    """What the scheduler needs of the adapter cache: a check/commit pair and a release."""

    def can_acquire(self, adapter_id: str) -> bool: ...

    def acquire(self, adapter_id: str) -> int: ...

    def release(self, adapter_id: str) -> None: ...

    def prefetch(self, adapter_ids: list[str]) -> None: ...


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs with: its identity (sha256 of its files) and where they are."""

    adapter_id: str
    path: str


@dataclass
class LoraBatch:
    seg_starts: torch.Tensor  # [num_segs + 1] int32, token offsets
    seg_slots: torch.Tensor  # [num_segs] int32, -1 = base model
    max_seg_len: int
    slots: SlotBuffers

    @classmethod
    def build(cls, token_slots: list[tuple[int, int]], slots: SlotBuffers,
              device: torch.device) -> "LoraBatch | None":
        """token_slots: (num_tokens, slot) per sequence, in flat-batch order. None if no adapter."""
        if all(slot < 0 for _, slot in token_slots):
            return None
        starts, seg_slots = [0], []
        for num_tokens, slot in token_slots:
            if seg_slots and seg_slots[-1] == slot:
                starts[-1] += num_tokens
            else:
                seg_slots.append(slot)
                starts.append(starts[-1] + num_tokens)
        max_len = max(b - a for a, b in zip(starts, starts[1:]))
        return cls(torch.tensor(starts, dtype=torch.int32, device=device),
                   torch.tensor(seg_slots, dtype=torch.int32, device=device), max_len, slots)

    def apply(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the LoRA delta of every token's adapter. x: [T, d_in]; out: [T, d_out]."""
        weights = self.slots.targets[target].layer(layer)
        num_slices, _, max_rank, _ = weights.lora_a.shape
        buffer = torch.empty(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
        sgmv_shrink(x, weights.lora_a, self.seg_starts, self.seg_slots, weights.slot_ranks, buffer,
                    self.max_seg_len)
        sgmv_expand(buffer, weights.lora_b, self.seg_starts, self.seg_slots, weights.slot_ranks,
                    weights.slot_scalings, out, weights.slice_offsets, self.max_seg_len)
