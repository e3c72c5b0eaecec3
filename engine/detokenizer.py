"""Incremental detokenization and stop strings, correct across multi-byte characters.

Decoding token by token breaks characters whose UTF-8 bytes span tokens; instead each step decodes
a short window of recent tokens and emits only text that is final (no trailing U+FFFD).
"""

from __future__ import annotations

from typing import Protocol

# Tokens before the read offset that are decoded again for context (merges, leading spaces).
_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; holds text back that a stop string may start."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.num_emitted_chars = 0
        self.stop_reason: str | None = None

    def add_tokens(self, new_token_ids: list[int], check_stop: bool = True) -> None:
        """Decode new tokens into `self.text`; sets `stop_reason` when a stop string appears.

        With `check_stop` False (before min_tokens) their text is never searched for stop strings,
        now or later: only a stop string that ends in text decoded while checking counts."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            if self.stop_reason is None:
                self._decode_next(check_stop)

    def take_delta(self, finished: bool, keep_partial: bool = True) -> str:
        """Text not yet returned. Unless finished, the last characters that could still grow into a
        stop string stay back. Once finished, bytes at the end that never formed a character are
        shown as U+FFFD if `keep_partial`, else dropped: the output ended on a stop token that is
        left out of the text, maybe the very byte that would have finished them (as vLLM)."""
        if finished and self.stop_reason is None and keep_partial:
            self._flush()
        end = len(self.text) if finished or self.stop_reason else len(self.text) - self.holdback
        if end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    def _decode_next(self, check_stop: bool) -> None:
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the bytes that finish it
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        num_old_chars = len(self.text)
        self.text += new_text
        if check_stop:
            self._check_stop(num_old_chars)

    def _flush(self) -> None:
        """At the end, bytes that never formed a character are shown as U+FFFD."""
        if self.read_offset < len(self.token_ids):
            decode = self.tokenizer.decode
            prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
            full = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)
            self.text += full[len(prefix):]
            self.read_offset = len(self.token_ids)

    def _check_stop(self, num_old_chars: int) -> None:
        """Find the earliest stop string that ends in the text after `num_old_chars`.

        NOTE: it starts at most `holdback` characters back, which take_delta has not emitted yet,
        so cutting the text there never takes back streamed text."""
        found = [(i, stop) for stop in self.stop
                 if (i := self.text.find(stop, max(0, num_old_chars - len(stop) + 1))) != -1]
        if found:
            index, stop = min(found)
            self.stop_reason = stop
            self.text = self.text[: index + len(stop) if self.include_stop else index]
