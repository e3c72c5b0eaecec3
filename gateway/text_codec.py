"""TextCodec: text to token ids and back through a Hugging Face tokenizer, as the EngineClient
protocol asks; shared by the in-process engine client and the remote-worker one."""

from __future__ import annotations

from typing import Any

from gateway.engine_client import RequestRejected


class TextCodec:
    """The tokenizer half of an EngineClient (`tokenizer` None: the model ships none)."""

    def __init__(self, tokenizer: Any | None):
        self._tokenizer = tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise RequestRejected("this model has no tokenizer: send token ids instead of text")
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def render_chat(self, messages: list[dict[str, str]]) -> str | None:
        if self._tokenizer is None or not getattr(self._tokenizer, "chat_template", None):
            return None
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True)
        except Exception as error:  # templates raise jinja errors for chats they do not support
            raise RequestRejected(f"the model's chat template rejected the messages: {error}") from None

    def token_text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id])

    def detokenize(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            return "".join(map(self.token_text, token_ids))
        return self._tokenizer.decode(token_ids)
