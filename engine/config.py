"""EngineConfig: every knob of one engine instance, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from adapters.config import AdapterConfig, require_ints

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class EngineConfig:
    """Configuration of one shared base-model engine."""

    model: str
    """Path to a Hugging Face model folder (config.json, *.safetensors, tokenizer files)."""
    dtype: str = "float32"
    """Weights, activations and KV cache dtype: float32, bfloat16 or float16."""
    device: str = "cpu"
    """Torch device string: "cpu", "cuda" or "cuda:N"."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_kv_blocks: int | None = None
    """Size the KV pool by block count; takes precedence over `kv_cache_memory_bytes`."""
    kv_cache_memory_bytes: int | None = None
    """Size the KV pool by a memory budget. With neither set: 1 GiB on CPU, 85% of free memory on CUDA."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (prefill chunks plus decode tokens)."""
    max_num_seqs: int = 64
    """Most requests in the running batch at once."""
    max_model_len: int | None = None
    """Longest prompt plus output; defaults to the model's max_position_embeddings."""
    enable_prefix_caching: bool = True
    """Share full KV blocks between requests with the same token prefix."""
    seed: int = 0
    """Seed of the engine-wide generator used by requests that carry no seed of their own."""
    lora: AdapterConfig | None = None
    """Serve LoRA adapters with these residency limits; None serves the base model only."""

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda"):
            import torch  # NOTE: here, so that reading a config does not load torch

            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: this machine's torch sees no CUDA "
                                 f"device (torch {torch.__version__}); use device 'cpu'")
        optional = ("num_kv_blocks", "kv_cache_memory_bytes", "max_model_len")
        require_ints(self, ("block_size", "max_num_batched_tokens", "max_num_seqs", "seed",
                            *optional), may_be_none=optional)
        if not isinstance(self.enable_prefix_caching, bool):  # NOTE: "false" is true
            raise ValueError(f"enable_prefix_caching must be True or False, "
                             f"got {self.enable_prefix_caching!r}")
        if self.lora is not None and not isinstance(self.lora, AdapterConfig):
            raise ValueError(f"lora must be an AdapterConfig or None, got {type(self.lora).__name__}")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
