"""adapter_config.json of a PEFT LoRA adapter: parsed, checked, and PEFT's module-matching rules.

The matching mirrors peft 0.21 (`check_target_module_exists`, `get_pattern_key`) so that the set
of modules an adapter targets here is exactly the set PEFT would have wrapped in the base model.
"""

from __future__ import annotations

import json
import math
import re
import re._parser  # NOTE: to inspect uploaded regexes before they are ever matched
from dataclasses import dataclass
from pathlib import Path
from re import _constants as _parser_constants

from adapters.errors import AdapterValidationError

CONFIG_NAME = "adapter_config.json"
ALL_LINEAR = "all-linear"
# PEFT's default target_modules for the llama, mistral and qwen2 model types.
DEFAULT_TARGET_MODULES = frozenset({"q_proj", "v_proj"})

# Fields that change the forward pass in ways this server does not implement: each must be unset.
_MAX_REGEX_CHARS = 1000
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
}


@dataclass(frozen=True)
class LoraSettings:
    """What an adapter_config.json says about which modules carry LoRA, with what rank and scale."""

    r: int
    lora_alpha: float
    use_rslora: bool  # scaling = alpha / sqrt(r) instead of alpha / r
    target_modules: str | frozenset[str]  # a regex (full match), "all-linear", or names/suffixes
    exclude_modules: str | frozenset[str]  # same forms; wins over target_modules
    layers_to_transform: frozenset[int] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: dict[str, int]  # module pattern -> r, first match wins (PEFT's get_pattern_key)
    alpha_pattern: dict[str, float]

    def targets(self, key: str) -> bool:
        """Whether PEFT would put LoRA on the module named `key` (e.g. model.layers.0.mlp.up_proj)."""
        if _matches(self.exclude_modules, key):
            return False
        if isinstance(self.target_modules, str):
            if self.target_modules == ALL_LINEAR:
                # NOTE: PEFT's all-linear is every Linear but the output head; in this model
                # family that is exactly the decoder layers' projections.
                return key.startswith("model.layers.")
            return re.fullmatch(self.target_modules, key) is not None
        if key in self.target_modules:
            return True  # a full module name: PEFT ignores layers_to_transform here
        if not any(key.endswith(f".{t}") for t in self.target_modules):
            return False
        layers = self.layers_to_transform
        return layers is None or _layer_index(key, self.layers_pattern) in layers

    def rank(self, key: str) -> int:
        return _pattern_value(self.rank_pattern, key, self.r)

    def scaling(self, key: str) -> float:
        rank, alpha = self.rank(key), _pattern_value(self.alpha_pattern, key, self.lora_alpha)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def read_lora_settings(folder: Path) -> LoraSettings:
    """Parse and check `folder`/adapter_config.json; AdapterValidationError says what is wrong."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise AdapterValidationError(
            f"{folder} has no {CONFIG_NAME}: save the adapter with PEFT's save_pretrained")
    try:
        cfg = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterValidationError(f"{CONFIG_NAME} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterValidationError(f"{CONFIG_NAME} must hold a JSON object")
    return parse_lora_settings(cfg)


def parse_lora_settings(cfg: dict) -> LoraSettings:
    """Check a PEFT config dict; reject what the server does not implement."""
    if cfg.get("peft_type") != "LORA":
        raise AdapterValidationError(
            f"peft_type {cfg.get('peft_type')!r} is not supported: only LoRA adapters "
            "(peft_type LORA) can be served")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if cfg.get(field):
            raise AdapterValidationError(f"{why} ({CONFIG_NAME} has {field}={cfg[field]!r})")
    if (cfg.get("bias") or "none") != "none":
        raise AdapterValidationError(
            f"bias={cfg['bias']!r} trains the base model's biases, which tenants cannot share; "
            "only bias='none' is supported")
    # NOTE: fan_in_fan_out is ignored on purpose: PEFT turns it off for nn.Linear targets (all of
    # them here), so A and B are stored [r, in] and [out, r] either way; load_adapter checks shapes.
    target_modules = _module_set(cfg.get("target_modules"), "target_modules")
    layers = cfg.get("layers_to_transform")
    if isinstance(target_modules, str) and layers is not None:
        raise AdapterValidationError(
            "layers_to_transform cannot be used when target_modules is a str (as in PEFT): "
            "list the module names instead")
    return LoraSettings(
        r=_positive_int(cfg.get("r", 8), "r"),
        lora_alpha=_number(cfg.get("lora_alpha", 8), "lora_alpha"),
        use_rslora=bool(cfg.get("use_rslora", False)),
        target_modules=DEFAULT_TARGET_MODULES if target_modules is None else target_modules,
        exclude_modules=_module_set(cfg.get("exclude_modules"), "exclude_modules") or frozenset(),
        layers_to_transform=_layer_set(layers),
        layers_pattern=_str_tuple(cfg.get("layers_pattern"), "layers_pattern"),
        rank_pattern={_regex(k, "rank_pattern"): _positive_int(v, f"rank_pattern[{k!r}]")
                      for k, v in (cfg.get("rank_pattern") or {}).items()},
        alpha_pattern={_regex(k, "alpha_pattern"): _number(v, f"alpha_pattern[{k!r}]")
                       for k, v in (cfg.get("alpha_pattern") or {}).items()},
    )


def _matches(modules: str | frozenset[str], key: str) -> bool:
    if isinstance(modules, str):
        return re.fullmatch(modules, key) is not None
    return key in modules or any(key.endswith(f".{m}") for m in modules)


def _layer_index(key: str, layers_pattern: tuple[str, ...]) -> int | None:
    # PEFT's regexes: the first numbered path segment, or the one after a layers_pattern name.
    patterns = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in layers_pattern] or [r".*?\.[^.]*\.(?P<idx>\d+)\."]
    for pattern in patterns:
        if match := re.match(pattern, key):
            return int(match["idx"])
    return None


def _pattern_value(patterns: dict, key: str, default):
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _module_set(value, field: str) -> str | frozenset[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return ALL_LINEAR if value.lower() == ALL_LINEAR else _regex(value, field)
    return frozenset(_str_tuple(value, field))


def _layer_set(value) -> frozenset[int] | None:
    values = [value] if _is_int(value) else value
    if value is not None and not (isinstance(values, list) and all(map(_is_int, values))):
        raise AdapterValidationError(f"layers_to_transform must be an int or a list of ints, got {value!r}")
    return frozenset(values) if values else None  # PEFT treats [] as "every layer"


def _str_tuple(value, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise AdapterValidationError(f"{field} must be a string or a list of strings, got {value!r}")
    return tuple(values)


def _regex(value: str, field: str) -> str:
    if len(value) > _MAX_REGEX_CHARS:
        raise AdapterValidationError(
            f"{field} is a {len(value)}-character regular expression; at most {_MAX_REGEX_CHARS} "
            "are accepted: list the module names instead")
    try:
        parsed = re._parser.parse(value)
    except re.error as e:
        raise AdapterValidationError(f"{field} {value!r} is not a valid regular expression ({e})") from e
    if _has_nested_repetition(parsed, inside_repeat=False):
        # NOTE: uploaded configs are untrusted and Python's re cannot be interrupted, so patterns
        # that can backtrack exponentially ((a+)+, (x|xy)*) would stall validation for everyone.
        raise AdapterValidationError(
            f"{field} {value!r} repeats a group that itself repeats or branches, which can take "
            "exponential time to match; simplify it or list the module names instead")
    return value


def _has_nested_repetition(pattern, inside_repeat: bool) -> bool:
    """Whether a parsed regex has a repeat or a branch inside a repeat of more than one."""
    for op, arg in pattern:
        if op in (_parser_constants.MAX_REPEAT, _parser_constants.MIN_REPEAT):
            _, max_count, sub = arg
            repeats = max_count > 1
            if repeats and inside_repeat:
                return True
            if _has_nested_repetition(sub, inside_repeat or repeats):
                return True
        elif op == _parser_constants.BRANCH:
            if inside_repeat:
                return True
            if any(_has_nested_repetition(sub, inside_repeat) for sub in arg[1]):
                return True
        elif op == _parser_constants.SUBPATTERN:
            if _has_nested_repetition(arg[-1], inside_repeat):
                return True
        elif op in (_parser_constants.ASSERT, _parser_constants.ASSERT_NOT):
            if _has_nested_repetition(arg[1], inside_repeat):
                return True
    return False


def _positive_int(value, field: str) -> int:
    if not _is_int(value) or value < 1:
        raise AdapterValidationError(f"{field} must be a positive integer, got {value!r}")
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise AdapterValidationError(f"{field} must be a finite number, got {value!r}")
    return float(value)
