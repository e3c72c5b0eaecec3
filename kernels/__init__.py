"""LoRA math: SGMV shrink/expand, Triton on GPU, torch twins on CPU (see `kernels/sgmv.py`)."""

from kernels.sgmv import sgmv_expand, sgmv_shrink

__all__ = ["sgmv_expand", "sgmv_shrink"]
