"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a flat batch and a paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.lora import LoraBatch
from engine.model.attention import AttentionMetadata, paged_attention, write_kv
from engine.model.linear import Linear
from engine.model.rope import RotaryEmbedding
from engine.model.spec import ModelSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as transformers' LlamaRMSNorm: normalize in float32, scale in the model dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: Linear  # q, k and v fused: [q_size + 2 * kv_size, hidden]
    o_proj: Linear
    post_attention_norm: torch.Tensor  # [hidden]
    gate_up_proj: Linear  # gate and up fused: [2 * intermediate, hidden]
    down_proj: Linear


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attention: AttentionMetadata
    logits_rows: torch.Tensor  # [num_rows] rows whose next-token logits are wanted (sampled, then prompt logprobs)
    lora: LoraBatch | None = None  # None when no token of the step uses an adapter


class LlamaModel:
    """Weights plus the forward pass. `forward` returns float32 logits for `logits_rows` only."""

    def __init__(self, spec: ModelSpec, embed_tokens: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, lm_head: Linear, max_positions: int):
        self.spec = spec
        self.embed_tokens = embed_tokens  # [vocab, hidden]
        self.layers = layers
        self.norm = norm  # [hidden]
        self.lm_head = lm_head  # hidden -> vocab; may share embed_tokens' weights
        self.rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta,
                                      spec.rope_scaling, embed_tokens.dtype, embed_tokens.device)
        self.scale = spec.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, batch: ForwardBatch, k_caches: list[torch.Tensor],
                v_caches: list[torch.Tensor]) -> torch.Tensor:
        eps = self.spec.rms_norm_eps
        hidden = F.embedding(batch.input_ids, self.embed_tokens)  # [T, hidden]
        for index, (layer, k_cache, v_cache) in enumerate(zip(self.layers, k_caches, v_caches)):
            lora = _LayerLora(batch.lora, index)
            attn_in = rms_norm(hidden, layer.input_norm, eps)
            hidden = hidden + self._attention(layer, attn_in, batch, k_cache, v_cache, lora)
            mlp_in = rms_norm(hidden, layer.post_attention_norm, eps)
            hidden = hidden + self._mlp(layer, mlp_in, lora)
        last = rms_norm(hidden[batch.logits_rows], self.norm, eps)
        return self.lm_head(last).float()  # [num_rows, vocab]

    def _attention(self, layer: DecoderLayer, x: torch.Tensor, batch: ForwardBatch,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, lora: "_LayerLora") -> torch.Tensor:
        spec = self.spec
        num_tokens = x.shape[0]
        qkv = lora(layer.qkv_proj, "qkv_proj", x)
        q, k, v = qkv.split([spec.q_size, spec.kv_size, spec.kv_size], dim=-1)
        q = self.rotary.apply(q.view(num_tokens, spec.num_heads, spec.head_dim), batch.positions)
        k = self.rotary.apply(k.view(num_tokens, spec.num_kv_heads, spec.head_dim), batch.positions)
        v = v.view(num_tokens, spec.num_kv_heads, spec.head_dim)
        write_kv(k, v, k_cache, v_cache, batch.attention.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, batch.attention, self.scale)
        return lora(layer.o_proj, "o_proj", out.view(num_tokens, spec.q_size))

    def _mlp(self, layer: DecoderLayer, x: torch.Tensor, lora: "_LayerLora") -> torch.Tensor:
        gate, up = lora(layer.gate_up_proj, "gate_up_proj", x).chunk(2, dim=-1)
        return lora(layer.down_proj, "down_proj", F.silu(gate) * up)


@dataclass
class _LayerLora:
    """Runs one layer's linears, adding the batch's LoRA deltas when the step has any."""

    batch: LoraBatch | None
    layer: int

    def __call__(self, linear: Linear, target: str, x: torch.Tensor) -> torch.Tensor:
        out = linear(x)
        if self.batch is not None:
            self.batch.apply(self.layer, target, x, out)
        return out
