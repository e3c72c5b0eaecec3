"""Model folders: what loads, and the errors for what does not."""

import json
import os
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.model.spec import ModelSpec, UnsupportedModelError
from engine.request import SamplingParams
from tests.helpers import make_hf_model, save_hf_model


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        ModelSpec.from_folder(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "config.json holds no JSON object"),
    ('{"model_type": "llama"}', "config.json lacks 'num_attention_heads', which a llama config has"),
    ('{"model_type": "llama", "num_attention_heads": "4", "num_hidden_layers": 2, "vocab_size": 9, '
     '"hidden_size": 8, "intermediate_size": 8}', "config.json holds a value of the wrong type"),
])
def test_a_config_json_that_cannot_be_read_says_why(tmp_path, text, message):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_folder(tmp_path)


def test_unsupported_rope_type_is_named(tmp_path):
    model = make_hf_model("llama")
    folder = save_hf_model(model, tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn'"):
        LLMEngine(EngineConfig(model=str(folder)), show_progress=False)


def test_pickle_checkpoints_are_refused(tmp_path):
    model = make_hf_model("llama")
    folder = save_hf_model(model, tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(UnsupportedModelError, match="pickle checkpoints are never loaded"):
        LLMEngine(EngineConfig(model=str(folder)), show_progress=False)


@pytest.mark.parametrize("damage", ["truncated", "an error page"])
def test_a_damaged_weights_file_is_named_with_what_to_do(tmp_path, damage):
    """An interrupted download leaves a truncated file, a failed one an HTML page under the
    weights' name: `switchboard serve` once exited with the reader's traceback."""
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else
                        b"<!DOCTYPE html><html><body>502 Bad Gateway</body></html>\n")
    with pytest.raises(UnsupportedModelError, match="model.safetensors cannot be read .*damaged or "
                       "incomplete.*fetch it again"):
        LLMEngine(EngineConfig(model=str(folder)), show_progress=False)


def test_missing_config_says_what_to_pass(tmp_path):
    with pytest.raises(UnsupportedModelError, match="no config.json"):
        LLMEngine(EngineConfig(model=str(tmp_path)), show_progress=False)


def test_legacy_rope_layout_is_read():
    spec = ModelSpec.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}})
    assert spec.rope_theta == 500000.0 and spec.rope_scaling["rope_type"] == "llama3"
    assert spec.num_kv_heads == 2 and spec.head_dim == 4


def test_the_context_is_the_trained_positions_stretched_by_linear_rope_scaling(tmp_path):
    base = {"architectures": ["LlamaForCausalLM"], **TINY_CONFIG, "max_position_embeddings": 4096}
    assert ModelSpec.from_dict(base).context_length == 4096
    linear = {**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert ModelSpec.from_dict(linear).context_length == 16384
    llama3 = {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 512}}
    assert ModelSpec.from_dict(llama3).context_length == 4096  # already the scaled length
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    trained = ModelSpec.from_folder(folder).context_length
    assert LLMEngine(EngineConfig(model=str(folder), max_model_len=trained, num_kv_blocks=1024),
                     show_progress=False).max_model_len == trained
    with pytest.raises(ValueError, match=f"more than the {trained} tokens this model was trained for"):
        LLMEngine(EngineConfig(model=str(folder), max_model_len=trained + 1), show_progress=False)


TINY_CONFIG = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
               "num_attention_heads": 2}


@pytest.mark.parametrize("architecture, settings, window", [
    ("LlamaForCausalLM", dict(use_sliding_window=True, sliding_window=16), None),  # Llama never windows
    ("MistralForCausalLM", dict(sliding_window=16), 16),
    ("MistralForCausalLM", dict(use_sliding_window=False, sliding_window=16), 16),  # Mistral ignores the flag
    ("Qwen2ForCausalLM", dict(use_sliding_window=False, sliding_window=16, max_window_layers=0), None),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16), None),  # max_window_layers 28 > 2
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0), 16),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                              layer_types=["full_attention"] * 2, max_window_layers=0), None),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16,
                              layer_types=["sliding_attention"] * 2), 16),
])
def test_sliding_window_is_read_as_transformers_reads_it(architecture, settings, window):
    spec = ModelSpec.from_dict({"architectures": [architecture], **TINY_CONFIG, **settings})
    assert spec.sliding_window == window


@pytest.mark.parametrize("settings", [
    dict(max_window_layers=1),  # a config.json from before transformers wrote layer_types
    dict(layer_types=["sliding_attention", "full_attention"]),
])
def test_mixed_sliding_and_full_attention_layers_are_refused(settings):
    config = {"architectures": ["Qwen2ForCausalLM"], **TINY_CONFIG, "use_sliding_window": True,
              "sliding_window": 16, **settings}
    with pytest.raises(UnsupportedModelError, match="mixes sliding-window and full attention layers "
                       r"\(1 of 2 layers.*set use_sliding_window to false"):
        ModelSpec.from_dict(config)


def test_mixed_attention_layers_are_refused_at_load_time(tmp_path):
    model = make_hf_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    folder = save_hf_model(model, tmp_path / "m")
    with pytest.raises(UnsupportedModelError, match="mixes sliding-window and full attention layers"):
        LLMEngine(EngineConfig(model=str(folder)), show_progress=False)


def test_unknown_layer_types_are_named():
    config = {"architectures": ["Qwen2ForCausalLM"], **TINY_CONFIG,
              "layer_types": ["full_attention", "chunked_attention"]}
    with pytest.raises(UnsupportedModelError, match=r"layer_types \['chunked_attention'\] are not supported"):
        ModelSpec.from_dict(config)


@pytest.mark.parametrize("bad", [dict(dtype="float64"), dict(device="tpu"), dict(block_size=0),
                                 dict(num_kv_blocks=1), dict(max_num_seqs=0)])
def test_invalid_engine_config_is_rejected(bad):
    with pytest.raises(ValueError):
        EngineConfig(model="x", **bad)


def test_kv_pool_sized_from_a_memory_budget(tmp_path, caplog):
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    # 2 layers * 2 (K, V) * 16 tokens * 2 kv heads * 16 dims * 4 bytes = 8 KiB per block
    with caplog.at_level("WARNING", logger="engine.engine"):
        engine = LLMEngine(EngineConfig(model=str(folder), kv_cache_memory_bytes=40 * 8192),
                           show_progress=False)
    assert engine.kv_manager.num_blocks == 40
    assert engine.max_model_len == 40 * 16  # the pool, not max_position_embeddings, is the limit
    assert [r.getMessage() for r in caplog.records if r.name == "engine.engine"] == [
        "the KV cache holds 640 tokens (40 blocks of 16), fewer than this model's context of 1024: "
        "max_model_len is 640; give the KV cache more memory to serve the whole context"]


def test_a_max_model_len_the_kv_pool_cannot_hold_is_refused(tmp_path):
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    assert LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=40, max_model_len=640),
                     show_progress=False).max_model_len == 640
    with pytest.raises(ValueError, match=r"max_model_len 641 is more than the 640 tokens the KV cache "
                                         r"holds \(40 blocks of 16\); give the KV cache more memory or "
                                         r"lower max_model_len"):
        LLMEngine(EngineConfig(model=str(folder), num_kv_blocks=40, max_model_len=641), show_progress=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(tmp_path, dtype):
    folder = save_hf_model(make_hf_model("llama"), tmp_path / "m")
    prompts = [[5, 9, 200, 31, 7, 7, 1, 99]]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    full = LLM(str(folder), show_progress=False).generate(prompts, params, use_tqdm=False)[0]
    half = LLM(str(folder), show_progress=False, dtype=dtype).generate(prompts, params,
                                                                        use_tqdm=False)[0]
    assert half.output_token_ids == full.output_token_ids
    assert torch.tensor(half.logprobs[0].logprob) == pytest.approx(full.logprobs[0].logprob, abs=0.1)


def test_demo_model_generates_text_with_stop_strings(tmp_path):
    from engine.demo import ensure_demo_model
    # What a start killed while writing the demo model leaves (SIGTERM ends it at once): swept
    # once old, as a younger one may be another start's, still writing.
    old, young = tmp_path / ".demo-killed", tmp_path / ".demo-writing"
    for staging in (old, young):
        staging.mkdir()
        (staging / "config.json").write_text("{}")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    folder = ensure_demo_model(tmp_path / "demo")
    assert ensure_demo_model(folder) == folder  # written once, then reused
    assert sorted(p.name for p in tmp_path.iterdir()) == [".demo-writing", "demo"]
    llm = LLM(str(folder), show_progress=False)
    free = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    assert len(free.output_token_ids) == 12 and free.finish_reason == "length"
    # The demo weights are fixed, so its output is too: cut it at its first printable character.
    stop = next(c for c in free.text if c != "\ufffd")
    cut = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, stop=[stop],
                                                 ignore_eos=True), use_tqdm=False)[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == free.text[: free.text.index(stop)]
    assert len(cut.output_token_ids) < 12


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(tmp_path):
    from engine.demo import ensure_demo_model
    llm = LLM(str(ensure_demo_model(tmp_path / "demo")), show_progress=False)
    free = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        use_tqdm=False)[0]
    stop = next(c for c in free.text if c != "\ufffd")
    first = llm.generate(["Hello"], SamplingParams(max_tokens=12, temperature=0, stop=[stop],
                                                   ignore_eos=True), use_tqdm=False)[0]
    exact = llm.generate(["Hello"], SamplingParams(max_tokens=len(first.output_token_ids),
                                                   temperature=0, stop=[stop], ignore_eos=True),
                         use_tqdm=False)[0]
    assert exact.output_token_ids == first.output_token_ids
    assert exact.finish_reason == "stop" and exact.stop_reason == stop
