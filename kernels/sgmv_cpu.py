"""The whole LoRA delta of a flat batch on CPU: what `sgmv_shrink` then `sgmv_expand` compute, in one call.

The torch twins run a few small torch ops per segment from Python, and on CPU those ops cost more
than the math: a decode step with 22 adapters spent most of its time dispatching ~1,400 tiny
matmuls. Here the (segment, slice) matmuls of decode segments all run in two `torch._foreach_mm`
calls (a C++ loop over pairs of views), and long prefill segments add their products straight into
the output with addmm_. How a step's segments split between the two ways is worked out once per
step (`SegmentPlans`), and the views of each slot's first `rank` rows once per (slot, rank), kept
across steps (`RankViews`); the decode matmuls run on the calling thread only (`_one_thread`).
No weight is copied or padded: each matmul reads a slot's real rank rows in place (B is stored
rank-major, adapters/slots.py), so a decode step reads each active adapter once, and never the
padding past its rank.

NOTE: `torch._foreach_mm` is a private op. torch is pinned (pyproject.toml), and tests/test_sgmv.py
compares this path with the twins, so a change in it shows up there.
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate

import torch

# Segments at least this long (prefill chunks) run two Python-dispatched ops per slice, which their
# length amortises, and add their products straight into out (_add_long). Shorter ones (decode)
# are batched in _foreach_mm, whose cost per (segment, slice) is a step of a C++ loop (_add_short).
LONG_SEGMENT = 16

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


class SegmentPlans:
    """One step's segments, and how a call splits them between the long and the short way.

    Built once per step (kernels.sgmv.Segments holds one). The split depends on the ranks and
    scalings of the step's slots, which are per (layer, target), so it is computed once per distinct
    set of them and reused: usually once a step, where each call used to redo it (a few hundred
    microseconds of Python, times every LoRA linear of every layer).
    """

    def __init__(self, lens: list[int], slots: list[int]):
        self.lens, self.slots = lens, slots
        self._slots_in_use = sorted({slot for slot, n in zip(slots, lens) if slot >= 0 and n > 0})
        self._plans: dict[tuple, CallPlan] = {}

    def plan(self, ranks: list[int], scalings: list[float], float32_out: bool) -> "CallPlan":
        in_use = self._slots_in_use
        key = (float32_out, *(ranks[s] for s in in_use), *(scalings[s] for s in in_use))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = CallPlan.build(self.lens, self.slots, ranks, scalings, float32_out)
        return plan


@dataclass(frozen=True)
class CallPlan:
    """Which segments a call adds, and how. Segments with no slot, no tokens or rank 0 are in neither list."""

    long: list[int]  # prefill segments: addmm_ straight into out
    short: list[int]  # decode segments: batched in _foreach_mm
    short_rows: torch.Tensor  # [n] int64, the short segments' token indices, in order
    short_row_scalings: torch.Tensor  # [n, 1] float32, each of those rows' slot scaling
    short_lens: list[int]  # tokens of each short segment

    @classmethod
    def build(cls, lens: list[int], slots: list[int], ranks: list[int], scalings: list[float],
              float32_out: bool) -> "CallPlan":
        active = [i for i, slot in enumerate(slots) if slot >= 0 and lens[i] > 0 and ranks[slot] > 0]
        # addmm_ cannot add a float32 product into a half-type out: their segments all go the short way.
        long = [i for i in active if lens[i] >= LONG_SEGMENT and float32_out]
        short = [i for i in active if lens[i] < LONG_SEGMENT or not float32_out]
        starts = list(accumulate(lens, initial=0))
        rows = [t for i in short for t in range(starts[i], starts[i + 1])]
        row_scalings = [scalings[slots[i]] for i in short for _ in range(lens[i])]
        return cls(long, short, torch.tensor(rows, dtype=torch.int64), torch.tensor(row_scalings)[:, None],
                   [lens[i] for i in short])


def add_lora_cpu(
    x: torch.Tensor,  # [num_tokens, d_in]
    weights: RankViews,  # lora_a [num_slices, num_slots, max_rank, d_in], lora_b: x.dtype
    segments: SegmentPlans,  # the step's segments: tokens and slot (-1 = no adapter) of each
    slot_ranks: torch.Tensor,  # [num_slots] int32
    slot_scalings: torch.Tensor,  # [num_slots] float32
    out: torch.Tensor,  # [num_tokens, d_out]
) -> None:
    """out[t, lo_s:hi_s] += scaling[slot] * (x[t] @ lora_a[s, slot, :r]^T) @ lora_b[slot, lo_s:hi_s, :r]^T.

    The product is formed in float32 and rounded to out.dtype once, when added; tokens without a
    slot, or whose slot has rank 0, are left untouched.
    """
    ranks, scalings = slot_ranks.tolist(), slot_scalings.tolist()
    plan = segments.plan(ranks, scalings, out.dtype == torch.float32)
    if not plan.long and not plan.short:
        return
    slots = segments.slots
    outs = [out[:, lo:hi].split_with_sizes(segments.lens) for lo, hi in weights.slices]  # [slice][segment]
    if plan.long:
        # NOTE: row-major x: MKL multiplies a column-major x by a rank-8 A^T about 10x slower.
        # Activations of tens of rows are row-major already (engine/model/linear.py), and then
        # this copies nothing. These matmuls are compute-bound and few, so they keep every thread.
        rows = x.contiguous().split_with_sizes(segments.lens)
        for i in plan.long:
            slot = slots[i]
            for a_t, b, dst in zip(*weights.get(slot, ranks[slot]), outs):
                dst[i].addmm_(rows[i] @ a_t, b, alpha=scalings[slot])
    if plan.short:
        # The rows in float32, each times its slot's scaling (LoRA is linear, so this scales the
        # delta with one op however many segments): one gathered copy, row-major whatever x's
        # layout, that reads no row of the other segments (a prefill's).
        scaled = x.index_select(0, plan.short_rows).float().mul_(plan.short_row_scalings)
        with _one_thread():
            _add_short(scaled.split_with_sizes(plan.short_lens), plan.short, slots, ranks, weights, outs)


def _add_short(rows: list[torch.Tensor], short: list[int], slots: list[int], ranks: list[int],
               weights: RankViews, outs: list[list[torch.Tensor]]) -> None:
    """Decode segments, rows already scaled: all the shrinks in one _foreach_mm, all the expands in
    another, all the adds in one _foreach_add_."""
    xs, a_ts, bs, dsts = [], [], [], []
    for i, segment_rows in zip(short, rows):
        slot = slots[i]
        a_t, b = weights.get(slot, ranks[slot])
        xs += [segment_rows] * len(a_t)
        a_ts += a_t
        bs += b
        dsts += [dst[i] for dst in outs]
    torch._foreach_add_(dsts, torch._foreach_mm(torch._foreach_mm(xs, _float(a_ts)), _float(bs)))


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run the decode segments' matmuls on the calling thread only. They are small (a row or two
    times a rank-wide block), so a second thread gains them little, and on a busy machine every op
    split across threads can wait milliseconds for a descheduled one: a decode step runs thousands.

    NOTE: torch.set_num_threads sets the calling thread's count, and also the process-wide count
    that every thread copies at its first torch call: a thread whose first call lands inside this
    window keeps one thread for good (torch 2.13), whichever thread opened it. The threads that run
    an engine's work pin their own count when they start (`pin_num_threads`)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def pin_num_threads(num_threads: int) -> None:
    """Give the calling thread `num_threads` intra-op threads for good, whatever `_one_thread`
    windows other threads open: call it first thing on a thread that runs an engine's torch work.

    NOTE: torch.set_num_threads alone is not enough: the thread's first torch call would still copy
    the process-wide count then, 1 inside a window. torch.get_num_threads makes that first call
    here, and set_num_threads then overrides whatever it copied."""
    torch.get_num_threads()
    torch.set_num_threads(num_threads)


def _float(views: list[torch.Tensor]) -> list[torch.Tensor]:
    """float32 weights as they are; half types upcast (the LoRA product is float32 whatever the
    model dtype, like the twins' rank buffer)."""
    if views[0].dtype == torch.float32:
        return views
    return [v.float() for v in views]
