"""Per-step LoRA state for the model: which token segments use which adapter slot.

The runner groups a step's tokens by adapter slot, so one SGMV launch per linear covers every
adapter in the batch (Punica-style). Base-model tokens form segments with slot -1, which the
kernels leave untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from adapters.slots import SlotBuffers
from kernels.sgmv import Segments, add_lora
from store.blobs import digest_files


class AdapterSlots(Protocol):
    """What the scheduler needs of the adapter cache: a check/commit pair and a release."""

    def can_acquire(self, adapter_id: str) -> bool: ...

    def is_loaded(self, adapter_id: str) -> bool: ...

    def acquire(self, adapter_id: str, counted: bool = True) -> int: ...

    def release(self, adapter_id: str) -> None: ...

    def prefetch(self, adapter_ids: list[str]) -> None: ...

    def drop_load(self, adapter_id: str) -> None: ...


@dataclass(frozen=True)
class LoraRequest:
    """The adapter a request runs with: its identity (sha256 of its files) and where they are."""

    adapter_id: str
    path: str

    @classmethod
    def of_folder(cls, folder: str | Path) -> "LoraRequest":
        """The request for the PEFT adapter in `folder`, its id the digest of its files (which the
        engine checks them against as it loads them)."""
        return cls(digest_files(Path(folder)), str(folder))


@dataclass
class LoraBatch:
    segments: Segments  # consecutive tokens of one slot, -1 = base model
    slots: SlotBuffers

    @classmethod
    def build(cls, token_slots: list[tuple[int, int]], slots: SlotBuffers,
              device: torch.device) -> "LoraBatch | None":
        """token_slots: (num_tokens, slot) per sequence, in flat-batch order. None if no adapter."""
        if all(slot < 0 for _, slot in token_slots):
            return None
        lens: list[int] = []
        seg_slots: list[int] = []
        for num_tokens, slot in token_slots:
            if seg_slots and seg_slots[-1] == slot:
                lens[-1] += num_tokens
            else:
                lens.append(num_tokens)
                seg_slots.append(slot)
        return cls(Segments.build(lens, seg_slots, device), slots)

    def apply(self, layer: int, target: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += the LoRA delta of every token's adapter. x: [T, d_in]; out: [T, d_out]."""
        weights = self.slots.targets[target].layer(layer)
        add_lora(x, weights.lora_a, weights.lora_b, self.segments, weights.slot_ranks, weights.slot_scalings, out,
                 weights.slice_offsets, weights.rank_views)
