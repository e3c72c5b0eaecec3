"""adapter_config.json of a PEFT LoRA adapter: parsed, checked, and PEFT's module-matching rules.

The matching mirrors peft 0.21 (`check_target_module_exists`, `get_pattern_key`) so that the set
of modules an adapter targets here is exactly the set PEFT would have wrapped in the base model.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass
from pathlib import Path

from adapters.config import is_int
from adapters.errors import AdapterValidationError, shown
from adapters.peft_regex import ModuleRegex, Regexes

CONFIG_NAME = "adapter_config.json"
# Far more than any PEFT config (a few kilobytes, tens with a rank_pattern per module): a larger one
# is not an adapter, and parsing hundreds of megabytes would stall the server.
MAX_CONFIG_BYTES = 1 << 20
ALL_LINEAR = "all-linear"
# PEFT's default target_modules for the llama, mistral and qwen2 model types.
DEFAULT_TARGET_MODULES = frozenset({"q_proj", "v_proj"})

# How PEFT compiles each kind of regex of the config ({} is the config's text).
_FULL_REGEX = "{}"  # target_modules, exclude_modules: re.fullmatch
_PATTERN_KEY_REGEX = r"(.*\.)?({})$"  # rank_pattern, alpha_pattern keys: get_pattern_key's re.match
# (a full match: module names hold no newline for $ to stop before)
_LAYERS_REGEX = r"(?:^|.*?\.){}\.(?P<idx>\d+)\."  # layers_pattern: re.match, idx is the layer
_ANY_LAYER_REGEX = re.compile(r".*?\.[^.]*\.(?P<idx>\d+)\.")  # without layers_pattern

# Fields that change the forward pass in ways this server does not implement: each must be unset.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA adapters (use_dora) are not supported; serve a plain LoRA adapter",
    "modules_to_save": "modules_to_save (fully trained copies of base modules) is not supported: "
                       "only LoRA weights can share a base model; retrain without modules_to_save",
    "lora_bias": "LoRA bias terms (lora_bias) are not supported; retrain with lora_bias=False",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
    "trainable_token_indices": "trainable token embeddings (trainable_token_indices) are not supported yet",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported: they change the base model's "
                   "weights, which adapters here share; serve a plain LoRA adapter",
    "arrow_config": "Arrow routing over several LoRA experts (arrow_config) is not supported; "
                    "serve each expert as an adapter of its own",
    "velora_config": "VeLoRA adapters (velora_config) are not supported; serve a plain LoRA adapter",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported; serve a plain "
                         "LoRA adapter",
}

_SUB_CONFIGS = {field for field in _UNSUPPORTED_FIELDS if field.endswith("_config")} | {"use_bdlora"}


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter_config.json says about which modules carry LoRA, with what rank and scale."""

    r: int
    lora_alpha: float
    use_rslora: bool  # scaling = alpha / sqrt(r) instead of alpha / r
    target_modules: str | ModuleRegex | frozenset[str]  # ALL_LINEAR, a regex, or names/suffixes
    exclude_modules: ModuleRegex | frozenset[str]  # a regex or names/suffixes; wins over target_modules
    layers_to_transform: frozenset[int] | None
    layers_pattern: tuple[re.Pattern, ...]  # compiled _LAYERS_REGEX, one per layers_pattern name
    rank_pattern: dict[ModuleRegex, int]  # _PATTERN_KEY_REGEX around each key -> r, first match wins
    alpha_pattern: dict[ModuleRegex, float]

    def targets(self, key: str) -> bool:
        """Whether PEFT would put LoRA on the module named `key` (e.g. model.layers.0.mlp.up_proj)."""
        if _matches(self.exclude_modules, key):
            return False
        if self.target_modules == ALL_LINEAR:
            # NOTE: PEFT's all-linear is every Linear but the output head; in this model
            # family that is exactly the decoder layers' projections.
            return key.startswith("model.layers.")
        if not isinstance(self.target_modules, frozenset):
            return self.target_modules.matches(key)
        if key in self.target_modules:
            return True  # a full module name: PEFT ignores layers_to_transform here
        if not _ends_in_one_of(key, self.target_modules):
            return False
        layers = self.layers_to_transform
        return layers is None or _layer_index(key, self.layers_pattern) in layers

    def rank(self, key: str) -> int:
        return _pattern_value(self.rank_pattern, key, self.r)

    def alpha(self, key: str) -> float:
        return _pattern_value(self.alpha_pattern, key, self.lora_alpha)

    def alpha_field(self, key: str) -> str:
        """The field that alpha(key) comes from, for messages."""
        return "alpha_pattern" if any(p.matches(key) for p in self.alpha_pattern) else "lora_alpha"

    def scaling(self, key: str) -> float:
        rank, alpha = self.rank(key), self.alpha(key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_lora_settings(folder: Path) -> LoraSettings:
    """Parse and check `folder`/adapter_config.json; AdapterValidationError says what is wrong."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterValidationError(
            f"{folder} has no {CONFIG_NAME}: save the adapter with PEFT's save_pretrained")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
        raise AdapterValidationError(
            f"{CONFIG_NAME} is {size} bytes, past the {MAX_CONFIG_BYTES} accepted (PEFT writes a "
            "few kilobytes): save the adapter with PEFT's save_pretrained")
    try:
        cfg = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, a number of over 4300 digits, deep nesting
        raise AdapterValidationError(f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterValidationError(f"{CONFIG_NAME} must hold a JSON object")
    return parse_lora_settings(cfg)


def parse_lora_settings(cfg: dict) -> LoraSettings:
    """Check a PEFT config dict; reject what the server does not implement."""
    if cfg.get("peft_type") != "LORA":
        raise AdapterValidationError(
            f"peft_type {reprlib.repr(cfg.get('peft_type'))} is not supported: only LoRA adapters "
            "(peft_type LORA) can be served")
    for field, why in _UNSUPPORTED_FIELDS.items():
        # NOTE: PEFT turns a variant on by any sub-config (*_config, use_bdlora) that is not null,
        # {} included.
        if cfg.get(field) is not None if field in _SUB_CONFIGS else cfg.get(field):
            raise AdapterValidationError(f"{why} ({CONFIG_NAME} has {field}={reprlib.repr(cfg[field])})")
    if _changes_base_weights(init := cfg.get("init_lora_weights")):
        raise AdapterValidationError(
            f"init_lora_weights={reprlib.repr(init)} is not supported: PEFT changes the base model's weights "
            "as it loads such an adapter (PiSSA, CorDA and OLoRA subtract their initial LoRA "
            "weights, LoftQ quantizes them), and here adapters share one base model; save a PiSSA, "
            "CorDA or OLoRA adapter as plain LoRA with save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...), or retrain without LoftQ")
    # NOTE: bias "all" or "lora_only" is refused by the bias tensors it saves (adapters share the
    # base model's biases), not by the config: over a model without biases it saves none, and the
    # adapter is plain LoRA.
    if (bias := cfg.get("bias")) not in (None, "none", "all", "lora_only"):
        raise AdapterValidationError(f"bias={reprlib.repr(bias)} is none of PEFT's settings: "
                                     "'none', 'all' or 'lora_only'")
    # NOTE: fan_in_fan_out is ignored on purpose: PEFT turns it off for nn.Linear targets (all of
    # them here), so A and B are stored [r, in] and [out, r] either way; load_adapter checks shapes.
    regexes = Regexes()
    target_modules = _field(cfg, "target_modules", _target_set, regexes)
    # NOTE: as PEFT's LoraConfig refuses them: it would load no such adapter.
    for field in ("layers_to_transform", "layers_pattern"):
        if not isinstance(target_modules, frozenset) and cfg.get(field) is not None:
            raise AdapterValidationError(
                f"{field} cannot be used when target_modules is a str (as in PEFT): list the "
                "module names instead")
    if cfg.get("layers_pattern") and cfg.get("layers_to_transform") is None:
        raise AdapterValidationError(
            "layers_pattern is set but layers_to_transform is not (PEFT refuses that): set "
            "layers_to_transform to the layers the adapter was trained on, or leave out both")
    return LoraSettings(
        r=_field(cfg, "r", _positive_int, default=8),
        lora_alpha=_field(cfg, "lora_alpha", _number, default=8),
        use_rslora=bool(cfg.get("use_rslora", False)),
        target_modules=target_modules,
        exclude_modules=_field(cfg, "exclude_modules", _module_set, regexes),
        layers_to_transform=_field(cfg, "layers_to_transform", _layer_set),
        layers_pattern=_field(cfg, "layers_pattern", _layer_patterns, regexes),
        rank_pattern=_field(cfg, "rank_pattern", _pattern_dict, regexes, _positive_int),
        alpha_pattern=_field(cfg, "alpha_pattern", _pattern_dict, regexes, _number),
    )


def _changes_base_weights(init_lora_weights) -> bool:
    """Whether PEFT, loading an adapter of this init_lora_weights, rewrites the base weights it
    wraps: the tests of peft 0.21's LoraLayer.update_layer. Converted adapters say True."""
    if not isinstance(init_lora_weights, str):
        return False
    return (init_lora_weights.startswith(("pissa", "corda")) or init_lora_weights.lower() == "olora"
            or init_lora_weights == "loftq")


def _field(cfg: dict, field: str, parse, *args, default=None):
    """parse(cfg[field], field, *args); an error the checks did not foresee still names the field."""
    value = cfg.get(field, default)
    try:
        return parse(value, field, *args)
    except AdapterValidationError:
        raise
    except (re.error, TypeError, ValueError, ArithmeticError, RecursionError) as e:
        raise AdapterValidationError(
            f"{CONFIG_NAME} has {field}={reprlib.repr(value)}, which cannot be used "
            f"({type(e).__name__}: {shown(str(e))}); write it as PEFT's LoraConfig documents") from e


def _matches(modules: ModuleRegex | frozenset[str], key: str) -> bool:
    if not isinstance(modules, frozenset):
        return modules.matches(key)
    return key in modules or _ends_in_one_of(key, modules)


def _ends_in_one_of(key: str, names: frozenset[str]) -> bool:
    """Whether `key` ends in "." + one of `names` (PEFT's suffix match), looked up by each of the
    key's few dotted suffixes: a scan of the names for each module took a config of 100,000 names
    (under 1 MB) half a minute to check on an 80-layer model, holding the GIL all along."""
    return any(key[i + 1:] in names for i, char in enumerate(key) if char == ".")


def _layer_index(key: str, layers_pattern: tuple[re.Pattern, ...]) -> int | None:
    # PEFT's regexes: the first numbered path segment, or the one after a layers_pattern name.
    for pattern in layers_pattern or (_ANY_LAYER_REGEX,):
        if match := pattern.match(key):
            # NOTE: None where a `|` in the pattern let a branch without the index match (PEFT:
            # the module is not targeted, and the search ends there too).
            return None if match["idx"] is None else int(match["idx"])
    return None


def _pattern_value(patterns: dict[ModuleRegex, float], key: str, default):
    for pattern, value in patterns.items():
        if pattern.matches(key):
            return value
    return default


def _target_set(value, field: str, regexes: Regexes) -> str | ModuleRegex | frozenset[str]:
    if value is None:
        return DEFAULT_TARGET_MODULES
    if isinstance(value, str) and value.lower() == ALL_LINEAR:
        return ALL_LINEAR
    return _module_set(value, field, regexes)


def _module_set(value, field: str, regexes: Regexes) -> ModuleRegex | frozenset[str]:
    if isinstance(value, str):
        return regexes.compile_module_regex(value, field, _FULL_REGEX)
    return frozenset(_str_tuple(value, field))


def _layer_patterns(value, field: str, regexes: Regexes) -> tuple[re.Pattern, ...]:
    if value == "":  # PEFT reads an empty layers_pattern ("" or []) as none (but [""] as one)
        return ()
    return tuple(regexes.compile(name, field, _LAYERS_REGEX) for name in _str_tuple(value, field))


def _pattern_dict(value, field: str, regexes: Regexes, parse_value) -> dict[ModuleRegex, float]:
    """rank_pattern or alpha_pattern: {module pattern: value}, each pattern compiled as PEFT does."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterValidationError(
            f"{field} must be a JSON object mapping module name patterns to values, e.g. "
            f'{{"v_proj": 8}}, got {reprlib.repr(value)}')
    return {regexes.compile_module_regex(k, f"{field} key", _PATTERN_KEY_REGEX):
            parse_value(v, f"{field}[{reprlib.repr(k)}]") for k, v in value.items()}


def _layer_set(value, field: str) -> frozenset[int] | None:
    values = [value] if is_int(value) else value
    if value is not None and not (isinstance(values, list) and all(map(is_int, values))):
        raise AdapterValidationError(f"{field} must be an int or a list of ints, got {reprlib.repr(value)}")
    return frozenset(values) if values else None  # PEFT treats [] as "every layer"


def _str_tuple(value, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise AdapterValidationError(
            f"{field} must be a string or a list of strings, got {reprlib.repr(value)}")
    return tuple(values)


def _positive_int(value, field: str) -> int:
    if not is_int(value) or value < 1:
        raise AdapterValidationError(f"{field} must be a positive integer, got {reprlib.repr(value)}")
    return value


def _number(value, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterValidationError(f"{field} must be a finite number, got {reprlib.repr(value)}")
    return float(value)
