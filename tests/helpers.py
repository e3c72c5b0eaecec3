"""Factories shared by the tests: small random Hugging Face models, PEFT adapters, requests, schedulers,
and small volumes to fill.

NOTE: transformers and peft are imported inside functions only: importing them loads triton, and
tests/test_sgmv.py must set TRITON_INTERPRET before triton is first imported during collection.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import itertools
import os
import resource
import shutil
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from adapters.slots import PackedAdapter
from adapters.targets import PROJECTION_PARENTS
from adapters.targets import PROJECTIONS as ALL_PROJECTIONS
from engine.kv_cache import KVCacheManager
from engine.model.spec import ModelSpec
from engine.request import Request, SamplingParams
from engine.scheduler import RunnerOutput, SampledToken, Scheduler, SchedulerConfig, SchedulerOutput

TINY_DIMS = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=384, max_position_embeddings=1024)

# The device the engine tests put the engine on: "cpu" unless SWITCHBOARD_TEST_DEVICE names another
# ("cuda"), so a GPU machine runs the same parity tests against the same CPU-computed references.
TEST_DEVICE = os.environ.get("SWITCHBOARD_TEST_DEVICE", "cpu")


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers model of the given family (llama, mistral or qwen2), in float32."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 24}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    }
    config_cls, model_cls, extra = families[arch]
    # A wider init than the default 0.02 keeps the top two logits apart, so greedy parity does not
    # hinge on float rounding.
    config = config_cls(**{**TINY_DIMS, "initializer_range": 0.1, **extra, **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


def save_hf_model(model, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def byte_tokenizer_with_token(token_bytes: bytes):
    """The demo model's byte-level tokenizer plus one token of `token_bytes`, id 258 (after <s> and
    </s>), which may end partway into a character as BPE merges do. Text never encodes to it."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from engine.demo import build_byte_tokenizer
    from engine.tokenizer import byte_to_unicode

    demo = build_byte_tokenizer()
    spec = json.loads(demo.backend_tokenizer.to_str())
    chars = byte_to_unicode()
    spec["model"]["vocab"]["".join(chars[byte] for byte in token_bytes)] = len(demo)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                        bos_token=demo.bos_token, eos_token=demo.eos_token)
    tokenizer.chat_template = demo.chat_template
    return tokenizer


def save_successor_model(successors: dict[int, int], folder: Path, tokenizer=None) -> Path:
    """A one-layer Llama with `tokenizer` (by default the demo model's byte-level one) whose greedy
    next token is `successors[current token]`: a hand-written output. The attention and MLP add
    nothing, the embeddings are one-hot, and the LM head maps each token to its successor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.demo import build_byte_tokenizer

    tokenizer = tokenizer or build_byte_tokenizer()
    vocab_size = len(tokenizer)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=264, intermediate_size=16,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab_size] = torch.eye(vocab_size)
        model.lm_head.weight.zero_()
        for token, successor in successors.items():
            model.lm_head.weight[successor, token] = 1.0
    tokenizer.save_pretrained(folder)
    return save_hf_model(model, folder)


def hf_greedy(model, prompt: list[int], num_tokens: int, **options) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy continuation of one prompt and the raw logits of every generated
    step, going on past EOS as the engine does with ignore_eos; `options` go to generate (logits
    processors, penalties)."""
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        # NOTE: an explicit mask: without one, generate reads every pad_token_id in the prompt as
        # padding. No EOS rather than min_new_tokens, which would keep EOS from being picked.
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_tokens,
                             eos_token_id=None, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, **options)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()  # [n, vocab]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


_ids = itertools.count()


def create_request(num_prompt_tokens: int = 8, max_tokens: int = 4, priority: int = 0,
                   prompt: list[int] | None = None, tenant: str | None = None, **params) -> Request:
    n = next(_ids)
    # Distinct default prompts, so no test gets prefix-cache hits it did not ask for.
    prompt = prompt if prompt is not None else [(n * 101 + i * 7) % 1000 for i in range(num_prompt_tokens)]
    return Request(f"req-{n}", prompt,
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, **params),
                   priority=priority, tenant=tenant)


def create_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_batched_tokens: int = 32,
                     max_num_seqs: int = 8, max_model_len: int = 256,
                     enable_prefix_caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens, max_num_seqs, max_model_len), kv)


def fake_runner_output(output: SchedulerOutput, token_id: int = 1) -> RunnerOutput:
    """A hand-built model output: every request whose chunk reached its end samples `token_id`."""
    return RunnerOutput({s.request.request_id: SampledToken(token_id)
                         for s in output.scheduled if s.samples})


def run_step(scheduler: Scheduler, token_id: int = 1) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update(output, fake_runner_output(output, token_id))
    return output


def tiny_spec() -> ModelSpec:
    """The spec of make_hf_model("llama"), without building the model."""
    return ModelSpec.from_dict({"model_type": "llama", **TINY_DIMS})


def make_peft_model(arch: str = "llama", seed: int = 0, model_overrides: dict | None = None,
                    peft_config=None, **lora_kwargs):
    """A PEFT model over a fresh tiny base model, with random lora_B (PEFT's init is zero, which
    would make every adapter a no-op). `lora_kwargs` go to LoraConfig unless `peft_config` is given."""
    from peft import LoraConfig, get_peft_model

    base = make_hf_model(arch, **(model_overrides or {}))
    if peft_config is None:
        peft_config = LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": list(ALL_PROJECTIONS),
                                    **lora_kwargs})
    torch.manual_seed(seed + 1)
    model = get_peft_model(base, peft_config).eval()
    gen = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model


def save_peft_adapter(folder: Path, arch: str = "llama", seed: int = 0, **kwargs):
    """Write a PEFT adapter folder (see make_peft_model) and return its PEFT model."""
    model = make_peft_model(arch, seed, **kwargs)
    model.save_pretrained(folder)
    return model


def damage_adapter_files(folder: Path) -> None:
    """Flip a byte of the weights in an adapter folder, as bit rot on a disk would: same size,
    same format, files that no longer hash to their digest."""
    path = folder / "adapter_model.safetensors"
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def peft_module(model, layer: int, proj: str) -> torch.nn.Module:
    """A projection of a PEFT model: LoRA-wrapped if the adapter targets it, else the plain Linear."""
    decoder = model.base_model.model.model.layers[layer]
    return getattr(getattr(decoder, PROJECTION_PARENTS[proj]), proj)


def peft_lora_layers(model) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, projection) -> PEFT's LoRA-wrapped linear, for every module the adapter targets."""
    num_layers = len(model.base_model.model.model.layers)
    modules = {(i, p): peft_module(model, i, p) for i in range(num_layers) for p in ALL_PROJECTIONS}
    return {key: m for key, m in modules.items() if "default" in getattr(m, "lora_A", {})}


def num_live_packed_adapters() -> int:
    """Packed adapters alive in this process: what adapter caches hold in host memory."""
    gc.collect()
    return sum(type(o) is PackedAdapter for o in gc.get_objects())


class IdleEngineParts:
    """The EngineClient methods a scripted test engine has nothing to say in: idle stats, no-op
    close, and token texts where a token is the character of its id."""

    counts_text_bytes = False

    def check_options(self, options) -> None:
        pass

    def max_prompt_tokens(self, prompt_token_ids: list[int]) -> int:
        return len(prompt_token_ids)

    def token_text(self, token_id: int) -> str:
        return chr(token_id)

    def text_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode()

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(map(chr, token_ids))

    def stats(self):
        from gateway.engine_client import EngineStats

        return EngineStats(num_running=0, num_waiting=0, kv_blocks_total=1, kv_blocks_used=0,
                           prefix_cache_hit_rate=0.0, num_prompt_tokens=0,
                           num_generation_tokens=0, num_preemptions=0)

    async def ensure_available(self, adapter: object = None) -> None:
        pass

    def close(self) -> None:
        pass


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Run the block with `num_threads` intra-op threads on the calling thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextmanager
def small_volume(folder: Path, size: str, inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of `size` (as mount reads it: "4m") and of `inodes` files and folders at most,
    mounted at `folder` (made) for the block: a volume a test can fill (of bytes with
    fill_volume, of inodes with use_up_inodes). Skips the test where mounting is not permitted
    (it needs root)."""
    folder.mkdir(parents=True)
    options = f"size={size}" if inodes is None else f"size={size},nr_inodes={inodes}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                             capture_output=True, text=True) if shutil.which("mount") else None
    if mounted is None or mounted.returncode != 0:
        why = "no mount command" if mounted is None else mounted.stderr.strip()
        pytest.skip(f"cannot mount a small tmpfs to fill, which needs root ({why})")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def use_up_inodes(folder: Path, leave: int) -> Path:
    """Create empty files in a new folder on the volume of `folder` until only `leave` more files
    or folders can be made there, as on a volume whose inodes are used up; delete the returned
    folder to free them."""
    fillers = folder / "inode-fillers"
    fillers.mkdir()
    for i in range(os.statvfs(folder).f_ffree - leave):
        (fillers / str(i)).touch()
    assert os.statvfs(folder).f_ffree == leave
    return fillers


def fill_volume(folder: Path) -> Path:
    """Fill the volume of `folder` with one file until no room is left; delete it to free it."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(bytes(4096))
        except OSError as error:
            if error.errno != errno.ENOSPC:
                raise
    return filler


class HeldEngine:
    """`engine`, whose first request waits for `resume` once it has come (`arrived`)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.arrived, self.resume = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    async def generate(self, *args, **kwargs):
        if not self.arrived.is_set():
            self.arrived.set()
            await asyncio.to_thread(self.resume.wait, 30)
        async for chunk in self._engine.generate(*args, **kwargs):
            yield chunk


@contextmanager
def no_open_file_left() -> Iterator[None]:
    """This process's soft limit on open files at 0 while the block runs: every socket or file it
    opens fails with EMFILE, those open now go on working. NOTE: not the number of the files held,
    which a file another thread closes meanwhile (a server's idle connection) makes room under."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
