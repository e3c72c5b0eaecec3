"""ServeConfig: everything `switchboard serve` needs, merged from its three sources.

Precedence: command-line options, then environment variables (SWITCHBOARD_HOME for the data
folder, SWITCHBOARD_ADMIN_KEY), then the TOML file of `--config`, then the defaults below. The
TOML keys are the long option names, with "_" or "-" (`max_num_seqs = 32`, `model = ["a=/m"]`).
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = Path("data")
_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)
_SIZE_SHIFTS = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}
_ENV = {"data_dir": "SWITCHBOARD_HOME", "admin_key": "SWITCHBOARD_ADMIN_KEY"}


@dataclass(frozen=True)
class ModelEntry:
    """One served model: its name (what clients send as `model`), folder and price."""

    name: str
    path: Path
    price_input: float = 0.0
    """USD per million prompt tokens, for spend accounting."""
    price_output: float = 0.0
    """USD per million completion tokens."""


@dataclass
class ServeConfig:
    """Settings of one gateway process and of the engines it loads."""

    model: list[str] = field(default_factory=list)
    """Served models as "NAME=PATH" (NAME is what clients send as `model`); empty: the demo model."""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Served models as TOML tables: [models.NAME] path = "...", price_input = 0.1, price_output = 0.4."""
    routes: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Routes as TOML tables: [routes.NAME] tiers = ["small", "large"], threshold = 0.5, ... (see
    routing/routes.py)."""
    default_route: str | None = None
    """The route `model: "auto"` means for tenants without a default route of their own."""
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = DEFAULT_DATA_DIR
    """Where the SQLite store and the demo model live."""
    store: str | None = None
    """Store URL (sqlite:///file.db or redis://host:port/0); None: SQLite in data_dir."""
    admin_key: str | None = None
    """The admin key to use; None keeps the stored one, or creates and prints one on first start."""
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    kv_cache_memory: int | None = None
    """KV-cache budget per model, in bytes (the CLI takes sizes like "4GiB")."""
    max_model_len: int | None = None
    max_loras: int = 8
    """Adapters resident on the device at once (distinct adapters in one batch); 0 serves no adapters."""
    max_cpu_loras: int = 64
    """Adapters kept loaded in host memory, ready to page in."""
    max_lora_rank: int = 64
    """Largest LoRA rank accepted (device slots are sized for it)."""
    adapter_dir: Path | None = None
    """Uploaded adapter files; None: data_dir/adapters. Gateways sharing a store share it too."""
    max_upload_size: int = 1 << 30
    """Largest adapter upload accepted, in bytes (the CLI takes sizes like "512MiB")."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if self.adapter_dir is not None:
            self.adapter_dir = Path(self.adapter_dir)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_model_len",
                     "max_cpu_loras", "max_lora_rank", "max_upload_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0 (0 serves no adapters), got {self.max_loras}")
        self.model_entries()  # NOTE: validates every model now, before any is loaded

    def model_entries(self) -> list[ModelEntry]:
        """Every served model: the "NAME=PATH" ones (a bare PATH is served under its folder's
        name), then the [models.NAME] tables."""
        entries: list[ModelEntry] = []
        for entry in self.model:
            name, sep, path = entry.partition("=")
            if not sep:
                name, path = Path(entry).name, entry
            if not name or not path:
                raise ValueError(f"--model takes NAME=PATH, got {entry!r}")
            entries.append(ModelEntry(name, Path(path).expanduser()))
        for name, table in self.models.items():
            entries.append(_model_table(name, table))
        names = [e.name for e in entries]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"the model name {name!r} is given twice")
        return entries

    def model_paths(self) -> dict[str, Path]:
        """{served name: model folder}."""
        return {entry.name: entry.path for entry in self.model_entries()}

    def engine_options(self) -> dict[str, Any]:
        """The EngineConfig fields this config sets (the rest keep the engine's defaults)."""
        options = {"device": self.device, "dtype": self.dtype,
                   "max_num_seqs": self.max_num_seqs,
                   "max_num_batched_tokens": self.max_num_batched_tokens,
                   "kv_cache_memory_bytes": self.kv_cache_memory,
                   "max_model_len": self.max_model_len}
        options = {k: v for k, v in options.items() if v is not None}
        if self.max_loras > 0:  # NOTE: the AdapterConfig fields, built where torch may be imported
            options["lora"] = {"max_gpu_adapters": self.max_loras,
                               "max_cpu_adapters": max(self.max_cpu_loras, self.max_loras),
                               "max_lora_rank": self.max_lora_rank}
        return options


def _model_table(name: str, table: Any) -> ModelEntry:
    known = {"path", "price_input", "price_output"}
    if not isinstance(table, dict) or "path" not in table:
        raise ValueError(f"[models.{name}] needs at least path = \"/a/model/folder\"")
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"unknown keys in [models.{name}]: {', '.join(unknown)}; known keys: "
                         f"{', '.join(sorted(known))}")
    prices = {k: table.get(k, 0.0) for k in ("price_input", "price_output")}
    for key, value in prices.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"[models.{name}] {key} must be a number >= 0 (USD per million "
                             f"tokens), got {value!r}")
    return ModelEntry(name, Path(table["path"]).expanduser(), float(prices["price_input"]),
                      float(prices["price_output"]))


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB", "512M", "1024" (binary units)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"cannot read {text!r} as a size: use bytes or e.g. 512MiB, 4GiB")
    return int(match.group(1)) << _SIZE_SHIFTS[match.group(2).upper()]


def load_serve_config(cli: dict[str, Any], config_file: Path | None = None,
                      environ: dict[str, str] | None = None) -> ServeConfig:
    """Merge the sources; `cli` holds only the options given on the command line."""
    environ = os.environ if environ is None else environ
    merged = _read_toml(config_file) if config_file is not None else {}
    merged.update({key: environ[var] for key, var in _ENV.items() if environ.get(var)})
    merged.update(cli)
    for size in ("kv_cache_memory", "max_upload_size"):
        if size in merged:
            merged[size] = parse_size(merged[size])
    if isinstance(merged.get("model"), str):
        merged["model"] = [merged["model"]]
    return ServeConfig(**merged)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise ValueError(f"cannot read the config file {path}: {error}") from None
    known = {f.name for f in fields(ServeConfig)}
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown keys in {path}: {', '.join(unknown)}; "
                         f"known keys: {', '.join(sorted(known))}")
    return values
