"""Engine core on CPU: offline throughput against transformers; batch-1 decode against the bandwidth floor.

Peers run in this process on the same random-weight Llama and the same workload (PERF.md), so the ratios
hold even though absolute times on a shared machine drift. Run from the repository root:

    python -m benchmarks.bench_engine
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from benchmarks.common import (
    DEFAULT_WORK_DIR,
    ModelSpec,
    WorkloadRequest,
    copy_bandwidth,
    decode_weight_bytes,
    ensure_model,
    kv_bytes,
    load_hf_model,
    load_summary,
    machine_summary,
    make_offline_workload,
    num_params,
    positive_float,
    positive_int,
    random_prompt,
    random_seed,
    scaled_range,
    timed,
)
from engine.llm import LLM
from engine.request import SamplingParams

# Budgets shared by Switchboard and transformers' continuous batching, so neither gets a bigger batch.
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
PAD_TOKEN_ID = 0
DECODE_WARMUP_STEPS = 4
DECODE_REPEATS = 3

STATIC = "transformers generate (static, padded)"
CONTINUOUS = "transformers generate_batch (continuous)"
SWITCHBOARD = "Switchboard LLM.generate"


@dataclass
class RunResult:
    seconds: float
    outputs: list[list[int]]  # generated token ids per request, input order


Peer = Callable[[list[WorkloadRequest]], RunResult]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=positive_int, default=48,
                        help="requests in the offline workload")
    parser.add_argument("--scale", type=positive_float, default=0.25,
                        help="factor on PERF.md's prompt [8, 512) and output [8, 256) lengths (1 = unscaled)")
    parser.add_argument("--seed", type=random_seed, default=0, help="workload seed")
    parser.add_argument("--rounds", type=positive_int, default=2,
                        help="timed runs of each peer, interleaved; the best is reported (shared machine)")
    parser.add_argument("--hf-batch-size", type=positive_int, default=16,
                        help="requests per padded batch of model.generate")
    parser.add_argument("--decode-context", type=positive_int, default=256,
                        help="prompt length of the batch-1 decode probe")
    parser.add_argument("--decode-steps", type=positive_int, default=32,
                        help="timed decode steps per batch-1 probe")
    parser.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR,
                        help="where the random model is cached")
    return parser.parse_args()


# ----------------------------------------------------------------------------------------------- peers


def run_hf_static(model: LlamaForCausalLM, workload: list[WorkloadRequest], batch_size: int) -> RunResult:
    """`model.generate` on padded batches in input order; a batch runs until its longest output is done."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        outputs += _hf_static_batch(model, workload[i:i + batch_size])
    return RunResult(time.perf_counter() - start, outputs)


def _hf_static_batch(model: LlamaForCausalLM, batch: list[WorkloadRequest]) -> list[list[int]]:
    width = max(len(r.prompt_token_ids) for r in batch)
    max_new = max(r.output_len for r in batch)
    # Left padding keeps every prompt's last token in the final column, where generation continues.
    pads = [width - len(r.prompt_token_ids) for r in batch]
    input_ids = torch.tensor([[PAD_TOKEN_ID] * p + r.prompt_token_ids for p, r in zip(pads, batch)])
    mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads])
    # min_new_tokens == max_new_tokens: EOS can never end a row early, like ignore_eos.
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, pad_token_id=PAD_TOKEN_ID)
    return [out[row, width:width + r.output_len].tolist() for row, r in enumerate(batch)]


def run_hf_continuous(model: LlamaForCausalLM, workload: list[WorkloadRequest]) -> RunResult:
    """transformers continuous batching (paged cache), the machinery behind `model.generate_batch`.

    NOTE: `generate_batch` takes one max_new_tokens for all requests, so we drive its manager directly to
    give each request its own length. The timer starts once the manager (cache, thread) is up, as
    Switchboard's LLM is built outside its timer too.
    """
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=PAD_TOKEN_ID,
                                  max_new_tokens=max(r.output_len for r in workload))
    cb_config = ContinuousBatchingConfig(max_batch_tokens=MAX_NUM_BATCHED_TOKENS,
                                         max_requests_per_batch=MAX_NUM_SEQS)
    hints = WorkloadHints(max_prompt_length=max(len(r.prompt_token_ids) for r in workload),
                          max_generated_length=gen_config.max_new_tokens, num_requests=len(workload))
    with model.continuous_batching_context_manager(generation_config=gen_config,
                                                   continuous_batching_config=cb_config,
                                                   workload_hints=hints, block=True, timeout=5) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, request_id=f"req-{i}", max_new_tokens=r.output_len,
                                   eos_token_id=-1) for i, r in enumerate(workload)]
        results = _collect_cb_results(manager, set(ids))
        seconds = time.perf_counter() - start
    return RunResult(seconds, [results[i] for i in ids])


def _collect_cb_results(manager, pending: set[str]) -> dict[str, list[int]]:
    results = {}
    while pending:
        out = manager.get_result(timeout=1)
        if out is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching thread died; see its log above")
        if out is not None and out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"transformers continuous batching failed {out.request_id}: {out.error}")
            results[out.request_id] = out.generated_tokens
            pending.discard(out.request_id)
    return results


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_switchboard(llm: LLM, workload: list[WorkloadRequest]) -> RunResult:
    prompts = [r.prompt_token_ids for r in workload]
    params = [greedy(r.output_len) for r in workload]
    # NOTE: every round repeats the same prompts; a warm prefix cache would skip their prefill.
    llm.engine.kv_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return RunResult(time.perf_counter() - start, [o.output_token_ids for o in outs])


def measure_throughput(peers: dict[str, Peer], workload: list[WorkloadRequest], warmup: list[WorkloadRequest],
                       rounds: int) -> dict[str, list[RunResult]]:
    """Every peer warms up, then all run `rounds` times, interleaved so that load from other processes
    on the machine falls on all of them alike."""
    for peer in peers.values():
        peer(warmup)
    runs: dict[str, list[RunResult]] = {name: [] for name in peers}
    for i in range(rounds):
        for name, peer in peers.items():
            runs[name].append(peer(workload))
            check_lengths(name, runs[name][-1], workload)
            print(f"  round {i + 1}: {name} {runs[name][-1].seconds:.1f} s", flush=True)
    return runs


def check_lengths(name: str, result: RunResult, workload: list[WorkloadRequest]) -> None:
    """Throughput counts each request's own output length, so each must have produced exactly that."""
    got = [len(o) for o in result.outputs]
    want = [r.output_len for r in workload]
    if got != want:
        raise RuntimeError(f"{name} produced output lengths {got}, expected {want}")


# ------------------------------------------------------------------------------------- batch-1 decode


def hf_decode_step_s(model: LlamaForCausalLM, prompt: list[int], num_steps: int) -> float:
    """Seconds per new token of `model.generate` at batch 1: generating 1 + n tokens minus generating 1
    cancels the prefill, leaving n decode steps (with generate's own per-token overhead, as users see it)."""
    input_ids = torch.tensor([prompt])

    def gen(n: int) -> float:
        return timed(lambda: model.generate(input_ids=input_ids, do_sample=False, max_new_tokens=n,
                                            min_new_tokens=n, pad_token_id=PAD_TOKEN_ID))

    gen(num_steps + 1)  # warm-up
    with_decode = min(gen(num_steps + 1) for _ in range(DECODE_REPEATS))
    return (with_decode - min(gen(1) for _ in range(DECODE_REPEATS))) / num_steps


def switchboard_decode_step_s(llm: LLM, prompts: list[list[int]], num_steps: int) -> float:
    """Median seconds of one `engine.step()` with a single request decoding, best over the prompts. Each
    prompt is distinct, so the prefix cache cannot skip a probe's prefill; the first probe is a warm-up."""
    times = [_switchboard_decode_probe(llm, p, num_steps, f"decode-probe-{i}") for i, p in enumerate(prompts)]
    return min(times[1:])


def _switchboard_decode_probe(llm: LLM, prompt: list[int], num_steps: int, request_id: str) -> float:
    engine = llm.engine
    engine.add_request(request_id, prompt, greedy(DECODE_WARMUP_STEPS + num_steps + 1))
    # Prefill may take several steps if the scheduler chunks it; decode starts after the first token.
    while not any(o.request_id == request_id and o.new_token_ids for o in engine.step()):
        pass
    for _ in range(DECODE_WARMUP_STEPS):
        engine.step()
    times = [timed(engine.step) for _ in range(num_steps)]
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


@torch.inference_mode()
def torch_gemv_pass_s(model: LlamaForCausalLM, repeats: int = 10) -> float:
    """Seconds of F.linear at batch 1 over every matrix a decode step reads: what torch's own CPU kernels
    reach on these weights before attention, norms or any engine overhead, i.e. a practical floor."""
    embed = model.get_input_embeddings().weight
    weights = [p for p in model.parameters() if p.dim() == 2 and p is not embed]
    inputs = [torch.randn(1, w.shape[1]) for w in weights]  # [1, d_in]

    def gemv_pass() -> None:
        for x, w in zip(inputs, weights):
            torch.nn.functional.linear(x, w)

    gemv_pass()  # warm-up
    return min(timed(gemv_pass) for _ in range(repeats))


def measure_decode(model: LlamaForCausalLM, llm: LLM, args: argparse.Namespace) -> None:
    bandwidth = copy_bandwidth()
    rng = random.Random(args.seed + 2)
    vocab = model.config.vocab_size
    prompts = [random_prompt(args.decode_context, vocab, rng) for _ in range(DECODE_REPEATS + 1)]
    # The timed steps read, on average, the prompt plus the warm-up tokens plus half of the timed tokens.
    mean_context = args.decode_context + DECODE_WARMUP_STEPS + args.decode_steps // 2
    floor_bytes = decode_weight_bytes(model) + kv_bytes(model.config, mean_context, torch.float32)
    steps = {
        "reference: torch F.linear over the weights": torch_gemv_pass_s(model),
        "transformers generate, per new token": hf_decode_step_s(model, prompts[0], args.decode_steps),
        "Switchboard engine.step(), median": switchboard_decode_step_s(llm, prompts, args.decode_steps),
    }
    print_decode(floor_bytes / bandwidth, bandwidth, floor_bytes, args.decode_context, steps)


# ------------------------------------------------------------------------------------------- report


def print_header(args: argparse.Namespace, spec: ModelSpec, model: LlamaForCausalLM,
                 workload: list[WorkloadRequest]) -> None:
    print(machine_summary())
    print(load_summary())
    print(f"model: random-weight Llama ({spec.name}), {num_params(model) / 1e6:.1f}M params, float32")
    p_lo, p_hi = scaled_range(8, 512, args.scale)
    o_lo, o_hi = scaled_range(8, 256, args.scale)
    scaled = "" if args.scale == 1 else f" [SCALED x{args.scale} from PERF.md's [8, 512) / [8, 256) for CPU]"
    print(f"workload: {len(workload)} requests, prompt len uniform [{p_lo}, {p_hi}), output len uniform "
          f"[{o_lo}, {o_hi}), greedy, ignore EOS, seed {args.seed}{scaled}")
    print(f"          {sum(len(r.prompt_token_ids) for r in workload)} prompt tokens, "
          f"{sum(r.output_len for r in workload)} output tokens; static batches of {args.hf_batch_size}; "
          f"continuous budgets {MAX_NUM_SEQS} seqs / {MAX_NUM_BATCHED_TOKENS} tokens per step", flush=True)


def print_throughput(runs: dict[str, list[RunResult]], workload: list[WorkloadRequest]) -> None:
    useful = sum(r.output_len for r in workload)
    best = {name: min(r.seconds for r in results) for name, results in runs.items()}
    print(f"\n== Offline throughput: useful output tokens/s, best of {len(runs[STATIC])} interleaved runs ==")
    for name, results in runs.items():
        all_runs = ", ".join(f"{r.seconds:.1f}" for r in results)
        print(f"  {name:<42} {best[name]:7.2f} s {useful / best[name]:8.1f} tok/s   (runs: {all_runs} s)")
    print(f"  Switchboard / static          {best[STATIC] / best[SWITCHBOARD]:6.2f}x   (target >= 3x)")
    print(f"  Switchboard / generate_batch  {best[CONTINUOUS] / best[SWITCHBOARD]:6.2f}x   (target >= 1.5x)")
    pairs = zip(runs[CONTINUOUS][-1].outputs, runs[SWITCHBOARD][-1].outputs)
    print(f"  greedy outputs identical to generate_batch: {sum(a == b for a, b in pairs)}/{len(workload)} "
          "requests (random weights leave near-ties, so float noise can flip a few)")


def print_decode(floor_s: float, bandwidth: float, floor_bytes: int, context: int,
                 steps: dict[str, float]) -> None:
    print(f"\n== Batch-1 decode step vs memory-bandwidth floor (context ~{context} tokens) ==")
    print(f"  copy bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB float32 copy, read + written, best of 10)")
    print(f"  floor = {floor_bytes / 1e6:.1f} MB (weights less the embedding table, plus KV) / bandwidth "
          f"= {floor_s * 1e3:.2f} ms")
    for name, s in steps.items():
        if s <= 0:  # a difference of two timings (generate's), lost in their noise
            print(f"  {name:<42} not measurable: timing noise exceeds the steps; raise --decode-steps")
            continue
        print(f"  {name:<42} {s * 1e3:7.2f} ms/step {s / floor_s:6.2f}x floor")
    print("  Switchboard target: <= 1.5x floor")


# --------------------------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    spec = ModelSpec()
    model_path = ensure_model(spec, args.work_dir)
    model = load_hf_model(model_path)
    vocab = model.config.vocab_size
    workload = make_offline_workload(args.num_requests, args.scale, vocab, seed=args.seed)
    # A different seed for warm-up, so that prefix caches cannot serve the timed prompts.
    warmup = make_offline_workload(4, args.scale, vocab, seed=args.seed + 1)
    print_header(args, spec, model, workload)
    llm = LLM(model=str(model_path), show_progress=False, dtype="float32", device="cpu",
              max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)

    peers: dict[str, Peer] = {
        STATIC: lambda w: run_hf_static(model, w, args.hf_batch_size),
        CONTINUOUS: lambda w: run_hf_continuous(model, w),
        SWITCHBOARD: lambda w: run_switchboard(llm, w),
    }
    print_throughput(measure_throughput(peers, workload, warmup, args.rounds), workload)
    measure_decode(model, llm, args)
    print(f"\n{load_summary()}")


if __name__ == "__main__":
    main()
