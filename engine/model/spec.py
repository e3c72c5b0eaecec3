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
    """The positions it was trained for (before a linear rope scaling stretches them)."""
    rope_theta: float
    rope_scaling: dict | None
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None  # the attention window of every layer; None = full attention
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def context_length(self) -> int:
        """The longest sequence it serves as trained: its positions, times a linear rope
        scaling's factor (llama3 scaling sets max_position_embeddings to the scaled length)."""
        scaling = self.rope_scaling or {}
        factor = scaling.get("factor", 1.0) if scaling.get("rope_type") == "linear" else 1.0
        return int(self.max_position_embeddings * factor)

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelSpec":
        """The spec of a Hugging Face model folder's config.json; UnsupportedModelError saying
        what is wrong with the folder or its config."""
        if not Path(folder).is_dir():
            state = "is not a folder" if Path(folder).exists() else "does not exist"
            raise UnsupportedModelError(f"{folder} {state}; pass a Hugging Face model folder")
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{folder} has no config.json; pass a Hugging Face model folder")
        try:
            cfg = json.loads(path.read_bytes())
        except ValueError as error:
            raise UnsupportedModelError(f"{path} is not valid JSON ({error})") from None
        if not isinstance(cfg, dict):
            raise UnsupportedModelError(f"{path} holds no JSON object")
        try:
            return cls.from_dict(cfg)
        except KeyError as error:
            raise UnsupportedModelError(f"{path} lacks {error.args[0]!r}, which a "
                                        f"{cfg.get('model_type') or 'model'} config has") from None
        except (TypeError, AttributeError) as error:  # a value of the wrong type
            raise UnsupportedModelError(f"{path} holds a value of the wrong type ({error})") from None

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelSpec":
        architecture = _architecture(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
        num_heads = cfg["num_attention_heads"]
        rope = _rope_parameters(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
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
            sliding_window=_sliding_window(cfg, architecture),
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


def _sliding_window(cfg: dict, architecture: str) -> int | None:
    """The window every layer shares, read exactly as transformers' own model class reads it."""
    if architecture == "LlamaForCausalLM":
        return None  # LlamaAttention never windows, whatever the config holds
    if architecture == "MistralForCausalLM":
        # MistralAttention windows every layer; it ignores use_sliding_window and layer_types.
        return cfg.get("sliding_window")
    return _qwen2_sliding_window(cfg)


def _qwen2_sliding_window(cfg: dict) -> int | None:
    """Qwen2 windows only the layers that layer_types marks "sliding_attention"; older config.json
    files have no layer_types, and Qwen2Config derives it: layers from max_window_layers on."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    first_windowed = cfg.get("max_window_layers", 28)
    layer_types = cfg.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_windowed else "full_attention"
        for i in range(cfg["num_hidden_layers"])]
    kinds = set(layer_types)
    unknown = kinds - {"full_attention", "sliding_attention"}
    if unknown:
        raise UnsupportedModelError(f"layer_types {sorted(unknown)} are not supported "
                                    "(only 'full_attention' and 'sliding_attention')")
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds == {"sliding_attention"}:
        return window
    num_windowed = layer_types.count("sliding_attention")
    raise UnsupportedModelError(
        f"this model mixes sliding-window and full attention layers ({num_windowed} of {len(layer_types)} "
        "layers are 'sliding_attention' in layer_types / max_window_layers), which this engine does not "
        "support yet; to run every layer with full attention (the same output while a context stays "
        f"within sliding_window={window} tokens), set use_sliding_window to false and drop layer_types "
        "in config.json")


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
