"""Tokenizer, token bytes and end-of-sequence ids of a Hugging Face model folder."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from collections.abc import Callable
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback
# Decoders that only respell pieces (or trim the start of a whole text): each token's bytes are
# its piece, respelled.
_PIECE_DECODERS = frozenset({"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"})


def has_tokenizer(folder: str | Path) -> bool:
    """Whether the model folder ships a tokenizer."""
    return any((Path(folder) / name).exists() for name in _TOKENIZER_FILES)


def load_tokenizer(folder: str | Path) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None when it ships none (then requests must carry token ids)."""
    folder = Path(folder)
    if not has_tokenizer(folder):
        logger.warning("%s has no tokenizer files: only token-id prompts will be accepted", folder)
        return None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as error:  # transformers raises many types here; all mean "cannot load"
        raise ValueError(f"could not load the tokenizer in {folder}: {error}. A tokenizer.json "
                         "(fast tokenizer) is the most portable form; add one to the folder") from error


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for every byte (what ByteLevel pre-tokenization emits)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


def token_bytes_reader(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], bytes]:
    """How to read one token's raw bytes from the tokenizer's vocabulary: what decoding the token
    alone cannot show when it holds part of a multi-byte character (decode gives U+FFFD).

    As exact_token_bytes_reader; tokenizers of other kinds (WordPiece...) are read by decoding
    the token.
    """
    exact = exact_token_bytes_reader(tokenizer)
    return exact or (lambda token_id: tokenizer.decode([token_id]).encode())


def exact_token_bytes_reader(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], bytes] | None:
    """Each token's raw bytes, read from the vocabulary, where its spelling says them exactly;
    None for a tokenizer whose tokens only decoding can read.

    Byte-level BPE (GPT-2, Llama 3, Qwen2) spells each byte as GPT-2's stand-in character;
    sentencepiece (Llama 2, Mistral) spells a space "▁" and a byte without a piece of its own
    "<0xC3>"; added tokens ("<s>") are their text. An id past the vocabulary (a padded
    embedding) has no bytes.
    """
    added = {i: token.content.encode() for i, token in tokenizer.added_tokens_decoder.items()}
    steps = _decoder_steps(tokenizer)
    kinds = {step["type"] for step in steps}
    if "ByteLevel" in kinds:
        piece = _byte_level_piece()
    elif kinds and kinds <= _PIECE_DECODERS:
        piece = _sentencepiece_piece(steps)
    else:
        return None

    def read(token_id: int) -> bytes:
        if token_id in added:
            return added[token_id]
        token = tokenizer.convert_ids_to_tokens(token_id)
        return b"" if token is None else piece(token)

    return read


def decoded_bytes_reader(tokenizer: PreTrainedTokenizerBase) -> Callable[[int], bytes] | None:
    """The bytes each token adds to what `decode(..., skip_special_tokens=True)` reads: its own,
    none for a special token; None where only decoding can read the tokens."""
    exact = exact_token_bytes_reader(tokenizer)
    if exact is None:
        return None
    special = special_token_ids(tokenizer)
    return lambda token_id: b"" if token_id in special else exact(token_id)


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens `decode(..., skip_special_tokens=True)` skips: those of the special-tokens map
    (`all_special_ids`) and every added token marked special, which that map may leave out (Llama
    3's header and reserved tokens)."""
    return frozenset(tokenizer.all_special_ids) | {
        i for i, token in tokenizer.added_tokens_decoder.items() if token.special}


def reading_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of everything by which `tokenizer` turns text into ids: two tokenizers with the
    same digest give every text the same ids.

    A fast tokenizer's: its class, normalizer, pre-tokenizer, model (vocabulary, merges), post-
    processor (the special tokens it adds, as a BOS), added tokens (and which are special) and
    whether it splits special tokens; not its decoder, padding or truncation, which change no
    text's ids, nor its chat template (the text it renders is told apart by itself). A Python
    tokenizer's rules are its code's: no two are taken to read alike, so each gets a digest of
    its own.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return f"python-tokenizer-{uuid.uuid4().hex}"
    added = [[i, t.content, t.special, t.single_word, t.lstrip, t.rstrip, t.normalized]
             for i, t in sorted(backend.get_added_tokens_decoder().items())]
    parts = [type(tokenizer).__name__.encode(), json.dumps(tokenizer.split_special_tokens).encode(),
             json.dumps(added).encode()]
    parts += [b"null" if step is None else step.__getstate__()
              for step in (backend.normalizer, backend.pre_tokenizer, backend.model,
                           backend.post_processor)]
    digest = hashlib.sha256()
    for part in parts:  # NOTE: each sized, so no two lists of parts hash alike
        digest.update(len(part).to_bytes(8, "big") + part)
    return digest.hexdigest()


def _decoder_steps(tokenizer: PreTrainedTokenizerBase) -> list[dict]:
    """The steps of a fast tokenizer's decoder, as its JSON spells them (none: not a fast one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = None if backend is None else backend.decoder
    if decoder is None:
        return []
    state = json.loads(decoder.__getstate__())
    return state["decoders"] if state["type"] == "Sequence" else [state]


def _byte_level_piece() -> Callable[[str], bytes]:
    byte_of = {char: byte for byte, char in byte_to_unicode().items()}
    return lambda token: b"".join(bytes([byte_of[c]]) if c in byte_of else c.encode()
                                  for c in token)


def _sentencepiece_piece(steps: list[dict]) -> Callable[[str], bytes]:
    respell = [(s["pattern"]["String"], s["content"]) for s in steps
               if s["type"] == "Replace" and "String" in s["pattern"]]
    respell += [(s["replacement"], " ") for s in steps if s["type"] == "Metaspace"]
    byte_fallback = any(s["type"] == "ByteFallback" for s in steps)

    def piece(token: str) -> bytes:
        if byte_fallback and (byte := _BYTE_PIECE.fullmatch(token)):
            return bytes([int(byte[1], 16)])
        for old, new in respell:
            token = token.replace(old, new)
        return token.encode()

    return piece


def end_of_sequence_ids(folder: str | Path, config_ids: tuple[int, ...],
                        tokenizer: PreTrainedTokenizerBase | None, vocab_size: int) -> frozenset[int]:
    """The tokens that end a sequence, as vLLM reads them: config.json's (`config_ids`),
    generation_config.json's and the tokenizer's own EOS token. A chat fine-tune's tokenizer often
    names a new end-of-turn token there while config.json keeps the base model's, and a model
    that ended its turns unheard would run every answer to max_tokens.

    An id the model cannot sample (past its `vocab_size`: a tokenizer's added token the model's
    embeddings were never resized for) is left out, with a warning: it would never end a reply,
    and banning it before min_tokens would index past the logits."""
    own = () if tokenizer is None or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    named = config_ids + _generation_eos_ids(folder) + own
    sampleable = frozenset(t for t in named if isinstance(t, int) and 0 <= t < vocab_size)
    if unusable := sorted({repr(t) for t in named if t not in sampleable}):
        logger.warning("%s names EOS token ids the model cannot generate (its vocabulary has %d "
                       "tokens): %s; they are ignored", folder, vocab_size, ", ".join(unusable))
    return sampleable


def _generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (Llama 3 instruct lists several there)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
