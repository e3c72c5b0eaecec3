"""Device slots: per-target, slot-stacked LoRA weight buffers, and adapters packed to fill one slot.

For each LoRA target (qkv_proj, o_proj, gate_up_proj, down_proj) one set of buffers holds every
layer and every slot, so layer i's view is exactly what kernels/sgmv.py takes:
    lora_a[i]         [num_slices, num_slots, max_rank, d_in]
    lora_b[i]         [num_slots, d_out, max_rank]   (the slices' B rows concatenated; a transposed
                                                      view of rank-major [num_slots, max_rank, d_out])
    slot_ranks[i]     [num_slots] int32              0 = the slot's adapter leaves this linear alone
    slot_scalings[i]  [num_slots] float32
Ranks are per (layer, target), so a target an adapter does not touch costs no LoRA compute.
B is stored rank-major so that a slot's first r ranks are one contiguous block: the CPU kernel
reads B[slot, :r] in place at memory bandwidth, where the [d_out, max_rank] layout would read d_out
short strided rows (and pull in the padding past r with them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from adapters.peft_format import LoraAdapter
from adapters.targets import LoraTarget, lora_targets
from engine.model.spec import ModelSpec
from kernels.sgmv_cpu import RankViews


@dataclass(frozen=True)
class PackedTarget:
    """One adapter's weights for one target, every layer: the contents of one slot, unpadded."""

    lora_a: torch.Tensor  # [num_layers, num_slices, rank, d_in], model dtype; rank = max over layers
    lora_b: torch.Tensor  # [num_layers, rank, d_out], rank-major like the slots
    ranks: torch.Tensor  # [num_layers] int32, each layer's own rank (0 = not targeted)
    scalings: torch.Tensor  # [num_layers] float32


@dataclass(frozen=True)
class PackedAdapter:
    """An adapter laid out for page-in (the host tier's entries); pinned on CUDA machines."""

    digest: str
    targets: dict[str, PackedTarget]  # by LoraTarget.name


def pack_adapter(adapter: LoraAdapter, spec: ModelSpec, dtype: torch.dtype,
                 pin_memory: bool) -> PackedAdapter:
    """Stack a validated adapter's modules per target, in the model dtype."""
    targets = {t.name: _pack_target(adapter, t, spec.num_layers, dtype) for t in lora_targets(spec)}
    if pin_memory:
        targets = {name: PackedTarget(*(x.pin_memory() for x in (t.lora_a, t.lora_b, t.ranks, t.scalings)))
                   for name, t in targets.items()}
    return PackedAdapter(adapter.digest, targets)


def _pack_target(adapter: LoraAdapter, target: LoraTarget, num_layers: int,
                 dtype: torch.dtype) -> PackedTarget:
    # layers[i]: (slice index, module) of each projection of the target the adapter has in layer i
    layers = [[(s, adapter.modules[(i, p)]) for s, p in enumerate(target.projections)
               if (i, p) in adapter.modules] for i in range(num_layers)]
    ranks = [max((m.rank for _, m in slices), default=0) for slices in layers]
    rank, offsets = max(ranks), target.slice_offsets
    lora_a = torch.zeros(num_layers, target.num_slices, rank, target.in_features)  # float32
    lora_b = torch.zeros(num_layers, rank, offsets[-1])
    scalings = torch.zeros(num_layers)
    for layer, slices in enumerate(layers):
        if not slices:
            continue
        scalings[layer] = slot_scaling = max((m.scaling for _, m in slices), key=abs)
        for s, m in slices:
            # NOTE: the fused slices of one slot share one scaling in the kernel, so a slice whose own
            # scaling differs (rank_pattern / alpha_pattern) gets the ratio folded into its B rows.
            # Its rows past its own rank stay zero, so padding to the layer's rank changes nothing.
            fold = m.scaling / slot_scaling if slot_scaling else 0.0
            lora_a[layer, s, :m.rank] = m.lora_a.float()
            lora_b[layer, :m.rank, offsets[s]:offsets[s + 1]] = m.lora_b.float().T * fold
    return PackedTarget(lora_a.to(dtype), lora_b.to(dtype), torch.tensor(ranks, dtype=torch.int32), scalings)


@dataclass(frozen=True)
class LoraLayerWeights:
    """One layer's slot-stacked weights of one target, in the layout kernels/sgmv.py takes."""

    lora_a: torch.Tensor  # [num_slices, num_slots, max_rank, d_in]
    lora_b: torch.Tensor  # [num_slots, d_out, max_rank]
    slot_ranks: torch.Tensor  # [num_slots] int32
    slot_scalings: torch.Tensor  # [num_slots] float32
    slice_offsets: torch.Tensor  # [num_slices + 1] int32
    rank_views: RankViews  # the CPU kernel's per-slot views of lora_a and lora_b, kept across steps


class TargetSlots:
    """The device buffers of one target, all layers and slots; slots are written whole."""

    def __init__(self, target: LoraTarget, num_layers: int, num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        self.target = target
        d_out = target.slice_offsets[-1]
        self.lora_a = torch.zeros(num_layers, target.num_slices, num_slots, max_rank, target.in_features,
                                  dtype=dtype, device=device)
        self.lora_b_rows = torch.zeros(num_layers, num_slots, max_rank, d_out, dtype=dtype, device=device)
        self.lora_b = self.lora_b_rows.transpose(2, 3)  # [num_layers, num_slots, d_out, max_rank]
        self.slot_ranks = torch.zeros(num_layers, num_slots, dtype=torch.int32, device=device)
        self.slot_scalings = torch.zeros(num_layers, num_slots, dtype=torch.float32, device=device)
        self.slice_offsets = torch.tensor(target.slice_offsets, dtype=torch.int32, device=device)
        self.layers = [LoraLayerWeights(self.lora_a[i], self.lora_b[i], self.slot_ranks[i],
                                        self.slot_scalings[i], self.slice_offsets,
                                        RankViews(self.lora_a[i], self.lora_b[i], target.slice_offsets))
                       for i in range(num_layers)]

    def layer(self, index: int) -> LoraLayerWeights:
        return self.layers[index]

    def write(self, slot: int, packed: PackedTarget) -> None:
        """Copy an adapter into `slot` on the current stream, zeroing the rank padding."""
        rank = packed.lora_a.shape[2]
        self.lora_a[:, :, slot, :rank].copy_(packed.lora_a, non_blocking=True)
        self.lora_a[:, :, slot, rank:].zero_()
        self.lora_b_rows[:, slot, :rank].copy_(packed.lora_b, non_blocking=True)
        self.lora_b_rows[:, slot, rank:].zero_()
        self.slot_ranks[:, slot].copy_(packed.ranks, non_blocking=True)
        self.slot_scalings[:, slot].copy_(packed.scalings, non_blocking=True)


def slot_buffer_bytes(spec: ModelSpec, num_slots: int, max_rank: int, dtype: torch.dtype) -> int:
    """The device memory SlotBuffers of these sizes take (its A and B weights), before any is
    allocated: so that a setting past the device's memory is refused with a message."""
    per_rank = sum(t.num_slices * t.in_features + t.slice_offsets[-1] for t in lora_targets(spec))
    return spec.num_layers * num_slots * max_rank * per_rank * torch.empty((), dtype=dtype).element_size()


class SlotBuffers:
    """Device slots of every target: `max_gpu_adapters` adapters resident at once."""

    def __init__(self, spec: ModelSpec, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.targets = {t.name: TargetSlots(t, spec.num_layers, num_slots, max_rank, dtype, device)
                        for t in lora_targets(spec)}

    def layer(self, index: int) -> dict[str, LoraLayerWeights]:
        """Layer `index`'s weights by target name: what its LoRA-aware linears read."""
        return {name: t.layer(index) for name, t in self.targets.items()}

    def write(self, slot: int, packed: PackedAdapter) -> None:
        for name, target in self.targets.items():
            target.write(slot, packed.targets[name])

    @property
    def nbytes(self) -> int:
        return sum(t.lora_a.nbytes + t.lora_b.nbytes for t in self.targets.values())
