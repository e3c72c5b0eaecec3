"""Triton SGMV kernels, Punica / S-LoRA style; twins in `kernels/sgmv_torch.py`.

One program owns one (segment, token tile) pair and a share of the remaining work: a slice and a
K-range for shrink, an output column tile for expand. It reads its slot's rank at run time and masks
every load of the rank dimension with it, so padding rows of a smaller adapter are never fetched.
Programs of empty, adapter-less or rank-0 segments (and tiles past their segment's end) exit at once.

Shapes are the canonical, sliced ones documented in `kernels/sgmv.py`.
"""

import torch
import triton
import triton.language as tl

# About four resident programs per SM on an H100 (132 SMs): below this, shrink splits K further.
_TARGET_PROGRAMS = 512


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, slot_ranks_ptr,
    d_in,
    stride_xt, stride_xk,
    stride_as, stride_aslot, stride_ar, stride_ak,
    stride_os, stride_ot, stride_or,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = (tl.program_id(2) // SPLIT_K).to(tl.int64)
    pid_k = tl.program_id(2) % SPLIT_K
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(slot_ranks_ptr + tl.maximum(slot, 0))
    m_start = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (slot < 0) | (rank == 0) | (m_start >= seg_end):
        return

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_end
    # NOTE: rank <= max_rank <= BLOCK_R (the adapter store validates ranks), so this mask is exact.
    mask_r = offs_r < rank
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xt + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_ptrs = (  # [BLOCK_K, BLOCK_R], the tile of A^T
        a_ptr + pid_s * stride_as + slot.to(tl.int64) * stride_aslot
        + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    )
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    # Split-K: program pid_k takes every SPLIT_K-th K block, so decode batches (a few tokens, a
    # 4096-long K) still spread over many SMs.
    for k in range(pid_k * BLOCK_K, d_in, SPLIT_K * BLOCK_K):
        mask_k = k + offs_k < d_in
        x = tl.load(x_ptrs + k * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptrs + k * stride_ak, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc = tl.dot(x, a, acc, input_precision=INPUT_PRECISION)

    out_ptrs = out_ptr + pid_s * stride_os + offs_m.to(tl.int64)[:, None] * stride_ot + offs_r[None, :] * stride_or
    mask_out = mask_m[:, None] & mask_r[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc, mask=mask_out)
    else:
        # NOTE: relies on the launcher zeroing out first.
        tl.atomic_add(out_ptrs, acc, mask=mask_out)


@triton.jit
def _expand_kernel(
    buf_ptr, b_ptr, out_ptr, seg_starts_ptr, seg_slots_ptr, slot_ranks_ptr, slot_scalings_ptr,
    slice_offsets_ptr,
    d_out,
    stride_bufs, stride_buft, stride_bufr,
    stride_bslot, stride_bn, stride_br,
    stride_ot, stride_on,
    NUM_SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    n_start = tl.program_id(2) * BLOCK_N
    slot = tl.load(seg_slots_ptr + seg)
    rank = tl.load(slot_ranks_ptr + tl.maximum(slot, 0))
    m_start = tl.load(seg_starts_ptr + seg) + pid_m * BLOCK_M
    seg_end = tl.load(seg_starts_ptr + seg + 1)
    if (slot < 0) | (rank == 0) | (m_start >= seg_end):
        return

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n_start + tl.arange(0, BLOCK_N)
    mask_m = offs_m < seg_end
    mask_r = offs_r < rank
    mask_n = offs_n < d_out
    b_ptrs = b_ptr + slot.to(tl.int64) * stride_bslot + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn
    # fp32 operands (tf32 MMA for 16-bit outputs): the rank buffer stays unrounded, and at K = rank
    # the MMA precision costs nothing next to the memory traffic.
    b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_N]
    # [BLOCK_M, BLOCK_R]
    buf_ptrs = buf_ptr + offs_m.to(tl.int64)[:, None] * stride_buft + offs_r[None, :] * stride_bufr
    mask_buf = mask_m[:, None] & mask_r[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if NUM_SLICES == 1:
        acc = tl.dot(tl.load(buf_ptrs, mask=mask_buf, other=0.0), b, acc, input_precision=INPUT_PRECISION)
    else:
        # Column tiles cover the fused output as one matrix; a tile straddling a slice boundary
        # does one dot per slice it touches, with the other slices' columns of B zeroed.
        for s in tl.static_range(NUM_SLICES):
            lo = tl.load(slice_offsets_ptr + s)
            hi = tl.load(slice_offsets_ptr + s + 1)
            if (lo < n_start + BLOCK_N) & (hi > n_start):
                buf = tl.load(buf_ptrs + s * stride_bufs, mask=mask_buf, other=0.0)
                b_s = tl.where(((offs_n >= lo) & (offs_n < hi))[None, :], b, 0.0)
                acc = tl.dot(buf, b_s, acc, input_precision=INPUT_PRECISION)

    scaling = tl.load(slot_scalings_ptr + slot)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_n[None, :] * stride_on  # [BLOCK_M, BLOCK_N]
    mask_out = mask_m[:, None] & mask_n[None, :]
    base = tl.load(out_ptrs, mask=mask_out).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask_out)


def sgmv_shrink_triton(
    x: torch.Tensor,  # [num_tokens, d_in]
    lora_a: torch.Tensor,  # [num_slices, num_slots, max_rank, d_in], x.dtype
    seg_starts: torch.Tensor,  # [num_segs + 1] int32
    seg_slots: torch.Tensor,  # [num_segs] int32, -1 = no adapter
    slot_ranks: torch.Tensor,  # [num_slots] int32
    out: torch.Tensor,  # [num_slices, num_tokens, max_rank] float32
    max_seg_len: int | None = None,
) -> None:
    """Triton twin of `sgmv_shrink_torch`; `max_seg_len` (default num_tokens) sizes the grid."""
    num_slices, _, max_rank, d_in = lora_a.shape
    num_segs = seg_slots.shape[0]
    max_seg_len = x.shape[0] if max_seg_len is None else max_seg_len
    out.zero_()
    if num_segs == 0 or max_seg_len == 0:
        return
    block_m = _block_m(max_seg_len)
    block_r = _block_r(max_rank)
    num_m_tiles = triton.cdiv(max_seg_len, block_m)
    precision = _input_precision(x.dtype)
    block_k, split_k = _shrink_config(num_segs * num_m_tiles * num_slices, d_in, block_m, block_r,
                                      uses_mma=precision != "ieee")
    _shrink_kernel[(num_segs, num_m_tiles, split_k * num_slices)](
        x, lora_a, out, seg_starts, seg_slots, slot_ranks,
        d_in,
        *x.stride(),
        *lora_a.stride(),
        *out.stride(),
        SPLIT_K=split_k, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        INPUT_PRECISION=precision,
        num_stages=4,  # one more K block in flight than Triton's default: 2-5% on an H100's decode shapes
    )


def sgmv_expand_triton(
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
    """Triton twin of `sgmv_expand_torch`; `max_seg_len` (default num_tokens) sizes the grid."""
    num_slices, num_tokens, max_rank = buf.shape
    num_segs = seg_slots.shape[0]
    d_out = out.shape[1]
    max_seg_len = num_tokens if max_seg_len is None else max_seg_len
    if num_segs == 0 or max_seg_len == 0 or d_out == 0:
        return
    block_m = _block_m(max_seg_len)
    num_m_tiles = triton.cdiv(max_seg_len, block_m)
    block_r = _block_r(max_rank)
    block_n = _expand_block_n(num_segs * num_m_tiles, d_out, block_m, block_r)
    _expand_kernel[(num_segs, num_m_tiles, triton.cdiv(d_out, block_n))](
        buf, lora_b, out, seg_starts, seg_slots, slot_ranks, slot_scalings,
        slice_offsets,
        d_out,
        *buf.stride(),
        *lora_b.stride(),
        *out.stride(),
        NUM_SLICES=num_slices, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        INPUT_PRECISION=_input_precision(out.dtype),
        num_warps=8,  # more loads in flight per program: 10-15% on an H100's small decode batches
    )


def _block_m(max_seg_len: int) -> int:
    # tl.dot needs >= 16 rows; decode segments are 1 token, so anything wider only wastes MMA.
    return min(64, max(16, triton.next_power_of_2(max_seg_len)))


def _block_r(max_rank: int) -> int:
    # The slots' rank rows in one tile (masked to each adapter's own rank); tl.dot needs >= 16.
    return max(16, triton.next_power_of_2(max_rank))


def _shrink_config(num_tiles: int, d_in: int, block_m: int, block_r: int,
                   uses_mma: bool) -> tuple[int, int]:
    """(BLOCK_K, SPLIT_K): a wide K block; K split over enough programs to fill the GPU, fewer the
    larger the tile each split adds atomically into the rank buffer."""
    # Measured on an H100 (benchmarks/README.md): a 64-token tile with a 32-wide K block (the cap was
    # 2048 // block) took 18.6 us for 256 tokens of one adapter, a 128-wide one 11.8 us. Never under
    # 16, the narrowest K tl.dot takes for 16-bit inputs on NVIDIA GPUs (ranks past 512).
    block_k = max(16, min(128, 8192 // max(block_m, block_r), triton.next_power_of_2(d_in)))
    tile = block_m * block_r
    if not uses_mma:
        # float32 dots run exact (IEEE) on the CUDA cores: compute-bound, they want every program.
        target_programs = _TARGET_PROGRAMS
    elif tile >= 64 * 64:
        # Splits of a tile this size contend on its atomic adds: 256 tokens of one rank-64 adapter
        # took 17.6 us unsplit, 29-33 us split 2 to 32 ways.
        target_programs = 0
    else:
        # Fewer programs for larger tiles: 1024 tokens of one rank-16 adapter took 21.7 us split 32
        # ways, 13.2 us split 8; 32 rank-64 adapters 15.3 us split 16 ways, 12.3 us split 4.
        target_programs = _TARGET_PROGRAMS * 16 * 16 // tile
    split_k = min(triton.cdiv(d_in, block_k), max(1, target_programs // num_tiles))
    return block_k, split_k


def _expand_block_n(num_tiles: int, d_out: int, block_m: int, block_r: int) -> int:
    """Widest column tile (fewer programs, each moving more of B) that still fills the GPU."""
    # A program holds a [BLOCK_R, BLOCK_N] tile of B: ranks past 128 get narrower columns.
    widest = max(16, min(triton.next_power_of_2(d_out), 32768 // block_r))
    for block_n in (256, 128):
        # Wider accumulators push sm90 builds of the 3-slice kernel past 255 registers, into spills.
        fits = block_n <= widest and block_m * block_n <= 4096
        if fits and num_tiles * triton.cdiv(d_out, block_n) >= _TARGET_PROGRAMS:
            return block_n
    return min(64, widest)


def _input_precision(dtype: torch.dtype) -> str:
    # fp32 models get exact fp32 products. 16-bit models: shrink's MMA is 16-bit anyway, and tf32's
    # rounding of expand's fp32 operands (2^-11) is finer than the 16-bit output's.
    return "ieee" if dtype == torch.float32 else "tf32"
