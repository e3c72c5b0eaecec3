"""The `switchboard` command: `switchboard serve` runs the gateway with its engines.

This is the one module of the gateway that builds engines (and so imports torch, lazily).
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import math
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway import version
from gateway.config import DEFAULT_DATA_DIR, LOG_LEVELS, ServeConfig, load_serve_config, parse_size
from gateway.engine_client import EngineClient
from routing.pricing import Price
from routing.routes import parse_routes

logger = logging.getLogger("gateway")
# How long `serve` waits, once its models are loaded, for a store that cannot take writes.
STORE_WAIT_S = 60.0

_SERVE_EPILOG = """\
Sources, strongest first: these options, then the environment (SWITCHBOARD_HOME is the data
folder, SWITCHBOARD_ADMIN_KEY the admin key, SWITCHBOARD_METRICS_KEY the metrics key), then
--config FILE.toml (same keys as the long options, e.g. port = 8080, max_num_seqs = 32,
model = ["small=/models/a"]), then the defaults.
A config file can also declare models with their prices (USD per million tokens), which tenants'
spend budgets are charged by:

  [models.small]
  path = "/models/small"
  price_input = 0.10
  price_output = 0.40
  kv_cache_memory = "2GiB"   # its own KV-cache budget (default: --kv-cache-memory)
  tier = 0                   # its place among cost tiers, cheapest first (informational)

or served by a remote OpenAI-compatible server (streamed from its API):

  [models.big]
  upstream = "https://api.example.com/v1"
  api_key_env = "BIG_API_KEY"  # the variable holding the key (never the key itself)
  upstream_model = "big-v2"  # the upstream's name for it (default: the table's name)
  upstream_api = "chat"      # "completions" (default: its /completions, chats as a transcript)
                             # or "chat" (its /chat/completions: chat models, chats as messages)
  timeout_s = 30             # to connect, to send, and for each read of the answer
  max_model_len = 8192       # its context, in tokens (default 8192)
  price_input = 1.00
  price_output = 4.00
  tier = 1

or, on a gateway with engine workers (--redis), served by them: a table with only the
price_input, price_output and tier of the model they serve under that name;

and routes, names clients send as `model` that pick a model per request (a cascade: the cheap
model answers unless its confidence is below the threshold), with the one "auto" means:

  default_route = "auto"
  [routes.auto]
  tiers = ["small", "large"]
  measure = "quantile"       # mean_logprob | min_prob | quantile
  threshold = 0.5

A route's tiers may mix local models and upstreams: each reads the prompt with its own
tokenizer (so a prompt sent as token ids suits only a route whose tiers share one).
With no model declared, the embedded demo model (random weights, byte tokenizer) is written to
DATA_DIR/switchboard-demo and served as "switchboard-demo". The first start without an
admin key creates one and prints it once; only its hash is stored.
"""

# NOTE: after each command's epilog: serve and worker stop, and exit, the same way.
_EXIT_STATUS = """
SIGTERM or Ctrl-C stops the server gracefully (see --shutdown-timeout); it then exits 0. Other
exit statuses: 2, a setting or model it cannot use (said before any model loads where it can be);
130, Ctrl-C while the models load (SIGTERM then stops it at once); others, a server that failed
to start (its log says why).
"""

WORKER_PORT = 9000
_MAX_SEED = 2**63 - 1  # torch takes seeds of 64 bits

_WORKER_EPILOG = """\
A worker serves one model with one engine (one GPU): run one per GPU, each with its own port.
It registers itself in Redis and heartbeats every second; gateways started with
`switchboard serve --redis URL` serve its model, place requests on the workers that hold the
request's adapter (or the least loaded), and stop using a worker within seconds of its last
heartbeat. Adapter files come from the gateways, by content hash, the first time a request needs
them. Gateways and workers share a random internal key through Redis.

  switchboard worker --model llama=/models/llama-3-8b --device cuda:0 --port 9000 \\
      --redis redis://10.0.0.5:6379/0 --advertise-url http://10.0.0.7:9000
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="switchboard",
        description="Switchboard: a multi-LoRA, multi-model LLM gateway with an OpenAI API.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve models over the OpenAI API", epilog=_SERVE_EPILOG + _EXIT_STATUS,
        description="Serve models over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    serve.add_argument("--config", type=_user_path, metavar="FILE.toml",
                       help="read settings from a TOML file")
    serve.add_argument("--model", action="append", metavar="NAME=PATH",
                       help="serve the Hugging Face model folder PATH as NAME (repeatable; "
                            "default: the demo model as switchboard-demo)")
    serve.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default 8000)")
    serve.add_argument("--data-dir", type=Path,
                       help=f"data folder (default $SWITCHBOARD_HOME, else ./{DEFAULT_DATA_DIR})")
    serve.add_argument("--store", metavar="URL",
                       help="store: sqlite:///abs/path/file.db (three slashes and an absolute "
                            "path), sqlite://file.db (in the data folder) or redis://host:port/0 "
                            "(default: SQLite in the data folder)")
    serve.add_argument("--admin-key", help="admin key (default $SWITCHBOARD_ADMIN_KEY, else the "
                                           "stored one, else a new one printed once); a key given "
                                           "replaces the stored one for later starts too")
    serve.add_argument("--metrics-key", help="a key that may read /metrics only, for a Prometheus "
                                             "scraper (default $SWITCHBOARD_METRICS_KEY; the admin "
                                             "key reads /metrics too)")
    _add_engine_options(serve)
    serve.add_argument("--adapter-dir", type=Path,
                       help="folder of uploaded adapter files (default DATA_DIR/adapters; "
                            "with a Redis store, a cache of the files kept in Redis)")
    serve.add_argument("--max-upload-size", type=parse_size, metavar="SIZE",
                       help="largest adapter upload accepted, e.g. 512MiB (default 1GiB)")
    serve.add_argument("--redis", metavar="URL",
                       help="Redis shared with engine workers (redis://host:port/0): serve the "
                            "models of the workers registered there; also the default --store")
    serve.add_argument("--worker-model-ttl", type=float, dest="worker_model_ttl_s",
                       metavar="SECONDS",
                       help="how long a workers' model stays served after their last heartbeat: "
                            "its calls get 503 until then, 404 after (default 3600; the same on "
                            "every gateway)")
    _add_server_options(serve, "serve")
    worker = commands.add_parser(
        "worker", help="run one model's engine for gateways sharing a Redis",
        description="Run one model's engine behind an internal HTTP API and register it in Redis, "
                    "where `switchboard serve --redis URL` gateways find it.",
        epilog=_WORKER_EPILOG + _EXIT_STATUS, formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS)
    # NOTE: required, but checked once the config file is read: `redis = ...` there counts.
    worker.add_argument("--redis", metavar="URL",
                        help="the Redis the gateways use (redis://host:port/0); required, here or "
                             "as `redis` in --config")
    worker.add_argument("--model", action="append", metavar="NAME=PATH",
                        help="the Hugging Face model folder PATH, served as NAME (default: the "
                             "demo model as switchboard-demo)")
    worker.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    worker.add_argument("--port", type=int, help=f"port to listen on (default {WORKER_PORT})")
    worker.add_argument("--advertise-url", metavar="URL",
                        help="the URL gateways reach this worker at (default http://HOST:PORT)")
    worker.add_argument("--heartbeat", type=float, dest="heartbeat_s", metavar="SECONDS",
                        help="seconds between heartbeats; a worker silent for 3 of them leaves "
                             "the pool (default 1)")
    worker.add_argument("--data-dir", type=Path,
                        help=f"data folder: adapter files sent by gateways, the demo model "
                             f"(default $SWITCHBOARD_HOME, else ./{DEFAULT_DATA_DIR})")
    worker.add_argument("--config", type=_user_path, metavar="FILE.toml",
                        help="read settings from a TOML file (the keys of the long options)")
    _add_engine_options(worker)
    _add_server_options(worker, "worker")
    router = commands.add_parser(
        "router", help="train the learned router of routes with kind = \"learned\"",
        description="Learned routing: a classifier that predicts from the prompt whether the "
                    "small model answers it well.")
    router_commands = router.add_subparsers(dest="router_command", required=True, metavar="STEP")
    train = router_commands.add_parser(
        "train", help="fit a router from a JSONL of prompts and outcomes",
        description="Fit a router from JSONL lines {\"prompt\": ..., \"small_correct\": true|false}, "
                    "calibrating its threshold on a held-out part so that the target share of "
                    "prompts goes to the strong model.")
    train.add_argument("data", type=_user_path, help="the JSONL file of prompts and outcomes")
    train.add_argument("--out", type=_user_path, required=True, help="folder to write router.json into")
    train.add_argument("--target-strong-share", type=float, default=0.4,
                       help="share of requests the strong model should answer (default 0.4)")
    train.add_argument("--holdout", type=float, default=0.2,
                       help="fraction of the data kept for calibration and the report (default 0.2)")
    train.add_argument("--epochs", type=_positive_int, default=60, help="training epochs (default 60)")
    train.add_argument("--seed", type=_seed, default=0,
                       help=f"seed of the split and the fit, 0 to {_MAX_SEED} (default 0)")
    return parser


def _user_path(text: str) -> Path:
    """A path option, "~" expanded: a shell leaves it as is after "=" (--config=~/sb.toml)."""
    return Path(text).expanduser()


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= _MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be from 0 to {_MAX_SEED}, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


_SHUTDOWN_HELP = {
    "serve": "on SIGTERM or Ctrl-C, how long requests in flight may take to finish (default 30); "
             "those still running then end with a 503 server_shutdown (a stream: with that "
             "error event), billed for what they produced",
    "worker": "on SIGTERM or Ctrl-C the worker leaves the pool at once (gateways place new "
              "requests on other workers) and gives requests in flight this long to finish "
              "(default 30); it then ends the others: gateways place one it has not started on "
              "another worker, and answer the rest 503 server_shutdown (a stream: that error "
              "event), billed for what they produced",
}


def _add_server_options(parser: argparse.ArgumentParser, command: str) -> None:
    """The options of the HTTP server a command runs (serve and worker share them)."""
    parser.add_argument("--shutdown-timeout", type=float, dest="shutdown_timeout_s",
                        metavar="SECONDS", help=_SHUTDOWN_HELP[command])
    parser.add_argument("--log-level", choices=LOG_LEVELS,
                        help="log level (default info)")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The options of the engines a command loads (serve and worker share them)."""
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="weights and KV-cache dtype (default float32)")
    parser.add_argument("--max-num-seqs", type=int,
                        help="most requests in one batch (default 64)")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="token budget of one step (default 2048)")
    parser.add_argument("--kv-cache-memory", type=parse_size, metavar="SIZE",
                        help="KV-cache budget per model, e.g. 4GiB (default: 1GiB on CPU, 85%% of "
                             "free memory on CUDA)")
    parser.add_argument("--max-model-len", type=int,
                        help="longest prompt plus output, in tokens (default: what the model was "
                             "trained for, or what the KV cache holds when that is less)")
    parser.add_argument("--max-loras", type=int,
                        help="LoRA adapters resident on the device at once, so the most distinct "
                             "adapters in one batch (default 8; 0 serves no adapters)")
    parser.add_argument("--max-cpu-loras", type=int,
                        help="adapters kept loaded in host memory (default 64)")
    parser.add_argument("--max-lora-rank", type=int, help="largest LoRA rank accepted (default 64)")


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    command = args.pop("command")
    try:
        return _run(command, args)
    except KeyboardInterrupt:  # Ctrl-C while models load (minutes for a large one), or training
        print(f"switchboard {command}: interrupted", file=sys.stderr)
        return 130


def _run(command: str, args: dict) -> int:
    if command in ("serve", "worker"):
        # NOTE: a default below every source: a config file's port counts for workers too.
        defaults = {"port": WORKER_PORT} if command == "worker" else {}
        try:
            config = load_serve_config(args, args.pop("config", None), defaults=defaults,
                                       command=command)
        except (ValueError, TypeError) as error:
            print(f"switchboard {command}: {error}", file=sys.stderr)
            return 2
        return serve(config) if command == "serve" else run_worker(config)
    if command == "router":
        return train_router_command(args)
    raise AssertionError(f"unhandled command {command!r}")


def _configure_logging(config: ServeConfig) -> None:
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # NOTE: httpx logs every request it sends at INFO: a second line per call to a worker or an
    # upstream, beside the access log's own. torch logs its compiler caches' statistics at INFO as
    # the process exits. Their warnings still show, and all of it at debug.
    if config.log_level.lower() != "debug":
        for chatty in ("httpx", "torch"):
            logging.getLogger(chatty).setLevel(logging.WARNING)


# As vLLM does: every request to an engine worker or an upstream holds a connection (a call
# with 2048 choices, 2048), and each file descriptor counts against the process's soft limit,
# often 1024 under systemd or Docker, while its hard limit allows far more.
_OPEN_FILES_TARGET = 65536


def _raise_open_files_limit() -> None:
    """Raise the process's soft limit on open files towards _OPEN_FILES_TARGET, as far as its
    hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _OPEN_FILES_TARGET if hard == resource.RLIM_INFINITY else min(hard, _OPEN_FILES_TARGET)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as error:
        logger.warning("cannot raise the open-files limit from %d (%s): calls with many choices "
                       "may fail; raise it with `ulimit -n`", soft, error)
        return
    logger.info("raised the open-files limit from %d to %d", soft, target)


def serve(config: ServeConfig) -> int:
    """Check the settings, load the engines, then serve until interrupted; the exit status."""
    _configure_logging(config)
    _raise_open_files_limit()
    # NOTE: before minutes of model loading.
    problem = (_folder_problem("--data-dir", config.data_dir) or _redis_problem(config.store)
               or (_redis_problem(config.redis) if config.redis != config.store else None)
               or _sqlite_problem(config)
               or _folder_problem("--adapter-dir", config.adapter_folder())
               or _models_problem(config.model_paths()))
    if problem is not None:
        print(f"switchboard serve: {problem}", file=sys.stderr)
        return 2
    return _on_port("serve", config, lambda sockets: _load_and_serve(config, sockets))


def _load_and_serve(config: ServeConfig, sockets: list[socket.socket]) -> int:
    """serve() once the settings are checked and the port is taken."""
    from gateway.app import create_app
    from gateway.upstream import open_upstreams

    models, upstreams = config.model_paths(), config.upstreams()
    if not models and not upstreams and config.redis is None:
        models = _demo_model("serve", config.data_dir)
        if models is None:
            return 2
    prices = {e.name: Price(e.price_input, e.price_output) for e in config.model_entries()}
    try:
        # With workers, what they serve is known once the registry is read (create_app checks
        # the routes then).
        routes = parse_routes(config.routes, None if config.redis else [*models, *upstreams])
        engines: dict[str, EngineClient] = dict(open_upstreams(upstreams, os.environ))
    except ValueError as error:  # a bad route, or an upstream's key missing from the environment
        print(f"switchboard serve: {error}", file=sys.stderr)
        return 2
    for name, source in upstreams.items():
        logger.info("serving %s from the upstream %s as %s", name, source.url, source.model)
    if models:
        logger.info("loading %s", ", ".join(f"{name} from {path}" for name, path in models.items()))
    try:
        for name, path in models.items():  # each with its own engine and memory budget
            engine = _load_engine("serve", name, path, config)
            if engine is None:
                return 2
            engines[name] = engine
        problem = _wait_for_stores(config)
        if problem is not None:
            print(f"switchboard serve: {problem}", file=sys.stderr)
            return 2
        try:
            app = create_app(engines, data_dir=config.data_dir, store_url=config.store,
                             admin_key=config.admin_key, metrics_key=config.metrics_key,
                             adapter_dir=config.adapter_folder(),
                             max_upload_bytes=config.max_upload_size, prices=prices,
                             routes=routes, default_route=config.default_route,
                             workers_url=config.redis, load_tokenizer=_load_tokenizer,
                             worker_model_ttl_s=config.worker_model_ttl_s,
                             announce_admin_key=functools.partial(
                                 _print_admin_key, _base_url(config.host, sockets)))
        except ValueError as error:  # e.g. a route naming a model that is not served
            print(f"switchboard serve: {error}", file=sys.stderr)
            return 2
        return _run_server(app, config, sockets)
    finally:
        for engine in engines.values():
            engine.close()


def _load_engine(command: str, name: str, path: Path, config: ServeConfig) -> EngineClient | None:
    """The engine of one local model, or None after saying why it cannot be loaded (a folder
    that is missing, or holds a model or settings this engine cannot run)."""
    from gateway.local_engine import load_engines

    try:
        return load_engines({name: path}, **config.engine_options_of(name))[name]
    except (OSError, ValueError) as error:
        print(f"switchboard {command}: {_cannot_serve(name, path, error)}", file=sys.stderr)
        return None


def run_worker(config: ServeConfig) -> int:
    """Check the settings, load the one model's engine, then serve the internal API until
    interrupted; the exit status."""
    _configure_logging(config)
    _raise_open_files_limit()
    if config.redis is None:
        print("switchboard worker: give the Redis the gateways use: --redis URL, or `redis = "
              "\"URL\"` in the --config file", file=sys.stderr)
        return 2
    if len(config.model_paths()) > 1:  # NOTE: a worker's config has no [models.NAME] tables
        print("switchboard worker: a worker serves exactly one local model (--model NAME=PATH); "
              "run one worker per model and GPU", file=sys.stderr)
        return 2
    if config.advertise_url is None and config.host in ("0.0.0.0", "::"):
        print(f"switchboard worker: listening on {config.host}, give --advertise-url with the "
              "address gateways reach this worker at", file=sys.stderr)
        return 2
    adapter_folder = config.data_dir / "worker-adapters"  # the files gateways send it
    problem = (_folder_problem("--data-dir", config.data_dir) or _redis_problem(config.redis)
               or _folder_problem("--data-dir", adapter_folder)
               or _models_problem(config.model_paths()))
    if problem is not None:
        print(f"switchboard worker: {problem}", file=sys.stderr)
        return 2
    return _on_port("worker", config,
                    lambda sockets: _load_and_run_worker(config, sockets, adapter_folder))


def _load_and_run_worker(config: ServeConfig, sockets: list[socket.socket],
                         adapter_folder: Path) -> int:
    """run_worker() once the settings are checked and the port is taken."""
    from gateway.worker import Worker, create_worker_app, tokenizer_files
    from store.blobs import BlobStore
    from store.workers import WorkerRegistry

    models = config.model_paths() or _demo_model("worker", config.data_dir)
    if models is None:
        return 2
    (name, path), = models.items()
    logger.info("loading %s from %s", name, path)
    engine = _load_engine("worker", name, path, config)
    if engine is None:
        return 2
    try:
        if (problem := _wait_until_writable("--redis", config.redis, config.data_dir)):
            print(f"switchboard worker: {problem}", file=sys.stderr)
            return 2
        worker = Worker(model=name, engine=engine,
                        url=config.advertise_url or _base_url(config.host, sockets),
                        blobs=BlobStore(adapter_folder),
                        registry=WorkerRegistry.open(config.redis), heartbeat_s=config.heartbeat_s,
                        store_url=config.redis, tokenizer_files=tokenizer_files(path))
        return _run_server(create_worker_app(worker), config, sockets,
                           on_shutdown=worker.begin_shutdown)
    finally:
        engine.close()


def _on_port(command: str, config: ServeConfig, run: Callable[[list[socket.socket]], int]) -> int:
    """Take the configured port (exit status 2, naming the setting, if it cannot be), then
    `run(sockets)`; the exit status."""
    try:
        sockets = _bind(config.host, config.port)
    except ValueError as error:
        print(f"switchboard {command}: {error}", file=sys.stderr)
        return 2
    try:
        return run(sockets)
    finally:
        for sock in sockets:
            sock.close()


_PORT_0_TRIES = 8  # --port 0 over several addresses: ports the system picks, taken elsewhere


def _bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to `port` on every address `host` names, not yet listening: taken before
    the models load, so a port in use is refused at once, while clients are refused (not kept
    waiting) until the server listens. With port 0, one port the system picks, for every
    address. ValueError naming the setting at fault."""
    for attempt in range(_PORT_0_TRIES):
        try:
            return _bind_once(host, port)
        except OSError as error:
            # NOTE: the port the system picked for the first address may be taken on another.
            if port == 0 and error.errno == errno.EADDRINUSE and attempt < _PORT_0_TRIES - 1:
                continue
            is_host = isinstance(error, socket.gaierror) or error.errno == errno.EADDRNOTAVAIL
            raise ValueError(f"{'--host' if is_host else '--port'}: cannot listen on {host}:{port}: "
                             f"{error.strerror or error}") from None
    raise AssertionError("unreachable")  # pragma: no cover


def _bind_once(host: str, port: int) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            # NOTE: as asyncio's listeners: a restart may take a port whose last connections wait
            # in TIME_WAIT; a port another process listens on is still refused.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's too: "::" takes IPv6 only
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if len(sockets) > 1:  # the port picked for the first (the same unless port 0)
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _base_url(host: str, sockets: list[socket.socket]) -> str:
    """The URL of the server on `sockets` (their port, when --port 0 let the system choose)."""
    port = sockets[0].getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _run_server(app: Callable, config: ServeConfig, sockets: list[socket.socket],
                on_shutdown: Callable[[], Awaitable[None]] | None = None) -> int:
    """Serve `app` on `sockets` until interrupted, awaiting `on_shutdown()` as its graceful
    shutdown begins; the exit status."""
    import uvicorn

    from gateway.http_server import Server

    # NOTE: without a deadline a client that stops sending mid-request holds the shutdown forever;
    # after it the requests still running are cancelled, as when their clients disconnect.
    server = Server(uvicorn.Config(app, log_config=None, access_log=False,
                                   log_level=config.log_level, lifespan="on",
                                   timeout_graceful_shutdown=config.shutdown_timeout_s),
                    on_shutdown)
    logger.info("listening on %s", _base_url(config.host, sockets))
    # NOTE: uvicorn shuts down gracefully on Ctrl-C and SIGTERM (what systemd, Docker and
    # Kubernetes send) once it listens for them, then raises the signal again. Until then, and
    # after, they are noted here: one that came first (while asyncio set up the loop, which would
    # have cancelled the server unstarted, or lost the signal) stops the server as it starts,
    # and the one raised again must not kill the process before the caller closes its engines.
    def note(sig: int, frame: object) -> None:
        server.early_signals.append(sig)

    handlers = {sig: signal.signal(sig, note) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if not server.started:
        return 130 if server.early_signals else 1
    return 0


def _redis_problem(url: str | None) -> str | None:
    """Why the Redis at `url` cannot be used now (None: it answers, or `url` is not Redis)."""
    import asyncio

    from redis.exceptions import ResponseError

    from store import UNAVAILABLE_ERRORS, RedisStore, masked_url

    if url is None or not url.startswith(("redis://", "rediss://", "unix://")):
        return None

    async def ping() -> None:
        await (await RedisStore.open(url)).close()

    try:
        asyncio.run(ping())
    except UNAVAILABLE_ERRORS as error:
        return str(error)
    except ResponseError as error:  # e.g. "DB index is out of range": Redis refuses the URL's db
        return f"the Redis at {masked_url(url)} refuses the connection: {error}"
    return None


def _folder_problem(option: str, folder: Path) -> str | None:
    """Why `folder`, set by `option`, cannot hold the server's files (None: it can, made if it
    was missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"{option}: cannot make the folder {folder}: {error.strerror or error}"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{option}: {folder} is not a folder this process may write in"
    return None


def _models_problem(models: dict[str, Path]) -> str | None:
    """Why one of the local `models` cannot be served, as far as its folder's config.json says
    (None: each may be): said before the first of them loads, which takes minutes."""
    from engine.model.spec import ModelSpec  # NOTE: torch-free

    for name, path in models.items():
        try:
            ModelSpec.from_folder(path)
        except (OSError, ValueError) as error:
            return _cannot_serve(name, path, error)
    return None


def _cannot_serve(name: str, path: Path, error: Exception) -> str:
    return f"cannot serve {name!r} from {path}: {error}"


def _wait_for_stores(config: ServeConfig) -> str | None:
    """Why the store, or the Redis of the worker registry (--redis, where it is another), still
    cannot take writes after STORE_WAIT_S of trying (None: both can). See _wait_until_writable."""
    if (problem := _wait_until_writable(_store_option(config), config.store, config.data_dir)):
        return problem
    if config.redis is not None and config.redis != config.store:
        return _wait_until_writable("--redis", config.redis, config.data_dir)
    return None


def _wait_until_writable(setting: str, url: str | None, data_dir: Path) -> str | None:
    """Why the store at `url` (set by `setting`) still cannot take writes after STORE_WAIT_S of
    trying (None: it can). It was checked before the models loaded, which takes minutes: a lock
    another process held for seconds since (a backup, another gateway starting), or Redis
    restarting, must not cost that start. Done before the server starts, so that Ctrl-C and
    SIGTERM stop it as they stop the loading of the models (uvicorn only notes them until its app
    has started)."""
    import asyncio

    from store import UNAVAILABLE_ERRORS, StoreError, open_store

    async def check() -> None:
        store = await open_store(url, data_dir)
        try:
            await store.ensure_writable()
        finally:
            await store.close()

    what = "the Redis" if setting == "--redis" else "the store"
    deadline = time.monotonic() + STORE_WAIT_S
    while True:
        try:
            asyncio.run(check())
            return None
        except StoreError as error:
            return f"{setting}: {error}"
        except UNAVAILABLE_ERRORS as error:
            if time.monotonic() >= deadline:
                return f"{setting}: {what} still cannot take writes after {STORE_WAIT_S:g} s: {error}"
            logger.warning("cannot use %s yet (%s); trying again for up to %.0f s", what, error,
                           deadline - time.monotonic())
            time.sleep(1.0)


def _sqlite_problem(config: ServeConfig) -> str | None:
    """Why the SQLite store of `config` cannot be used, naming the setting that chose it (None:
    it can, or the store is not SQLite). One locked by another
    process now (a backup, say) is no problem yet: _wait_for_stores waits for it once the models
    are loaded (this exited 2 at once)."""
    import asyncio

    from store import UNAVAILABLE_ERRORS, StoreError, open_store

    if config.store is not None and not config.store.startswith("sqlite://"):
        return None

    async def open_and_close() -> None:
        await (await open_store(config.store, config.data_dir)).close()

    try:
        asyncio.run(open_and_close())
    except StoreError as error:
        return f"{_store_option(config)}: {error}"
    except UNAVAILABLE_ERRORS as error:
        logger.warning("cannot use the store now (%s); it is waited for once the models are loaded",
                       error)
    return None


def _store_option(config: ServeConfig) -> str:
    """The option that chose the store: --data-dir for the default SQLite file there, --redis
    for the registry's Redis (the store when --store is left out)."""
    if config.store is None:
        return "--data-dir"
    return "--redis" if config.store == config.redis else "--store"


def _load_tokenizer(folder: Path):
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(folder)


def train_router_command(args: dict) -> int:
    """`switchboard router train`: fit, calibrate, save, and report."""
    from routing.learned import read_examples, train_router

    if Path(args["out"]).exists() and not Path(args["out"]).is_dir():  # before minutes of training
        print(f"switchboard router train: --out {args['out']} is a file; name a folder",
              file=sys.stderr)
        return 2
    try:
        # NOTE: utf-8-sig: a file some Windows tools wrote starts with a byte order mark.
        with open(args["data"], encoding="utf-8-sig") as lines:
            examples = read_examples(lines, str(args["data"]))
        router, report = train_router(examples, args["target_strong_share"],
                                      holdout_fraction=args["holdout"], seed=args["seed"],
                                      epochs=args["epochs"])
        router.save(args["out"])
    except (OSError, ValueError) as error:
        print(f"switchboard router train: {error}", file=sys.stderr)
        return 2
    auc = (f"held-out ROC AUC {report.auc:.3f}" if not math.isnan(report.auc) else
           "no held-out ROC AUC: every held-out prompt has the same outcome (add prompts of both)")
    print(f"trained on {report.num_train} prompts; calibrated on {report.num_holdout} held out: "
          f"threshold {report.threshold:.4f} sends {report.strong_share:.1%} to the strong model "
          f"(target {args['target_strong_share']:.1%}); {auc}\n"
          f"saved to {args['out']}")
    return 0


def _demo_model(command: str, data_dir: Path) -> dict[str, Path] | None:
    """The demo model, written into the data folder on first use; None, once the error is
    printed, where it cannot be written there."""
    from engine.demo import DEMO_NAME, ensure_demo_model

    # NOTE: the engine's own default when data_dir is $SWITCHBOARD_HOME, so both share one copy.
    folder = data_dir / DEMO_NAME
    try:
        return {DEMO_NAME: ensure_demo_model(folder)}
    except Exception as error:  # an OSError, or safetensors' own error for one
        is_full = getattr(error, "errno", None) == errno.ENOSPC or "No space left" in str(error)
        print(f"switchboard {command}: --data-dir: cannot write the demo model to {folder} "
              f"({error}): " + ("free disk space on that volume" if is_full else
                                "the data folder must be writable"), file=sys.stderr)
        return None


def _print_admin_key(base_url: str, key: str) -> None:
    auth = f"-H 'Authorization: Bearer {key}'"
    print(f"\nCreated the admin key. It is shown only now (the store keeps its hash):\n\n  {key}\n\n"
          "Create a tenant and an API key for it:\n"
          f"  curl {auth} -d '{{\"name\": \"acme\"}}' {base_url}/admin/tenants\n"
          f"  curl {auth} -X POST {base_url}/admin/tenants/acme/keys\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
