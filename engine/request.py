"""One request's whole state (Request), how to sample it (SamplingParams), and where it stands."""

from __future__ import annotations

import enum
import itertools
import math
import numbers
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from adapters.config import is_int

# Temperatures below this sample greedily (as vLLM): dividing logits by them overflows float32.
_GREEDY_TEMPERATURE = 1e-5
# Repetition penalties within these keep float32 logits finite (the gateway's HTTP bound is the same).
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 0.01, 100


def _is_list_like(value: object) -> bool:
    """A list, tuple, range, set...: read more than once, and not a text or a mapping."""
    return isinstance(value, Collection) and not isinstance(value, (str, bytes, Mapping))


class InvalidParameter(ValueError):
    """A request the engine can never run because of one field: `param` names it (a
    SamplingParams field, or "prompt"), so an API can point its client at what to change."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """How one request is decoded. Validated at construction; errors name the field."""

    max_tokens: int | None = 16
    """None: as many as the model's context holds (as vLLM's None)."""
    temperature: float = 1.0
    """0 (or anything below 1e-5) means greedy."""
    top_k: int = 0
    """0 (or -1) disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    """Makes the request's samples reproducible, independent of what it is batched with."""
    stop: tuple[str, ...] | None = ()
    stop_token_ids: tuple[int, ...] | None = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    """No stop condition (EOS, stop token, stop string) is honoured before this many tokens were
    generated; a stop string that appears earlier stays in the text and never ends the request."""
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the top-k alternatives."""
    prompt_logprobs: int | None = None
    """Like `logprobs`, for each prompt token after the first (vLLM's): what the model gave it
    from the tokens before. The whole prompt is computed for them: no prefix-cache hits."""
    repetition_penalty: float = 1.0
    """CTRL's, on prompt and output tokens: positive logits divided by it, negative ones times it.
    In [0.01, 100]."""
    presence_penalty: float = 0.0
    """OpenAI's, on output tokens (as vLLM): subtracted once from the logit of every token generated so far."""
    frequency_penalty: float = 0.0
    """OpenAI's, on output tokens: subtracted from a token's logit once per time it was generated."""
    logit_bias: dict[int, float] | None = field(default_factory=dict)
    """OpenAI's: token id -> added to its logit before sampling (greedy too); -100 all but bans it."""

    def __post_init__(self) -> None:
        # None as vLLM's defaults mean: none.
        self.stop = () if self.stop is None else self.stop
        self.stop_token_ids = () if self.stop_token_ids is None else self.stop_token_ids
        self.logit_bias = {} if self.logit_bias is None else self.logit_bias
        self._check_types()
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.logit_bias = {int(token): float(bias) for token, bias in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be >= 1 (or None: up to the context), got {self.max_tokens}"),
            ("temperature", 0 <= self.temperature < math.inf,
             f"temperature must be finite and >= 0, got {self.temperature}"),
            ("top_k", self.top_k >= 0, f"top_k must be -1, 0 or positive, got {self.top_k}"),
            ("top_p", 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            ("min_tokens", 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20,
             f"logprobs must be in [0, 20], got {self.logprobs}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
            ("repetition_penalty",
             _MIN_REPETITION_PENALTY <= self.repetition_penalty <= _MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in [{_MIN_REPETITION_PENALTY}, {_MAX_REPETITION_PENALTY}], "
             f"got {self.repetition_penalty}"),
            ("presence_penalty", -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("logit_bias", all(-100 <= bias <= 100 for bias in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            ("logit_bias", all(token >= 0 for token in self.logit_bias),
             "logit_bias token ids must be >= 0"),
            ("stop", all(self.stop), "stop strings must be non-empty"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameter(message, param)

    def _check_types(self) -> None:
        """InvalidParameter naming the first field of the wrong type. A bool or a float where a
        count goes (logprobs=True, top_k=2.5) passed the range checks, then failed the step that
        sampled it: every request batched with it."""
        counts = [("max_tokens", self.max_tokens, True), ("min_tokens", self.min_tokens, False),
                  ("top_k", self.top_k, False), ("seed", self.seed, True),
                  ("logprobs", self.logprobs, True), ("prompt_logprobs", self.prompt_logprobs, True)]
        for param, value, may_be_none in counts:
            if not (is_int(value) or (may_be_none and value is None)):
                raise InvalidParameter(f"{param} must be an integer{' or None' * may_be_none}, "
                                       f"got {value!r}", param)
        for param in ("temperature", "top_p", "repetition_penalty", "presence_penalty",
                      "frequency_penalty"):
            value = getattr(self, param)
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise InvalidParameter(f"{param} must be a number, got {value!r}", param)
        # NOTE: a lone number where a list goes raised a TypeError naming no field.
        stops = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not _is_list_like(stops) or not all(isinstance(stop, str) for stop in stops):
            raise InvalidParameter(f"stop must be a string or a list of strings, got {self.stop!r}",
                                   "stop")
        if not _is_list_like(self.stop_token_ids) or not all(
                is_int(t) for t in self.stop_token_ids):
            raise InvalidParameter(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}",
                                   "stop_token_ids")
        bias = self.logit_bias
        # NOTE: keys may be strings of digits, as JSON (OpenAI's logit_bias) writes them; ASCII
        # ones: isdigit() also holds for "²", which int() cannot read.
        if not isinstance(bias, dict) or not all(
                (is_int(k) or (isinstance(k, str) and k.isascii() and k.isdigit()))
                and isinstance(v, numbers.Real) and not isinstance(v, bool) for k, v in bias.items()):
            raise InvalidParameter(f"logit_bias must be a map of token ids to numbers, got {bias!r}",
                                   "logit_bias")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the model's logits before choosing (penalties, biases)."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0 or bool(self.logit_bias))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)


@dataclass
class TokenLogprobs:
    """Logprob of one sampled token and the top alternatives at that position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first


_arrival_counter = itertools.count()


@dataclass(eq=False)
class Request:
    """Owns one request's state; the scheduler moves it and the runner reads it.

    `num_computed_tokens` counts tokens whose KV is in the cache. Prefill is not a phase: each step
    the scheduler decides how many of the `num_tokens - num_computed_tokens` pending tokens to run.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    """Lower runs first (the vLLM convention)."""
    tenant: str | None = None
    """Who sent it; part of the prefix-cache key, so tenants never share cached blocks."""
    adapter_id: str | None = None
    """Identity of the LoRA adapter; part of the prefix-cache key because LoRA changes K and V."""
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    fair_round: int = 0
    """Its turn among the tenants' requests of its priority, given by the scheduler (TenantRounds)."""

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Entry j is prompt token j + 1's, as predicted at position j (with `prompt_logprobs`)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    """Hashes of this request's full token blocks, in order (filled lazily by the KV manager)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when the request was first scheduled."""
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    lora_slot: int = -1
    """Device slot of the request's adapter while it runs; -1 = base model or not admitted."""
    error: str | None = None
    """Why the request ended with FINISHED_ERROR."""

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise InvalidParameter("prompt must contain at least one token", "prompt")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def can_stop(self) -> bool:
        """Whether stop conditions count yet: not before min_tokens tokens were generated."""
        return self.num_output_tokens >= self.sampling_params.min_tokens

    @property
    def unsampleable_token_ids(self) -> frozenset[int]:
        """Tokens the next one must not be: before min_tokens, those that would stop the request
        (its stop_token_ids, and EOS unless ignore_eos), as vLLM masks them."""
        if self.can_stop:
            return frozenset()
        params = self.sampling_params
        return frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are still to be computed."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """The positions among [start, end) whose logits give prompt logprobs not yet recorded
        (a chunk computed again after a preemption records nothing twice)."""
        if self.sampling_params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: priority first, then the tenants' turns (first come, first served
        within one tenant's turns), then arrival."""
        return (self.priority, self.fair_round, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
