"""Build a LlamaModel from a Hugging Face model folder (config.json + *.safetensors)."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.model.linear import Linear
from engine.model.llama import DecoderLayer, LlamaModel
from engine.model.spec import ModelSpec, UnsupportedModelError

logger = logging.getLogger(__name__)


class _WeightReader:
    """Name -> tensor over every safetensors shard of a folder, converted on read."""

    def __init__(self, folder: Path, stack: ExitStack, dtype: torch.dtype, device: torch.device):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
            hint = (f" (found {', '.join(pickled)}: pickle checkpoints are never loaded; convert them "
                    "with `save_pretrained(..., safe_serialization=True)`)") if pickled else ""
            raise UnsupportedModelError(f"no *.safetensors weights in {folder}{hint}")
        self.location: dict[str, tuple[Any, Path]] = {}  # name: (open file, its path)
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
            except SafetensorError as error:
                raise UnsupportedModelError(_damaged(path, error)) from None
            for name in handle.keys():
                self.location[name] = (handle, path)
        self.dtype, self.device = dtype, device

    def has(self, name: str) -> bool:
        return name in self.location

    def get(self, name: str) -> torch.Tensor:
        if name not in self.location:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        handle, path = self.location[name]
        try:
            tensor = handle.get_tensor(name)
        except SafetensorError as error:
            raise UnsupportedModelError(_damaged(path, error)) from None
        return tensor.to(device=self.device, dtype=self.dtype)

    def get_cat(self, names: list[str]) -> torch.Tensor:
        return torch.cat([self.get(n) for n in names], dim=0)


def _damaged(path: Path, error: Exception) -> str:
    return (f"{path.name} cannot be read ({error}): the file is damaged or incomplete, as an "
            "interrupted download or copy leaves it; fetch it again")


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device,
               max_positions: int | None = None, show_progress: bool = True) -> LlamaModel:
    folder = Path(folder)
    spec = ModelSpec.from_folder(folder)
    with ExitStack() as stack:
        weights = _WeightReader(folder, stack, dtype, device)
        embed = weights.get("model.embed_tokens.weight")
        layers = [
            _load_layer(weights, spec, i)
            for i in tqdm(range(spec.num_layers), desc=f"Loading {folder.name}",
                          unit="layer", disable=not show_progress)
        ]
        if spec.tie_word_embeddings or not weights.has("lm_head.weight"):
            lm_head = embed
        else:
            lm_head = weights.get("lm_head.weight")
        norm = weights.get("model.norm.weight")
    logger.info("loaded %s (%s, %d layers) as %s on %s", folder, spec.architecture,
                spec.num_layers, dtype, device)
    return LlamaModel(spec, embed, layers, norm, Linear(lm_head),
                      max_positions or spec.max_position_embeddings)


def _load_layer(weights: _WeightReader, spec: ModelSpec, index: int) -> DecoderLayer:
    p = f"model.layers.{index}."
    attn, mlp = p + "self_attn.", p + "mlp."
    qkv = [attn + f"{name}_proj" for name in ("q", "k", "v")]
    gate_up = [mlp + "gate_proj", mlp + "up_proj"]
    return DecoderLayer(
        input_norm=weights.get(p + "input_layernorm.weight"),
        qkv_proj=Linear(weights.get_cat([n + ".weight" for n in qkv]),
                        weights.get_cat([n + ".bias" for n in qkv]) if spec.qkv_bias else None),
        o_proj=Linear(weights.get(attn + "o_proj.weight"),
                      weights.get(attn + "o_proj.bias") if spec.o_bias else None),
        post_attention_norm=weights.get(p + "post_attention_layernorm.weight"),
        gate_up_proj=Linear(weights.get_cat([n + ".weight" for n in gate_up]),
                            weights.get_cat([n + ".bias" for n in gate_up]) if spec.mlp_bias else None),
        down_proj=Linear(weights.get(mlp + "down_proj.weight"),
                         weights.get(mlp + "down_proj.bias") if spec.mlp_bias else None),
    )
