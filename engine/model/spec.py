"""ModelSpec: the architecture facts the engine needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# architecture -> whether q/k/v projections carry a bias regardless of config.attention_bias
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


class UnsupportedModelError(ValueError):
    """The model folder describes something this engine cannot run; the message says what."""


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelSpec":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{folder} has no config.json; pass a Hugging Face model folder")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelSpec":
        architecture = _architecture(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        use_window = cfg.get("use_sliding_window", architecture == "MistralForCausalLM")
        return cls(
            architecture=architecture,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
            qkv_bias=SUPPORTED_ARCHITECTURES[architecture] or bool(cfg.get("attention_bias", False)),
            o_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=cfg.get("sliding_window") if use_window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _architecture(cfg: dict) -> str:
    names = cfg.get("architectures") or []
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    model_type = cfg.get("model_type")
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    if not names and model_type in by_type:
        return by_type[model_type]
    raise UnsupportedModelError(
        f"architecture {names or model_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope_parameters(cfg: dict) -> dict:
    """Rope settings from either layout: transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` pair that most published model folders carry."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    return params
