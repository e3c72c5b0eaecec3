"""A measurement rig: an EngineClient that answers at once, and the real gateway served over it.

With no model work behind it, the gateway's own cost per request (HTTP, auth, admission, billing,
JSON, metrics, access log) is all that limits throughput. It lives in benchmarks/ only; the
product never serves it. Run the gateway over it (what bench_gateway.py starts in a child
process):

    python -m benchmarks.instant_engine --port 8123 --data-dir /tmp/gw --admin-key sb-admin-x
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from pathlib import Path

from gateway.engine_client import (AdapterInfo, AdapterRef, AdapterRejected, EngineStats,
                                   GenerationChunk, SamplingOptions)

INSTANT_MODEL = "instant"
_TEXT = "Hello from the instant engine."


class InstantEngine:
    """The EngineClient protocol with no model: byte-level tokens, and every request finishes at
    once with the first `max_tokens` bytes of a fixed text (one chunk, finish_reason "length")."""

    counts_text_bytes = False

    def __init__(self, max_model_len: int = 4096):
        self._max_model_len = max_model_len
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    @property
    def tokenizer_key(self) -> str:
        return "bytes"

    def max_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        return len(prompt_token_ids)

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        return None

    def token_text(self, token_id: int) -> str:
        return bytes([token_id]).decode(errors="replace")

    def text_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode(errors="replace")

    @property
    def supports_adapters(self) -> bool:
        return False

    @property
    def why_no_adapters(self) -> str:
        return "is a benchmark's stand-in for an engine, which runs no adapters"

    @property
    def max_adapter_rank(self) -> int:
        return 0

    def check_options(self, options: SamplingOptions) -> None:
        """Nothing: it ignores the options."""

    async def check_adapter(self, folder: str) -> AdapterInfo:
        raise AdapterRejected("the instant engine serves no adapters")

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        token_ids = list(_TEXT.encode()[:options.max_tokens])
        self._num_prompt_tokens += len(prompt_token_ids)
        self._num_generation_tokens += len(token_ids)
        yield GenerationChunk(
            token_ids=token_ids, text=bytes(token_ids).decode(errors="replace"), logprobs=[],
            finished=True, finish_reason="length", num_prompt_tokens=len(prompt_token_ids),
            num_output_tokens=len(token_ids), num_cached_tokens=0)

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        """Always available: there is nothing behind it."""

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_blocks_total=1, kv_blocks_used=0,
                           prefix_cache_hit_rate=0.0, num_prompt_tokens=self._num_prompt_tokens,
                           num_generation_tokens=self._num_generation_tokens, num_preemptions=0)

    def close(self) -> None:
        pass


def serve(port: int, data_dir: Path, admin_key: str, log_level: str, access_log: Path) -> None:
    """The real gateway app over an InstantEngine, under uvicorn as `switchboard serve` runs it;
    the gateway's log (the access log included) goes to `access_log`."""
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(filename=access_log, level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app({INSTANT_MODEL: InstantEngine()}, data_dir=data_dir, admin_key=admin_key)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, log_level=log_level, lifespan="on"))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT that stopped it, once shut down
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="loopback port to listen on")
    parser.add_argument("--data-dir", type=Path, required=True, help="where the SQLite store lives")
    parser.add_argument("--admin-key", required=True, help="the admin key to set")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                        help="gateway log level; info writes one access-log line per request")
    parser.add_argument("--log-file", type=Path, help="log file (default DATA_DIR/gateway.log)")
    args = parser.parse_args()
    args.data_dir.mkdir(parents=True, exist_ok=True)  # the log file goes there before the store
    serve(args.port, args.data_dir, args.admin_key, args.log_level,
          args.log_file or args.data_dir / "gateway.log")


if __name__ == "__main__":
    main()
