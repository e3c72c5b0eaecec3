"""Where LoRA can attach: the PEFT projections of a decoder layer and the engine linears fusing them."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from engine.model.spec import ModelSpec

# PEFT projection name -> the decoder-layer submodule holding it (transformers' Llama layout).
PROJECTION_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
PROJECTIONS = tuple(PROJECTION_PARENTS)


def module_key(layer: int, projection: str) -> str:
    """The module's name in a transformers *ForCausalLM, the name PEFT matches and saves."""
    return f"model.layers.{layer}.{PROJECTION_PARENTS[projection]}.{projection}"


@dataclass(frozen=True)
class LoraTarget:
    """One linear of the engine's decoder layer (engine/model/llama.py) and the projections it fuses."""

    name: str  # the engine's linear: qkv_proj, o_proj, gate_up_proj or down_proj
    projections: tuple[str, ...]  # fused PEFT projections, in the order of their output columns
    in_features: int
    out_features: tuple[int, ...]  # one per projection

    @property
    def num_slices(self) -> int:
        return len(self.projections)

    @property
    def slice_offsets(self) -> list[int]:
        """Column offsets of the slices in the fused output: [0, ..., sum(out_features)]."""
        return [0, *accumulate(self.out_features)]


def lora_targets(spec: ModelSpec) -> tuple[LoraTarget, ...]:
    """The four LoRA-aware linears of every decoder layer of `spec`."""
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return (
        LoraTarget("qkv_proj", ("q_proj", "k_proj", "v_proj"), hidden,
                   (spec.q_size, spec.kv_size, spec.kv_size)),
        LoraTarget("o_proj", ("o_proj",), spec.q_size, (hidden,)),
        LoraTarget("gate_up_proj", ("gate_proj", "up_proj"), hidden, (inter, inter)),
        LoraTarget("down_proj", ("down_proj",), inter, (hidden,)),
    )


def projection_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """PEFT projection name -> (in_features, out_features) of that base linear."""
    return {
        projection: (target.in_features, out)
        for target in lora_targets(spec)
        for projection, out in zip(target.projections, target.out_features)
    }
