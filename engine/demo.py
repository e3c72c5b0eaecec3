"""The embedded default model: a small random-weight Llama with a byte-level tokenizer.

It lets `switchboard serve` run with no download. Its text is noise (the weights are random); it
exists so the whole stack, from HTTP to the paged KV cache, can run anywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from engine.tokenizer import byte_to_unicode

logger = logging.getLogger(__name__)

DEMO_NAME = "switchboard-demo"
_SEED = 1234
_STAGING_PREFIX = ".demo-"
_STALE_STAGING_S = 600.0  # writing the demo model takes seconds
_SPECIAL_TOKENS = ("<s>", "</s>")
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def build_byte_tokenizer():
    """A tokenizer whose ids 0..255 are the bytes themselves, then <s> and </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in byte_to_unicode().items()}
    for offset, token in enumerate(_SPECIAL_TOKENS):
        vocab[token] = 256 + offset
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(_SPECIAL_TOKENS))
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 256)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def demo_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=256 + len(_SPECIAL_TOKENS), hidden_size=256, intermediate_size=704,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
        architectures=["LlamaForCausalLM"],
    )


def default_demo_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """Where LLM() keeps the demo model: in $SWITCHBOARD_HOME read as `serve` reads it (`~`
    expanded, as a service manager leaves it; empty as unset), else in ~/.cache/switchboard."""
    home = environ.get("SWITCHBOARD_HOME") or Path.home() / ".cache" / "switchboard"
    return Path(home).expanduser() / DEMO_NAME


def ensure_demo_model(folder: Path | None = None) -> Path:
    """Write the demo model to `folder` (default: default_demo_dir()) unless it is already there;
    returns the folder."""
    folder = default_demo_dir() if folder is None else Path(folder)
    _remove_stale_staging(folder.parent)
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaForCausalLM

    logger.info("writing the demo model to %s (first use)", folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=folder.parent))
    try:
        with torch.random.fork_rng():
            torch.manual_seed(_SEED)
            model = LlamaForCausalLM(demo_config())
        model.save_pretrained(staging, safe_serialization=True)
        build_byte_tokenizer().save_pretrained(staging)
    except BaseException:  # Ctrl-C too
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        staging.rename(folder)  # NOTE: atomic, so a concurrent first start never sees half a model
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def _remove_stale_staging(parent: Path) -> None:
    """Remove half-written demo models left by a start that was killed while writing one (a
    SIGTERM then ends the process at once); only old ones, as another start may be writing."""
    if not parent.is_dir():
        return
    for staging in parent.glob(_STAGING_PREFIX + "*"):
        with contextlib.suppress(OSError):  # another start removed it meanwhile
            if time.time() - staging.stat().st_mtime > _STALE_STAGING_S:
                shutil.rmtree(staging, ignore_errors=True)
