"""Helpers shared by the benchmarks: machine info, the benchmark model, workloads, bandwidth floor."""

from __future__ import annotations

import argparse
import math
import os
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

DEFAULT_WORK_DIR = Path("/tmp/switchboard-bench")
# torch takes seeds of 64 bits; a benchmark adds small offsets to its seed.
MAX_SEED = 2**62


def positive_int(text: str) -> int:
    """An argparse type: a count or size, at least 1 (0 would divide by zero or time nothing)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def random_seed(text: str) -> int:
    """An argparse type: a seed."""
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be from 0 to {MAX_SEED}, got {value}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a duration or scale, above 0."""
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a duration that may be 0 (a warm-up that can be left out)."""
    value = float(text)
    if not value >= 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def machine_summary() -> str:
    """One line naming what the numbers were measured on."""
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), python {platform.python_version()}"
    )


def load_summary() -> str:
    """Other processes share the cores and stretch timings; the load average shows how much."""
    one, five, _ = os.getloadavg()
    return f"load average: {one:.2f} (1 min), {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.machine()


@dataclass(frozen=True)
class ModelSpec:
    """A random-weight Llama; the defaults give ~125M parameters, big enough to be memory-bound at batch 1."""

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    intermediate_size: int = 2048
    vocab_size: int = 32000
    max_position_embeddings: int = 2048
    seed: int = 0

    @property
    def name(self) -> str:
        return (
            f"llama-h{self.hidden_size}-l{self.num_hidden_layers}-a{self.num_attention_heads}"
            f"-kv{self.num_key_value_heads}-i{self.intermediate_size}-v{self.vocab_size}-s{self.seed}"
        )

    def to_config(self) -> LlamaConfig:
        return LlamaConfig(
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            vocab_size=self.vocab_size,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False,
            dtype="float32",
        )


def ensure_model(spec: ModelSpec, work_dir: Path) -> Path:
    """Save the random model as safetensors once; later runs (and every peer) load the same weights."""
    path = work_dir / spec.name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(spec.to_config())
    # Write to a temp folder first so that an interrupted save is never mistaken for a finished one.
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    return path


def load_hf_model(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def decode_weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step must read: every parameter except the input embedding table,
    of which a step gathers only one row per token (unless it is tied to the LM head, which reads it all)."""
    embed = model.get_input_embeddings().weight
    tied = embed.data_ptr() == model.get_output_embeddings().weight.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


def kv_bytes(config: LlamaConfig, num_tokens: int, dtype: torch.dtype) -> int:
    """Bytes of K and V cache for num_tokens tokens across all layers."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return per_token * num_tokens * dtype.itemsize


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int


def scaled_range(lo: int, hi: int, scale: float) -> tuple[int, int]:
    """[lo, hi) scaled proportionally, keeping at least one value in range."""
    s_lo = max(1, round(lo * scale))
    return s_lo, max(s_lo + 1, round(hi * scale))


def make_offline_workload(
    num_requests: int,
    scale: float,
    vocab_size: int,
    seed: int = 0,
    prompt_range: tuple[int, int] = (8, 512),
    output_range: tuple[int, int] = (8, 256),
) -> list[WorkloadRequest]:
    """PERF.md's offline workload (S-LoRA's ranges): uniform prompt and output lengths, random token ids."""
    rng = random.Random(seed)
    p_lo, p_hi = scaled_range(*prompt_range, scale)
    o_lo, o_hi = scaled_range(*output_range, scale)
    requests = []
    for _ in range(num_requests):
        prompt = random_prompt(rng.randrange(p_lo, p_hi), vocab_size, rng)
        requests.append(WorkloadRequest(prompt, rng.randrange(o_lo, o_hi)))
    return requests


def random_prompt(length: int, vocab_size: int, rng: random.Random) -> list[int]:
    # Skip the low ids that Llama configs reserve for special tokens (pad/bos/eos).
    return [rng.randrange(3, vocab_size) for _ in range(length)]


def copy_bandwidth(num_bytes: int = 1 << 30, repeats: int = 10) -> float:
    """Best-of-`repeats` bytes/s of a large float32 tensor copy, counting bytes read plus written."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * num_bytes / best


def timed(fn: Callable[[], object]) -> float:
    """Seconds taken by one call of fn."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
