"""SGMV LoRA math for a flat batch: `sgmv_shrink` then `sgmv_expand`, Punica-style.

A layer's LoRA delta for a batch is `out += scaling * (x @ A^T) @ B^T`, with A and B picked per
token by its adapter slot. Tokens are grouped into contiguous segments, one slot per segment:

    seg_starts     int32 [num_segs + 1]   CSR offsets into the tokens (segments may be empty)
    seg_slots      int32 [num_segs]       slot of each segment, any order, repeats allowed; -1 = none
    slot_ranks     int32 [num_slots]      each slot's real rank (0 <= r <= max_rank), read at run
                                          time: padding rows past r are never read, rank 0 = no-op
    slot_scalings  float32 [num_slots]    LoRA alpha / r of each slot

Fused layers (q/k/v, gate/up) apply several slices in one launch. Slice s has its own A stack
`lora_a[s]` and its own column range `slice_offsets[s]:slice_offsets[s + 1]` of the fused output;
`lora_b` holds the slices' B rows concatenated, like the fused base weight, so its row n feeds
output column n. A plain layer is one slice: lora_a may drop the slice dim ([num_slots, max_rank,
d_in]), the rank buffer too ([num_tokens, max_rank]), and slice_offsets defaults to the whole output.

The rank buffer is float32: split-K partial sums are added into it atomically, and the LoRA product
is rounded to the model dtype only once, when added to the base output.

`add_lora` is shrink then expand in one call, what a LoRA-aware linear runs; it takes the step's
segments as `Segments`, built once per step (device tensors for the GPU, lists for the CPU).

Dispatch: CUDA tensors run the Triton kernels (`kernels/sgmv_triton.py`). On CPU, `add_lora` runs
`kernels/sgmv_cpu.py`, which batches the per-segment matmuls and never materialises the rank
buffer, while `sgmv_shrink` / `sgmv_expand` run the torch twins (`kernels/sgmv_torch.py`), the
reference the other two are tested against. lora_b may be any strided view; adapters/slots.py
passes a transposed view of rank-major [num_slots, max_rank, d_out] storage, whose slot rows the
CPU path reads in place. `max_seg_len`, the longest segment, is a host-side hint that sizes the GPU
grid; None means num_tokens (correct, but launches idle programs for decode batches).
"""

from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kernels.sgmv_cpu import RankViews, SegmentPlans, add_lora_cpu
from kernels.sgmv_torch import sgmv_expand_torch, sgmv_shrink_torch


@dataclass(frozen=True)
class Segments:
    """One step's segments, built once per step: tensors for the GPU kernels, lists for the CPU path."""

    starts: torch.Tensor  # [num_segs + 1] int32
    slots: torch.Tensor  # [num_segs] int32, -1 = no adapter
    lens: list[int]  # [num_segs] tokens per segment
    slot_list: list[int]  # [num_segs] slots, as in `slots`
    cpu: SegmentPlans = field(init=False, repr=False, compare=False)  # the CPU path's per-step split

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu", SegmentPlans(self.lens, self.slot_list))

    @classmethod
    def build(cls, lens: list[int], slots: list[int], device: torch.device) -> "Segments":
        starts = torch.tensor(list(accumulate(lens, initial=0)), dtype=torch.int32, device=device)
        return cls(starts, torch.tensor(slots, dtype=torch.int32, device=device), lens, slots)

    @property
    def max_len(self) -> int:
        """The longest segment: the GPU kernels' launch-size hint."""
        return max(self.lens, default=0)


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, d_in]
    lora_a: torch.Tensor,  # [num_slices, num_slots, max_rank, d_in] or [num_slots, max_rank, d_in]
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32
    slot_ranks: torch.Tensor,  # [num_slots] int32
    out: torch.Tensor,  # [num_slices, num_tokens, max_rank] or [num_tokens, max_rank], float32
    max_seg_len: int | None = None,
) -> None:
    """Overwrite out: out[s, t, :r] = x[t] @ lora_a[s, slot, :r]^T, zero everywhere else."""
    lora_a = lora_a if lora_a.dim() == 4 else lora_a.unsqueeze(0)
    out = out if out.dim() == 3 else out.unsqueeze(0)
    assert lora_a.dtype == x.dtype and out.dtype == torch.float32, "x, lora_a: model dtype; out: float32"
    assert out.shape == (lora_a.shape[0], x.shape[0], lora_a.shape[2]), "out must be [num_slices, num_tokens, max_rank]"
    if x.is_cuda:
        # Imported here so CPU-only processes never load triton.
        from kernels.sgmv_triton import sgmv_shrink_triton as impl
    else:
        impl = sgmv_shrink_torch
    impl(x, lora_a, seg_starts, seg_slots, slot_ranks, out, max_seg_len)


def sgmv_expand(
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank] or [num_tokens, max_rank], float32
    lora_b: torch.Tensor,  # [num_slots, d_out, max_rank]
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32
    slot_ranks: torch.Tensor,  # [num_slots] int32
    slot_scalings: torch.Tensor,  # [num_slots] float32
    out: torch.Tensor,  # [num_tokens, d_out]
    slice_offsets: torch.Tensor | None = None,  # [num_slices + 1] int32, 0 first, d_out last
    max_seg_len: int | None = None,
) -> None:
    """In place: out[t, lo_s:hi_s] += scaling[slot] * buf[s, t, :r] @ lora_b[slot, lo_s:hi_s, :r]^T.

    Summed in float32 and rounded to out.dtype once; tokens without an adapter are left untouched.
    """
    buf = buf if buf.dim() == 3 else buf.unsqueeze(0)
    assert lora_b.dtype == out.dtype and buf.dtype == torch.float32, "out, lora_b: model dtype; buf: float32"
    assert lora_b.shape[1] == out.shape[1] and buf.shape[1] == out.shape[0], "lora_b rows must match out columns"
    assert slice_offsets is not None or buf.shape[0] == 1, "several slices need slice_offsets"
    if out.is_cuda:
        from kernels.sgmv_triton import sgmv_expand_triton as impl
    else:
        impl = sgmv_expand_torch
    impl(buf, lora_b, seg_starts, seg_slots, slot_ranks, slot_scalings, out, slice_offsets, max_seg_len)


def add_lora(
    x: torch.Tensor,  # [num_tokens, d_in]
    lora_a: torch.Tensor,  # [num_slices, num_slots, max_rank, d_in] or [num_slots, max_rank, d_in]
    lora_b: torch.Tensor,  # [num_slots, d_out, max_rank]
    segments: Segments,
    slot_ranks: torch.Tensor,  # [num_slots] int32
    slot_scalings: torch.Tensor,  # [num_slots] float32
    out: torch.Tensor,  # [num_tokens, d_out]
    slice_offsets: torch.Tensor | None = None,  # [num_slices + 1] int32, 0 first, d_out last
    rank_views: RankViews | None = None,  # of lora_a and lora_b, kept between calls by their owner
) -> None:
    """In place: out += the LoRA delta of every token, as `sgmv_shrink` then `sgmv_expand` would."""
    lora_a = lora_a if lora_a.dim() == 4 else lora_a.unsqueeze(0)
    assert lora_a.dtype == x.dtype and lora_b.dtype == out.dtype, "x, lora_a: model dtype; lora_b, out too"
    assert slice_offsets is not None or lora_a.shape[0] == 1, "several slices need slice_offsets"
    if not out.is_cuda:
        if rank_views is None:
            offsets = [0, out.shape[1]] if slice_offsets is None else slice_offsets.tolist()
            rank_views = RankViews(lora_a, lora_b, offsets)
        add_lora_cpu(x, rank_views, segments.cpu, slot_ranks, slot_scalings, out)
        return
    num_slices, _, max_rank, _ = lora_a.shape
    buffer = torch.empty(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)
    sgmv_shrink(x, lora_a, segments.starts, segments.slots, slot_ranks, buffer, segments.max_len)
    sgmv_expand(buffer, lora_b, segments.starts, segments.slots, slot_ranks, slot_scalings, out, slice_offsets,
                segments.max_len)
