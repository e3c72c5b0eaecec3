"""LocalEngineClient: the EngineClient of an AsyncEngine in this process.

NOTE: this module imports the engine (and so torch); only the CLI and test fixtures import it, so
the request-handling modules stay free of torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec

from adapters import AdapterConfig, AdapterValidationError, LoraAdapter, load_adapter
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine, RequestOutput
from engine.lora import LoraRequest
from engine.request import InvalidParameter, SamplingParams, TokenLogprobs
from gateway.engine_client import (AdapterInfo, AdapterRef, AdapterRejected, EngineFailure,
                                   EngineStats, GenerationChunk, RequestRejected, SamplingOptions,
                                   TokenLogprob)
from gateway.text_codec import TextCodec
from kernels.sgmv_cpu import pin_num_threads


class LocalEngineClient(TextCodec):
    """Serves one model folder with an in-process AsyncEngine (its step loop runs on a thread)."""

    def __init__(self, engine: AsyncEngine):
        super().__init__(engine.tokenizer)
        self._engine = engine

    @classmethod
    def load(cls, config: EngineConfig, show_progress: bool = True) -> "LocalEngineClient":
        """Load the model of `config` (with a progress bar) and start its step loop."""
        return cls(AsyncEngine(LLMEngine(config, show_progress=show_progress)))

    @property
    def max_model_len(self) -> int:
        return self._engine.engine.max_model_len

    @property
    def supports_adapters(self) -> bool:
        return self._engine.engine.config.lora is not None

    @property
    def why_no_adapters(self) -> str:
        return ("is served here without adapter slots (--max-loras 0), so it runs no adapters: "
                "the operator must restart the server with --max-loras above 0")

    @property
    def max_adapter_rank(self) -> int:
        """Fixed by its config: a call that asks for more is refused until the server restarts."""
        lora = self._engine.engine.config.lora
        return 0 if lora is None else lora.max_lora_rank

    @property
    def counts_text_bytes(self) -> bool:
        return False

    def check_options(self, options: SamplingOptions) -> None:
        """Nothing: the engine serves every option (values out of bounds, the same on every
        engine, are refused by `generate`)."""

    async def check_adapter(self, folder: str, max_lora_rank: int | None = None) -> AdapterInfo:
        """`max_lora_rank` above this engine's: check the rank against it instead (a worker
        checking an adapter that another worker of its model, restarting, serves)."""
        engine = self._engine.engine
        if engine.config.lora is None:
            raise AdapterRejected("this model is served without adapter slots (--max-loras 0), "
                                  "so it takes no adapters; start it with --max-loras above 0")
        rank_limit = max(engine.config.lora.max_lora_rank, max_lora_rank or 0)

        def check() -> LoraAdapter:
            # NOTE: an executor thread whose first torch call landed in a LoRA decode's one-thread
            # window (kernels/sgmv_cpu.py) would otherwise check every upload on one thread.
            pin_num_threads(engine.num_threads)
            return load_adapter(folder, engine.spec, rank_limit)

        try:
            adapter = await asyncio.to_thread(check)
        except AdapterValidationError as error:
            # The folder is the server's temporary copy: its path means nothing to the client.
            raise AdapterRejected(str(error).replace(str(folder), "the adapter")) from None
        return AdapterInfo(rank=max(m.rank for m in adapter.modules.values()),
                           target_modules=sorted({proj for _, proj in adapter.modules}))

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        try:
            fields = msgspec.structs.asdict(options)
            del fields["fills_context"]  # for upstreams; this engine fills its context anyway
            params = SamplingParams(**fields)
        except ValueError as error:
            raise _rejected(error) from None
        lora = None if adapter is None else LoraRequest(adapter.digest, adapter.path)
        outputs = self._engine.generate(prompt_token_ids, params, request_id=request_id,
                                        tenant=tenant, lora=lora)
        try:
            async for output in outputs:
                if output.finish_reason == "error":  # this request alone failed in the engine
                    message = output.error or "the engine failed the request"
                    if adapter is not None:  # the folder is this server's: its path means nothing
                        message = message.replace(adapter.path, "the adapter's stored copy")
                    raise EngineFailure(message)
                yield _chunk(output)
        except ValueError as error:  # NOTE: the engine only raises it when adding the request
            raise _rejected(error) from None
        except EngineFailure:
            raise
        except RuntimeError as error:
            raise EngineFailure(str(error)) from None
        finally:
            await outputs.aclose()  # aborts the engine request if this stream is closed early

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        """Always: the engine runs in this process (an adapter above its rank limit is refused
        before, see gateway.serving)."""

    def stats(self) -> EngineStats:
        m = self._engine.metrics()
        return EngineStats(
            num_running=m.num_running, num_waiting=m.num_waiting,
            kv_blocks_total=m.kv_blocks_total, kv_blocks_used=m.kv_blocks_used,
            prefix_cache_hit_rate=m.prefix_cache_hit_rate, num_prompt_tokens=m.num_prompt_tokens,
            num_generation_tokens=m.num_generation_tokens, num_preemptions=m.num_preemptions,
            adapter_hits=m.adapter_hits, adapter_misses=m.adapter_misses,
            adapter_evictions=m.adapter_evictions, adapter_disk_loads=m.adapter_disk_loads,
            adapters_resident=m.adapters_resident,
            prefix_cache_queried_tokens=m.prefix_cache_queried_tokens,
            prefix_cache_hit_tokens=m.prefix_cache_hit_tokens)

    @property
    def max_loras(self) -> int:
        """Device slots for adapters (0 without LoRA support)."""
        lora = self._engine.engine.config.lora
        return 0 if lora is None else lora.max_gpu_adapters

    def resident_adapters(self) -> tuple[list[str], list[str]]:
        """Digests of the adapters in device slots, and of those loaded in host memory."""
        cache = self._engine.engine.adapter_cache
        # NOTE: read from another thread than the engine's; list() copies a dict atomically.
        return ([], []) if cache is None else (cache.resident_ids(), cache.host_ids())

    def close(self) -> None:
        self._engine.shutdown()


def load_engines(models: dict[str, Path], *, lora: dict | None = None,
                 **config) -> dict[str, LocalEngineClient]:
    """One LocalEngineClient per served name; `config` holds the EngineConfig fields they share,
    `lora` the AdapterConfig fields (None: no adapters)."""
    adapters = None if lora is None else AdapterConfig(**lora)
    return {name: LocalEngineClient.load(EngineConfig(model=str(path), lora=adapters, **config))
            for name, path in models.items()}


def _rejected(error: ValueError) -> RequestRejected:
    return RequestRejected(str(error), error.param if isinstance(error, InvalidParameter) else None)


def _chunk(output: RequestOutput) -> GenerationChunk:
    return GenerationChunk(
        token_ids=output.new_token_ids,
        text=output.new_text,
        logprobs=_logprobs(output.new_logprobs),
        finished=output.finished,
        finish_reason=output.finish_reason,
        num_prompt_tokens=output.num_prompt_tokens,
        num_output_tokens=output.num_output_tokens,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=None if output.prompt_logprobs is None else _logprobs(output.prompt_logprobs),
    )


def _logprobs(logprobs: list[TokenLogprobs]) -> list[TokenLogprob]:
    return [TokenLogprob(lp.token_id, lp.logprob, lp.top) for lp in logprobs]
