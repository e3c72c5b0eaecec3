"""Incremental detokenization and stop strings, correct across multi-byte characters.

Decoding token by token breaks characters whose UTF-8 bytes span tokens; instead each step decodes
a short window of recent tokens and emits only text that is final (no trailing U+FFFD that may
still grow into a character).
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Collection
from typing import Protocol

# Tokens before the read offset that are decoded again for context (merges, leading spaces).
_CONTEXT_TOKENS = 5
# The most tokens past the read offset that a character begun but not finished at the end holds
# back; past them, those before it are read (_read_up_to_unfinished_character). Only bytes that
# never make a character (as a logit_bias can force) hold back so many. NOTE: a byte-fallback
# decoder (sentencepiece's) may show such a run, read in parts, with other U+FFFDs than whole.
_MAX_UNREAD_TOKENS = 16
# The prompt's last tokens read for a character its end leaves partway: its bytes are at most 3 of
# 4, in as many tokens, and special tokens between them read as no bytes.
PROMPT_TAIL_TOKENS = 8


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; holds text back that a stop string may start."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False,
                 token_bytes: Callable[[int], bytes] | None = None,
                 special_token_ids: Collection[int] = frozenset()):
        """`token_bytes`: the bytes each token adds to the decoded text, where the tokenizer's
        vocabulary says them (engine.tokenizer.decoded_bytes_reader). With them, a trailing
        U+FFFD is told apart: bytes that may still become a character are held back, bytes that
        never will (no character starts so) are final at once. Without them, every trailing
        U+FFFD is held back until a character follows (or the output ends).
        `special_token_ids`: the tokens decoding skips (engine.tokenizer.special_token_ids),
        which add no text: known without the token bytes too."""
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes
        self.special_token_ids = special_token_ids
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.read_offset = len(self.token_ids)
        self.prefix_offset = self._context_start(self.read_offset)
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        # Characters of the tokens after the read offset already in `text`: those before an
        # incomplete character at the end, which holds the read offset back.
        self.num_unread_chars_taken = 0
        self.num_emitted_chars = 0
        self.stop_reason: str | None = None
        if token_bytes is not None and self._unfinished_character(self.token_ids[-PROMPT_TAIL_TOKENS:]):
            self._start_at_the_prompts_partial_character()

    def _start_at_the_prompts_partial_character(self) -> None:
        """A prompt of token ids may end partway into a character, which the output's first
        tokens may finish: the character is then the output's, shown whole (as vLLM's decode
        stream). Reading past the prompt's whole text would drop it (its bytes decode to a U+FFFD
        in the prompt's text, the whole character in the output's). So the prompt's last tokens
        are read as output is, and the text they give is not output."""
        prompt = self.token_ids
        # NOTE: from a character's first byte: the bytes read before it would show as U+FFFDs
        # (one per byte piece, for a byte-fallback decoder), and the output's text would be
        # taken from where those end.
        start = self._character_start(max(0, len(prompt) - PROMPT_TAIL_TOKENS))
        self.token_ids = prompt[:start]
        self.prefix_offset, self.read_offset = self._context_start(start), start
        self.add_tokens(prompt[start:], check_stop=False)
        self.num_prompt_tokens = len(self.token_ids)  # those of no bytes were left out
        self.text = ""

    def _context_start(self, end: int) -> int:
        """Where the tokens decoded for context before token `end` start: _CONTEXT_TOKENS back, or
        further to the last that shows text, where the token bytes say which do. A decoder may
        strip the leading space of a text's start (sentencepiece's), which context of special
        tokens alone (skipped) would look like: the first token after them lost its space."""
        start = max(0, end - _CONTEXT_TOKENS)
        if self.token_bytes is not None:
            shows_text = next((i for i in range(end - 1, -1, -1) if self.token_bytes(self.token_ids[i])), 0)
            start = min(start, shows_text)
        return self._character_start(start)

    def _character_start(self, index: int) -> int:
        """`index`, or the token before it that starts the character token `index` is partway
        into (where the token bytes say so): a byte-fallback decoder (sentencepiece's) shows a
        run of byte pieces that is not UTF-8 as one U+FFFD per byte, the whole characters after
        the cut included. A character continues for at most 3 bytes."""
        if self.token_bytes is None:
            return index
        for _ in range(3):
            if index == 0 or not _continues_a_character(self.token_bytes(self.token_ids[index])):
                break
            index -= 1
        return index

    def add_tokens(self, new_token_ids: list[int], check_stop: bool = True, is_last: bool = False) -> None:
        """Decode new tokens into `self.text`; sets `stop_reason` when a stop string appears.

        With `check_stop` False (before min_tokens) their text is never searched for stop strings,
        now or later: only a stop string that ends in text decoded while checking counts.
        `is_last`: the output ends with these tokens, so bytes at the end that never formed a
        character are shown as U+FFFD. Without it (the output ended on a stop token that is left
        out of the text: see `end_before`) they are dropped."""
        for i, token_id in enumerate(new_token_ids):
            # NOTE: a token of no bytes (a special token) adds no text, now or to what follows:
            # it is left out of the tokens decoded, which would otherwise grow by each (an answer
            # of EOS tokens under ignore_eos was decoded whole at every one).
            if token_id not in self.special_token_ids and (
                    self.token_bytes is None or self.token_bytes(token_id)):
                self.token_ids.append(token_id)
            if self.stop_reason is None:
                self._decode_next(check_stop, is_last and i == len(new_token_ids) - 1)

    def end_before(self, stop_token_id: int) -> None:
        """The output ended on `stop_token_id`, which is left out of the text. If it has no text
        (EOS, a special token), bytes at the end that never formed a character are shown as
        U+FFFD, as when the output ends on its length; else (maybe the very byte that would
        have finished them, as vLLM) they are dropped."""
        if self.stop_reason is None and not self.tokenizer.decode([stop_token_id],
                                                                   skip_special_tokens=True):
            self._decode_next(check_stop=False, is_last=True)

    def take_delta(self, finished: bool) -> str:
        """Text not yet returned. Unless finished, the last characters that could still grow into a
        stop string stay back."""
        end = len(self.text) if finished or self.stop_reason else len(self.text) - self.holdback
        if end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    def _decode_next(self, check_stop: bool, is_last: bool) -> None:
        # Bytes of the prompt's unfinished character that the output added none to are not the
        # output's: an answer of only EOS is "", not U+FFFD (as transformers decodes the output).
        is_last = is_last and self._output_adds_bytes()
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        unread_text = decode(self.token_ids[self.prefix_offset:], skip_special_tokens=True)[len(prefix):]
        unfinished = b"" if is_last or not unread_text.endswith("\ufffd") else \
            self._unfinished_character(self.token_ids[self.prefix_offset:])
        is_incomplete = unfinished != b""
        # A trailing U+FFFD that is a character whose bytes may still come: the characters before
        # it are final (and may end a stop string), it is not.
        final_text = self._before_unfinished_character(unread_text, unfinished) if is_incomplete \
            else unread_text
        num_old_chars = len(self.text)
        self.text += final_text[self.num_unread_chars_taken:]
        self.num_unread_chars_taken = max(self.num_unread_chars_taken, len(final_text))
        if unread_text and not is_incomplete:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self.num_unread_chars_taken = 0
        elif unfinished and len(self.token_ids) - self.read_offset > _MAX_UNREAD_TOKENS:
            self._read_up_to_unfinished_character(unfinished, prefix)
        if check_stop and len(self.text) > num_old_chars:
            self._check_stop(num_old_chars)

    def _read_up_to_unfinished_character(self, unfinished: bytes, prefix: str) -> None:
        """Move the read offset up to the tokens of the character begun but not finished at the
        end (its bytes `unfinished`), past those before it, whose text the bytes to come cannot
        change (a character's first byte starts anew): output that keeps ending partway into a
        character (bytes that never make one, as a logit_bias can force) was decoded whole at
        every token, ever longer, on the engine's thread. `prefix`: the text of the tokens
        decoded for context, as _decode_next decoded it."""
        start, num_bytes = len(self.token_ids), 0
        while num_bytes < len(unfinished) and start > self.read_offset:
            start -= 1
            num_bytes += len(self.token_bytes(self.token_ids[start]))
        if num_bytes < len(unfinished) or start == self.read_offset:
            return
        read = self.tokenizer.decode(self.token_ids[self.prefix_offset:start],
                                     skip_special_tokens=True)[len(prefix):]
        self.text += read[self.num_unread_chars_taken:]  # NOTE: none, but where a decoder differs
        self.num_unread_chars_taken = max(0, self.num_unread_chars_taken - len(read))
        self.prefix_offset, self.read_offset = self.read_offset, start

    def _output_adds_bytes(self) -> bool:
        """Whether the output's tokens so far add bytes to the text (taken as so without the token
        bytes: then no character of the prompt is read as the output's)."""
        return self.token_bytes is None or any(
            self.token_bytes(t) for t in self.token_ids[self.num_prompt_tokens:])

    def _unfinished_character(self, token_ids: list[int]) -> bytes | None:
        """The bytes that `token_ids` end in of a character begun but not finished (which is what
        tokens decoded to a trailing U+FFFD may end in): b"" when none, None when not known (no
        token bytes)."""
        if self.token_bytes is None:
            return None
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(b"".join(self.token_bytes(t) for t in token_ids), final=False)
        return decoder.getstate()[0]  # the bytes it holds for the rest of a character

    def _before_unfinished_character(self, unread_text: str, unfinished: bytes | None) -> str:
        """`unread_text` less the U+FFFDs that its `unfinished` character (see above) decodes to
        for now. U+FFFDs before those, of bytes no character can be made of, are final."""
        num_trailing = len(unread_text) - len(unread_text.rstrip("\ufffd"))
        unread_bytes = b"" if unfinished is None else \
            b"".join(self.token_bytes(t) for t in self.token_ids[self.read_offset:])
        if unfinished is None or len(unfinished) > len(unread_bytes):
            return unread_text[:len(unread_text) - num_trailing]
        before = unread_bytes[:len(unread_bytes) - len(unfinished)].decode("utf-8", "replace")
        num_final = len(before) - len(before.rstrip("\ufffd"))
        # NOTE: a decoder may show a U+FFFD per byte where Python shows one per broken character
        # (sentencepiece's byte fallback, for a run of byte pieces that is not UTF-8 as a whole,
        # whose characters the unfinished one may still make whole): then none is final.
        num_unfinished = num_trailing - num_final if num_trailing > num_final else num_trailing
        return unread_text[:len(unread_text) - num_unfinished]

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


def _continues_a_character(token_bytes: bytes) -> bool:
    """Whether bytes start with a UTF-8 continuation byte (10xxxxxx): the middle of a character."""
    return bool(token_bytes) and 0x80 <= token_bytes[0] < 0xC0
