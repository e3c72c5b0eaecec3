"""Incremental detokenization on the demo byte-level tokenizer, where characters span tokens."""

import pytest

from engine.demo import build_byte_tokenizer
from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def stream(tokenizer, text: str, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    prompt = tokenizer.encode("prompt: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    for i, token in enumerate(ids):
        detok.add_tokens([token])
        deltas.append(detok.take_delta(finished=i == len(ids) - 1 or detok.stop_reason is not None))
        if detok.stop_reason:
            break
    return deltas, detok


def test_multibyte_characters_are_never_split(tokenizer):
    text = "naïve 日本語 ✓ 🙂!"
    deltas, _ = stream(tokenizer, text)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    # "日" is three byte tokens: nothing is emitted until the third arrives.
    assert deltas.count("") >= 2 * 3 + 3


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    deltas, detok = stream(tokenizer, "hello STOP world", stop=("STOP",))
    assert "".join(deltas) == "hello "
    assert detok.stop_reason == "STOP"
    assert all("S" not in d for d in deltas)


def test_stop_string_can_be_kept_and_earliest_wins(tokenizer):
    deltas, detok = stream(tokenizer, "a, b. c", stop=(".", ","), include_stop_str_in_output=True)
    assert "".join(deltas) == "a,"
    assert detok.stop_reason == ","


def test_invalid_bytes_are_flushed_at_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    detok.add_tokens([ord("o"), ord("k"), 0xE6])  # a lone lead byte of a 3-byte character
    assert detok.take_delta(finished=False) == "ok"
    assert detok.take_delta(finished=True) == "\ufffd"
