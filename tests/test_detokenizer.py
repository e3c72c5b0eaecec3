"""Incremental detokenization on the demo byte-level tokenizer, where characters span tokens."""

import codecs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.demo import build_byte_tokenizer
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import decoded_bytes_reader, special_token_ids
from tests.helpers import byte_tokenizer_with_token
from tests.test_gateway_logprobs import sentencepiece_bpe


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def stream(tokenizer, text: str, min_tokens: int = 0, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed `text` token by token, checking stop strings from token `min_tokens` on (as the engine)."""
    prompt = tokenizer.encode("prompt: ")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt, **kwargs)
    deltas = []
    for i, token in enumerate(ids):
        detok.add_tokens([token], check_stop=i + 1 >= min_tokens)
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


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_before_min_tokens_stay_and_never_stop_later(tokenizer, include):
    # "." ends token 2 < min_tokens 4; "...." (never there) widens the held-back window to 3 chars.
    deltas, detok = stream(tokenizer, "a.b.c.", min_tokens=4, stop=(".", "...."),
                           include_stop_str_in_output=include)
    assert "".join(deltas) == ("a.b." if include else "a.b")
    assert detok.stop_reason == "."


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_completed_at_min_tokens_is_cut_from_held_back_text(tokenizer, include):
    # "STOP" starts at token 4 (unchecked) and ends at token 7, the first one checked.
    deltas, detok = stream(tokenizer, "ab STOP cd", min_tokens=7, stop=("STOP",),
                           include_stop_str_in_output=include)
    assert "".join(deltas) == ("ab STOP" if include else "ab ")
    assert detok.stop_reason == "STOP"
    assert all("S" not in d for d in deltas[:-1])


def test_invalid_bytes_are_flushed_at_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    detok.add_tokens([ord("o"), ord("k"), 0xE6])  # the lead byte of a 3-byte character
    assert detok.take_delta(finished=False) == "ok"
    detok.add_tokens([0x97], is_last=True)  # its second byte, and the output ends without a third
    assert detok.take_delta(finished=True) == "\ufffd"


def test_bytes_a_left_out_stop_token_would_have_finished_are_dropped(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("x"))
    detok.add_tokens([ord("o"), ord("k"), 0xC3])  # the stop token 0xA9 would make it "é"
    assert detok.take_delta(finished=False) == "ok"
    assert detok.take_delta(finished=True) == ""


@pytest.fixture(scope="module")
def mixed_tokenizer():
    return byte_tokenizer_with_token(b"c\xc3")


MIXED = 258  # "c" then the lead byte of a 2-byte character ("é" with 0xA9)


def test_whole_characters_before_a_partial_one_are_not_held_back(mixed_tokenizer):
    detok = IncrementalDetokenizer(mixed_tokenizer, mixed_tokenizer.encode("x"))
    detok.add_tokens([ord("a"), MIXED])
    assert detok.take_delta(finished=False) == "ac"
    detok.add_tokens([0xA9])
    assert detok.take_delta(finished=False) == "\u00e9"


@pytest.mark.parametrize("stop, text", [("ac", ""), ("c", "a")])
@pytest.mark.parametrize("is_last", [False, True])
def test_a_stop_string_can_end_in_the_characters_before_a_partial_one(mixed_tokenizer, stop, text,
                                                                      is_last):
    detok = IncrementalDetokenizer(mixed_tokenizer, mixed_tokenizer.encode("x"), stop=(stop,))
    detok.add_tokens([ord("a"), MIXED], is_last=is_last)
    assert (detok.stop_reason, detok.take_delta(finished=True)) == (stop, text)


def test_bytes_shown_as_u_fffd_at_the_end_can_end_a_stop_string(mixed_tokenizer):
    def run(is_last: bool) -> tuple[str | None, str]:
        detok = IncrementalDetokenizer(mixed_tokenizer, mixed_tokenizer.encode("x"), stop=("c\ufffd",))
        detok.add_tokens([ord("a"), MIXED], is_last=is_last)
        return detok.stop_reason, detok.take_delta(finished=is_last)

    assert run(is_last=False) == (None, "a")  # the lead byte may still become "é"; "c" held back
    assert run(is_last=True) == ("c\ufffd", "a")


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def any_tokenizer(request):
    return build_byte_tokenizer() if request.param == "byte-level" else sentencepiece_bpe()


def byte_ids(tokenizer, data: bytes) -> list[int]:
    """The tokens of each byte of `data`: the byte-level vocabulary's, or sentencepiece's byte pieces."""
    ids = tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in data])
    return list(data) if tokenizer.unk_token_id in ids else ids


def decoded_after(tokenizer, prompt: list[int], ids: list[int]) -> str:
    """What the tokenizer decodes `ids` to after `prompt`: the text a detokenizer must give."""
    return tokenizer.decode(prompt + ids, skip_special_tokens=True)[len(tokenizer.decode(
        prompt, skip_special_tokens=True)):]


def streamed_text(tokenizer, prompt: list[int], output: list[int], token_bytes,
                  special_token_ids: frozenset[int] = frozenset()) -> str:
    """The text `output` streams to after `prompt`, a token at a time, ending on its length."""
    detok = IncrementalDetokenizer(tokenizer, prompt, token_bytes=token_bytes,
                                   special_token_ids=special_token_ids)
    deltas = []
    for i, token in enumerate(output):
        detok.add_tokens([token], is_last=i == len(output) - 1)
        deltas.append(detok.take_delta(finished=i == len(output) - 1))
    return "".join(deltas)


def test_with_the_token_bytes_characters_are_still_never_split(any_tokenizer):
    reader = decoded_bytes_reader(any_tokenizer)
    text = "Hello naïve ✓ 🙂!"
    deltas, _ = stream(any_tokenizer, text, token_bytes=reader)
    expected = decoded_after(any_tokenizer, any_tokenizer.encode("prompt: "),
                             any_tokenizer.encode(text, add_special_tokens=False))
    assert "".join(deltas) == expected and expected.strip() == text
    assert all("\ufffd" not in d for d in deltas)
    detok = IncrementalDetokenizer(any_tokenizer, any_tokenizer.encode("x"), token_bytes=reader)
    detok.add_tokens(byte_ids(any_tokenizer, "✓".encode()[:2]))
    assert detok.take_delta(finished=False) == ""  # its third byte may still come


@pytest.mark.parametrize("stray", [b"\x80", b"\xff", b"\xe2\x28\xa1"])
def test_with_the_token_bytes_bytes_no_character_starts_with_are_final_at_once(any_tokenizer, stray):
    """No byte that may come could make a character of them: they stream as U+FFFD at once, and a
    stop string may end in it. Without the bytes, any trailing U+FFFD waits for what follows."""
    # NOTE: "Hello" has a piece of its own in sentencepiece_bpe: its byte fallback shows a run of
    # byte pieces that is not UTF-8 as one U+FFFD per byte, letters included.
    prompt = any_tokenizer.encode("x")
    ids = any_tokenizer.encode("Hello", add_special_tokens=False) + byte_ids(any_tokenizer, stray)
    text = decoded_after(any_tokenizer, prompt, ids)
    stop = text[-2:]

    def run(reader) -> tuple[str, str | None]:
        detok = IncrementalDetokenizer(any_tokenizer, prompt, token_bytes=reader)
        detok.add_tokens(ids)
        delta = detok.take_delta(finished=False)
        stopped = IncrementalDetokenizer(any_tokenizer, prompt, stop=(stop,), token_bytes=reader)
        stopped.add_tokens(ids)
        return delta, stopped.stop_reason

    assert run(decoded_bytes_reader(any_tokenizer)) == (text, stop)
    assert run(None) == (text.rstrip("\ufffd"), None)


def test_a_character_the_prompt_ends_partway_into_is_the_outputs_first(any_tokenizer):
    """A prompt of token ids may stop partway into a character that the output finishes: the output
    starts with it whole, never split (its bytes were read past with the prompt's text, and lost)."""
    reader = decoded_bytes_reader(any_tokenizer)
    head = any_tokenizer.encode("x")
    ok = any_tokenizer.encode("ok", add_special_tokens=False)
    detok = IncrementalDetokenizer(any_tokenizer, head + byte_ids(any_tokenizer, b"\xe4\xbd"),
                                   token_bytes=reader)
    deltas = []
    for token in byte_ids(any_tokenizer, b"\xa0") + ok:
        detok.add_tokens([token])
        deltas.append(detok.take_delta(finished=False))
    whole = head + byte_ids(any_tokenizer, "\u4f60".encode())
    assert deltas[0] == "\u4f60" and "".join(deltas[1:]) == decoded_after(any_tokenizer, whole, ok)


@pytest.mark.parametrize("ends_on_stop_token", [True, False])
def test_a_character_the_prompt_ends_partway_into_that_the_output_adds_nothing_to_is_not_shown(
        any_tokenizer, ends_on_stop_token):
    """An answer of only EOS (or of tokens with no text) after a prompt ending partway into a
    character is "", as transformers decodes it: the prompt's bytes were shown as the output's
    U+FFFD. Once the output adds a byte to the character, its end shows it (as any output's)."""
    reader = decoded_bytes_reader(any_tokenizer)
    prompt = any_tokenizer.encode("x") + byte_ids(any_tokenizer, b"\xe4")
    no_text = any_tokenizer.bos_token_id  # a special token: no bytes

    def answer(ids: list[int]) -> str:
        detok = IncrementalDetokenizer(any_tokenizer, prompt, token_bytes=reader)
        if ends_on_stop_token:
            detok.add_tokens(ids)
            detok.end_before(any_tokenizer.eos_token_id)
        else:
            detok.add_tokens(ids, is_last=True)
        return detok.take_delta(finished=True)

    assert answer([no_text] if not ends_on_stop_token else []) == ""
    unfinished = byte_ids(any_tokenizer, b"\xe4\xbd")  # shown as the tokenizer decodes them
    assert answer(unfinished[1:]) == any_tokenizer.decode(unfinished) != ""
    assert decoded_after(any_tokenizer, prompt, [any_tokenizer.eos_token_id]) == ""


def test_an_answer_after_a_prompt_ending_in_byte_pieces_is_not_read_with_part_of_a_character(
        any_tokenizer):
    """The tokens decoded for context before the answer started partway into the prompt's last
    characters: a byte-fallback decoder shows a run of byte pieces that is not UTF-8 as one U+FFFD
    per byte, the answer's whole characters included ("Hello🙂🙂" answered "����🙂")."""
    reader = decoded_bytes_reader(any_tokenizer)
    prompt = any_tokenizer.encode("Hello") + byte_ids(any_tokenizer, "🙂🙂".encode())
    answer = byte_ids(any_tokenizer, "🙂🙂".encode())
    assert streamed_text(any_tokenizer, prompt, answer, reader) == \
        decoded_after(any_tokenizer, prompt, answer) == "🙂🙂"


@pytest.mark.parametrize("between", [0, 3], ids=["", "special tokens between"])
def test_a_character_the_prompt_ends_partway_into_is_the_outputs_after_other_byte_pieces(
        any_tokenizer, between):
    """The prompt's last tokens, read again for the character it ends partway into, started
    partway into a character before it: a byte-fallback decoder showed them all as one U+FFFD per
    byte ("Hello 你好" and 3 of 🙂's bytes, answered the 4th, gave "����"), or the answer lost
    characters (with special tokens between, it gave "", or " ok" for "✓ ok")."""
    reader = decoded_bytes_reader(any_tokenizer)
    head = (any_tokenizer.encode("Hello") + byte_ids(any_tokenizer, "你好".encode())
            + [any_tokenizer.eos_token_id] * between)
    character = byte_ids(any_tokenizer, ("🙂" if between == 0 else "✓").encode())
    ok = any_tokenizer.encode(" ok", add_special_tokens=False)
    cut = 3 if between == 0 else 1
    shown = decoded_after(any_tokenizer, head, character + ok)
    assert shown.startswith("🙂" if between == 0 else "✓") and shown.endswith("ok")
    assert streamed_text(any_tokenizer, head + character[:cut], character[cut:] + ok, reader) == shown
    assert streamed_text(any_tokenizer, head + character[:cut], character[cut:], reader) == shown[:1]


@settings(max_examples=150, deadline=None)
@given(before=st.lists(st.sampled_from(["a", "é", "你", "🙂", None]), max_size=6),
       character=st.sampled_from(["é", "✓", "🙂"]), cut=st.integers(1, 3),
       after=st.sampled_from(["", " ok", "你"]))
def test_any_character_a_prompt_ends_partway_into_is_the_outputs_first(
        any_tokenizer, before, character, cut, after):
    """Whatever byte pieces and special tokens (None) come before it in the prompt."""
    reader = decoded_bytes_reader(any_tokenizer)
    head = any_tokenizer.encode("Hello") + [
        any_tokenizer.eos_token_id if c is None else t
        for c in before for t in ([None] if c is None else byte_ids(any_tokenizer, c.encode()))]
    data = character.encode()
    cut = min(cut, len(data) - 1)
    answer = byte_ids(any_tokenizer, data[cut:]) + any_tokenizer.encode(after, add_special_tokens=False)
    prompt = head + byte_ids(any_tokenizer, data[:cut])
    assert streamed_text(any_tokenizer, prompt, answer, reader) == \
        decoded_after(any_tokenizer, head, byte_ids(any_tokenizer, data[:cut]) + answer)


class _CountingDecodes:
    """A tokenizer that counts the tokens it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.num_decoded = tokenizer, 0

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.num_decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("repeated", ["lead byte", "EOS", "EOS, without the token bytes"])
def test_output_that_shows_no_new_character_is_decoded_in_a_window_that_does_not_grow(
        any_tokenizer, repeated):
    """Bytes that never make a character, each starting one anew (as a logit_bias can force), or
    tokens of no text (EOS under ignore_eos): the tokens decoded at each were all those since the
    last character, so 8000 such tokens took 141 s on the engine's thread, slowing every call.
    Special tokens are known to add no text where the token bytes are not (some tokenizers')."""
    reader = None if repeated.endswith("without the token bytes") else decoded_bytes_reader(any_tokenizer)
    token = byte_ids(any_tokenizer, b"\xe2")[0] if repeated == "lead byte" else any_tokenizer.eos_token_id
    prompt = any_tokenizer.encode("Hello")
    output = [token] * 2000 + any_tokenizer.encode(" ok", add_special_tokens=False)
    counting = _CountingDecodes(any_tokenizer)
    assert streamed_text(counting, prompt, output, reader, special_token_ids(any_tokenizer)) == \
        decoded_after(any_tokenizer, prompt, output)
    assert counting.num_decoded < 100 * len(output)  # all since the last character: ~1000 each


# Bytes that start, continue, break and finish characters of every length, and a letter.
_BYTES = [ord("a"), 0x80, 0xBF, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xED, 0xF0, 0x9F, 0x99, 0x82, 0xFF]


@settings(max_examples=300, deadline=None)
@given(data=st.lists(st.sampled_from(_BYTES), max_size=10), ends_on_stop_token=st.booleans())
def test_byte_by_byte_the_text_is_what_the_tokenizer_decodes(tokenizer, data, ends_on_stop_token):
    """Fed a byte a token, the text streamed is what decoding all of them gives. Ended by a stop
    token (left out of the text: it may be the byte that would have finished a character), less
    only the character its bytes leave unfinished: the U+FFFDs of bytes before it are final (one
    was dropped with it when both ended the text)."""
    prompt = tokenizer.encode("x")
    detok = IncrementalDetokenizer(tokenizer, prompt, token_bytes=decoded_bytes_reader(tokenizer))
    streamed = []
    for i, token in enumerate(data):
        detok.add_tokens([token], is_last=not ends_on_stop_token and i == len(data) - 1)
        streamed.append(detok.take_delta(finished=False))
    streamed.append(detok.take_delta(finished=True))
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(bytes(data), final=False)
    shown = len(data) - len(decoder.getstate()[0]) if ends_on_stop_token else len(data)
    assert "".join(streamed) == decoded_after(tokenizer, prompt, data[:shown])


def test_a_special_added_token_outside_the_special_tokens_map_adds_no_bytes():
    """Added tokens marked special that the special-tokens map leaves out (Llama 3's headers and
    reserved tokens): decoding skips them, and the token bytes counted theirs, so a character
    split around one showed as U+FFFD instead of the character the tokenizer decodes."""
    from transformers import AddedToken

    tokenizer = build_byte_tokenizer()
    tokenizer.add_tokens([AddedToken("<|x|>", special=True)])
    marker = tokenizer.convert_tokens_to_ids("<|x|>")
    assert marker not in tokenizer.all_special_ids
    reader = decoded_bytes_reader(tokenizer)
    assert reader(marker) == b""
    prompt, output = tokenizer.encode("x"), [0xD2, marker, 0x82]  # U+0482 split by the marker
    assert streamed_text(tokenizer, prompt, output, reader) == \
        decoded_after(tokenizer, prompt, output) == "\u0482"


def test_a_token_after_a_prompt_ending_in_special_tokens_keeps_its_leading_space():
    """Decoded with context of the skipped special tokens alone, sentencepiece's decoder took the
    token for the text's start and stripped its space: " Hello" read "Hello"."""
    tokenizer = sentencepiece_bpe()
    reader = decoded_bytes_reader(tokenizer)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    for prompt in (tokenizer.encode("Hi") + [tokenizer.eos_token_id] * 6, [tokenizer.bos_token_id]):
        detok = IncrementalDetokenizer(tokenizer, prompt, token_bytes=reader)
        detok.add_tokens(hello * 2)
        assert detok.take_delta(finished=True) == decoded_after(tokenizer, prompt, hello * 2)
    assert detok.text == "Hello Hello"  # at the text's start, as the tokenizer decodes it
