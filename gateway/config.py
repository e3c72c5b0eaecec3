"""ServeConfig: everything `switchboard serve` needs, merged from its three sources.

Precedence: command-line options, then environment variables (SWITCHBOARD_HOME for the data
folder, SWITCHBOARD_ADMIN_KEY, SWITCHBOARD_METRICS_KEY), then the TOML file of `--config`, then
the defaults below. The TOML keys are the long option names, with "_" or "-" (`max_num_seqs = 32`,
`model = ["a=/m"]`). `switchboard worker` reads the same config, less the gateway's own settings.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import SplitResult, urlsplit

import msgspec

from routing.pricing import MAX_USD_PER_MTOK
from routing.routes import AUTO
from store.redis import check_redis_url, masked_url

DEFAULT_DATA_DIR = Path("data")
MAX_UPSTREAM_CONTEXT = 2**30  # tokens: far past any model's context
MAX_HEARTBEAT_S = 3600.0
# NOTE: a worker's record lapses after three beats; much shorter, gateways would rarely see it.
MIN_HEARTBEAT_S = 0.1
_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]?)(iB|B)?", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_ENV = {"data_dir": "SWITCHBOARD_HOME", "admin_key": "SWITCHBOARD_ADMIN_KEY",
        "metrics_key": "SWITCHBOARD_METRICS_KEY"}
# Config-file keys named after a long option whose value lands in a field of another name.
_FILE_KEYS = {"heartbeat": "heartbeat_s", "shutdown_timeout": "shutdown_timeout_s",
              "worker_model_ttl": "worker_model_ttl_s"}
Command = Literal["serve", "worker"]
# The settings (fields) only one command uses; the others apply to both. Each command refuses the
# other's, which it would silently ignore.
_OWN_SETTINGS: dict[Command, frozenset[str]] = {
    "serve": frozenset({"models", "routes", "default_route", "store", "admin_key", "metrics_key",
                        "adapter_dir", "max_upload_size", "worker_model_ttl_s"}),
    "worker": frozenset({"advertise_url", "heartbeat_s"}),
}
_COMMON_KEYS = {"price_input", "price_output", "tier"}  # of [models.NAME], local or upstream
_UPSTREAM_KEYS = {"upstream", "api_key_env", "upstream_model", "upstream_api", "timeout_s",
                  "max_model_len"}
_UPSTREAM_APIS = ("completions", "chat")  # the OpenAI APIs an upstream may be reached by
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_STORE_SCHEMES = ("sqlite://", "redis://", "rediss://", "unix://")  # what store.open_store opens


@dataclass(frozen=True)
class UpstreamSource:
    """A remote OpenAI-compatible server that answers for a served model (gateway/upstream.py)."""

    url: str
    """Its OpenAI base URL, with the version: "https://host/v1" (requests go to url/completions,
    or url/chat/completions for the chat API)."""
    model: str
    """The upstream's name for the model (what the gateway sends as `model`)."""
    api_key_env: str | None = None
    """The environment variable holding the key sent as `Authorization: Bearer`; None: no key.
    The key itself never appears in the config file."""
    timeout_s: float = 30.0
    """Longest wait to connect, to send, and for each read of the answer, in seconds."""
    max_model_len: int = 8192
    """The model's context, in tokens. The gateway counts an upstream prompt in UTF-8 bytes (no
    fewer than its tokens), so its context check may refuse a prompt that would just fit. A chat
    sent to the chat API counts as the bytes of its messages' roles, names and contents plus one
    per field: no fewer than the tokens of those, but the upstream's chat template adds tokens of
    its own (a few a message), so a chat that only just fits may be refused by the upstream (a
    call's hold counts those: see upstream._PromptOverhead)."""
    api: Literal["completions", "chat"] = "completions"
    """The OpenAI API it is reached by: "completions" (the legacy API; a chat arrives as the
    gateway's plain transcript) or "chat" (Chat Completions: a chat arrives as its messages, a
    plain prompt as one user message). Chat-only models (most hosted APIs) need "chat"."""

    def api_key(self, environ: Mapping[str, str]) -> str | None:
        """The key from `environ`; ValueError if the variable it names is not set."""
        if self.api_key_env is None:
            return None
        key = environ.get(self.api_key_env)
        if not key:
            raise ValueError(f"the environment variable {self.api_key_env} is not set; it holds "
                             f"the API key of the upstream {self.url}")
        return key


@dataclass(frozen=True)
class ModelEntry:
    """One served model: its name (what clients send as `model`), source and price.

    The source is a local folder (`path`) or a remote server (`upstream`); neither, on a gateway
    with engine workers (`redis`), for a model the workers serve (the entry gives its price).
    """

    name: str
    path: Path | None
    price_input: float = 0.0
    """USD per million prompt tokens, for spend accounting."""
    price_output: float = 0.0
    """USD per million completion tokens."""
    tier: int = 0
    """Its place among cost tiers, cheapest first (informational: routes list their own tiers)."""
    upstream: UpstreamSource | None = None
    kv_cache_memory: int | None = None
    """This local model's KV-cache budget in bytes; None: the server-wide --kv-cache-memory."""


@dataclass
class ServeConfig:
    """Settings of one gateway process and of the engines it loads."""

    model: list[str] = field(default_factory=list)
    """Served models as "NAME=PATH" (NAME is what clients send as `model`); with no models declared
    here or in `models`: the demo model."""
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Served models as TOML tables: [models.NAME] path = "..." (a local folder) or upstream =
    "https://host/v1" (a remote server; see UpstreamSource), price_input = 0.1, price_output = 0.4,
    tier = 0. With `redis`, a table without either prices a model that engine workers serve."""
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
    metrics_key: str | None = None
    """A key that reads /metrics and nothing else (for a Prometheus scraper); the admin key reads
    it too. The series name every tenant, so /metrics is never open to any caller."""
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
    redis: str | None = None
    """Redis shared by gateways and engine workers (redis://host:port/0). A gateway serves the
    models of the workers registered there and uses it as its store unless `store` says
    otherwise; a worker registers there."""
    advertise_url: str | None = None
    """A worker's URL as gateways reach it; None: http://host:port."""
    heartbeat_s: float = 1.0
    """Seconds between a worker's heartbeats; it leaves the pool after three missed ones."""
    worker_model_ttl_s: float = 3600.0
    """Seconds a gateway keeps serving a workers' model after their last heartbeat (its calls get
    503 until a worker is back, then 404); give every gateway sharing a Redis the same value."""
    shutdown_timeout_s: float = 30.0
    """Seconds a graceful shutdown (SIGTERM, Ctrl-C) lets requests in flight finish; then their
    connections are dropped and the requests cancelled, as when their clients disconnect."""
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("admin_key", "metrics_key"):
            # A key read from a secret file often ends with a newline no request can send.
            key = getattr(self, name)
            if key is not None:
                key = key.strip()
                if not key or any(ch.isspace() for ch in key):
                    raise ValueError(f"{name} must be one word without spaces, got {len(key)} "
                                     "characters with whitespace inside or nothing at all")
                # NOTE: not echoed: it is a secret. Requests' headers are read as latin-1 and keys
                # hashed as UTF-8, so a key with other characters would never match.
                if not (key.isascii() and key.isprintable()):
                    raise ValueError(f"{name} must be printable ASCII only, as clients send it in an "
                                     "HTTP header: it holds other characters; choose another key")
                setattr(self, name, key)
        if self.log_level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.redis is not None:
            check_redis_url(self.redis)
            if self.store is None:
                self.store = self.redis
        if self.store is not None and not self.store.startswith(_STORE_SCHEMES):
            raise ValueError(f"unknown store URL {masked_url(self.store)!r}: use "
                             "sqlite:///path/to/file.db or redis://host:port/0")
        if self.store not in (None, self.redis) and not self.store.startswith("sqlite://"):
            check_redis_url(self.store)  # NOTE: --redis, checked above, is often the store too
        # NOTE: "~" expanded here, as for model paths: a shell leaves it as is in a config file,
        # an environment variable set by a service manager, or after "=" in --data-dir=~/x.
        self.data_dir = Path(self.data_dir).expanduser()
        if self.adapter_dir is not None:
            self.adapter_dir = Path(self.adapter_dir).expanduser()
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "max_model_len",
                     "max_cpu_loras", "max_lora_rank", "max_upload_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.advertise_url is not None:
            self.advertise_url = _worker_url(self.advertise_url)
        # NOTE: bounded, as Redis keeps a worker's record for three beats, in milliseconds.
        if not MIN_HEARTBEAT_S <= self.heartbeat_s <= MAX_HEARTBEAT_S:
            raise ValueError(f"heartbeat must be in [{MIN_HEARTBEAT_S}, {MAX_HEARTBEAT_S}] "
                             f"seconds, got {self.heartbeat_s}")
        if not self.worker_model_ttl_s > 0:
            raise ValueError(f"worker_model_ttl must be positive seconds, got {self.worker_model_ttl_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
        if self.default_route is not None and self.default_route not in self.routes:
            raise ValueError(f"default_route {self.default_route!r} is not a declared route: "
                             f"declare [routes.{self.default_route}] (routes: "
                             f"{', '.join(self.routes) or 'none'})")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0 (0 serves no adapters), got {self.max_loras}")
        for entry in self.model_entries():  # NOTE: validates every model now, before any is loaded
            if entry.path is None and entry.upstream is None and self.redis is None:
                raise ValueError(
                    f"[models.{entry.name}] needs path = \"/a/model/folder\" or upstream = "
                    "\"https://host/v1\" (a remote OpenAI-compatible server); only a gateway "
                    "with engine workers (--redis) may leave both out, for a model its workers "
                    "serve")

    def adapter_folder(self) -> Path:
        """Where uploaded adapter files live: adapter_dir, else data_dir/adapters."""
        return self.adapter_dir if self.adapter_dir is not None else self.data_dir / "adapters"

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
            _check_model_name(name)
            if names.count(name) > 1:
                raise ValueError(f"the model name {name!r} is given twice")
        return entries

    def model_paths(self) -> dict[str, Path]:
        """{served name: model folder} of the local models."""
        return {e.name: e.path for e in self.model_entries() if e.path is not None}

    def upstreams(self) -> dict[str, UpstreamSource]:
        """{served name: remote server} of the models served by upstreams."""
        return {e.name: e.upstream for e in self.model_entries() if e.upstream is not None}

    def engine_options_of(self, name: str) -> dict[str, Any]:
        """engine_options() with the [models.NAME] table's own KV-cache budget, if it has one."""
        options = self.engine_options()
        for entry in self.model_entries():
            if entry.name == name and entry.kv_cache_memory is not None:
                options["kv_cache_memory_bytes"] = entry.kv_cache_memory
        return options

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
    where = f"[models.{name}]"
    if not isinstance(table, dict):
        raise ValueError(f"{where} must be a table")
    if "path" in table and "upstream" in table:
        raise ValueError(f"{where} takes path (a local model) or upstream (a remote one), not both")
    if "api_key" in table:  # NOTE: never echo its value: it is a secret
        raise ValueError(f"{where} must not hold the API key: set api_key_env = \"VARIABLE\" and "
                         "put the key in that environment variable")
    known = _COMMON_KEYS | (_UPSTREAM_KEYS if "upstream" in table else
                            {"path", "kv_cache_memory"} if "path" in table else set())
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"unknown keys in {where}: {', '.join(unknown)}; known keys: "
                         f"{', '.join(sorted(known))}")
    prices = [_number(where, k, table.get(k, 0.0), "USD per million tokens", maximum=MAX_USD_PER_MTOK)
              for k in ("price_input", "price_output")]
    tier = _integer(where, "tier", table.get("tier", 0), 0, "0 is the cheapest")
    if "path" in table and not (isinstance(table["path"], str) and table["path"]):
        raise ValueError(f"{where} path must be the model's folder, like \"/models/llama\", got "
                         f"{table['path']!r}")
    path = Path(table["path"]).expanduser() if "path" in table else None
    upstream = _upstream_source(name, table) if "upstream" in table else None
    memory = table.get("kv_cache_memory")
    if memory is not None:
        try:
            memory = parse_size(memory)
        except ValueError as error:
            raise ValueError(f"{where} kv_cache_memory: {error}") from None
        if memory < 1:
            raise ValueError(f"{where} kv_cache_memory must be positive, like \"2GiB\"")
    return ModelEntry(name, path, *prices, tier, upstream, memory)


def _check_model_name(name: str) -> None:
    """ValueError for a name clients could not call the model by: `model` names a model's adapter
    as `base:adapter` and the default route as `auto`, and the name goes into response headers."""
    if not name or name == AUTO or ":" in name or len(name) > 128 or not name.isascii() or \
            not name.isprintable() or any(ch.isspace() for ch in name):
        raise ValueError(f"invalid model name {name!r}: use up to 128 printable ASCII characters "
                         "without spaces or ':' (clients write a model's adapter as "
                         "model:adapter), other than 'auto' (the tenant's default route)")


def _worker_url(url: str) -> str:
    """`url` as gateways reach a worker at it: an http(s) URL with a host and maybe a path (a
    proxy's prefix), without a trailing "/" (gateways append their paths to it); ValueError for
    anything else, which would register a worker no call can reach."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or \
            parts.fragment or "@" in parts.netloc or not _has_usable_host_and_port(parts):
        raise ValueError(f"advertise_url must be an http(s) URL like \"http://10.0.0.7:9000\", "
                         f"got {url!r}")
    return url.rstrip("/")


def _has_usable_host_and_port(parts: SplitResult) -> bool:
    """Whether a connection can be made to the URL's host and port: urlsplit checks the port only
    when it is read, and a port out of 1-65535 (or a space in the host) got through to fail every
    call (a 500, or a 502 saying to try again later) instead of the startup."""
    try:
        port = parts.port
    except ValueError:  # not a number, or out of 0-65535
        return False
    return port != 0 and not any(ch.isspace() for ch in parts.netloc)


def _upstream_source(name: str, table: dict[str, Any]) -> UpstreamSource:
    where = f"[models.{name}]"
    url = table["upstream"]
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is not None and "@" in parts.netloc:  # NOTE: checked first, so it is never echoed
        raise ValueError(f"{where} upstream must not hold credentials: put the API key in an "
                         "environment variable and name it with api_key_env")
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
            or not _has_usable_host_and_port(parts):
        raise ValueError(f"{where} upstream must be an http(s) base URL like "
                         f"\"https://api.openai.com/v1\", got {url!r}")
    api_key_env = table.get("api_key_env")
    if api_key_env is not None and not (isinstance(api_key_env, str)
                                        and _ENV_NAME_RE.fullmatch(api_key_env)):
        # NOTE: not echoed: a key pasted here by mistake must not reach the log
        raise ValueError(f"{where} api_key_env must name an environment variable, like "
                         "\"OPENAI_API_KEY\" (the key itself goes in that variable)")
    model = table.get("upstream_model", name)
    if not isinstance(model, str) or not model:
        raise ValueError(f"{where} upstream_model must be the upstream's model name, got {model!r}")
    timeout_s = _number(where, "timeout_s", table.get("timeout_s", UpstreamSource.timeout_s),
                        "seconds", positive=True)
    # NOTE: bounded: a call's token hold adds up its tiers' contexts, which the store keeps as
    # 64-bit integers (a route over two contexts of 2^63 tokens answered every chat with a 500).
    max_model_len = _integer(where, "max_model_len",
                             table.get("max_model_len", UpstreamSource.max_model_len), 1, "tokens",
                             maximum=MAX_UPSTREAM_CONTEXT)
    api = table.get("upstream_api", UpstreamSource.api)
    if api not in _UPSTREAM_APIS:
        raise ValueError(f"{where} upstream_api must be \"completions\" (the legacy /completions "
                         f"API) or \"chat\" (/chat/completions), got {api!r}")
    return UpstreamSource(url, model, api_key_env, timeout_s, max_model_len, api)


def _number(where: str, key: str, value: Any, unit: str, *, positive: bool = False,
            maximum: float = math.inf) -> float:
    """`value` as a float; ValueError unless it is a finite number >= 0 (> 0 when `positive`),
    and <= `maximum`: an infinite price (or one whose cost overflows) would bill inf (stored as
    null) and refuse every call of a tenant with a spend budget."""
    is_number = not isinstance(value, bool) and isinstance(value, (int, float))
    if not is_number or not math.isfinite(value) or not (value > 0 if positive else value >= 0) \
            or value > maximum:
        most = "" if maximum == math.inf else f" and <= {maximum:g}"
        raise ValueError(f"{where} {key} must be a finite number {'>' if positive else '>='} 0"
                         f"{most} ({unit}), got {value!r}")
    return float(value)


def _integer(where: str, key: str, value: Any, minimum: int, unit: str,
             maximum: int | None = None) -> int:
    """`value`; ValueError unless it is an integer >= `minimum` (and <= `maximum`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or \
            (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{where} {key} must be an integer {bounds} ({unit}), got {value!r}")
    return value


class SizeError(ValueError, argparse.ArgumentTypeError):
    """A size that cannot be read; argparse shows the message of this kind of error (of a plain
    ValueError, only the type function's name)."""


def parse_size(text: str | int) -> int:
    """Bytes from "4GiB", "512M", "1024" (binary units), or "4GB" (decimal, as GB means)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise SizeError(
            f"cannot read {text!r} as a size: use bytes or e.g. 512MiB, 4GiB (or 4GB, 10^9 bytes)")
    number, prefix, unit = match.group(1), match.group(2).upper(), (match.group(3) or "").lower()
    base = 1000 if unit == "b" and prefix else 1024
    return int(number) * base ** _SIZE_POWERS[prefix]


def load_serve_config(cli: dict[str, Any], config_file: Path | None = None,
                      environ: dict[str, str] | None = None,
                      defaults: dict[str, Any] | None = None,
                      command: Command = "serve") -> ServeConfig:
    """Merge the sources of `command`'s settings; `cli` holds only the options given on the command
    line, `defaults` the command's own defaults (below every source). ValueError naming the setting
    for any value of the wrong type or range, and for a config-file key `command` does not take."""
    environ = os.environ if environ is None else environ
    others = _OWN_SETTINGS[_other(command)]
    merged = dict(defaults or {})
    merged.update(_read_toml(config_file, command) if config_file is not None else {})
    # NOTE: one environment often starts gateways and workers alike, so a variable of the other
    # command is left unread (not refused, as a config file's key is).
    merged.update({key: environ[var] for key, var in _ENV.items()
                   if key not in others and environ.get(var)})
    merged.update(cli)
    for size in ("kv_cache_memory", "max_upload_size"):
        if size in merged:
            try:
                merged[size] = parse_size(merged[size])
            except ValueError as error:
                raise ValueError(f"{size}: {error}") from None
    if isinstance(merged.get("model"), str):
        merged["model"] = [merged["model"]]
    try:  # NOTE: checks every field's type (a TOML file may hold anything), then __post_init__
        return msgspec.convert(merged, ServeConfig, dec_hook=_path)
    except msgspec.ValidationError as error:
        raise ValueError(f"invalid setting: {str(error).replace('$.', '')}") from None


def _other(command: Command) -> Command:
    return "worker" if command == "serve" else "serve"


def _path(kind: type, value: Any) -> Any:
    if kind is Path and isinstance(value, (str, Path)):
        return Path(value)
    # NOTE: a TypeError, which msgspec reports as a ValidationError naming the setting.
    raise TypeError(f"Expected a folder path (a string), got {type(value).__name__}")


def _read_toml(path: Path, command: Command) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the config file {path}: {error}") from None
    # A file's keys are the long options' names (as `--heartbeat` is `heartbeat`), or the fields'.
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    settings = {key: _FILE_KEYS.get(key, key) for key in values}  # the field each key sets
    spellings: dict[str, list[str]] = {}
    for key in raw:
        spellings.setdefault(settings[key.replace("-", "_")], []).append(key)
    twice = next((keys for keys in spellings.values() if len(keys) > 1), None)
    if twice is not None:  # else one of the two was silently dropped
        raise ValueError(f"{path} sets one setting twice, as {' and '.join(twice)}: keep one")
    known, others = {f.name for f in fields(ServeConfig)}, _OWN_SETTINGS[_other(command)]
    unknown = sorted(key for key, setting in settings.items() if setting not in known)
    if unknown:
        option_names = {setting: key for key, setting in _FILE_KEYS.items()}
        listed = sorted(option_names.get(setting, setting) for setting in known - others)
        raise ValueError(f"unknown keys in {path}: {', '.join(unknown)}; "
                         f"known keys: {', '.join(listed)}")
    foreign = sorted(key for key, setting in settings.items() if setting in others)
    if foreign:
        are, them = ("is a setting", "it") if len(foreign) == 1 else ("are settings", "them")
        raise ValueError(f"{', '.join(foreign)} in {path} {are} of switchboard {_other(command)}, "
                         f"not of switchboard {command}: remove {them}")
    return {settings[key]: value for key, value in values.items()}
