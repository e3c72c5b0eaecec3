"""TextCodec: text to token ids and back through a Hugging Face tokenizer, as the EngineClient
protocol asks; shared by the in-process engine client and the remote-worker one.

Logprobs name a token by its text, or, as OpenAI does, a token that is only part of a character
(its bytes are not UTF-8 on their own) by its bytes: "bytes:\\xe2\\x80". `token_name` spells
that name and `name_bytes` reads the bytes back from it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from gateway.engine_client import ChatNotServed, ContextExceeded, RequestRejected

_BYTES_PREFIX = "bytes:"
_ESCAPED_BYTES = re.compile(r"(?:\\x[0-9a-fA-F]{2})+")


def token_name(data: bytes) -> str:
    """How logprobs name a token of these bytes: its text, or "bytes:\\xNN..." when the bytes
    are not whole UTF-8 characters."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return _BYTES_PREFIX + "".join(f"\\x{byte:02x}" for byte in data)


def name_bytes(name: str) -> bytes:
    """The bytes a token's logprob name stands for (see token_name)."""
    if name.startswith(_BYTES_PREFIX) and _ESCAPED_BYTES.fullmatch(name, len(_BYTES_PREFIX)):
        return bytes.fromhex(name[len(_BYTES_PREFIX):].replace("\\x", ""))
    return name.encode()


_MAX_NORMALIZATION_SHRINK = 4


class TextCodec:
    """The tokenizer half of an EngineClient (`tokenizer` None: the model ships none); the other
    half gives `max_model_len`."""

    max_model_len: int

    def __init__(self, tokenizer: Any | None):
        self.use_tokenizer(tokenizer)

    def use_tokenizer(self, tokenizer: Any | None) -> None:
        """Read text with `tokenizer` from now on (a model's workers were upgraded)."""
        # NOTE: the cached_properties' values; a route whose models read alike with the old
        # tokenizer may read differently now.
        self.__dict__.pop("max_token_bytes", None)
        self.__dict__.pop("tokenizer_key", None)
        self._tokenizer = tokenizer
        self._token_bytes = None
        self._special_ids: frozenset[int] = frozenset()
        if tokenizer is not None:
            # NOTE: imported here: the engine's tokenizer module imports transformers (and torch),
            # which a tokenizer object has loaded already and the gateway alone never needs.
            from engine.tokenizer import special_token_ids, token_bytes_reader

            self._special_ids = special_token_ids(tokenizer)  # what the engine's text skips
            self._token_bytes = token_bytes_reader(tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise RequestRejected("this model has no tokenizer: send token ids instead of text")
        # A text whose bytes the longest tokens could not fit in the context even with
        # normalization shrinking it (NFKC, accents stripped: at most 4 bytes into 1, as "𝐀" into
        # "A") is refused before the seconds that tokenizing megabytes takes.
        max_bytes = _MAX_NORMALIZATION_SHRINK * self.max_token_bytes * self.max_model_len
        if 0 < max_bytes < len(text) or 0 < max_bytes < len(text.encode()):  # 0: no worker yet
            raise ContextExceeded(
                f"the prompt is {len(text)} characters long, more than this model's context of "
                f"{self.max_model_len} tokens can hold; shorten the prompt", "prompt")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def max_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        return len(prompt_token_ids)  # the engine runs the ids as they are

    @functools.cached_property
    def tokenizer_key(self) -> str | None:
        """A digest of how the tokenizer reads text (engine.tokenizer.reading_digest)."""
        if self._tokenizer is None:
            return None
        from engine.tokenizer import reading_digest  # NOTE: as in use_tokenizer

        return reading_digest(self._tokenizer)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes of text one token of the vocabulary stands for."""
        return max(map(len, map(self.token_bytes, range(len(self._tokenizer)))), default=1)

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        template = getattr(self._tokenizer, "chat_template", None)
        if not template:
            return None
        if "developer" not in str(template):
            # NOTE: OpenAI's newer name for the system role, which templates written before it
            # do not know: Qwen2's drops such a message silently, Llama 2's refuses the chat.
            messages = [m | {"role": "system"} if m["role"] == "developer" else m for m in messages]
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
        except Exception as error:  # templates raise jinja errors for chats they do not support
            raise ChatNotServed(str(error)) from None

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes, from the tokenizer's vocabulary (a special token's: its text;
        with no tokenizer, its name's: "token_id:<id>")."""
        if self._token_bytes is None:
            return f"token_id:{token_id}".encode()
        return self._token_bytes(token_id)

    def token_text(self, token_id: int) -> str:
        return token_name(self.token_bytes(token_id))

    def text_bytes(self, token_id: int) -> bytes:
        return b"" if token_id in self._special_ids else self.token_bytes(token_id)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The ids' text; ids outside the vocabulary read as nothing. A learned route reads a
        prompt before the engine checks its ids (and refuses those), and the tokenizer raises
        on ids past its own integer type."""
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self._special_ids]
        if self._tokenizer is None:
            return "".join(map(self.token_text, token_ids))
        size = len(self._tokenizer)
        return self._tokenizer.decode([t for t in token_ids if 0 <= t < size])
