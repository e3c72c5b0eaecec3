"""LLM: the offline batch API for scripts and benchmarks (no server, no event loop)."""

from __future__ import annotations

import itertools
import numbers
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from engine.config import EngineConfig
from engine.demo import ensure_demo_model
from engine.engine import LLMEngine, RequestOutput
from engine.lora import LoraRequest
from engine.request import SamplingParams, TokenLogprobs
from store.blobs import ADAPTER_FILES, digest_files


@dataclass
class CompletionOutput:
    """One finished request: everything its step outputs carried, concatenated."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # with SamplingParams.prompt_logprobs
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine failed the request, when finish_reason is "error"

    def add(self, output: RequestOutput) -> None:
        self.output_token_ids.extend(output.new_token_ids)
        self.text += output.new_text
        self.logprobs.extend(output.new_logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.finish_reason = output.finish_reason
        self.stop_reason = output.stop_reason
        self.num_cached_tokens = output.num_cached_tokens
        self.error = output.error


class LLM:
    """Run a batch of prompts to completion with continuous batching.

    `LLM()` uses the embedded demo model; keyword arguments are EngineConfig fields.
    """

    def __init__(self, model: str | None = None, show_progress: bool = True, **config):
        model = model or str(ensure_demo_model())
        self.engine = LLMEngine(EngineConfig(model=model, **config), show_progress=show_progress)
        self._ids = itertools.count()
        # Adapters whose id was checked against their files, with what the files' stat said then:
        # hashing an adapter's files (hundreds of MB at large ranks) on every call made a loop of
        # small calls several times slower than its generation.
        self._checked_adapters: dict[tuple[str, str], tuple] = {}

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora: LoraRequest | Sequence[LoraRequest | None] | None = None) -> list[CompletionOutput]:
        """Outputs in the order of `prompts`: a list of prompts, or one prompt (a text, or a list
        of token ids), as vLLM takes them. One SamplingParams (or adapter) applies to all
        prompts; a sequence gives one per prompt."""
        prompts = _prompt_list(prompts)
        sampling_params = _per_prompt(SamplingParams() if sampling_params is None else sampling_params,
                                      SamplingParams, prompts)  # NOTE: [] is 0 values, not none given
        loras = _per_prompt(lora, LoraRequest, prompts)
        for adapter in {a for a in loras if a is not None}:
            self._check_adapter_id(adapter)
        results: dict[str, CompletionOutput] = {}
        try:
            for prompt, params, adapter in zip(prompts, sampling_params, loras):
                request_id = str(next(self._ids))
                request = self.engine.add_request(request_id, prompt, params, lora=adapter)
                results[request_id] = CompletionOutput(request_id, request.prompt_token_ids)
            self._run_to_completion(results, use_tqdm)
        except BaseException:
            # NOTE: a failed call (a rejected prompt, Ctrl-C) must leave no request of its own
            # queued: the next call would get their outputs and find no CompletionOutput for them.
            for request_id in results:
                self.engine.abort_request(request_id)
            raise
        return list(results.values())

    def _run_to_completion(self, results: dict[str, CompletionOutput], use_tqdm: bool) -> None:
        with tqdm(total=len(results), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    results[output.request_id].add(output)
                    bar.update(int(output.finished))


    def _check_adapter_id(self, adapter: LoraRequest) -> None:
        """ValueError unless the adapter's id is the digest of its files, as the engine requires
        (a vLLM user names adapters freely): said now, with what to do, where the engine would
        fail each of its requests as if the files were damaged. Files checked before are hashed
        again only once their stat changes (the engine checks the digest as it loads them)."""
        folder = Path(adapter.path)
        key = (adapter.adapter_id, adapter.path)
        try:
            stat = _files_stat(folder)
            if self._checked_adapters.get(key) == stat:
                return
            digest = digest_files(folder)
        except OSError:  # no such folder or files: the engine's loader says what is wrong (`error`)
            return
        if digest != adapter.adapter_id:
            raise ValueError(f"the adapter id {adapter.adapter_id!r} is not the digest of the files "
                             f"in {adapter.path} ({digest}); name an adapter by its files' digest: "
                             "LoraRequest.of_folder(path)")
        self._checked_adapters[key] = stat


def _files_stat(folder: Path) -> tuple:
    """What changes when an adapter's files are rewritten, replaced or moved."""
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)
                 for s in (os.stat(folder / name) for name in ADAPTER_FILES))


def _prompt_list(prompts: str | list[int] | Sequence[str | list[int]]) -> list[str | list[int]]:
    """The prompts of generate(): one prompt alone is a list of one (a text was run as one
    prompt per character, and a list of token ids failed)."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
        return [prompts]
    return prompts


def _per_prompt(value, single_type: type, prompts: Sequence) -> list:
    if value is None or isinstance(value, single_type):
        return [value] * len(prompts)
    if len(value) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(value)} {single_type.__name__} values")
    return list(value)
