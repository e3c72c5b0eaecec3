"""The OpenAI API's request and response bodies as msgspec Structs.

Requests ignore unknown fields (as OpenAI does); constraints are declared with `Meta`, so a bad
value is refused at decode time with the field's path, which becomes the error's `param`. Every
optional field accepts null, as OpenAI clients send it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

Temperature = Annotated[float, Meta(ge=0, le=2)]
TopP = Annotated[float, Meta(gt=0, le=1)]
TopK = Annotated[int, Meta(ge=-1)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
# Bounded so that a call's token estimate stays a 64-bit integer (what stores keep); far above any
# model's context, which each model checks on its own.
MaxTokens = Annotated[int, Meta(ge=0, le=2**31 - 1)]
PositiveMaxTokens = Annotated[int, Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, Meta(ge=-2**63, le=2**63 - 1)]  # a 64-bit integer, as torch seeds are
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
# A completions call starts one engine request per prompt per choice, all at once: bounded, so
# that one call cannot hold the engine (and the gateway's memory) that every tenant shares.
MAX_PROMPTS = 2048  # prompts in one completions call, as OpenAI allows
MAX_CHOICES_PER_CALL = 2048  # prompts x n
# The gateway tokenizes a call's prompts before it admits the call, in threads that every
# tenant's calls share: a list of prompts is bounded in all (about a million tokens, seconds of
# tokenizing), so that one call cannot hold them for minutes. One prompt alone is bounded by its
# model's context (gateway/text_codec.py).
MAX_PROMPT_LIST_CHARS = 2**22
# A chat's messages are each checked and rendered through the chat template before the call is
# admitted: bounded, as a list of prompts is, so that one call cannot hold the gateway for seconds.
MAX_MESSAGES = 2048
Penalty = Annotated[float, Meta(ge=0.01, le=100)]  # wider ones make float32 logits overflow
OpenAIPenalty = Annotated[float, Meta(ge=-2, le=2)]
LogitBias = Annotated[float, Meta(ge=-100, le=100)]
# The engine checks a request's stop strings and stop token ids, and applies its logit biases, for
# every token of every choice inside the step that every tenant's requests share: bounded, so
# that one call cannot slow that step for all (OpenAI allows 4 stop strings).
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIASES = 1024
StopString = Annotated[str, Meta(max_length=MAX_STOP_CHARS)]
Stop = StopString | Annotated[list[StopString], Meta(max_length=MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[int], Meta(max_length=MAX_STOP_TOKEN_IDS)]
LogitBiases = Annotated[dict[str, LogitBias], Meta(max_length=MAX_LOGIT_BIASES)]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both endpoints share: OpenAI's, then vLLM's extras (top_k onwards)."""

    model: str
    n: NumChoices | None = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: TopK | None = None
    min_tokens: NonNegativeInt | None = None
    ignore_eos: bool | None = None
    repetition_penalty: Penalty | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool | None = None
    return_tokens_as_token_ids: bool | None = False
    """Logprob tokens as "token_id:<id>" instead of text (vLLM's extra; exact for any bytes)."""
    presence_penalty: OpenAIPenalty | None = None
    frequency_penalty: OpenAIPenalty | None = None
    logit_bias: LogitBiases | None = None
    """Token id (a decimal string, as JSON keys are) -> bias added to its logit."""
    # vLLM's extras that constrain what is sampled, which this server does not do: declared to be
    # refused, as a vLLM client relying on them would otherwise get unconstrained text.
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    min_p: Any = None
    use_beam_search: Any = None

    def unsupported_field(self) -> tuple[str, str] | None:
        """(field, why) for the first OpenAI (or vLLM) field set to something this gateway cannot
        honour, if any: better a 400 than a reply that silently ignored it. The shared sampling
        fields are all honoured but vLLM's constraints; each endpoint's body adds its own."""
        for name in _CONSTRAINTS:
            if getattr(self, name) not in (None, [], {}):
                return _unsupported(name)
        if self.min_p not in (None, 0):
            return _unsupported("min_p")
        if self.use_beam_search not in (None, False):
            return _unsupported("use_beam_search")
        return None

    def conflict(self) -> tuple[str, str] | None:
        """(field, why) for a field whose value the others make invalid, as OpenAI refuses it."""
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


_CONSTRAINTS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "allowed_token_ids", "bad_words", "logits_processors")


def _unsupported(field: str) -> tuple[str, str]:
    """(field, why) for a field this server does not support."""
    return field, f"'{field}' is not supported by this server; leave it out"


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or lists of ids."""

    prompt: str | list[str | int | list[int]]
    max_tokens: MaxTokens | None = 16
    """0 only with echo: the prompt alone, scored (with logprobs)."""
    logprobs: NumLogprobs | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: NumChoices | None = None

    def unsupported_field(self) -> tuple[str, str] | None:
        if self.suffix or (self.best_of or 1) > (self.n or 1):
            return _unsupported("suffix" if self.suffix else "best_of")
        return super().unsupported_field()

    def conflict(self) -> tuple[str, str] | None:
        if self.best_of is not None and self.best_of < (self.n or 1):
            return "best_of", f"best_of must be at least n ({self.n}), got {self.best_of}"
        return super().conflict()


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


CHAT_ROLES = ("system", "developer", "user", "assistant")  # the roles a chat's messages may have
_TOOL_ROLES = ("tool", "function")  # the results of tool and function calls


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A chat with tool or function calls (which this server never makes), refused rather than
    # read without them: an assistant turn's calls, and the id of the call a result answers.
    tool_calls: list[dict] | None = None
    function_call: dict | None = None
    tool_call_id: str | None = None

    def unsupported_field(self) -> str | None:
        """The field that holds a tool or function call, or its result, if any ("role" for a
        message of a call's result)."""
        for name in ("tool_calls", "function_call", "tool_call_id"):
            if getattr(self, name):
                return name
        return "role" if self.role in _TOOL_ROLES else None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions. `max_completion_tokens` wins over the older `max_tokens`."""

    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: PositiveMaxTokens | None = None
    max_completion_tokens: PositiveMaxTokens | None = None
    logprobs: bool | None = False
    top_logprobs: NumLogprobs | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None  # tools' predecessor
    function_call: str | dict | None = None
    response_format: dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    # vLLM's extras that change how the messages are rendered: refused unless left as they are.
    chat_template: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None

    def unsupported_field(self) -> tuple[str, str] | None:
        for name in ("tools", "functions", "audio"):
            if getattr(self, name):
                return _unsupported(name)
        if self.function_call not in (None, "none"):
            return _unsupported("function_call")
        if self.tool_choice not in (None, "none"):  # no tools are ever called
            return _unsupported("tool_choice")
        if any(modality != "text" for modality in self.modalities or ()):
            return _unsupported("modalities")
        if self.response_format and self.response_format.get("type", "text") != "text":
            return _unsupported("response_format")
        for name, default in (("chat_template", None), ("chat_template_kwargs", None),
                              ("add_generation_prompt", True), ("continue_final_message", False)):
            if getattr(self, name) not in (None, default, {}):
                return _unsupported(name)
        for i, message in enumerate(self.messages):
            if (name := message.unsupported_field()) is not None:
                held = f"the role {message.role!r}" if name == "role" else f"'{name}'"
                return (f"messages[{i}].{name}",
                        f"messages[{i}] has {held}, but this server calls no tools or functions, "
                        "so a chat cannot hold their calls or results; leave them out")
        return super().unsupported_field()


# Responses.


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    cost_usd: float = 0.0  # the whole call's price, tiers a route escalated past included


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct, kw_only=True):
    """A /v1/completions response, and (with `usage` None) each of its stream chunks."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None  # None for a token with no text, like EOS (as OpenAI's spec allows)


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]
    refusal: None = None


class AssistantMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    """A base model (parent None), or a LoRA adapter with its base as parent (as vLLM lists them)."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "switchboard"
    max_model_len: int | None  # None: a route some of whose models have no worker yet
    parent: str | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]
