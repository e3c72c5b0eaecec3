"""UpstreamEngineClient: a model of a remote OpenAI-compatible server (vLLM, another Switchboard,
...) as an EngineClient, so the gateway serves it like a local model and routes can use it as a tier.

The protocol speaks token ids, an upstream speaks text. Ids of this client's own, meaningful only
to it, make the mapping lossless:

- prompt ids are the UTF-8 bytes of the text (`tokenize`); `generate` decodes them back and sends
  the text as `prompt`, or to the chat API as the content of one user message;
- a chat for the chat API is ids no text has. Each message is ROLE_ID then its role's bytes,
  CONTENT_ID then its content's bytes, and NAME_ID then its name's bytes if it has one. The marks
  are negative and a text's ids are bytes (0-255), so `generate` reads a prompt whose first id is
  ROLE_ID as a chat and any other as a text: no prompt text can pass for a chat, whatever it holds.
  Only `render_chat` makes a chat: a RenderedChat, a str holding the messages, which `tokenize`
  turns into these ids (user text is a plain str, so it is always read as bytes). A chat counts as
  the bytes of its fields plus one per field (see UpstreamSource.max_model_len), and a call holds
  what the upstream adds to each message besides (`max_prompt_tokens`, _PromptOverhead);
- output ids stand for the upstream's tokens: FIRST_TOKEN_ID + the index of each token's text in a
  table this client fills as tokens arrive (`token_text` reads it back). The upstream is always
  asked for logprobs (`logprobs: 0`, or the chat API's `logprobs: true`, gives just the chosen
  token's), whose tokens are how the client knows where its tokens start and end, so output
  counts are in the upstream's tokens. An upstream that sends no logprobs has each piece of text
  it sends counted as one token, with the id TEXT_PIECE_ID.

Requests are streamed with usage, to the API the source's `api` names; both APIs' answers are read
alike (text, tokens, logprobs, usage):
- "completions": the upstream's `/completions` (the legacy API, which vLLM, llama.cpp, TGI and
  Switchboard serve; at OpenAI only its instruct models). Chats reach it as the gateway's plain
  transcript (`render_chat` is None): that API cannot reach the upstream's chat template.
- "chat": its `/chat/completions` (what hosted chat models serve), where a chat's messages go
  through the upstream's own template.

Sampling options the OpenAI APIs lack (vLLM's extras) are sent only when set, so an upstream that
does not know one refuses the request rather than ignoring it. Token ids in sampling options
(`stop_token_ids`, `logit_bias`) are passed as they are: they name the upstream's own tokens.
Prompt logprobs (for echo) are refused up front (`check_options`): the client cannot ask the
upstream for them. A prompt sent as token ids is read as above: ids with the marks spell a chat,
read strictly (each message a role and a content, maybe a name: what the chat endpoint passes on),
so they reach nothing the chat endpoint does not.

Refused connections, timeouts (to connect, to send, and for each read: a stream that stalls midway
too) and 429/503/504 answers are UpstreamUnavailable; 401/403/404 and other 5xx answers and
malformed streams are UpstreamFailure. Tenants are told only which served model failed: the
upstream's origin, what it answered and what the operator should fix (say, the variable that holds
a refused key) go to the log, at warning level. The upstream's 400/413/422 (the request itself was
wrong) is RequestRejected with the upstream's message, which is about the tenant's own request,
without the upstream's address. No message holds the key.

Byte ids match no local tokenizer, but a route may still mix upstreams and local models: each tier
reads the prompt's text with its own tokenizer (gateway/generation.py Prompt), and a prompt sent
as token ids is refused by a route whose tiers do not share one.

NOTE: the httpx client lives on an event loop of this client's own thread, so its keep-alive
connections outlive any caller's loop, and the protocol's synchronous `close()` can close them
after the server's loop has ended.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

import httpx
import msgspec

from gateway.config import UpstreamSource
from gateway.engine_client import (AdapterInfo, AdapterRef, AdapterRejected, EngineStats,
                                   GenerationChunk, OptionNotServed, RequestRejected,
                                   SamplingOptions, TokenLogprob, UpstreamFailure,
                                   UpstreamUnavailable, out_of_open_files)
from gateway.protocol import CHAT_ROLES
from gateway.sse import sse_lines
from gateway.text_codec import name_bytes

logger = logging.getLogger(__name__)

TEXT_PIECE_ID = 256  # a piece of text the upstream sent without its tokens (ids below are bytes)
FIRST_TOKEN_ID = 257  # the first id of the upstream's tokens, in the order they were first seen
ROLE_ID, CONTENT_ID, NAME_ID = -1, -2, -3  # the marks of a chat's fields (no text has them)
_FIELD_MARKS = {"role": ROLE_ID, "content": CONTENT_ID, "name": NAME_ID}
_FIELD_KEYS = {mark: key for key, mark in _FIELD_MARKS.items()}
_API_PATHS = {"completions": "/completions", "chat": "/chat/completions"}
# The special tokens an upstream may add to a prompt it reads as text (a BOS, and some add more),
# which the prompt's bytes do not count.
_SPECIAL_TOKENS_ROOM = 8
# What a chat template may add to each message of a chat beyond its role's and content's bytes:
# the tokens around each message, and those it adds once (a BOS, a default system message, the
# assistant's opening), which in a chat of one message come to some 30 tokens in common templates.
_CHAT_TEMPLATE_ROOM = 32
_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}  # others read as "stop"
_REJECTED_STATUSES = (400, 413, 422)  # the request itself was wrong: the caller can fix it
_UNAVAILABLE_STATUSES = (429, 503, 504)  # overloaded, or too slow behind its own proxy: retry later
_MAX_IDLE_CONNECTIONS = 32
_MAX_MESSAGE_CHARS = 500
_CLOSE_TIMEOUT_S = 10.0


class _UpstreamError(Exception):
    """What went wrong with an upstream request, as the operator needs it (the origin, the status,
    the upstream's message, what to fix): for the log only; tenants get an UpstreamFailure."""

    def __init__(self, detail: str, *, is_unavailable: bool = False):
        super().__init__(detail)
        self.is_unavailable = is_unavailable


class _ErrorBody(msgspec.Struct):
    message: str = ""


class _TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None | msgspec.UnsetType = msgspec.UNSET  # as _ChatTokenLogprob's


class _ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    top_logprobs: list[_TopLogprob] | None = None
    # null for a token that adds no text (a special token, as the EOS ending a reply); absent
    # where the upstream does not say
    bytes: list[int] | None | msgspec.UnsetType = msgspec.UNSET


class _Logprobs(msgspec.Struct):
    """A choice's logprobs: the completions API's parallel lists, or the chat API's `content`."""

    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    content: list[_ChatTokenLogprob] | None = None

    def entries(self) -> list[_Entry] | None:
        """Each token's entry; None if the lists differ in length."""
        if self.content is not None:
            return [_Entry(e.token, e.logprob, [_textless(t.token, t.logprob, t.bytes)
                                                for t in e.top_logprobs or ()], e.bytes is None)
                    for e in self.content]
        tops = self.top_logprobs or [None] * len(self.tokens)
        if not len(self.tokens) == len(self.token_logprobs) == len(tops):
            return None
        return [_Entry(token, logprob, [(t, lp, None) for t, lp in (top or {}).items()], False)
                for token, logprob, top in zip(self.tokens, self.token_logprobs, tops)]


def _textless(token: str, logprob: float, token_bytes: list[int] | None | msgspec.UnsetType
              ) -> tuple[str, float, bool | None]:
    """A top alternative, and whether it adds no text (its bytes null; None: not said)."""
    return token, logprob, None if token_bytes is msgspec.UNSET else token_bytes is None


class _Entry(NamedTuple):
    token: str
    logprob: float
    # The top alternatives: each with whether the upstream said it adds no text (None: not said)
    top: list[tuple[str, float, bool | None]]
    is_textless: bool  # the upstream said it adds no text (the completions API never says)


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    """A choice of a stream's event: a piece of text (`text`, or the chat API's `delta`)."""

    text: str = ""
    delta: _Delta | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None

    @property
    def piece(self) -> str:
        return (self.delta.content or "") if self.delta is not None else self.text


class _PromptTokensDetails(msgspec.Struct):
    cached_tokens: int | None = 0


class _Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    prompt_tokens_details: _PromptTokensDetails | None = None


class _Event(msgspec.Struct):
    """One `data:` event of an upstream's stream, or an error body (OpenAI's nested shape, or
    vLLM's older flat one with `message`)."""

    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: _ErrorBody | str | None = None
    message: str | None = None

    def error_message(self) -> str | None:
        if isinstance(self.error, _ErrorBody):
            return self.error.message
        return self.error if self.error is not None else self.message


_decode_event = msgspec.json.Decoder(_Event).decode


@dataclass
class _Counts:
    """Token counts of one answer: the upstream's usage once it arrives (with the end of the
    answer), until then an estimate of the prompt's tokens (_PromptRatio) and the output tokens
    seen. An answer left before its end (a cascade's judged tier, a client that leaves, a failure
    midway) is billed with those."""

    estimated_prompt_tokens: int
    num_tokens_seen: int = 0
    usage: _Usage | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.usage.prompt_tokens if self.usage is not None else self.estimated_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.usage.completion_tokens if self.usage is not None else self.num_tokens_seen

    @property
    def num_cached_tokens(self) -> int:
        details = self.usage and self.usage.prompt_tokens_details
        return (details.cached_tokens or 0) if details else 0


class _PromptRatio:
    """The upstream's prompt tokens as `per_byte` * bytes + `per_message` * messages, fitted by
    least squares to the usage of the answers it finished.

    The upstream counts a prompt only in the usage it sends after the answer ends, and its
    tokenizer is unknown here, so an answer left before then has its prompt estimated from what
    the upstream said of earlier ones (its tokenizer; its template and special tokens, which add
    tokens per message whatever the text: a ratio of tokens to bytes alone, learnt on short
    chats, would bill a long one several times its tokens), or at DEFAULT_BYTES_PER_TOKEN
    (English text under common BPE vocabularies) before it said any. Billing the prompt's bytes
    instead would charge several times its tokens. (The caller caps the estimate at what the
    call held for the prompt.)
    """

    DEFAULT_BYTES_PER_TOKEN = 4

    def __init__(self) -> None:
        # Sums over the answers learnt from: bytes², bytes·messages, messages², bytes·tokens,
        # messages·tokens (the normal equations of the fit).
        self._bb = self._bm = self._mm = self._bt = self._mt = 0.0

    def learn(self, num_prompt_bytes: int, num_messages: int, num_prompt_tokens: int) -> None:
        b, m, t = num_prompt_bytes, num_messages, num_prompt_tokens
        self._bb += b * b
        self._bm += b * m
        self._mm += m * m
        self._bt += b * t
        self._mt += m * t

    def estimate(self, num_prompt_bytes: int, num_messages: int) -> int:
        if self._mm == 0:  # nothing learnt yet (every prompt has a message)
            return -(-num_prompt_bytes // self.DEFAULT_BYTES_PER_TOKEN)
        per_byte, per_message = self._fit()
        return max(1, round(per_byte * num_prompt_bytes + per_message * num_messages))

    def _fit(self) -> tuple[float, float]:
        """(per_byte, per_message), neither negative."""
        determinant = self._bb * self._mm - self._bm * self._bm
        if self._bb > 0 and determinant > 1e-9 * self._bb * self._mm:
            per_byte = (self._bt * self._mm - self._mt * self._bm) / determinant
            per_message = (self._mt * self._bb - self._bt * self._bm) / determinant
            if per_byte >= 0 and per_message >= 0:
                return per_byte, per_message
            if per_byte < 0:  # say, a hidden system prompt far longer than the texts
                return 0.0, self._mt / self._mm
        # The prompts learnt from all had the same bytes per message (one answer, say), or fewer
        # tokens per message than none: tokens per byte alone.
        return (self._bt / self._bb, 0.0) if self._bb > 0 else (0.0, self._mt / self._mm)


class _PromptOverhead:
    """The most tokens an upstream adds to a prompt per message beyond the prompt's ids here (a
    text is one message): its special tokens, and the chat API's template. A call holds that much
    of its tenant's budgets and tpm besides the ids (which count a text's bytes, never fewer than
    its tokens), so that the usage the upstream bills fits what the call held.

    Learnt from the usage of the last `window` answers the upstream finished, as the most any of
    them showed per message: an average would hold too little for chats of few messages, where
    what a template adds once weighs most; and the most of all answers ever would let one answer
    billed far above its text (a hosted API's hidden system prompt for one call) raise every
    later call's hold for good. Before any finished, `default_per_message`.
    NOTE: learnt on the client's loop, read on the gateway's: one int, replaced whole.
    """

    def __init__(self, default_per_message: int, window: int = 64):
        self._default_per_message = default_per_message
        self._recent: collections.deque[int] = collections.deque(maxlen=window)
        self._per_message: int | None = None

    def learn(self, num_prompt_ids: int, num_messages: int, num_prompt_tokens: int) -> None:
        self._recent.append(max(0, -(-(num_prompt_tokens - num_prompt_ids) // num_messages)))
        self._per_message = max(self._recent)

    def estimate(self, num_messages: int) -> int:
        per_message = self._per_message
        return num_messages * (self._default_per_message if per_message is None else per_message)


class UpstreamEngineClient:
    """Serves one model of a remote OpenAI-compatible server; see the module docstring."""

    def __init__(self, name: str, source: UpstreamSource, api_key: str | None = None):
        self._source = source
        self._api_key = api_key
        self._where = f"the upstream of {name!r} ({_origin(source.url)})"  # for the log
        self._public_name = f"the upstream serving {name!r}"  # for tenants: no address
        self._address = _address(source.url)
        self._url = source.url.rstrip("/") + _API_PATHS[source.api]
        self._token_ids: dict[tuple[str, bool], int] = {}  # (name, adds no text): id
        self._textless_ids: set[int] = set()
        self._token_texts: list[str] = []  # NOTE: appended to only on the client's loop
        self._num_in_flight = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._prompt_ratio = _PromptRatio()  # NOTE: used only on the client's loop
        self._prompt_overhead = _PromptOverhead(
            _CHAT_TEMPLATE_ROOM if source.api == "chat" else _SPECIAL_TOKENS_ROOM)
        self._is_closed = False
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # NOTE: no cap on connections: each running request holds one, and the gateway's
        # admission already bounds how many run; a cap would queue them behind the pool timeout.
        self._client = httpx.AsyncClient(
            headers=headers, timeout=source.timeout_s,
            limits=httpx.Limits(max_connections=None,
                                max_keepalive_connections=_MAX_IDLE_CONNECTIONS))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"upstream-{name}",
                                        daemon=True)
        self._thread.start()

    @property
    def max_model_len(self) -> int:
        return self._source.max_model_len

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Byte ids: the UTF-8 bytes of `text`, only meaningful to this client (the upstream
        tokenizes the text itself, adding its own special tokens); a RenderedChat's marked
        fields (see the module docstring)."""
        return _chat_ids(text.messages) if isinstance(text, RenderedChat) else list(text.encode())

    @property
    def tokenizer_key(self) -> str:
        return "utf-8 bytes"  # as `tokenize` reads a text, whatever the upstream's model

    def max_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        """The ids, and what the upstream may add to each message of the prompt (_PromptOverhead)."""
        return len(prompt_token_ids) + self._prompt_overhead.estimate(_num_messages(prompt_token_ids))

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        """The messages whole for the chat API; None for the completions API, which cannot
        reach the upstream's template (the gateway's transcript is sent)."""
        return RenderedChat(messages) if self._source.api == "chat" else None

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        # Only byte ids have text: the others are the names of tokens an upstream answered with.
        return bytes(t for t in token_ids if 0 <= t < TEXT_PIECE_ID).decode(errors="replace")

    def token_text(self, token_id: int) -> str:
        if 0 <= token_id < TEXT_PIECE_ID:
            return bytes([token_id]).decode(errors="replace")
        index = token_id - FIRST_TOKEN_ID
        return self._token_texts[index] if 0 <= index < len(self._token_texts) else ""

    def text_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self._textless_ids else name_bytes(self.token_text(token_id))

    @property
    def supports_adapters(self) -> bool:
        return False

    @property
    def why_no_adapters(self) -> str:
        # Its API runs models of its own: no adapter of this gateway's reaches it.
        return ("is served by an upstream API, which runs none of this gateway's adapters: upload "
                "the adapter for a base model this server runs itself")

    @property
    def max_adapter_rank(self) -> int:
        return 0

    @property
    def counts_text_bytes(self) -> bool:
        return True

    def check_options(self, options: SamplingOptions) -> None:
        if options.prompt_logprobs is not None:  # the APIs have no way to ask for them
            raise OptionNotServed(f"{self._public_name} returns no logprobs of the prompt through "
                                  "this gateway; leave out echo with logprobs, or call a local "
                                  "model", "prompt_logprobs")

    async def check_adapter(self, folder: str) -> AdapterInfo:
        raise AdapterRejected("this model is served by an upstream server, which takes no "
                              "adapters from this gateway; upload the adapter for a local model")

    async def generate(self, prompt_token_ids: list[int], options: SamplingOptions, *,
                       request_id: str, tenant: str | None = None,
                       adapter: AdapterRef | None = None) -> AsyncIterator[GenerationChunk]:
        if adapter is not None:
            raise RequestRejected(f"{self._public_name} serves no adapters from this gateway")
        self.check_options(options)
        body = self._request_body(prompt_token_ids, options)
        if self._is_closed:
            raise UpstreamUnavailable(f"{self._public_name} is unavailable: the gateway has closed "
                                      "its connections to it")
        caller = asyncio.get_running_loop()
        chunks: asyncio.Queue[GenerationChunk | Exception | None] = asyncio.Queue()
        relay = asyncio.run_coroutine_threadsafe(
            self._relay(body, request_id, prompt_token_ids, options.logprobs is not None,
                        functools.partial(caller.call_soon_threadsafe, chunks.put_nowait)),
            self._loop)
        try:
            while (item := await chunks.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            relay.cancel()  # closes the upstream request when this stream is left early

    async def ensure_available(self, adapter: AdapterRef | None = None) -> None:
        """Always: only a request finds out whether the upstream answers (it runs no adapter)."""

    def stats(self) -> EngineStats:
        """Requests in flight as running, and the tokens counted; the rest is the upstream's."""
        return EngineStats(num_running=self._num_in_flight, num_waiting=0, kv_blocks_total=0,
                           kv_blocks_used=0, prefix_cache_hit_rate=0.0,
                           num_prompt_tokens=self._num_prompt_tokens,
                           num_generation_tokens=self._num_generation_tokens, num_preemptions=0)

    def close(self) -> None:
        """Fail the requests still running, close the connections, and stop the client's loop."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(_CLOSE_TIMEOUT_S)
        except TimeoutError:
            logger.warning("%s: its connections did not close within %g s; leaving them",
                           self._where, _CLOSE_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()

    async def _shutdown(self) -> None:
        relays = asyncio.all_tasks() - {asyncio.current_task()}
        for relay in relays:
            relay.cancel()
        await asyncio.gather(*relays, return_exceptions=True)
        await self._client.aclose()

    def _request_body(self, prompt_token_ids: list[int], options: SamplingOptions) -> bytes:
        body = {"model": self._source.model, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": options.temperature,
                "top_p": options.top_p}
        if (max_tokens := self._upstream_max_tokens(options)) is not None:
            body["max_tokens"] = max_tokens
        # NOTE: logprobs always asked: their tokens are how output tokens are counted
        if self._source.api == "chat":
            body |= {"messages": _messages(prompt_token_ids), "logprobs": True}
            if options.logprobs:
                body["top_logprobs"] = options.logprobs
        else:
            body |= {"prompt": _prompt_text(prompt_token_ids), "logprobs": options.logprobs or 0}
        if options.seed is not None:
            body["seed"] = options.seed
        if options.stop:
            body["stop"] = options.stop
        for name in ("presence_penalty", "frequency_penalty", "logit_bias"):
            if value := getattr(options, name):  # sent only when set, like the extras below
                body[name] = value
        return msgspec.json.encode(body | _vllm_extras(options))

    def _upstream_max_tokens(self, options: SamplingOptions) -> int | None:
        """What to ask the upstream for: the client's max_tokens as it is. But an answer that
        may run to the end of the context (a call that left max_tokens out) cannot be sent as
        it is: the prompt's count here is its bytes, and the upstream adds its special tokens,
        and the chat API its template, so it would refuse the call as too long. The chat API is
        then sent no max_tokens (it fills what its context leaves), the completions API (where
        it defaults to 16) leaves room for the special tokens."""
        if not options.fills_context:
            return options.max_tokens
        if self._source.api == "chat":
            return None
        return max(1, options.max_tokens - _SPECIAL_TOKENS_ROOM)

    async def _relay(self, body: bytes, request_id: str, prompt_token_ids: list[int],
                     with_logprobs: bool, put: Callable[[object], object]) -> None:
        """Run one upstream request on the client's loop, handing each chunk to `put`, then None
        or the error: the caller waits on what `put` delivers, so every outcome must reach it."""
        self._num_in_flight += 1
        try:
            headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
            async with self._client.stream("POST", self._url, content=body,
                                           headers=headers) as response:
                await self._check_status(response)
                async for chunk in self._chunks(sse_lines(response.aiter_bytes()), prompt_token_ids,
                                                with_logprobs):
                    put(chunk)
            put(None)
        except asyncio.CancelledError:  # the caller left, or the gateway is closing
            put(UpstreamFailure(f"{self._public_name}: the request was stopped"))
            raise
        except RequestRejected as error:
            put(error)
        except Exception as error:
            put(self._failure(error, request_id))
        finally:
            self._num_in_flight -= 1

    def _failure(self, error: Exception, request_id: str) -> UpstreamFailure:
        """What the caller gets for `error`: a failure that names only the served model, since
        tenants must not learn the upstream's address, its own words nor how the operator set it
        up. The detail goes to the log for the operator."""
        detail, is_unavailable = self._detail(error)
        logger.warning("request %s: %s", request_id, detail)
        if is_unavailable:
            return UpstreamUnavailable(f"{self._public_name} is unavailable or did not answer in "
                                       "time; try again later")
        return UpstreamFailure(f"{self._public_name} failed on this request (the gateway's "
                               "operator can see why in its log); try again later")

    def _detail(self, error: Exception) -> tuple[str, bool]:
        """What went wrong, for the log, and whether the upstream was only unavailable."""
        if isinstance(error, _UpstreamError):
            return str(error), error.is_unavailable
        if isinstance(error, httpx.TimeoutException):
            return (f"{self._where} timed out: {type(error).__name__} after "
                    f"{self._source.timeout_s:g} s", True)
        detail = f"{self._where} failed: {type(error).__name__}: {self._scrub(str(error))}"
        if out_of_open_files(error):  # else it reads as the upstream refusing to connect
            detail += (" (this gateway is out of open files: raise its open-files limit, "
                       "ulimit -n, or run more gateways)")
        return detail, isinstance(error, httpx.ConnectError)

    async def _check_status(self, response: httpx.Response) -> None:
        if response.is_success:
            return
        status, message = response.status_code, self._scrub(_error_message(await response.aread()))
        if status in _REJECTED_STATUSES:
            raise RequestRejected(f"{self._public_name} refused the request: "
                                  f"{self._without_address(message)}")
        if status in (401, 403):
            env = self._source.api_key_env
            hint = (f"check the key in ${env}" if env else
                    "name the environment variable that holds its key with api_key_env")
            raise _UpstreamError(f"{self._where} refused the gateway's credentials ({status}: "
                                 f"{message}); {hint}")
        raise _UpstreamError(f"{self._where} answered {status}: {message}",
                             is_unavailable=status in _UNAVAILABLE_STATUSES)

    async def _chunks(self, lines: AsyncIterator[str], prompt_token_ids: list[int],
                      with_logprobs: bool) -> AsyncIterator[GenerationChunk]:
        """The answer's chunks; the finished one is held back until the stream ends, since the
        upstream sends its usage after it."""
        num_prompt_bytes, num_messages = len(prompt_token_ids), _num_messages(prompt_token_ids)
        counts = _Counts(min(self._prompt_ratio.estimate(num_prompt_bytes, num_messages),
                             self.max_prompt_tokens(prompt_token_ids)))
        ending: _Choice | None = None
        async for event in self._events(lines):
            for choice in event.choices:
                if choice.finish_reason is not None:
                    ending = choice
                elif (chunk := self._chunk(choice, counts, with_logprobs, None)).token_ids:
                    yield chunk  # not an empty piece, like the chat API's opening role delta
            if event.usage is not None:
                counts.usage = event.usage
        if ending is None:
            raise _UpstreamError(f"{self._where} ended its stream before the answer finished")
        if counts.usage is not None:  # once an answer: some upstreams send usage with each event
            self._prompt_ratio.learn(num_prompt_bytes, num_messages, counts.usage.prompt_tokens)
            self._prompt_overhead.learn(num_prompt_bytes, num_messages, counts.usage.prompt_tokens)
        self._num_prompt_tokens += counts.num_prompt_tokens
        yield self._chunk(ending, counts, with_logprobs,
                          _FINISH_REASONS.get(ending.finish_reason, "stop"))

    async def _events(self, lines: AsyncIterator[str]) -> AsyncIterator[_Event]:
        async for line in lines:
            if not line.startswith("data:"):
                continue  # the blank line after each event, comments, event names
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            try:
                event = _decode_event(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise _UpstreamError(f"{self._where} sent a malformed stream: {error}") from None
            message = event.error_message()
            if message is not None:
                raise _UpstreamError(f"{self._where} failed midway: {self._scrub(message)}")
            yield event

    def _chunk(self, choice: _Choice, counts: _Counts, with_logprobs: bool,
               finish_reason: str | None) -> GenerationChunk:
        entries = choice.logprobs.entries() if choice.logprobs is not None else []
        if entries is None:
            raise _UpstreamError(f"{self._where} sent logprobs whose lists differ in length")
        text = choice.piece
        token_ids = [self._token_id(e.token, e.is_textless) for e in entries] or \
            ([TEXT_PIECE_ID] if text else [])
        self._num_generation_tokens += len(token_ids)
        counts.num_tokens_seen += len(token_ids)
        logprobs = [TokenLogprob(token_id, e.logprob, self._best_first(e.top, e.token, token_id))
                    for token_id, e in zip(token_ids, entries)] \
            if with_logprobs else []
        return GenerationChunk(
            token_ids=token_ids, text=text, logprobs=logprobs,
            finished=finish_reason is not None, finish_reason=finish_reason,
            num_prompt_tokens=counts.num_prompt_tokens, num_output_tokens=counts.num_output_tokens,
            num_cached_tokens=counts.num_cached_tokens)

    def _best_first(self, top: list[tuple[str, float, bool | None]], chosen: str, chosen_id: int
                    ) -> list[tuple[int, float]]:
        """The alternatives by id, best first; the chosen token among them has its id (where
        the upstream does not say whether an alternative adds text, one named as the chosen
        token is that token)."""
        ranked = sorted(top, key=lambda item: item[1], reverse=True)
        return [(chosen_id if token == chosen and is_textless is None
                 else self._token_id(token, bool(is_textless)), logprob)
                for token, logprob, is_textless in ranked]

    def _token_id(self, token: str, is_textless: bool = False) -> int:
        """The id of a token of the upstream's: one for its text, another for the same name
        standing for no text (a special token "</s>" against the text "</s>")."""
        token_id = self._token_ids.get((token, is_textless))
        if token_id is None:
            token_id = FIRST_TOKEN_ID + len(self._token_texts)
            self._token_texts.append(token)
            self._token_ids[(token, is_textless)] = token_id
            if is_textless:
                self._textless_ids.add(token_id)
        return token_id

    def _scrub(self, message: str) -> str:
        """`message` without the API key, should the upstream echo it."""
        return message.replace(self._api_key, "<api key>") if self._api_key else message

    def _without_address(self, message: str) -> str:
        """`message` as a tenant may read it: without the upstream's host, should it name itself."""
        return message.replace(self._address, "<upstream>") if self._address else message


def open_upstreams(sources: Mapping[str, UpstreamSource],
                   environ: Mapping[str, str]) -> dict[str, UpstreamEngineClient]:
    """One client per served name, its API key read from `environ`; ValueError naming the
    variable if one is not set (and then no client is opened)."""
    keys = {name: source.api_key(environ) for name, source in sources.items()}
    return {name: UpstreamEngineClient(name, source, keys[name])
            for name, source in sources.items()}


class RenderedChat(str):
    """A chat as the chat API reads it (a chat upstream's `render_chat`): its messages, kept whole
    for `tokenize`; the text itself is their JSON, for logs only.

    NOTE: relies on the rendering reaching `tokenize` as this very object (gateway/chat.py and
    generation.py Prompt pass it on untouched); a plain str copy of it would be read as a text,
    that is sent as one user message: a chat may fall back to text, never a text pass for a chat.
    """

    messages: list[dict[str, str]]

    def __new__(cls, messages: list[dict[str, str]]) -> RenderedChat:
        rendered = super().__new__(cls, msgspec.json.encode(messages).decode())
        rendered.messages = messages
        return rendered


def _prompt_text(token_ids: list[int]) -> str:
    try:
        return bytes(token_ids).decode()
    except ValueError:  # an id outside 0-255, or bytes that are not UTF-8
        raise RequestRejected("this model is served by an upstream server, which reads text: "
                              "send the prompt as text (its token ids here are the UTF-8 bytes "
                              "of the text)", "prompt") from None


def _chat_ids(messages: list[dict[str, str]]) -> list[int]:
    """A chat's ids: each field of each message as its mark, then its UTF-8 bytes."""
    return [token_id for message in messages for key, mark in _FIELD_MARKS.items()
            if key in message for token_id in (mark, *message[key].encode())]


def _num_messages(token_ids: list[int]) -> int:
    """The messages of a prompt: a chat's (marked ids), or 1 for a text."""
    return max(1, token_ids.count(ROLE_ID))


def _messages(token_ids: list[int]) -> list[dict[str, str]]:
    """The chat API's messages of a prompt: a chat's (marked ids), or a text's as one user
    message; RequestRejected for marks out of place."""
    if not token_ids or token_ids[0] != ROLE_ID:
        return [{"role": "user", "content": _prompt_text(token_ids)}]
    starts = [i for i, token_id in enumerate(token_ids) if token_id < 0] + [len(token_ids)]
    messages: list[dict[str, str]] = []
    for start, end in zip(starts, starts[1:]):
        key = _FIELD_KEYS.get(token_ids[start])
        if key == "role":
            messages.append({})
        if key is None or key in messages[-1]:
            raise RequestRejected(f"token id {token_ids[start]} is out of place: send the "
                                  "prompt as text, or the chat to /v1/chat/completions",
                                  param="prompt")
        messages[-1][key] = _prompt_text(token_ids[start + 1:end])
    if any("content" not in message for message in messages):
        raise RequestRejected("a chat's token ids need each message's content: send the chat "
                              "to /v1/chat/completions", param="prompt")
    # NOTE: as /v1/chat/completions reads them: an upstream's refusal of another role named
    # messages[i] to a call that sent a prompt.
    for message in messages:
        if message["role"] not in CHAT_ROLES:
            raise RequestRejected(f"a chat's token ids name the role {message['role']!r}, which is "
                                  f"none of {', '.join(CHAT_ROLES)}", param="prompt")
    return messages


def _vllm_extras(options: SamplingOptions) -> dict[str, object]:
    """vLLM's sampling extras that change the answer; left out at their defaults, since other
    upstreams (OpenAI's) refuse fields they do not know."""
    extras = {"top_k": options.top_k if options.top_k > 0 else None,
              "min_tokens": options.min_tokens or None,
              "repetition_penalty": None if options.repetition_penalty == 1.0
              else options.repetition_penalty,
              "stop_token_ids": options.stop_token_ids or None,
              "include_stop_str_in_output": options.include_stop_str_in_output or None,
              "ignore_eos": options.ignore_eos or None}
    return {key: value for key, value in extras.items() if value is not None}


def _error_message(body: bytes) -> str:
    """The message of an upstream's error body, or the body itself (shortened)."""
    try:
        message = _decode_event(body).error_message()
    except (msgspec.DecodeError, msgspec.ValidationError):
        message = None
    text = message if message is not None else body.decode(errors="replace").strip()
    return text[:_MAX_MESSAGE_CHARS] or "no message"


def _origin(url: str) -> str:
    """scheme://host[:port] of `url`: enough to name the upstream, with no path or credentials."""
    return f"{urlsplit(url).scheme}://{_address(url)}"


def _address(url: str) -> str:
    """host[:port] of `url`, without credentials."""
    return urlsplit(url).netloc.rpartition("@")[2]
