"""Load a PEFT LoRA adapter folder and validate it against a base model, before anything is kept.

A folder holds adapter_config.json and adapter_model.safetensors, as PEFT's `save_pretrained`
writes them. Pickle checkpoints (.bin, .pt, ...) are never opened: unpickling runs code.
Tensor names look like
    base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight   # [r, in_features]
    base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight   # [out_features, r]
(PEFT strips the adapter name on save; a `.default` segment after lora_A/lora_B is accepted too).
Every check happens on the safetensors header first, so a wrong file is rejected before its
tensors are read.
"""

from __future__ import annotations

import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from adapters.errors import AdapterValidationError, shown
from adapters.peft_config import LoraSettings, read_lora_settings
from adapters.targets import PROJECTION_PARENTS, PROJECTIONS, module_key, projection_shapes
from engine.model.spec import ModelSpec
from store.blobs import digest_files

WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}
# NOTE: ASCII, and a layer number as PEFT writes it (no leading zero, at most 6 digits): PEFT
# matches names to modules as strings, so "layers.01." or an Arabic-Indic "layers.١." would be
# weights PEFT leaves out, not layer 1's.
_LORA_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(?P<layer>0|[1-9][0-9]{0,5})\.(?P<parent>self_attn|mlp)"
    r"\.(?P<proj>\w+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight", re.ASCII)


@dataclass(frozen=True)
class LoraModule:
    """The LoRA weights of one base linear: delta(x) = scaling * (x @ lora_a^T) @ lora_b^T."""

    lora_a: torch.Tensor  # [rank, in_features], the file's dtype
    lora_b: torch.Tensor  # [out_features, rank]
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter: the weights of every module it targets, and its identity."""

    digest: str  # sha256 of its files (store.blobs.digest_files): the adapter's identity
    modules: dict[tuple[int, str], LoraModule]  # (layer index, PEFT projection name) -> weights


def load_adapter(folder: str | Path, spec: ModelSpec, max_lora_rank: int) -> LoraAdapter:
    """Read and validate a PEFT LoRA adapter folder for the base model `spec`.

    Raises AdapterValidationError, saying what is wrong and what to do, for anything the engine
    cannot serve exactly as PEFT would run it.
    """
    folder = Path(folder)
    _check_files(folder)
    settings = read_lora_settings(folder)
    expected = _targeted_modules(settings, spec)
    try:
        with safe_open(str(folder / WEIGHTS_NAME), framework="pt", device="cpu") as f:
            names = _module_tensor_names(list(f.keys()), spec.num_layers)
            _check_module_set(set(names), expected)
            shapes = projection_shapes(spec)
            for key, pair in names.items():
                _check_header(f, key, pair, settings, shapes[key[1]], max_lora_rank)
            modules = {key: _read_module(f, key, pair, settings) for key, pair in sorted(names.items())}
    except (SafetensorError, OSError) as e:
        # NOTE: the library's message quotes names and values from the header, of any length.
        raise AdapterValidationError(
            f"{WEIGHTS_NAME} is truncated or corrupt ({shown(str(e), 300)}); upload it again") from e
    return LoraAdapter(digest_files(folder), modules)


def _check_files(folder: Path) -> None:
    if not folder.is_dir():
        raise AdapterValidationError(f"{folder} does not exist: no adapter is there")
    if (folder / WEIGHTS_NAME).is_file():
        return
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickled:
        raise AdapterValidationError(
            f"{folder} has {', '.join(pickled)} but no {WEIGHTS_NAME}: pickle checkpoints are never "
            "opened; re-save the adapter with save_pretrained(..., safe_serialization=True)")
    raise AdapterValidationError(
        f"{folder} has no {WEIGHTS_NAME}: save the adapter with PEFT's save_pretrained")


def _targeted_modules(settings: LoraSettings, spec: ModelSpec) -> set[tuple[int, str]]:
    for key, what in (("model.embed_tokens", "the token embeddings"), ("lm_head", "lm_head")):
        if settings.targets(key):
            raise AdapterValidationError(
                f"LoRA on {what} ({key}) is not supported yet; target only the decoder layers' "
                f"projections ({', '.join(PROJECTIONS)})")
    return {(layer, proj) for layer in range(spec.num_layers) for proj in PROJECTIONS
            if settings.targets(module_key(layer, proj))}


def _module_tensor_names(names: list[str], num_layers: int) -> dict[tuple[int, str], tuple[str, str]]:
    """(layer, projection) -> (lora_A name, lora_B name), every tensor name accounted for."""
    found: dict[tuple[int, str], dict[str, str]] = {}
    for name in names:
        match = _LORA_NAME.fullmatch(name)
        if match is None:
            raise AdapterValidationError(_unsupported_tensor(name))
        layer, proj = int(match["layer"]), match["proj"]
        if PROJECTION_PARENTS.get(proj) != match["parent"]:
            raise AdapterValidationError(_unsupported_tensor(name))
        if layer >= num_layers:
            raise AdapterValidationError(
                f"tensor {shown(name)} is for layer {layer}, but the base model has {num_layers} layers: "
                "the adapter was trained for a different base model")
        pair = found.setdefault((layer, proj), {})
        if match["ab"] in pair:
            raise AdapterValidationError(
                f"{WEIGHTS_NAME} has two lora_{match['ab']} tensors for {module_key(layer, proj)} "
                f"({shown(pair[match['ab']])} and {shown(name)}); save one adapter per folder")
        pair[match["ab"]] = name
    for (layer, proj), pair in found.items():
        if len(pair) != 2:
            have, lack = ("A", "B") if "A" in pair else ("B", "A")
            raise AdapterValidationError(
                f"{module_key(layer, proj)} has lora_{have} but no lora_{lack} in {WEIGHTS_NAME}: "
                "the file is incomplete; save the adapter again")
    return {key: (pair["A"], pair["B"]) for key, pair in found.items()}


def _unsupported_tensor(name: str) -> str:
    shown_name = shown(name)
    is_embeddings = "lora_embedding" in name or "embed_tokens" in name
    is_lm_head = name.startswith("base_model.model.lm_head")
    if (is_embeddings or is_lm_head) and "lora_" not in name:
        # NOTE: what PEFT saves of a model whose vocabulary was resized (save_embedding_layers
        # "auto"), whatever the adapter targets: not LoRA on those layers.
        return (f"tensor {shown_name}: the adapter carries its own full token embeddings or "
                "lm_head (saved as the vocabulary was resized, or with save_embedding_layers="
                "True), and adapters here share the base model's vocabulary: train without "
                "adding tokens, or save with save_embedding_layers=False")
    if is_embeddings:
        return f"tensor {shown_name}: LoRA on the token embeddings is not supported yet"
    if is_lm_head:
        return f"tensor {shown_name}: LoRA on lm_head is not supported yet"
    if "lora_magnitude_vector" in name:
        return f"tensor {shown_name}: DoRA adapters are not supported; serve a plain LoRA adapter"
    if name.endswith(".bias"):
        return (f"tensor {shown_name}: bias terms are not supported; train with bias='none' and "
                "lora_bias=False")
    return (f"tensor {shown_name} is not a LoRA weight of a decoder layer's projection "
            f"({', '.join(PROJECTIONS)}); other modules are not supported")


def _check_module_set(found: set[tuple[int, str]], expected: set[tuple[int, str]]) -> None:
    if not found:
        raise AdapterValidationError(f"{WEIGHTS_NAME} holds no LoRA weights")
    if missing := sorted(expected - found):
        raise AdapterValidationError(
            f"adapter_config.json targets {len(missing)} modules that have no weights in {WEIGHTS_NAME} "
            f"(first: {module_key(*missing[0])}): the file is incomplete or belongs to another config")
    if extra := sorted(found - expected):
        raise AdapterValidationError(
            f"{WEIGHTS_NAME} has weights for {len(extra)} modules that adapter_config.json does not "
            f"target (first: {module_key(*extra[0])}); PEFT would ignore them: fix target_modules "
            "or layers_to_transform")


def _check_header(f, key: tuple[int, str], names: tuple[str, str], settings: LoraSettings,
                  shape: tuple[int, int], max_lora_rank: int) -> None:
    """Dtype, rank and shapes of one module's tensors, from the safetensors header alone."""
    name = module_key(*key)
    rank, (in_features, out_features) = settings.rank(name), shape
    if rank > max_lora_rank:
        raise AdapterValidationError(
            f"{name} has rank {reprlib.repr(rank)}, above the highest its engines serve "
            f"(--max-lora-rank {max_lora_rank}); retrain with r <= {max_lora_rank}")
    _check_scaling(name, settings)
    for tensor_name, want in zip(names, ([rank, in_features], [out_features, rank])):
        tensor = f.get_slice(tensor_name)
        if tensor.get_dtype() not in _DTYPES:
            raise AdapterValidationError(
                f"{shown(tensor_name)} has dtype {tensor.get_dtype()}; LoRA weights must be "
                "float16, bfloat16 or float32")
        if tensor.get_shape() != want:
            raise AdapterValidationError(
                f"{shown(tensor_name)} has shape {tensor.get_shape()}, expected {want} (r={rank} from "
                f"adapter_config.json; {name} maps {in_features} to {out_features} features in the base "
                "model): the adapter belongs to a different base model, or its config does not match "
                "its weights")


def _check_scaling(name: str, settings: LoraSettings) -> None:
    # NOTE: packing (adapters/slots.py) folds a fused slice's scaling into its B rows as a ratio to
    # the largest scaling of the layer's slot, at most 1 in magnitude: only scalings can overflow.
    scaling = settings.scaling(name)
    if not torch.tensor(scaling, dtype=torch.float32).isfinite():
        field, rank = settings.alpha_field(name), settings.rank(name)
        over, divisor = ("sqrt(r)", f"sqrt({rank})") if settings.use_rslora else ("r", str(rank))
        raise AdapterValidationError(
            f"{name} is scaled by {field} / {over} = {settings.alpha(name):g} / {divisor} = "
            f"{scaling:g}, past the float32 range (about 3.4e38) in which the server applies it; "
            f"lower {field}")


def _read_module(f, key: tuple[int, str], names: tuple[str, str], settings: LoraSettings) -> LoraModule:
    lora_a, lora_b = (f.get_tensor(name) for name in names)
    for name, tensor in zip(names, (lora_a, lora_b)):
        if not torch.isfinite(tensor).all():
            raise AdapterValidationError(
                f"{shown(name)} holds NaN or Inf values; the adapter's training diverged")
    return LoraModule(lora_a, lora_b, settings.scaling(module_key(*key)))
