"""Plain-torch twins of the SGMV kernels in `kernels/sgmv_triton.py`.

Same signatures and shapes (the canonical, sliced ones documented in `kernels/sgmv.py`), same
results up to float32 summation order. They are the reference that the Triton kernels and the
CPU path (`kernels/sgmv_cpu.py`, what runs on CPU in production) are tested against, so they stay
plain: a loop over segments (one matmul each), never tokens.
"""

from collections.abc import Iterator

import torch


def _active_segments(
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32
    slot_ranks: torch.Tensor,  # [num_slots] int32
) -> Iterator[tuple[int, int, int, int]]:
    """Yield (start, end, slot, rank) for each segment that has work: tokens, a slot, a rank > 0."""
    starts = seg_starts.tolist()
    ranks = slot_ranks.tolist()
    for seg, slot in enumerate(seg_slots.tolist()):
        start, end = starts[seg], starts[seg + 1]
        if slot >= 0 and end > start and ranks[slot] > 0:
            yield start, end, slot, ranks[slot]


def sgmv_shrink_torch(
    x: torch.Tensor,  # [num_tokens, d_in]
    lora_a: torch.Tensor,  # [num_slices, num_slots, max_rank, d_in], x.dtype
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32, -1 = no adapter
    slot_ranks: torch.Tensor,  # [num_slots] int32
    out: torch.Tensor,  # [num_slices, num_tokens, max_rank] float32
    max_seg_len: int | None = None,
) -> None:
    """out[s, t, :r] = x[t] @ lora_a[s, slot, :r]^T in float32; every other entry of out is 0.

    `max_seg_len` is the GPU kernel's launch-size hint; segment bounds are read directly here.
    """
    num_slices = lora_a.shape[0]
    out.zero_()
    for start, end, slot, rank in _active_segments(seg_starts, seg_slots, slot_ranks):
        # All slices in one matmul: their A rows side by side.
        a = lora_a[:, slot, :rank].float().reshape(num_slices * rank, -1)  # [S * r, d_in]
        y = x[start:end].float() @ a.T  # [seg_len, S * r]
        out[:, start:end, :rank] = y.view(end - start, num_slices, rank).transpose(0, 1)


def sgmv_expand_torch(
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank] float32
    lora_b: torch.Tensor,  # [num_slots, d_out, max_rank], out.dtype
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32, -1 = no adapter
    slot_ranks: torch.Tensor,  # [num_slots] int32
    slot_scalings: torch.Tensor,  # [num_slots] float32
    out: torch.Tensor,  # [num_tokens, d_out]
    slice_offsets: torch.Tensor | None = None,  # [num_slices + 1] int32
    max_seg_len: int | None = None,
) -> None:
    """out[t, lo_s:hi_s] += scaling[slot] * buf[s, t, :r] @ lora_b[slot, lo_s:hi_s, :r]^T, in place.

    The sum is formed in float32 and rounded to out.dtype once. Tokens of segments without a slot
    (or with rank 0) are left untouched. `max_seg_len` is the GPU kernel's launch-size hint.
    """
    bounds = [0, out.shape[1]] if slice_offsets is None else slice_offsets.tolist()
    scalings = slot_scalings.tolist()
    for start, end, slot, rank in _active_segments(seg_starts, seg_slots, slot_ranks):
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            b = lora_b[slot, lo:hi, :rank].float()  # [hi - lo, r]
            base = out[start:end, lo:hi].float()  # [seg_len, hi - lo]
            out[start:end, lo:hi] = torch.addmm(base, buf[s, start:end, :rank], b.T, alpha=scalings[slot])
