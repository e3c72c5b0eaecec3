"""Linear layers that read their weights at full memory bandwidth on CPU as well as on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows from which a CPU matmul goes through the pre-packed oneDNN weight (see Linear).
_MIN_PACKED_ROWS = 3


def _num_row_blocks(out_features: int) -> int:
    """One block of output rows per thread, or the most blocks below that dividing the rows."""
    threads = max(1, torch.get_num_threads())
    return max(s for s in range(1, threads + 1) if out_features % s == 0)


def _pack_for_onednn(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` reordered once into oneDNN's blocked layout for its matmul; None where that path is
    not taken (no oneDNN, or not float32: the half types are only fast on CPUs with native bf16)."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


class Linear:
    """y = x @ W^T + b for W given as [out_features, in_features] (the checkpoint layout).

    On CPU a matmul of a few rows is neither compute- nor bandwidth-bound with torch's default
    kernels: MKL repacks the whole weight on every call. Two ways around that, by row count:
    - One or two rows (batch-1 decode): torch runs a one-row matmul on a single thread at about half
      the machine's bandwidth. Viewing W as [num_threads, out / num_threads, in] and running one
      bmm of the row blocks against x^T puts every thread on its own block, which streams the
      weights at about copy bandwidth. The view shares W's memory (tied embeddings stay shared).
    - Three rows or more (batched decode, prefill): W is reordered once at load into oneDNN's
      blocked layout, and oneDNN's matmul reads it as it is: 1.2-2.5x the bmm's speed at 4-64 rows
      and 0.9-1.3x at prefill sizes, for a float32 weight on two threads (benchmarks/README.md).
      Below three rows oneDNN is slower than the row blocks.
    The packed copy is a second copy of W: a float32 model's linear weights take twice their size
    in host memory. CUDA keeps cuBLAS's F.linear.

    NOTE: `mkldnn._reorder_linear_weight` and `mkldnn._linear_pointwise` are the private ops that
    torch.compile's CPU backend uses for frozen linears. torch is pinned (pyproject.toml), and the
    engine's parity tests against transformers run through them.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.bias = bias  # [out]
        self.row_blocks = None  # [num_blocks, out / num_blocks, in], CPU only
        self.packed = None  # oneDNN's layout of weight, CPU float32 only
        if weight.device.type == "cpu":
            self.row_blocks = weight.view(_num_row_blocks(self.out_features), -1, self.in_features)
            self.packed = _pack_for_onednn(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        if self.row_blocks is None:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None and x.shape[0] >= _MIN_PACKED_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        num_blocks = self.row_blocks.shape[0]
        y = torch.bmm(self.row_blocks, x.t().unsqueeze(0).expand(num_blocks, -1, -1))  # [n, out/n, T]
        y = y.permute(2, 0, 1).reshape(x.shape[0], self.out_features)
        return y if self.bias is None else y.add_(self.bias)
