"""AdapterConfig: the knobs of adapter residency (CPU tier, device slots, background loading)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdapterConfig:
    """Configuration of one engine's adapter cache."""

    max_lora_rank: int = 64
    """Largest LoRA rank accepted; device slots are sized for it, larger adapters are rejected."""
    max_gpu_adapters: int = 8
    """Device slots: adapters resident at once, so the most distinct adapters in one batch."""
    max_cpu_adapters: int = 64
    """Adapters kept validated and packed in host memory (pinned on CUDA) for fast page-in."""
    num_load_threads: int = 1
    """Threads that load adapters from storage for `prefetch`; 0 loads on the caller's thread."""

    def __post_init__(self) -> None:
        for name in ("max_lora_rank", "max_gpu_adapters", "max_cpu_adapters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_load_threads < 0:
            raise ValueError(f"num_load_threads must be >= 0, got {self.num_load_threads}")
