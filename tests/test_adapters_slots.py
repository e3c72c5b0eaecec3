"""Slot buffers: an adapter packed into a slot holds exactly its weights (zero padded), and the SGMV
kernels run over the slots reproduce PEFT's outputs for a batch mixing adapters."""

import pytest
import torch

from adapters.peft_format import load_adapter
from adapters.slots import SlotBuffers, pack_adapter, slot_buffer_bytes
from adapters.targets import lora_targets
from kernels import sgmv_expand, sgmv_shrink
from tests.helpers import peft_module, save_peft_adapter, tiny_spec

SPEC = tiny_spec()
MAX_RANK = 8


def assert_slot_holds(slots: SlotBuffers, slot: int, adapter) -> None:
    """Every target and layer of `slot` holds `adapter`'s weights, zero past each slice's rank, and
    rank 0 with all-zero weights where the adapter leaves a linear alone."""
    for target in lora_targets(SPEC):
        buffers, offsets = slots.targets[target.name], target.slice_offsets
        for layer in range(SPEC.num_layers):
            lora_a = buffers.lora_a[layer, :, slot].cpu()  # [num_slices, max_rank, d_in]
            lora_b = buffers.lora_b[layer, slot].cpu()  # [d_out, max_rank]
            modules = {s: adapter.modules.get((layer, p)) for s, p in enumerate(target.projections)}
            ranks = [m.rank for m in modules.values() if m is not None]
            assert buffers.slot_ranks[layer, slot].item() == max(ranks, default=0)
            for s, m in modules.items():
                rank = 0 if m is None else m.rank
                b_rows = lora_b[offsets[s]:offsets[s + 1]]
                if m is not None:
                    scaling = buffers.slot_scalings[layer, slot].item()
                    assert torch.equal(lora_a[s, :rank], m.lora_a.to(lora_a.dtype))
                    want_b = m.lora_b.to(b_rows.dtype) * m.scaling
                    torch.testing.assert_close(b_rows[:, :rank] * scaling, want_b)
                assert not lora_a[s, rank:].any() and not b_rows[:, rank:].any()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Two PEFT models on identical base weights and their loaded adapters: a dense one whose fused
    slices differ in rank and scaling, and a sparse rsLoRA one on q/v of layer 1 only."""
    root = tmp_path_factory.mktemp("slots")
    dense = save_peft_adapter(root / "dense", seed=1, r=4, lora_alpha=8, target_modules="all-linear",
                              rank_pattern={"v_proj": 2, "up_proj": 7}, alpha_pattern={"k_proj": 16})
    sparse = save_peft_adapter(root / "sparse", seed=2, r=3, lora_alpha=5, use_rslora=True,
                               target_modules=["q_proj", "v_proj"], layers_to_transform=[1])
    return [(dense, load_adapter(root / "dense", SPEC, MAX_RANK)),
            (sparse, load_adapter(root / "sparse", SPEC, MAX_RANK))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_slot_holds_exact_weights(adapters, dtype):
    slots = SlotBuffers(SPEC, num_slots=3, max_rank=MAX_RANK, dtype=dtype, device=torch.device("cpu"))
    # What a server checks against the device's memory before it allocates any slot.
    assert slot_buffer_bytes(SPEC, 3, MAX_RANK, dtype) == slots.nbytes
    (_, dense), (_, sparse) = adapters
    slots.write(2, pack_adapter(dense, SPEC, dtype, pin_memory=False))
    slots.write(0, pack_adapter(sparse, SPEC, dtype, pin_memory=False))
    assert_slot_holds(slots, 2, dense)
    assert_slot_holds(slots, 0, sparse)
    assert slots.targets["qkv_proj"].slot_ranks[:, 0].tolist() == [0, 3]
    assert slots.targets["o_proj"].slot_ranks[:, 0].tolist() == [0, 0]
    assert all(not t.lora_a[:, :, 1].any() and not t.slot_ranks[:, 1].any() for t in slots.targets.values())

    # Overwriting a slot with a lower-rank adapter leaves no trace of the old one.
    slots.write(2, pack_adapter(sparse, SPEC, dtype, pin_memory=False))
    assert_slot_holds(slots, 2, sparse)


def test_sgmv_over_slots_matches_peft(adapters):
    (dense_model, dense), (sparse_model, sparse) = adapters
    slots = SlotBuffers(SPEC, num_slots=3, max_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"))
    slots.write(2, pack_adapter(dense, SPEC, torch.float32, pin_memory=False))
    slots.write(0, pack_adapter(sparse, SPEC, torch.float32, pin_memory=False))
    # Tokens 0-3 use the dense adapter (slot 2), 4-6 none, 7-9 the sparse one (slot 0).
    seg_starts = torch.tensor([0, 4, 7, 10], dtype=torch.int32)
    seg_slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    rows = {dense_model: slice(0, 4), None: slice(4, 7), sparse_model: slice(7, 10)}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in range(SPEC.num_layers):
            for target in lora_targets(SPEC):
                w = slots.layer(layer)[target.name]
                x = torch.randn(10, target.in_features, generator=gen)
                modules = [peft_module(dense_model, layer, p) for p in target.projections]
                base = torch.cat([getattr(m, "base_layer", m)(x) for m in modules], dim=1)
                buf = torch.empty(target.num_slices, 10, MAX_RANK)
                sgmv_shrink(x, w.lora_a, seg_starts, seg_slots, w.slot_ranks, buf)
                out = base.clone()
                sgmv_expand(buf, w.lora_b, seg_starts, seg_slots, w.slot_ranks, w.slot_scalings, out,
                            w.slice_offsets)
                for model, r in rows.items():
                    want = base[r] if model is None else torch.cat(
                        [peft_module(model, layer, p)(x[r]) for p in target.projections], dim=1)
                    torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
