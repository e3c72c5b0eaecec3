"""Logprobs as the OpenAI API has them, through the real server over the demo model: tokens that
are only part of a character keep their own bytes (chat `bytes`, "bytes:\\xc3" names), completions'
`text_offset` points into the returned text (whole, streamed, echoed), and an engine failure is an
error, never a finish reason; plus token bytes read from byte-level and sentencepiece vocabularies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from engine.demo import build_byte_tokenizer
from engine.engine import RequestOutput
from engine.tokenizer import byte_to_unicode, load_tokenizer
from gateway.completions import TextOffsets
from gateway.engine_client import EngineFailure, SamplingOptions
from gateway.local_engine import LocalEngineClient
from gateway.text_codec import TextCodec, name_bytes, token_name
from store.blobs import BlobStore
from store.workers import WorkerRegistry
from tests.conftest import DEMO_MODEL, run_server, serve_gateway
from tests.helpers import damage_adapter_files
from tests.redis_server import start_redis_server, stop_redis_server

# Greedy, and steered into "éé...": the bytes C3 A9 over and over, one token each (the penalty
# makes the two take turns).
E_ACUTE = {"logit_bias": {"195": 100, "169": 100}, "frequency_penalty": 2.0, "temperature": 0}
NO_SPECIALS = {"256": -100, "257": -100}  # <s> and </s>, whose text the engine's text leaves out


@pytest.fixture(scope="module")
def key(server) -> str:
    return server.new_tenant("logprobs-tests")


@pytest.fixture(scope="module")
def client(server, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def events(server, key: str, path: str, **body) -> list[dict]:
    """The data of each server-sent event of a streamed request, [DONE] aside."""
    response = httpx.post(server.url + path, json={"model": DEMO_MODEL, "stream": True, **body},
                          headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 200, response.text
    data = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def streamed_logprobs(chunks: list[dict]) -> tuple[str, dict[str, list]]:
    """A streamed completion's text and logprobs, joined over its chunks (one choice)."""
    text, joined = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        choice = chunk["choices"][0]
        text += choice["text"]
        for field, values in joined.items():
            values.extend(choice["logprobs"][field])
    return text, joined


# Token bytes and names.

def byte_level_bpe():
    """A GPT-2 style byte-level BPE: the 256 byte characters, merges into "é", " hi" and "€"'s
    first two bytes, and one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = byte_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    merges = [(chars[0xC3], chars[0xA9]), (chars[0x20], "h"), (chars[0x20] + "h", "i"),
              (chars[0xE2], chars[0x82])]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>")


def sentencepiece_bpe(metaspace: bool = False):
    """A Llama-2 style sentencepiece BPE: "▁" for spaces, "<0xE2>" byte pieces for characters
    without a piece of their own, and a piece for "é"; with `metaspace`, a T5 style decoder
    instead (Metaspace, no byte fallback: it reads "<0xE2>" as that text)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "H", "e", "l", "o", "w", "é", "▁H", "▁He", "ll", "▁Hell", "▁Hello", "▁w"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("▁He", "ll"), ("▁Hell", "o"), ("▁", "w")]
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Metaspace() if metaspace else decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_token_names_spell_bytes_that_are_not_utf8_and_read_back():
    assert token_name("é".encode()) == "é" and token_name(b" hi") == " hi"
    assert token_name(b"\xe2\x82") == "bytes:\\xe2\\x82"
    assert token_name(b"a\xc3") == "bytes:\\x61\\xc3"
    for data in (b"\xe2\x82", b"\xa9", b"a\xc3", "é".encode(), b"bytes:", b"token_id:7", b""):
        assert name_bytes(token_name(data)) == data
    assert name_bytes("bytes:\\xE2") == b"\xe2"  # OpenAI's names, either case
    assert name_bytes("bytes:x") == b"bytes:x" and name_bytes("token_id:7") == b"token_id:7"


def test_token_bytes_of_the_demo_tokenizer_are_its_bytes(demo_engine):
    codec = TextCodec(build_byte_tokenizer())
    for engine in (codec, demo_engine):  # built here, and as saved and loaded by the engine
        assert [engine.token_bytes(i) for i in range(256)] == [bytes([i]) for i in range(256)]
        assert (engine.token_bytes(256), engine.token_bytes(257)) == (b"<s>", b"</s>")
        assert [engine.token_text(i) for i in (72, 32, 195, 169, 256)] == \
            ["H", " ", "bytes:\\xc3", "bytes:\\xa9", "<s>"]


def test_token_bytes_of_a_byte_level_bpe_read_its_byte_characters():
    tokenizer = byte_level_bpe()
    codec = TextCodec(tokenizer)
    ids = tokenizer.encode("é hi €")
    assert [codec.token_bytes(i) for i in ids] == [b"\xc3\xa9", b" hi", b" ", b"\xe2\x82", b"\xac"]
    assert [codec.token_text(i) for i in ids] == ["é", " hi", " ", "bytes:\\xe2\\x82", "bytes:\\xac"]
    assert tokenizer.decode([ids[3]]) == "\ufffd"  # what naming by decoding gave
    special = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert codec.token_text(special) == "<|endoftext|>"
    assert codec.token_bytes(len(tokenizer) + 5) == b""  # a padded embedding's id


@pytest.mark.parametrize("metaspace", [False, True])
def test_token_bytes_of_a_sentencepiece_bpe_read_spaces_and_byte_pieces(metaspace):
    tokenizer = sentencepiece_bpe(metaspace)
    codec = TextCodec(tokenizer)
    ids = tokenizer.encode("Hello wé€")
    assert tokenizer.convert_ids_to_tokens(ids) == \
        ["▁Hello", "▁w", "é", "<0xE2>", "<0x82>", "<0xAC>"]
    pieces = [b"<0xE2>", b"<0x82>", b"<0xAC>"] if metaspace else [b"\xe2", b"\x82", b"\xac"]
    assert [codec.token_bytes(i) for i in ids] == [b" Hello", b" w", "é".encode(), *pieces]
    assert [codec.token_text(i) for i in ids[:3]] == [" Hello", " w", "é"]
    assert codec.token_text(ids[3]) == ("<0xE2>" if metaspace else "bytes:\\xe2")
    assert codec.token_text(tokenizer.convert_tokens_to_ids("<s>")) == "<s>"


def test_text_offsets_count_characters_across_tokens_and_chunks():
    codec = TextCodec(build_byte_tokenizer())
    ids = list("aé€".encode()) + [0xC3, ord("b"), 0xA9, ord("c")]  # then a broken é, a stray byte
    whole = TextOffsets(codec).advance(ids)
    assert whole == [0, 1, 1, 2, 2, 2, 3, 4, 5, 6]
    counter = TextOffsets(codec, start=4)
    assert counter.advance(ids[:2]) + counter.advance(ids[2:5]) + counter.advance(ids[5:]) == \
        [4 + offset for offset in whole]
    assert counter.num_chars == 4 + len(bytes(ids).decode(errors="replace"))


# Bytes that begin, continue or break characters (0xED 0xA0..0xBF would begin a UTF-16
# surrogate, which no byte finishes), and plain ASCII.
BYTES_OF_NOTE = [0x41, 0x09, 0x80, 0x9F, 0xA0, 0xB2, 0xBF, 0xC0, 0xC3, 0xE0, 0xE2, 0xED, 0xEF,
                 0xF0, 0xF4, 0xF5, 0xFF]


@pytest.mark.parametrize("seed", range(20))
def test_text_offsets_index_the_text_the_tokenizer_reads_for_any_bytes(seed):
    """Each token starts at the character of the text its first byte belongs to, however the
    text's broken characters read, and a stream's chunks count alike."""
    codec = TextCodec(build_byte_tokenizer())
    rng = random.Random(seed)
    ids = [rng.choice(BYTES_OF_NOTE) if rng.random() < 0.8 else rng.randrange(256)
           for _ in range(60)]
    text = codec.detokenize(ids)  # what the engine's text shows
    counter = TextOffsets(codec)
    cuts = sorted(rng.sample(range(1, len(ids)), 5))
    offsets = [o for a, b in zip([0, *cuts], [*cuts, len(ids)]) for o in counter.advance(ids[a:b])]
    for k, offset in enumerate(offsets):
        upto = codec.detokenize(ids[:k + 1])  # its last character holds byte k
        assert (offset, text[:offset]) == (len(upto) - 1, upto[:-1]), (k, bytes(ids).hex())
    assert counter.num_chars_at_end == len(text)


def test_text_offsets_after_a_prompt_that_shows_no_text_or_ends_partway_into_a_character():
    """Where the engine's text starts otherwise than its tokens' bytes: without the leading space
    that sentencepiece's decoder strips at the start of a text (after a prompt of special tokens
    alone: offsets were a character too far), or with the character a prompt of token ids ends
    partway into, which the first tokens finish (engine/detokenizer.py: offsets counted its
    bytes' U+FFFDs)."""
    tokenizer = sentencepiece_bpe()
    sentencepiece = TextCodec(tokenizer)
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    bos = [tokenizer.bos_token_id]
    for prompt in (bos, tokenizer.encode("Hi")):
        text = sentencepiece.detokenize(prompt + hello * 3, skip_special_tokens=True)[
            len(sentencepiece.detokenize(prompt, skip_special_tokens=True)):]
        offsets = TextOffsets(sentencepiece, after=prompt).advance(hello * 3)
        assert [text[offset:].lstrip(" ")[:5] for offset in offsets] == ["Hello"] * 3
        assert offsets == ([0, 5, 11] if prompt == bos else [0, 6, 12])
    byte_level = TextCodec(build_byte_tokenizer())
    prompt = [ord("Q"), *"\u4f60".encode()[:2]]
    assert TextOffsets(byte_level, after=prompt).advance([0xA0, ord("o"), ord("k")]) == [0, 1, 2]
    assert TextOffsets(byte_level, start=2, after=prompt).advance([0xA0, ord("o")]) == [2, 3]


def test_a_reply_finishing_the_character_its_token_id_prompt_ends_partway_into(tmp_path):
    """The reply's text starts with the whole character; its tokens' offsets point into it, echoed
    or not, whole or streamed."""
    from engine.config import EngineConfig
    from tests.helpers import save_successor_model

    written = [ord("Q"), *"\u4f60ok".encode(), 257]  # then EOS
    folder = save_successor_model(dict(zip(written, written[1:])), tmp_path / "model")
    engine = LocalEngineClient.load(EngineConfig(model=str(folder), num_kv_blocks=16), show_progress=False)
    kwargs = dict(model=DEMO_MODEL, prompt=[ord("Q"), 0xE4], max_tokens=6, temperature=0, logprobs=1)
    try:
        with serve_gateway({DEMO_MODEL: engine}, tmp_path / "gateway") as server:
            key = server.new_tenant("partway")
            client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
            replies = {echo: client.completions.create(echo=echo, **kwargs).choices[0]
                       for echo in (False, True)}
            streamed = streamed_logprobs(events(server, key, "/v1/completions", **kwargs, echo=True))
    finally:
        engine.close()
    assert replies[False].text == "\u4f60ok"
    assert replies[False].logprobs.text_offset == [0, 0, 1, 2, 3]  # 0xBD, 0xA0, "o", "k", EOS
    assert replies[True].text == "Q\ufffd\u4f60ok"  # the prompt's text shows its lead byte
    assert replies[True].logprobs.text_offset == [0, 1, 2, 2, 3, 4, 5]
    streamed_text, streamed_fields = streamed
    assert (streamed_text, streamed_fields["tokens"], streamed_fields["text_offset"]) == (
        replies[True].text, replies[True].logprobs.tokens, replies[True].logprobs.text_offset)


# Chat: bytes.

def test_chat_bytes_are_each_token_s_own_and_join_into_the_reply(client, server, key):
    chat = client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        logprobs=True, top_logprobs=2, **E_ACUTE)
    choice = chat.choices[0]
    assert choice.message.content == "éé"
    content = choice.logprobs.content
    assert [t.token for t in content] == ["bytes:\\xc3", "bytes:\\xa9"] * 2
    assert [t.bytes for t in content] == [[0xC3], [0xA9]] * 2
    assert b"".join(bytes(t.bytes) for t in content) == choice.message.content.encode()
    for entry in content:
        assert all(bytes(top.bytes) == name_bytes(top.token) for top in entry.top_logprobs)
    streamed = events(server, key, "/v1/chat/completions", messages=[{"role": "user", "content": "Hello"}],
                      max_tokens=4, logprobs=True, top_logprobs=2, **E_ACUTE)
    entries = [e for c in streamed[1:] if c["choices"][0]["logprobs"]
               for e in c["choices"][0]["logprobs"]["content"]]
    assert [(e["token"], e["bytes"]) for e in entries] == [(t.token, t.bytes) for t in content]
    as_ids = client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4,
        logprobs=True, extra_body={"return_tokens_as_token_ids": True}, **E_ACUTE)
    assert [(t.token, t.bytes) for t in as_ids.choices[0].logprobs.content] == \
        [("token_id:195", [0xC3]), ("token_id:169", [0xA9])] * 2


def test_the_eos_that_ends_a_chat_has_null_bytes_so_the_bytes_join_into_the_reply(client):
    # EOS (id 257) is all but certain once min_tokens allows it: the reply is 2 tokens, then EOS.
    chat = client.chat.completions.create(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        logprobs=True, top_logprobs=1, temperature=0,
        extra_body={"min_tokens": 2, "logit_bias": {"257": 100}})
    choice = chat.choices[0]
    assert choice.finish_reason == "stop"
    content = choice.logprobs.content
    assert (len(content), content[-1].token, content[-1].bytes) == (3, "</s>", None)
    assert b"".join(bytes(t.bytes or b"") for t in content) == choice.message.content.encode()


# Completions: top_logprobs and text_offset.

def test_top_logprobs_keep_the_chosen_token_s_logprob_and_every_alternative(client):
    completion = client.completions.create(model=DEMO_MODEL, prompt="Hello", max_tokens=6,
                                           temperature=0, logprobs=5)
    logprobs = completion.choices[0].logprobs
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 5
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the best


@pytest.mark.parametrize("num_top", [0, 1])
def test_top_logprobs_always_hold_the_sampled_token(client, num_top):
    """As OpenAI's reference says (and vLLM does): up to logprobs + 1 entries, the sampled token's
    among them, where a token sampled outside the top ones (or logprobs=0) was once missing."""
    completion = client.completions.create(model=DEMO_MODEL, prompt="Hello", max_tokens=16,
                                           temperature=2.0, seed=3, logprobs=num_top, echo=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs.top_logprobs[0] is None  # the first prompt token has no logprob
    entries = list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))[1:]
    for token, logprob, top in entries:
        assert top[token] == logprob and len(top) <= num_top + 1
    # Sampled hot, some tokens were not the best: those entries hold one more.
    assert any(len(top) == num_top + 1 for _, _, top in entries)


def test_top_logprobs_keep_the_better_of_two_tokens_with_one_name():
    from gateway.completions import _logprobs

    def name(token_id: int) -> str:  # a byte piece and a character's own piece spell alike
        return "A" if token_id in (65, 300) else chr(token_id)

    logprobs = _logprobs(name, [(65, -0.5, [(65, -0.5), (300, -2.0), (66, -3.0)])], [0])
    assert logprobs.top_logprobs == [{"A": -0.5, "B": -3.0}]


def test_text_offsets_point_into_the_text_across_multibyte_characters(client, server, key):
    kwargs = dict(prompt="Hello", max_tokens=6, logprobs=0, **E_ACUTE)
    choice = client.completions.create(model=DEMO_MODEL, **kwargs).choices[0]
    assert choice.text == "ééé"
    assert choice.logprobs.tokens == ["bytes:\\xc3", "bytes:\\xa9"] * 3
    assert choice.logprobs.text_offset == [0, 0, 1, 1, 2, 2]
    text, streamed = streamed_logprobs(events(server, key, "/v1/completions", **kwargs))
    assert (text, streamed["text_offset"]) == ("ééé", [0, 0, 1, 1, 2, 2])


def test_echoed_offsets_count_from_the_prompt_text_not_its_special_tokens(client, server, key):
    prompt = "naïve café €5"  # <s>, then one token a byte: 2 and 3 bytes to some characters
    kwargs = dict(prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    choice = client.completions.create(model=DEMO_MODEL, **kwargs).choices[0]
    assert choice.text.startswith(prompt)
    assert len(choice.logprobs.tokens) == 1 + len(prompt.encode()) + 1
    prompt_offsets = [0] + [len(prompt.encode()[:i].decode(errors="ignore"))
                            for i in range(len(prompt.encode()))]
    assert choice.logprobs.text_offset == prompt_offsets + [len(prompt)]
    assert choice.logprobs.tokens[:4] == ["<s>", "n", "a", "bytes:\\xc3"]
    text, streamed = streamed_logprobs(events(server, key, "/v1/completions", **kwargs))
    assert text == choice.text and streamed["text_offset"] == choice.logprobs.text_offset
    # A prompt sent as token ids echoes as their text, <s> and broken characters included.
    ids = [256, 0xC3, ord("A"), 0xA9, ord("B")]
    choice = client.completions.create(model=DEMO_MODEL, prompt=ids, max_tokens=0, echo=True,
                                       logprobs=0).choices[0]
    assert choice.text == "<s>\ufffdA\ufffdB"
    assert choice.logprobs.text_offset == [0, 3, 4, 5, 6]
    # 0xED 0xB2 never begins a character: two U+FFFD, each byte's own.
    choice = client.completions.create(model=DEMO_MODEL, prompt=[72, 0xED, 0xB2, 9, 65],
                                       max_tokens=0, echo=True, logprobs=0).choices[0]
    assert choice.text == "H\ufffd\ufffd\tA"
    assert choice.logprobs.text_offset == [0, 1, 2, 3, 4]


def test_a_call_carries_at_most_one_full_context_of_logprobs(server, demo_engine):
    """Each choice's logprob entries are its echoed prompt's tokens and its max_tokens (at least
    one, as the context counts them), times logprobs + 1; one call carries at most the model's
    context times 21. More is refused before admission: not billed, nor counted against rpm."""
    name = "logprob-bound-tests"
    key = server.new_tenant(name, rpm=2)
    url, headers = server.url + "/v1/completions", {"Authorization": f"Bearer {key}"}
    max_entries = demo_engine.max_model_len * 21
    prompt = list(range(3, 103))  # 100 ids; echoed with max_tokens 0: 101 tokens x 21 each
    most = max_entries // (101 * 21)
    scoring = dict(model=DEMO_MODEL, echo=True, logprobs=20, max_tokens=0,
                   return_tokens_as_token_ids=True)
    too_many = [dict(scoring, prompt=[prompt] * (most + 1)), dict(scoring, prompt=prompt, n=most + 1)]
    for body in too_many * 2:  # twice the tenant's rpm
        refused = httpx.post(url, json=body, headers=headers, timeout=60)
        assert refused.status_code == 400, refused.text[:500]
        error = refused.json()["error"]
        assert error["param"] == "logprobs", error
        assert f"{(most + 1) * 101 * 21} entries" in error["message"]
        assert f"at most {max_entries}" in error["message"] and "fewer prompts" in error["message"]
    chat = httpx.post(server.url + "/v1/chat/completions", headers=headers, timeout=60, json=dict(
        model=DEMO_MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=1100,
        logprobs=True, top_logprobs=20))
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "top_logprobs", chat.text
    usage = server.admin("GET", f"/admin/tenants/{name}").json()["usage"]
    assert (usage["reserved_tokens"], usage["tokens_in"], usage["requests"]) == (0, 0, 0)

    scored = httpx.post(url, json=dict(scoring, prompt=[prompt] * most), headers=headers, timeout=60)
    assert scored.status_code == 200, scored.text
    choices = scored.json()["choices"]
    assert len(choices) == most
    for choice in choices:
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [f"token_id:{t}" for t in prompt]
        assert logprobs["top_logprobs"][0] is None
        assert all(20 <= len(top) <= 21 for top in logprobs["top_logprobs"][1:])


@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("specials", [NO_SPECIALS, {"256": 6, "257": 6}], ids=["none", "often"])
def test_text_offsets_are_where_each_token_s_text_starts_whole_or_streamed(client, server, key,
                                                                          echo, specials):
    """Sampled text: bytes of the random model, often broken characters, and special tokens
    (with ignore_eos), which add nothing to the text."""
    kwargs = dict(prompt="Offsets à la carte", max_tokens=24, temperature=1.0, seed=11,
                  logprobs=2, echo=echo, logit_bias=specials)
    completion = client.completions.create(model=DEMO_MODEL, **kwargs,
                                           extra_body={"ignore_eos": True})
    choice = completion.choices[0]
    text, logprobs = choice.text, choice.logprobs
    offsets = logprobs.text_offset
    num_prompt = 1 + len(kwargs["prompt"].encode())  # <s>, then a token a byte
    assert len(offsets) == len(logprobs.tokens) == (num_prompt + 24 if echo else 24)
    assert offsets == sorted(offsets) and 0 <= offsets[0] and offsets[-1] <= len(text)
    generated = logprobs.tokens[num_prompt:] if echo else logprobs.tokens
    assert ("<s>" in generated or "</s>" in generated) == (specials is not NO_SPECIALS)
    for token, offset in zip(logprobs.tokens, offsets):
        if not token.startswith("bytes:") and token not in ("<s>", "</s>"):
            assert text[offset:].startswith(token), (token, offset, text)
    streamed_text, streamed = streamed_logprobs(events(
        server, key, "/v1/completions", **kwargs, ignore_eos=True))
    assert streamed_text == text and streamed["tokens"] == logprobs.tokens
    assert streamed["text_offset"] == offsets
    as_ids = client.completions.create(model=DEMO_MODEL, **kwargs, extra_body={
        "ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0].logprobs
    assert as_ids.text_offset == offsets


# Engine failures.

@pytest.fixture(scope="module")
def adapter_files(demo_model_dir, tmp_path_factory) -> dict[str, tuple[str, bytes]]:
    """A small PEFT adapter of the demo model (of its own: no other test loads its digest)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("adapter")
    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(demo_model_dir)
    lora = LoraConfig(r=2, lora_alpha=3, target_modules=["v_proj"])
    get_peft_model(base, lora).save_pretrained(folder)
    return {name: (name, (folder / name).read_bytes())
            for name in ("adapter_config.json", "adapter_model.safetensors")}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    process, url = start_redis_server()
    yield url
    stop_redis_server(process)


def _upload(url: str, key: str, name: str, files: dict) -> str:
    response = httpx.post(url + "/v1/adapters", data={"name": name, "base_model": DEMO_MODEL},
                          files=files, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert response.status_code == 201, response.text
    return response.json()["digest"]


def assert_engine_failure(url: str, key: str, model: str, reason: str, hidden: str,
                          streams: tuple[bool, ...] = (False, True)) -> None:
    """A request the engine fails is a 500 engine_failure saying why, whole or streamed, and
    never naming `hidden` (the server's files)."""
    for stream in streams:
        response = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "stream": stream}, headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "engine_failure")
        assert reason in error["message"] and hidden not in error["message"], error["message"]


def test_an_adapter_that_cannot_load_is_a_500_engine_failure(server, key, adapter_files):
    digest = _upload(server.url, key, "damaged", adapter_files)
    folder = server.app.state.gateway.blobs.path(digest)
    damage_adapter_files(folder)
    assert_engine_failure(server.url, key, "damaged", f"adapter {digest} could not be loaded",
                          hidden=str(folder))


def _worker_urls(redis_url: str) -> list[str]:
    async def read() -> list[str]:
        registry = WorkerRegistry.open(redis_url)
        try:
            return [record.url for record in await registry.workers()]
        finally:
            await registry.close()

    return asyncio.run(read())


@contextlib.contextmanager
def _worker_and_gateway(engine, model_dir: Path, redis_url: str, tmp_path: Path, **store):
    """A worker of `engine` registered in `redis_url`, and a gateway using it (with `store`)."""
    from gateway.worker import Worker, create_worker_app, tokenizer_files

    worker = Worker(model=DEMO_MODEL, engine=engine, url="", blobs=BlobStore(tmp_path / "w"),
                    registry=WorkerRegistry.open(redis_url),
                    tokenizer_files=tokenizer_files(model_dir), heartbeat_s=0.1,
                    lapse_beats=50)  # stays registered while the busy test machine stalls it
    with run_server(create_worker_app(worker), on_bound=lambda url: setattr(worker, "url", url)) as url:
        deadline = time.monotonic() + 10
        while _worker_urls(redis_url) != [url]:
            assert time.monotonic() < deadline, "the worker did not register"
            time.sleep(0.05)
        with serve_gateway({}, tmp_path / "gateway", workers_url=redis_url,
                           load_tokenizer=load_tokenizer, **store) as gateway:
            yield worker, gateway


def _place_damaged_copy(blobs: BlobStore, digest: str, adapter_files: dict) -> Path:
    folder = blobs.root / digest
    folder.mkdir(exist_ok=True)
    for name, (_, data) in adapter_files.items():
        (folder / name).write_bytes(data)
    damage_adapter_files(folder)
    return folder


def test_a_worker_whose_engine_fails_a_request_gives_the_same_500(
        demo_engine, demo_model_dir, adapter_files, redis_url, tmp_path):
    """Its copy and the gateway's both damaged (and no store copy to replace them): the call
    fails as it would on a local engine, naming no path of the worker's."""
    with _worker_and_gateway(demo_engine, demo_model_dir, redis_url, tmp_path) as (worker, gateway):
        key = gateway.new_tenant("acme")
        digest = _upload(gateway.url, key, "damaged", adapter_files)
        folder = _place_damaged_copy(worker.blobs, digest, adapter_files)
        damage_adapter_files(gateway.app.state.gateway.blobs.path(digest))
        assert_engine_failure(gateway.url, key, "damaged", f"adapter {digest} could not be loaded",
                              hidden=str(folder), streams=(False,))
        assert worker.blobs.path(digest) is None  # the failure dropped the damaged copy


def test_a_gateway_copy_no_store_copy_replaces_fails_once_hashed_once(
        demo_engine, demo_model_dir, adapter_files, redis_url, tmp_path, caplog):
    """The worker refuses the gateway's damaged copy, and the store keeps none: the call fails
    saying so, and the copy is hashed (and the failure logged) once, not again for a retry that
    would meet the same damage."""
    with _worker_and_gateway(demo_engine, demo_model_dir, redis_url, tmp_path) as (worker, gateway):
        key = gateway.new_tenant("acme")
        digest = _upload(gateway.url, key, "damaged", adapter_files)
        damage_adapter_files(gateway.app.state.gateway.blobs.path(digest))
        assert_engine_failure(gateway.url, key, "damaged",
                              f"this gateway's copy of the files of adapter {digest} is damaged",
                              hidden=str(tmp_path), streams=(False,))
    kept = [r for r in caplog.records
            if r.name == "store.blobs" and r.getMessage().startswith("kept the damaged copy")]
    assert len(kept) == 1, [r.getMessage() for r in kept]


def test_a_workers_damaged_copy_of_an_adapter_is_replaced_within_the_call(
        demo_engine, demo_model_dir, adapter_files, redis_url, tmp_path):
    """The worker's engine fails on its damaged copy, which the failure drops; the gateway's copy
    is intact, so the call is sent once more, the files with it, and answers (the call once
    failed with a 500)."""
    from store.blobs import digest_files

    with _worker_and_gateway(demo_engine, demo_model_dir, redis_url, tmp_path,
                             store_url=redis_url) as (worker, gateway):
        key = gateway.new_tenant("acme")
        digest = _upload(gateway.url, key, "damaged", adapter_files)
        _place_damaged_copy(worker.blobs, digest, adapter_files)
        response = httpx.post(gateway.url + "/v1/completions", timeout=60, json={
            "model": "damaged", "prompt": "hi", "max_tokens": 3},
            headers={"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        assert digest_files(worker.blobs.path(digest)) == digest


class FailingAsyncEngine:
    """An AsyncEngine whose requests answer "Hi", then fail in the engine as engine.py reports
    it: a last output with finish_reason "error" and the reason."""

    def __init__(self):
        self.tokenizer = build_byte_tokenizer()
        self.engine = SimpleNamespace(max_model_len=64, config=SimpleNamespace(lora=None))

    async def generate(self, prompt, params, *, request_id, tenant=None, lora=None):
        counts = dict(stop_reason=None, num_prompt_tokens=len(prompt), num_cached_tokens=0)
        for i, token in enumerate(b"Hi"):
            yield RequestOutput(request_id, [token], chr(token), [], finished=False,
                                finish_reason=None, num_output_tokens=i + 1, **counts)
        yield RequestOutput(request_id, [], "", [], finished=True, finish_reason="error",
                            num_output_tokens=2, error="the device lost its memory", **counts)

    def shutdown(self) -> None:
        pass


def test_an_engine_error_output_is_an_engine_failure_not_a_finish_reason():
    engine = LocalEngineClient(FailingAsyncEngine())
    chunks = []

    async def run() -> None:
        async for chunk in engine.generate([1, 2], SamplingOptions(max_tokens=4), request_id="r"):
            chunks.append(chunk)

    with pytest.raises(EngineFailure, match="^the device lost its memory$"):
        asyncio.run(run())
    assert [c.text for c in chunks] == ["H", "i"]
    assert all(c.finish_reason is None for c in chunks)


def test_an_engine_failure_midway_ends_a_stream_with_an_error_event(tmp_path):
    with serve_gateway({DEMO_MODEL: LocalEngineClient(FailingAsyncEngine())}, tmp_path) as server:
        key = server.new_tenant("acme")
        whole = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": DEMO_MODEL, "prompt": "x", "max_tokens": 4})
        assert whole.status_code == 500
        assert whole.json()["error"]["code"] == "engine_failure"
        assert whole.json()["error"]["message"] == \
            "the engine failed on this request: the device lost its memory"
        chunks = events(server, key, "/v1/chat/completions", max_tokens=4,
                        messages=[{"role": "user", "content": "x"}])
        assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == ["H", "i"]
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert chunks[-1]["error"]["code"] == "engine_failure"
