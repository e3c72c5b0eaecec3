"""EngineClient: how the gateway talks to an engine, in-process or on a worker over HTTP.

These types are the whole boundary: the gateway never imports torch or the engine package, so a
remote worker can implement the same protocol by sending the Structs below as JSON.
"""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec


class SamplingOptions(msgspec.Struct, frozen=True, kw_only=True):
    """How one engine request is decoded; mirrors the engine's SamplingParams field for field,
    but for `fills_context`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    # The client left max_tokens out, and max_tokens is what the context leaves after the prompt
    # (as this gateway counts it): an upstream, which counts the prompt its own way, is not held
    # to that count (UpstreamEngineClient._upstream_max_tokens). An engine here ignores it.
    fills_context: bool = False


class TokenLogprob(msgspec.Struct, frozen=True):
    """Logprob of one sampled token and the top alternatives, (token id, logprob) best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class GenerationChunk(msgspec.Struct, frozen=True, kw_only=True):
    """What one engine step produced for one request (the tokens and text since the last chunk)."""

    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    # With SamplingOptions.prompt_logprobs, on the first chunk: prompt tokens 1.. (the first
    # follows nothing).
    prompt_logprobs: list[TokenLogprob] | None = None


class AdapterRef(msgspec.Struct, frozen=True):
    """The LoRA adapter a request runs with: its identity (store.blobs digest), its folder and
    its rank, by which requests are placed on workers that serve it."""

    digest: str
    path: str
    rank: int = 0  # the largest over its modules; 0: not known here (a worker reads the files)


class AdapterInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine found in an adapter folder it accepted."""

    rank: int  # the largest rank over its modules
    target_modules: list[str]  # PEFT projection names, sorted


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's gauges and cumulative counters, as published after its latest step."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefix_cache_hit_rate: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    adapter_hits: int = 0  # requests whose adapter was in a device slot
    adapter_misses: int = 0  # requests whose adapter had to be paged in
    adapter_evictions: int = 0  # device slots taken from an idle adapter
    adapter_disk_loads: int = 0  # adapters read from storage into host memory
    adapters_resident: int = 0  # adapters in device slots now
    # Prompt tokens looked up in the prefix cache, and found there: a hit rate over several
    # engines is theirs summed, as each one's counts a token once whether or not it was computed.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0


class EngineClient(Protocol):
    """One served base model."""

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus output the engine accepts, in tokens."""

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; RequestRejected if the model has no tokenizer."""

    @property
    def tokenizer_key(self) -> str | None:
        """What tells tokenizers apart: engines with the same key give every text the same ids,
        so a route over them reads a prompt once and takes token ids; None when the model has no
        tokenizer (it reads token ids only)."""

    def max_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        """The most tokens the model may count a prompt of these ids as, which a call holds of
        its tenant's budgets and tpm: their number, or more where the model reads the prompt's
        text its own way (an upstream adds its special tokens and chat template)."""

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        """The prompt text of a chat through the model's chat template; None if it has none."""

    def token_text(self, token_id: int) -> str:
        """How logprobs name one token: its text, or for a token that is only part of a
        character, its bytes as OpenAI names them ("bytes:\\xe2\\x80"; see
        gateway/text_codec.py, whose name_bytes reads the bytes back)."""

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes one generated token adds to the reply's text: its own, or none for a
        special token, which the engine's text leaves out."""

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """How a run of tokens reads (for echo: a character may span several tokens); without
        the special ones ("<s>") if `skip_special_tokens`."""

    @property
    def supports_adapters(self) -> bool:
        """Whether this engine serves LoRA adapters (started with adapter slots)."""

    @property
    def why_no_adapters(self) -> str:
        """While `supports_adapters` is False: why, and who can change it, as the rest of a
        sentence that starts with the model's name ("'demo' is served here without adapter
        slots ..."), for the errors of an upload or of a call with an adapter."""

    @property
    def max_adapter_rank(self) -> float:
        """The highest adapter rank this engine serves while the gateway runs (its
        --max-lora-rank): 0 when it serves no adapters, inf when it has no fixed limit (engine
        workers, which come and go with limits of their own). Checked before a call with an
        adapter is admitted: one of a higher rank could never run."""

    @property
    def counts_text_bytes(self) -> bool:
        """Whether `tokenize` gives the text's bytes, not the model's tokens (an upstream, which
        tokenizes on its side): several bytes make a token, so only the model can tell that a
        prompt alone overflows its context."""

    def check_options(self, options: SamplingOptions) -> None:
        """OptionNotServed if this engine refuses every request with `options`, whatever its
        prompt. Cheap, and checked before a call runs: a route leaves out a tier that would
        refuse the call, rather than escalate into it after running (and billing) the tiers
        before it."""

    async def check_adapter(self, folder: str) -> AdapterInfo:
        """Validate a PEFT adapter folder against this base model, reading all of it.

        Raises AdapterRejected saying what is wrong and what to do.
        """

    def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                 request_id: str, tenant: str | None = None,
                 adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream one request's chunks, on the base model or with `adapter`. The first iteration
        raises RequestRejected if the engine refuses the request, later ones EngineFailure;
        leaving the loop early aborts it."""

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        """EngineUnavailable (saying what to do) when no request could start now, as when every
        remote worker of the model is down, or (AdapterNotServedNow) none that is up runs
        `adapter`'s rank; checked before a call is admitted, so that a call that could only get
        a 503 does not use up its tenant's rate limit, nor run a route's tiers before it."""

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters."""

    def close(self) -> None:
        """Stop the engine; requests still running fail."""


class RequestRejected(ValueError):
    """The engine cannot serve this request as asked; the message says why and what to change,
    and `param`, when one field is the cause, names it as the engine knows it (a SamplingOptions
    field, or "prompt")."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class CannotServe(RequestRejected):
    """This model cannot serve the call as asked, though another model may: a route runs the
    call on its tiers that can (ContextExceeded, OptionNotServed, ChatNotServed)."""


class ContextExceeded(CannotServe):
    """The call cannot fit the model's context: its prompt alone (`param` "prompt"), or with its
    answer's max_tokens ("max_tokens"). A model with a longer context may hold it."""


class ChatNotServed(CannotServe):
    """The model's chat template refuses the chat (`param` "prompt"), as Mistral's first
    templates refuse a system message, for `reason`; another model's template may take it."""

    def __init__(self, reason: str, model: str | None = None):
        self.reason = reason
        # NOTE: "the chat template of 'm'", not "'m''s chat template", which reads as a typo.
        of_whom = "the model" if model is None else repr(model)
        super().__init__(f"the chat template of {of_whom} rejected the messages: {reason}; send a "
                         "chat it takes, or call another model", "prompt")


class OptionNotServed(CannotServe):
    """A sampling option this engine never serves, whatever the prompt (`param` names it, as a
    SamplingOptions field): an upstream asked for the prompt's logprobs. Another model may."""


class AdapterRejected(RequestRejected):
    """An adapter the engine cannot serve: the message says what is wrong with it."""


class EngineFailure(RuntimeError):
    """The engine failed while running the request (or was shut down); the request is gone."""


class EngineUnavailable(EngineFailure):
    """No engine can take the request now (say no worker of its model is up): retry shortly."""


class GatewayOutOfFiles(EngineUnavailable):
    """This gateway could not open a connection to an engine: it has used up its open files.
    Says nothing of the engine, which is not passed over for it."""

    def __init__(self) -> None:
        super().__init__("this gateway has no connection free to reach an engine now (it is "
                         "out of open files); retry shortly")


_OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE})


def out_of_open_files(error: BaseException | None) -> bool:
    """Whether `error`, or an error it came from, is this process (or its host) out of open
    files: a connection that failed so failed here, before it reached the far end."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _OUT_OF_FILES:
            return True
        error = error.__cause__ or error.__context__
    return False


class EngineStopped(EngineFailure):
    """The engine's worker shut down gracefully before the request finished (its deadline came
    first): sent again, the request runs on a worker that is up."""


class WorkersOutOfSpace(EngineFailure):
    """The engine workers that could take the request have no disk space left to keep its
    adapter's files: sent again, it would fail the same way until their operator frees space."""


class AdapterCannotRun(EngineFailure):
    """The request's adapter, not its engine, is what cannot run: no other engine (a route's next
    tier) answers in its place, as the call asked for the adapter."""


class DamagedAdapterCopy(AdapterCannotRun):
    """This gateway's copy of the request's adapter files is damaged, and no intact copy could
    replace it: sent again, the request would fail the same way."""


class AdapterNotServedNow(EngineUnavailable, AdapterCannotRun):
    """Engines of the request's model are up, but none that is runs its adapter (its rank is
    above theirs, or they have no adapter slots): retry shortly, as engines come and go; a
    route's next tier does not answer in its place meanwhile."""


class AdapterDeleted(AdapterCannotRun):
    """The request's adapter was deleted, and its files with it, before the engine read them:
    the request cannot run, and sent again it would name a model that no longer exists."""


class AdapterUnusable(AdapterCannotRun):
    """The request's adapter does not fit the model now served under its base model's name (the
    server was restarted on a model of other shapes): sent again, it would fail the same way
    until the adapter is uploaded again, made for the model served now."""


class UpstreamFailure(EngineFailure):
    """An upstream server (gateway/upstream.py) failed the request. The message names only the
    model it serves: its address, its answer and what to fix are the operator's, in the log."""


class UpstreamUnavailable(UpstreamFailure):
    """The upstream could not be reached, did not answer in time, or said it is overloaded."""
