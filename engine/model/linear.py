"""Linear layers that read their weights at full memory bandwidth on CPU as well as on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _num_row_blocks(out_features: int) -> int:
    """One block of output rows per thread, or the most blocks below that dividing the rows."""
    threads = max(1, torch.get_num_threads())
    return max(s for s in range(1, threads + 1) if out_features % s == 0)


class Linear:
    """y = x @ W^T + b for W given as [out_features, in_features] (the checkpoint layout).

    NOTE: on CPU, torch runs a one-row matmul (batch-1 decode) on a single thread and reads the
    weight at about half the machine's bandwidth. Viewing W as [num_threads, out / num_threads, in]
    and running one bmm of the row blocks against x^T puts every thread on its own block: batch-1
    decode then streams the weights at about copy bandwidth, and larger batches gain too. The view
    shares W's memory (tied embeddings stay shared). CUDA keeps cuBLAS's F.linear.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # [out, in]
        self.bias = bias  # [out]
        self.row_blocks = None  # [num_blocks, out / num_blocks, in], CPU only
        if weight.device.type == "cpu":
            self.row_blocks = weight.view(_num_row_blocks(self.out_features), -1, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, in_features] -> [num_tokens, out_features]."""
        if self.row_blocks is None:
            return F.linear(x, self.weight, self.bias)
        num_blocks = self.row_blocks.shape[0]
        y = torch.bmm(self.row_blocks, x.t().unsqueeze(0).expand(num_blocks, -1, -1))  # [n, out/n, T]
        y = y.permute(2, 0, 1).reshape(x.shape[0], self.out_features)
        return y if self.bias is None else y.add_(self.bias)
