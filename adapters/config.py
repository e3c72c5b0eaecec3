"""AdapterConfig: the knobs of adapter residency (CPU tier, device slots, background loading)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass


def is_int(value: object) -> bool:
    """An integer, not a bool (which Python counts as one): what a count or a size must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_ints(config: object, names: Iterable[str], may_be_none: Iterable[str] = ()) -> None:
    """ValueError naming the first of `config`'s fields `names` that is not an integer (None
    allowed for those in `may_be_none`). A float passed the range checks and failed much later,
    with no field named (kv_cache_memory_bytes=2e8 once the weights had loaded); a bool is not
    an integer here either."""
    may_be_none = set(may_be_none)
    for name in names:
        value = getattr(config, name)
        if value is None and name in may_be_none:
            continue
        if not is_int(value):
            raise ValueError(f"{name} must be an integer{' or None' * (name in may_be_none)}, "
                             f"got {value!r}")


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
        require_ints(self, ("max_lora_rank", "max_gpu_adapters", "max_cpu_adapters",
                            "num_load_threads"))
        for name in ("max_lora_rank", "max_gpu_adapters", "max_cpu_adapters"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_load_threads < 0:
            raise ValueError(f"num_load_threads must be >= 0, got {self.num_load_threads}")
