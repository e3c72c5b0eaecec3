"""SGMV kernels: torch twins vs a per-token reference loop on CPU, Triton vs the twins on the GPU
when there is one, else on CPU under the Triton interpreter; `add_lora` (the CPU path of
kernels/sgmv_cpu.py, or Triton on a GPU) vs the twins' shrink then expand."""

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    # NOTE: must be set before kernels.sgmv_triton is imported: @triton.jit reads it at decoration time.
    os.environ["TRITON_INTERPRET"] = "1"

import math
from dataclasses import dataclass, fields, replace
from itertools import accumulate

import pytest
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.runtime import interpreter

from kernels import sgmv_cpu, sgmv_expand, sgmv_shrink, sgmv_triton
from kernels.sgmv import Segments, add_lora
from kernels.sgmv_cpu import RankViews
from kernels.sgmv_torch import sgmv_expand_torch, sgmv_shrink_torch
from kernels.sgmv_triton import sgmv_expand_triton, sgmv_shrink_triton

if DEVICE == "cpu" and not isinstance(sgmv_triton._shrink_kernel, interpreter.InterpretedFunction):
    raise RuntimeError("kernels.sgmv_triton was imported before TRITON_INTERPRET=1 was set; run this file alone")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of out to its dtype, plus float32 summation-order noise.
EXPAND_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# The rank buffer is float32 from the same (rounded) inputs whatever the model dtype.
SHRINK_TOL = 1e-5
SLICE_WIDTHS = [(72,), (24, 56, 16)]
# Mixed ranks 1..64, a rank-0 slot (3), repeated slots out of order, empty and one-token segments,
# adapter-less segments (one of them empty and last), and a 70-token segment (several token tiles).
EDGE = dict(
    seg_lens=[3, 0, 4, 70, 0, 5, 1, 2, 0],
    seg_slots=[2, 0, -1, 1, 3, 2, 4, 0, -1],
    slot_ranks=[1, 64, 8, 0, 16],
)


@pytest.fixture(autouse=True, scope="module")
def interpreter_bf16_dot():
    """triton-lang/triton#11584: the interpreter's tl.dot multiplies the bit patterns of bfloat16
    operands. Upcast them to float32 first, which is exact, as the GPU's MMA effectively does."""
    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (self.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h for h in (a, b))
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_bf16)
        yield


@pytest.fixture(autouse=True, scope="module")
def nvidia_dot_shapes():
    """The interpreter takes a tl.dot of any shape; an NVIDIA build refuses K under 16 for 16-bit
    inputs (8 for float32). Check the kernels' tiles by NVIDIA's rule, as a CUDA build would."""
    from triton.backends.nvidia.compiler import min_dot_size

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(interpreter.interpreter_builder.codegen_fns, "min_dot_size", min_dot_size(None))
        yield


@dataclass
class Batch:
    x: torch.Tensor  # [num_tokens, d_in]
    lora_a: torch.Tensor  # [num_slices, num_slots, max_rank, d_in]
    lora_b: torch.Tensor  # [num_slots, d_out, max_rank]
    seg_starts: torch.Tensor  # [num_segs + 1] int32
    seg_slots: torch.Tensor  # [num_segs] int32
    slot_ranks: torch.Tensor  # [num_slots] int32
    slot_scalings: torch.Tensor  # [num_slots] float32
    slice_offsets: torch.Tensor | None  # [num_slices + 1] int32
    base: torch.Tensor  # [num_tokens, d_out], the base layer's output

    def to(self, device: str) -> "Batch":
        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{name: None if t is None else t.to(device) for name, t in tensors.items()})

    @property
    def meta(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.seg_starts, self.seg_slots, self.slot_ranks

    def token_ranks(self) -> list[tuple[int, int]]:
        """(slot, rank) of every token; rank 0 where the token has no adapter."""
        ranks = self.slot_ranks.tolist()
        lens = self.seg_starts.diff().tolist()
        slots = [slot for slot, n in zip(self.seg_slots.tolist(), lens) for _ in range(n)]
        return [(slot, ranks[slot] if slot >= 0 else 0) for slot in slots]

    def rank_mask(self) -> torch.Tensor:  # [num_tokens, max_rank] bool, the entries a rank covers
        ranks = torch.tensor([rank for _, rank in self.token_ranks()], dtype=torch.long)
        return torch.arange(self.lora_a.shape[2])[None, :] < ranks[:, None]

    def segments(self) -> Segments:
        return Segments.build(self.seg_starts.diff().tolist(), self.seg_slots.tolist(), self.x.device)

    def slice_bounds(self) -> list[tuple[int, int]]:
        bounds = [0, self.base.shape[1]] if self.slice_offsets is None else self.slice_offsets.tolist()
        return list(zip(bounds[:-1], bounds[1:]))


def make_batch(
    seg_lens, seg_slots, slot_ranks, *, max_rank=None, d_in=48, slice_widths=(72,), dtype=torch.float32, seed=0
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_tokens, num_slots, num_slices, d_out = sum(seg_lens), len(slot_ranks), len(slice_widths), sum(slice_widths)
    max_rank = max_rank or max(slot_ranks + [1])
    lora_a = torch.randn(num_slices, num_slots, max_rank, d_in, generator=gen) / math.sqrt(d_in)
    lora_b = torch.randn(num_slots, d_out, max_rank, generator=gen) / math.sqrt(max_rank)
    for slot, rank in enumerate(slot_ranks):
        # NaN padding: a single read past a slot's rank poisons the result.
        lora_a[:, slot, rank:] = math.nan
        lora_b[slot, :, rank:] = math.nan
    return Batch(
        x=torch.randn(num_tokens, d_in, generator=gen).to(dtype),
        lora_a=lora_a.to(dtype),
        lora_b=lora_b.to(dtype),
        seg_starts=torch.tensor(list(accumulate(seg_lens, initial=0)), dtype=torch.int32),
        seg_slots=torch.tensor(seg_slots, dtype=torch.int32),
        slot_ranks=torch.tensor(slot_ranks, dtype=torch.int32),
        slot_scalings=torch.rand(num_slots, generator=gen) * 2 + 0.5,
        slice_offsets=torch.tensor(list(accumulate(slice_widths, initial=0)), dtype=torch.int32)
        if num_slices > 1
        else None,
        base=torch.randn(num_tokens, d_out, generator=gen).to(dtype),
    )


def reference_shrink(b: Batch) -> torch.Tensor:  # [num_slices, num_tokens, max_rank] float64
    num_slices, _, max_rank, _ = b.lora_a.shape
    out = torch.zeros(num_slices, b.x.shape[0], max_rank, dtype=torch.float64)
    for t, (slot, rank) in enumerate(b.token_ranks()):
        for s in range(num_slices):
            if rank > 0:
                out[s, t, :rank] = b.lora_a[s, slot, :rank].double() @ b.x[t].double()
    return out


def reference_expand(b: Batch, buf: torch.Tensor) -> torch.Tensor:  # [num_tokens, d_out] float64
    out = b.base.double()
    for t, (slot, rank) in enumerate(b.token_ranks()):
        for s, (lo, hi) in enumerate(b.slice_bounds()):
            if rank > 0:
                delta = b.lora_b[slot, lo:hi, :rank].double() @ buf[s, t, :rank].double()
                out[t, lo:hi] += b.slot_scalings[slot].item() * delta
    return out


def expand_input(b: Batch) -> torch.Tensor:  # [num_slices, num_tokens, max_rank] float32
    """The exact rank buffer, NaN wherever expand must not read (past a rank, tokens without adapter)."""
    buf = reference_shrink(b.to("cpu")).float().masked_fill(~b.rank_mask(), math.nan)
    return buf.to(b.x.device)


def run_shrink(impl, b: Batch, max_seg_len=None) -> torch.Tensor:
    # Stale values: shrink must overwrite every entry, zeros included.
    out = torch.full((b.lora_a.shape[0], b.x.shape[0], b.lora_a.shape[2]), 7.0, device=b.x.device)
    impl(b.x, b.lora_a, *b.meta, out, max_seg_len)
    return out


def run_expand(impl, b: Batch, buf: torch.Tensor, max_seg_len=None) -> torch.Tensor:
    out = b.base.clone()
    impl(buf, b.lora_b, *b.meta, b.slot_scalings, out, b.slice_offsets, max_seg_len)
    return out


def run_add_lora(b: Batch) -> torch.Tensor:
    out = b.base.clone()
    add_lora(b.x, b.lora_a, b.lora_b, b.segments(), b.slot_ranks, b.slot_scalings, out, b.slice_offsets)
    return out


def run_twins(b: Batch) -> torch.Tensor:
    """What add_lora must compute: the twins' shrink, then their expand, on CPU."""
    b = b.to("cpu")
    return run_expand(sgmv_expand_torch, b, run_shrink(sgmv_shrink_torch, b))


def rank_major(b: Batch) -> Batch:
    """The same batch with lora_b a transposed view of rank-major storage, as adapters/slots.py keeps it."""
    return replace(b, lora_b=b.lora_b.transpose(1, 2).contiguous().transpose(1, 2))


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with rows strided: what a row-blocked Linear returns on one thread."""
    return t.t().contiguous().t()


def assert_shrink_matches(out: torch.Tensor, expected: torch.Tensor, b: Batch) -> None:
    out, expected = out.cpu(), expected.cpu()
    assert torch.equal(out[:, ~b.rank_mask()], torch.zeros_like(out[:, ~b.rank_mask()]))
    torch.testing.assert_close(out.double(), expected.double(), rtol=SHRINK_TOL, atol=SHRINK_TOL)


def assert_expand_matches(out: torch.Tensor, expected: torch.Tensor, b: Batch) -> None:
    out, expected, base = out.cpu(), expected.cpu(), b.base.cpu()
    idle = torch.tensor([rank == 0 for _, rank in b.token_ranks()], dtype=torch.bool)
    assert torch.equal(out[idle], base[idle])
    tol = EXPAND_TOL[b.base.dtype]
    torch.testing.assert_close(out.double(), expected.double(), rtol=tol, atol=tol)


def assert_triton_matches_twins(b: Batch, max_seg_len: int | None = None) -> None:
    """Shrink, then expand, by the Triton kernels as by the torch twins."""
    assert_shrink_matches(run_shrink(sgmv_shrink_triton, b, max_seg_len), run_shrink(sgmv_shrink_torch, b), b)
    buf = expand_input(b)
    assert_expand_matches(run_expand(sgmv_expand_triton, b, buf, max_seg_len),
                          run_expand(sgmv_expand_torch, b, buf), b)


@pytest.mark.parametrize("slice_widths", SLICE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_twins_match_per_token_reference(dtype, slice_widths):
    b = make_batch(**EDGE, slice_widths=slice_widths, dtype=dtype)
    assert_shrink_matches(run_shrink(sgmv_shrink_torch, b), reference_shrink(b), b)
    buf = expand_input(b)
    assert_expand_matches(run_expand(sgmv_expand_torch, b, buf), reference_expand(b, buf), b)


@pytest.mark.parametrize("max_seg_len", [None, 70])
@pytest.mark.parametrize("slice_widths", SLICE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_twins(dtype, slice_widths, max_seg_len):
    assert_triton_matches_twins(make_batch(**EDGE, slice_widths=slice_widths, dtype=dtype, seed=1).to(DEVICE),
                                max_seg_len)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_rank", [256, 512])
def test_triton_matches_twins_in_slots_wider_than_128_ranks(dtype, max_rank):
    """A server started with --max-lora-rank past 128 sizes every slot to it: the tiles must still
    be ones NVIDIA's tl.dot takes, whatever rank the adapters have."""
    b = make_batch(seg_lens=[1, 3, 0, 2], seg_slots=[1, 0, 2, -1], slot_ranks=[8, max_rank, 3],
                   max_rank=max_rank, d_in=64, slice_widths=(24, 40), dtype=dtype).to(DEVICE)
    assert_triton_matches_twins(b)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_shrink_triton_split_k(monkeypatch, split_k):
    # d_in 80 = five 16-wide K blocks: split 2 and 3 give programs unequal block counts.
    monkeypatch.setattr(sgmv_triton, "_shrink_config", lambda *_, **__: (16, split_k))
    b = make_batch(**EDGE, d_in=80, slice_widths=SLICE_WIDTHS[1], dtype=torch.bfloat16, seed=2).to(DEVICE)
    assert_shrink_matches(run_shrink(sgmv_shrink_triton, b), run_shrink(sgmv_shrink_torch, b), b)


@pytest.mark.parametrize("block_n", [16, 32])
def test_expand_triton_column_tiles_straddle_slices(monkeypatch, block_n):
    # Slice bounds 24 and 80: mid-tile for both widths; slice 1 spans several tiles.
    monkeypatch.setattr(sgmv_triton, "_expand_block_n", lambda *_: block_n)
    b = make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], dtype=torch.float16, seed=3).to(DEVICE)
    buf = expand_input(b)
    assert_expand_matches(run_expand(sgmv_expand_triton, b, buf), run_expand(sgmv_expand_torch, b, buf), b)


def test_expand_triton_reads_rank_major_b():
    # adapters/slots.py passes lora_b as a transposed view of rank-major storage.
    b = rank_major(make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], dtype=torch.float16, seed=12)).to(DEVICE)
    buf = expand_input(b)
    assert_expand_matches(run_expand(sgmv_expand_triton, b, buf), run_expand(sgmv_expand_torch, b, buf), b)


@pytest.mark.parametrize("impl", [sgmv_expand_torch, sgmv_expand_triton])
def test_expand_zero_scaling_leaves_base_bitwise(impl):
    b = make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], dtype=torch.bfloat16, seed=4).to(DEVICE)
    b.slot_scalings.zero_()
    assert torch.equal(run_expand(impl, b, expand_input(b)), b.base)


def test_public_api_single_slice_forms_dispatch_to_twins_on_cpu():
    b = make_batch(**EDGE, dtype=torch.bfloat16, seed=5)
    out = torch.full((b.x.shape[0], b.lora_a.shape[2]), 7.0)  # [num_tokens, max_rank]
    sgmv_shrink(b.x, b.lora_a[0], *b.meta, out)
    assert torch.equal(out, run_shrink(sgmv_shrink_torch, b)[0])
    y = b.base.clone()
    sgmv_expand(out, b.lora_b, *b.meta, b.slot_scalings, y)
    assert torch.equal(y, run_expand(sgmv_expand_torch, b, out.unsqueeze(0)))


def test_public_expand_requires_slice_offsets_for_several_slices():
    b = make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], seed=6)
    with pytest.raises(AssertionError, match="slice_offsets"):
        sgmv_expand(expand_input(b), b.lora_b, *b.meta, b.slot_scalings, b.base.clone())


@st.composite
def batches(draw) -> Batch:
    num_slots = draw(st.integers(1, 4))
    slot_ranks = draw(st.lists(st.integers(0, 64), min_size=num_slots, max_size=num_slots))
    num_segs = draw(st.integers(0, 6))
    return make_batch(
        seg_lens=draw(st.lists(st.integers(0, 9), min_size=num_segs, max_size=num_segs)),
        seg_slots=draw(st.lists(st.integers(-1, num_slots - 1), min_size=num_segs, max_size=num_segs)),
        slot_ranks=slot_ranks,
        max_rank=max(slot_ranks + [1]) + draw(st.integers(0, 3)),
        d_in=draw(st.integers(1, 64)),
        slice_widths=tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=60, deadline=None)
@given(b=batches())
def test_twins_match_reference_property(b):
    assert_shrink_matches(run_shrink(sgmv_shrink_torch, b), reference_shrink(b), b)
    buf = expand_input(b)
    assert_expand_matches(run_expand(sgmv_expand_torch, b, buf), reference_expand(b, buf), b)


@settings(max_examples=25, deadline=None)
@given(b=batches())
def test_triton_matches_twins_property(b):
    b = b.to(DEVICE)
    assert_triton_matches_twins(b)


# LONG_SEGMENT 1 sends every float32 segment down the addmm_ path, 1000 every one down _foreach_mm;
# at 16, EDGE's 70-token segment takes addmm_ and the others _foreach_mm, in the same call.
CPU_PATHS = pytest.mark.parametrize("long_segment", [1, 16, 1000], ids=["addmm", "mixed", "foreach"])


@CPU_PATHS
@pytest.mark.parametrize("is_rank_major", [False, True])
@pytest.mark.parametrize("slice_widths", SLICE_WIDTHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_lora_matches_twins(monkeypatch, dtype, slice_widths, is_rank_major, long_segment):
    monkeypatch.setattr(sgmv_cpu, "LONG_SEGMENT", long_segment)
    b = make_batch(**EDGE, slice_widths=slice_widths, dtype=dtype, seed=7)
    b = rank_major(b) if is_rank_major else b
    assert_expand_matches(run_add_lora(b.to(DEVICE)), run_twins(b), b)


@CPU_PATHS
def test_add_lora_reads_strided_activations(monkeypatch, long_segment):
    monkeypatch.setattr(sgmv_cpu, "LONG_SEGMENT", long_segment)
    b = make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], seed=8)
    strided = replace(b, x=column_major(b.x), base=column_major(b.base))
    assert_expand_matches(run_add_lora(strided), run_twins(b), b)


def test_add_lora_single_slice_form_and_nothing_to_do():
    b = make_batch(**EDGE, dtype=torch.bfloat16, seed=9)
    out = b.base.clone()
    add_lora(b.x, b.lora_a[0], b.lora_b, b.segments(), b.slot_ranks, b.slot_scalings, out)
    assert_expand_matches(out, run_twins(b), b)
    idle = make_batch(seg_lens=[3, 0, 2], seg_slots=[-1, 0, 1], slot_ranks=[4, 0], seed=10)
    assert torch.equal(run_add_lora(idle), idle.base)  # no adapter, empty segment, rank 0


@CPU_PATHS
def test_add_lora_zero_scaling_leaves_base_bitwise(monkeypatch, long_segment):
    monkeypatch.setattr(sgmv_cpu, "LONG_SEGMENT", long_segment)
    b = make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], seed=11)
    b.slot_scalings.zero_()
    assert torch.equal(run_add_lora(b), b.base)


@CPU_PATHS
def test_rank_views_follow_a_refilled_slot(monkeypatch, long_segment):
    # Views kept across calls read the buffers' current contents, and a new rank gets its own views.
    # The segments are kept too: their split, worked out once, must follow the new ranks and scalings.
    monkeypatch.setattr(sgmv_cpu, "LONG_SEGMENT", long_segment)
    b = rank_major(make_batch(**EDGE, slice_widths=SLICE_WIDTHS[1], seed=13))
    views = RankViews(b.lora_a, b.lora_b, b.slice_offsets.tolist())
    segments = b.segments()
    for refill in range(3):
        out = b.base.clone()
        add_lora(b.x, b.lora_a, b.lora_b, segments, b.slot_ranks, b.slot_scalings, out, b.slice_offsets, views)
        assert_expand_matches(out, run_twins(b), b)
        new = make_batch(**{**EDGE, "slot_ranks": [[1, 5, 8, 0, 16], [0, 3, 0, 64, 2]][refill % 2]}, max_rank=64,
                         slice_widths=SLICE_WIDTHS[1], seed=14 + refill)
        b.lora_a.copy_(new.lora_a), b.lora_b.copy_(new.lora_b), b.slot_ranks.copy_(new.slot_ranks)
        b.slot_scalings.mul_(1.5)


def test_segments_build():
    segments = Segments.build([3, 0, 5], [2, -1, 0], torch.device("cpu"))
    assert segments.starts.tolist() == [0, 3, 3, 8] and segments.starts.dtype == torch.int32
    assert segments.slots.tolist() == [2, -1, 0] and segments.max_len == 5


@settings(max_examples=60, deadline=None)
@given(b=batches(), long_segment=st.sampled_from([1, 4, 1000]), is_rank_major=st.booleans())
def test_add_lora_matches_twins_property(b, long_segment, is_rank_major):
    b = rank_major(b) if is_rank_major else b
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sgmv_cpu, "LONG_SEGMENT", long_segment)
        assert_expand_matches(run_add_lora(b.to(DEVICE)), run_twins(b), b)
