"""Tokenizer and end-of-sequence ids of a Hugging Face model folder."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


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


def generation_eos_ids(folder: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (Llama 3 instruct lists several there)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
