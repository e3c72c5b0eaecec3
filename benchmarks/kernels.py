"""SGMV kernel benchmark: Triton vs torch twin latency on one CUDA GPU, and the bandwidth achieved as
a fraction of the same GPU's copy bandwidth, measured in the same run.

    python benchmarks/kernels.py                                # hidden 4096, rank 16, bf16
    python benchmarks/kernels.py --slices 4096 1024 1024        # fused q/k/v expand

Each case is a decode batch of N tokens over k distinct adapters (k in 1, sqrt(N), N), one contiguous
segment per adapter. shrink: x [N, hidden] -> buf [S, N, rank]; expand: buf -> out [N, sum(slices)].
Bytes are the minimum each op must move: shrink reads x and the used A rows and writes buf; expand
reads buf and the used B rows and reads and writes out. Without CUDA it says so and exits 0.

Two Triton times: `eager` launches each call from Python, as the engine does today, so a small
kernel's time is its launch overhead; `graph` replays the calls captured in one CUDA graph, which
leaves launches out and is the kernel's own time. The graph cycles through enough copies of the
inputs to overflow L2, so every call reads its adapter weights from device memory. Bandwidth and
`of_copy` use the graph time, and `floor_us` is the bytes over the copy bandwidth. The torch twin
reads its segments on the host (it cannot be captured), so it is timed eager only; `vs_torch` is
its time over Triton's eager time. A shrink's time includes the memset that zeroes its output.
"""

import argparse
import math
import sys
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

# Run as a script, this file's folder leads sys.path and this file's name would shadow the kernels
# package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from kernels.sgmv_torch import sgmv_expand_torch, sgmv_shrink_torch  # noqa: E402


@dataclass
class Case:
    x: torch.Tensor  # [num_tokens, hidden]
    lora_a: torch.Tensor  # [num_slices, num_adapters, rank, hidden]
    lora_b: torch.Tensor  # [num_adapters, d_out, rank], a view of rank-major storage
    buf: torch.Tensor  # [num_slices, num_tokens, rank] float32
    out: torch.Tensor  # [num_tokens, d_out]
    seg_starts: torch.Tensor  # [num_adapters + 1] int32
    seg_slots: torch.Tensor  # [num_adapters] int32
    slot_ranks: torch.Tensor  # [num_adapters] int32
    slot_scalings: torch.Tensor  # [num_adapters] float32
    slice_offsets: torch.Tensor | None  # [num_slices + 1] int32
    max_seg_len: int

    def shrink(self, impl, out: torch.Tensor | None = None) -> None:
        impl(self.x, self.lora_a, self.seg_starts, self.seg_slots, self.slot_ranks,
             self.buf if out is None else out, self.max_seg_len)

    def expand(self, impl, out: torch.Tensor | None = None) -> None:
        impl(self.buf, self.lora_b, self.seg_starts, self.seg_slots, self.slot_ranks, self.slot_scalings,
             self.out if out is None else out, self.slice_offsets, self.max_seg_len)

    def shrink_bytes(self) -> int:
        return self.x.nbytes + self.lora_a.nbytes + self.buf.nbytes

    def expand_bytes(self) -> int:
        return self.buf.nbytes + self.lora_b.nbytes + 2 * self.out.nbytes


def make_case(num_tokens: int, num_adapters: int, args: argparse.Namespace) -> Case:
    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    num_slices, d_out = len(args.slices), sum(args.slices)
    seg_lens = [num_tokens // num_adapters + (i < num_tokens % num_adapters) for i in range(num_adapters)]
    int32 = dict(dtype=torch.int32, device=device)
    # Small weights: timing repeats the in-place expand thousands of times on the same out.
    return Case(
        x=torch.randn(num_tokens, args.hidden, dtype=dtype, device=device),
        lora_a=torch.randn(num_slices, num_adapters, args.rank, args.hidden, dtype=dtype, device=device) * 0.01,
        # Rank-major storage read through a transposed view, as adapters/slots.py lays out the slots.
        lora_b=(torch.randn(num_adapters, args.rank, d_out, dtype=dtype, device=device) * 0.01).mT,
        buf=torch.randn(num_slices, num_tokens, args.rank, device=device),  # expand's input (never zeros)
        out=torch.randn(num_tokens, d_out, dtype=dtype, device=device),
        seg_starts=torch.tensor(list(accumulate(seg_lens, initial=0)), **int32),
        seg_slots=torch.randperm(num_adapters, device=device).int(),
        slot_ranks=torch.full((num_adapters,), args.rank, **int32),
        slot_scalings=torch.full((num_adapters,), 2.0, device=device),
        slice_offsets=torch.tensor(list(accumulate(args.slices, initial=0)), **int32) if num_slices > 1 else None,
        max_seg_len=max(seg_lens),
    )


def check(case: Case, shrink_triton, expand_triton) -> None:
    """Fail loudly if the compiled kernels disagree with the twins on this GPU."""
    buf = torch.empty_like(case.buf)
    case.shrink(shrink_triton, buf)
    case.shrink(sgmv_shrink_torch)  # fills case.buf, which expand (checked and timed) then reads
    torch.testing.assert_close(buf, case.buf, rtol=1e-3, atol=1e-3)
    out, ref_out = case.out.clone(), case.out.clone()
    case.expand(expand_triton, out)
    case.expand(sgmv_expand_torch, ref_out)
    torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)


def gpu_copy_bandwidth(num_bytes: int = 1 << 30) -> float:
    """Bytes/s of a GPU device-to-device copy, bytes read plus written, timed with CUDA events (the
    CPU `benchmarks.common.copy_bandwidth` times the host clock, which a CUDA launch returns before)."""
    from triton.testing import do_bench

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * num_bytes / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def copies_to_overflow_l2(case_bytes: int) -> int:
    """How many input sets a timed graph cycles through so that each call's reads miss L2."""
    l2_bytes = torch.cuda.get_device_properties().L2_cache_size
    return max(2, min(64, math.ceil(4 * l2_bytes / case_bytes)))


def time_graph(apply, cases: list[Case]) -> float:
    """Seconds per call of the GPU work alone: one call per case, captured in one CUDA graph."""
    from triton.testing import do_bench_cudagraph

    def all_cases() -> None:
        for case in cases:
            apply(case)

    return do_bench_cudagraph(all_cases, return_mode="median") * 1e-3 / len(cases)


def run(args: argparse.Namespace) -> None:
    from triton.testing import do_bench

    from kernels.sgmv_triton import sgmv_expand_triton, sgmv_shrink_triton

    copy_bw = gpu_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  copy bandwidth {copy_bw / 1e9:.0f} GB/s  hidden {args.hidden}  "
          f"rank {args.rank}  {args.dtype}  slices {args.slices}")
    print(f"{'tokens':>6} {'adapters':>8} {'op':>6} {'eager_us':>8} {'graph_us':>8} {'torch_us':>8} "
          f"{'floor_us':>8} {'GB/s':>6} {'of_copy':>7} {'vs_torch':>8}")
    for num_tokens in args.tokens:
        for num_adapters in sorted({1, math.isqrt(num_tokens), num_tokens}):
            case = make_case(num_tokens, num_adapters, args)
            check(case, sgmv_shrink_triton, sgmv_expand_triton)
            cases = [case] + [make_case(num_tokens, num_adapters, args)
                              for _ in range(copies_to_overflow_l2(case.shrink_bytes()) - 1)]
            for op, triton_impl, torch_impl, num_bytes in (
                ("shrink", sgmv_shrink_triton, sgmv_shrink_torch, case.shrink_bytes()),
                ("expand", sgmv_expand_triton, sgmv_expand_torch, case.expand_bytes()),
            ):
                t_eager = do_bench(lambda: getattr(case, op)(triton_impl), return_mode="median") * 1e-3
                t_graph = time_graph(lambda c: getattr(c, op)(triton_impl), cases)
                t_torch = do_bench(lambda: getattr(case, op)(torch_impl), return_mode="median") * 1e-3
                bw = num_bytes / t_graph
                floor = num_bytes / copy_bw
                print(f"{num_tokens:>6} {num_adapters:>8} {op:>6} {t_eager * 1e6:>8.1f} "
                      f"{t_graph * 1e6:>8.2f} {t_torch * 1e6:>8.1f} {floor * 1e6:>8.2f} "
                      f"{bw / 1e9:>6.0f} {bw / copy_bw:>7.1%} {t_torch / t_eager:>7.1f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096, help="d_in of shrink (default 4096)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of every adapter (default 16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--slices", type=int, nargs="+", default=[4096], help="output width of each fused slice")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py measures the Triton SGMV kernels on a CUDA GPU; none is available here, "
              "so there is nothing to measure (the CPU path is covered by tests/test_sgmv.py).")
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
