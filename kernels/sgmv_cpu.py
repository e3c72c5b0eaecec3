"""The whole LoRA delta of a flat batch on CPU: what `sgmv_shrink` then `sgmv_expand` compute, in one call.

The torch twins run a few small torch ops per segment from Python, and on CPU those ops cost more
than the math: a decode step with 22 adapters spent most of its time dispatching ~1,400 tiny
matmuls. Here the (segment, slice) matmuls of decode segments all run in two `torch._foreach_mm`
calls (a C++ loop over pairs of views), and long prefill segments add their products straight into
the output with addmm_. The views of each slot's first `rank` rows are made once per (slot, rank)
and kept (`RankViews`); everything runs on the calling thread only (`_one_thread`). No weight is
copied or padded: each matmul reads a slot's real rank rows in place (B is stored rank-major,
adapters/slots.py), so a decode step reads each active adapter once, and never the padding past
its rank.

NOTE: `torch._foreach_mm` is a private op. torch is pinned (pyproject.toml), and tests/test_sgmv.py
compares this path with the twins, so a change in it shows up there.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import accumulate

import torch

# Segments at least this long (prefill chunks) run two Python-dispatched ops per slice, which their
# length amortises, and add their products straight into out (_add_long). Shorter ones (decode)
# are batched in _foreach_mm, whose cost per (segment, slice) is a step of a C++ loop (_add_short).
LONG_SEGMENT = 16

# (rows of x, A^T [d_in, r], B [r, w], destination rows [n, w], slot) of one (segment, slice)
Pair = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


class RankViews:
    """One layer's slot weights cut at each slot's real rank: per slice, A^T [d_in, r] and
    B [r, hi - lo], as views of the slot buffers.

    Views share the buffers' memory, so they stay right when a slot is refilled, and a cache keyed
    by (slot, rank) never goes stale: each view is made once, not on every call.
    """

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, slice_offsets: list[int]):
        self.lora_a = lora_a  # [num_slices, num_slots, max_rank, d_in]
        self.lora_b_rows = lora_b.transpose(1, 2)  # [num_slots, max_rank, d_out]
        self.slices = list(zip(slice_offsets[:-1], slice_offsets[1:]))
        self._views: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def get(self, slot: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(A^T per slice, B per slice) of `slot` at `rank`."""
        views = self._views.get((slot, rank))
        if views is None:
            a_t = [a[slot, :rank].t() for a in self.lora_a]
            b = [self.lora_b_rows[slot, :rank, lo:hi] for lo, hi in self.slices]
            views = self._views[slot, rank] = (a_t, b)
        return views


def add_lora_cpu(
    x: torch.Tensor,  # [num_tokens, d_in]
    weights: RankViews,  # lora_a [num_slices, num_slots, max_rank, d_in], lora_b: x.dtype
    seg_lens: list[int],  # [num_segs] tokens per segment, summing to num_tokens
    seg_slots: list[int],  # [num_segs] slot of each segment, -1 = no adapter
    slot_ranks: torch.Tensor,  # [num_slots] int32
    slot_scalings: torch.Tensor,  # [num_slots] float32
    out: torch.Tensor,  # [num_tokens, d_out]
) -> None:
    """out[t, lo_s:hi_s] += scaling[slot] * (x[t] @ lora_a[s, slot, :r]^T) @ lora_b[slot, lo_s:hi_s, :r]^T.

    The product is formed in float32 and rounded to out.dtype once, when added; tokens without a
    slot, or whose slot has rank 0, are left untouched.
    """
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()
    active = [i for i, slot in enumerate(seg_slots) if slot >= 0 and seg_lens[i] > 0 and ranks[slot] > 0]
    # addmm_ cannot add a float32 product into a half-type out: their segments all go the short way.
    long = [i for i in active if seg_lens[i] >= LONG_SEGMENT and out.dtype == torch.float32]
    short = [i for i in active if seg_lens[i] < LONG_SEGMENT or out.dtype != torch.float32]
    views = {slot: weights.get(slot, ranks[slot]) for slot in {seg_slots[i] for i in active}}
    outs = [out[:, lo:hi].split(seg_lens) for lo, hi in weights.slices]  # [slice][segment]

    def pairs(segments: list[int], rows: dict[int, torch.Tensor]) -> list[Pair]:
        """Every (segment, slice) of `segments`, reading its rows from `rows`."""
        return [(rows[i], a_t, b, dst[i], seg_slots[i])
                for i in segments for a_t, b, dst in zip(*views[seg_slots[i]], outs)]

    with _one_thread():
        if long:
            # NOTE: row-major x: the row-blocked Linear (engine/model/linear.py) returns column-major
            # outputs, and MKL multiplies a column-major x by a rank-8 A^T about 10x slower.
            _add_long(pairs(long, dict(enumerate(x.contiguous().split(seg_lens)))), scalings)
        if short:
            _add_short(pairs(short, _scaled_rows(x, seg_lens, seg_slots, short, scalings)))


def _add_long(pairs: list[Pair], scalings: list[float]) -> None:
    """Float32 prefill segments: each product added straight into out's rows by addmm_."""
    for rows, a_t, b, dst, slot in pairs:
        dst.addmm_(rows @ a_t, b, alpha=scalings[slot])


def _add_short(pairs: list[Pair]) -> None:
    """Decode segments, rows already scaled: all the shrinks in one _foreach_mm, all the expands in
    another, all the adds in one _foreach_add_."""
    rows, a_t, b, dst, _ = (list(column) for column in zip(*pairs))
    torch._foreach_add_(dst, torch._foreach_mm(torch._foreach_mm(rows, _float(a_t)), _float(b)))


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the LoRA matmuls on the calling thread only. They are small (rank-wide), so a second
    thread gains them little, and on a busy machine every op split across threads can wait
    milliseconds for a descheduled one: a decode step runs thousands of them.

    NOTE: called on a process's main thread, torch.set_num_threads also sets the count that other
    threads take at their first torch op: one that starts torch work inside this window keeps one
    thread (seen with torch 2.13). Here that can be an adapter loader thread, whose packing is copies."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def _scaled_rows(x: torch.Tensor, seg_lens: list[int], seg_slots: list[int], segments: list[int],
                 scalings: list[float]) -> dict[int, torch.Tensor]:
    """The rows of `segments`, in float32 and each times its slot's scaling (LoRA is linear, so this
    scales the delta with one op however many segments), by segment. One gathered copy: row-major
    whatever x's layout, and no pass over the rows of the other segments (a prefill's)."""
    starts = list(accumulate(seg_lens, initial=0))
    tokens = [t for i in segments for t in range(starts[i], starts[i + 1])]
    row_scalings = [scalings[seg_slots[i]] for i in segments for _ in range(seg_lens[i])]
    rows = x.index_select(0, torch.tensor(tokens)).float().mul_(torch.tensor(row_scalings)[:, None])
    return dict(zip(segments, rows.split([seg_lens[i] for i in segments])))


def _float(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 weights as they are; half types upcast (the LoRA product is float32 whatever the
    model dtype, like the twins' rank buffer)."""
    if views[0].dtype == torch.float32:
        return views
    return [v.float() for v in views]
