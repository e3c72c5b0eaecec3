"""Multi-LoRA on CPU: Switchboard with n adapters against its own base model and against PEFT.

Runs in one process on a small random-weight Llama (hidden 512, 8 layers) with real PEFT-format
adapters (ranks cycling 8/16/32/64 on all seven linears), so the ratios hold even though absolute
times on a shared machine drift. Run from the repository root:

    python -m benchmarks.bench_lora

Adapter popularity follows S-LoRA: each request's adapter index is floor(u * n) with u drawn from
numpy's power distribution (density alpha * u^(alpha - 1) on [0, 1)), so alpha = 1 is uniform and
smaller alpha piles requests onto the low indices.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from safetensors.torch import save_file

from adapters.config import AdapterConfig
from benchmarks.common import (
    DEFAULT_WORK_DIR,
    ModelSpec,
    WorkloadRequest,
    copy_bandwidth,
    ensure_model,
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
)
from engine.llm import LLM
from engine.lora import LoraRequest
from engine.request import SamplingParams
from store.blobs import digest_files

SPEC = ModelSpec(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                 intermediate_size=1376, vocab_size=32000)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16, 32, 64)
# S-LoRA's ranks 8-64 sit on a 4096-wide model; these are the same fractions of this 512-wide one,
# so adapter bytes stand to the base model's as in S-LoRA (section 1's diagnostic row).
WIDTH_SCALED_RANKS = tuple(r * SPEC.hidden_size // 4096 for r in RANKS)
LORA_ALPHA = 16
B_STD = 0.02  # lora_B values; PEFT initialises B to zero, which would make every adapter a no-op
MAX_NUM_SEQS = 64
MAX_NUM_BATCHED_TOKENS = 2048
PAD_TOKEN_ID = 0
MIN_ADAPTERS = 132  # on disk: n = 128 and the width-scaled 32 (section 1) need this many
CHECK_ADAPTER = 5  # the adapter whose greedy tokens are checked against PEFT's


def num_adapters(registered: int) -> int:
    """How many adapter folders the run builds."""
    return max(registered, MIN_ADAPTERS)


def scale_point_pool(registered: int, cold_repeats: int) -> list[int]:
    """The adapters the scale point may make active: the registered ones, less those the cold-load
    probes use (the last cold_repeats + 1 built, so that nothing else touched them) and the one
    checked against PEFT."""
    cold = range(num_adapters(registered) - cold_repeats - 1, num_adapters(registered))
    return [i for i in range(registered) if i not in cold and i != CHECK_ADAPTER]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=positive_int, default=32)
    p.add_argument("--scale", type=positive_float, default=0.125,
                   help="factor on PERF.md's prompt [8, 512) and output [8, 256) lengths")
    p.add_argument("--seed", type=random_seed, default=0)
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="timed Switchboard runs per config (best reported)")
    p.add_argument("--with-128", action="store_true", help="also run n = 128 adapters")
    p.add_argument("--alphas", type=positive_float, nargs="+", default=[1.0],
                   help="S-LoRA power-law alphas (1 = uniform); e.g. --alphas 1 0.3 0.1")
    p.add_argument("--peft-batch-size", type=positive_int, default=8)
    p.add_argument("--peft-requests", type=positive_int, default=16,
                   help="PEFT runs only the first this-many requests (it is slow); throughput is per token")
    p.add_argument("--registered", type=positive_int, default=1000,
                   help="adapters on disk for the scale point")
    p.add_argument("--scale-active", type=positive_int, default=128,
                   help="adapters active in the scale point")
    p.add_argument("--scale-slots", type=positive_int, default=32,
                   help="device slots in the scale point (a quarter of the active adapters)")
    p.add_argument("--cpu-adapters", type=positive_int, default=256,
                   help="host adapter cache (max_cpu_adapters); S-LoRA keeps the active adapters in host memory")
    p.add_argument("--cold-repeats", type=positive_int, default=5)
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    args = p.parse_args(argv)
    pool = len(scale_point_pool(args.registered, args.cold_repeats))
    if args.scale_active > pool:
        p.error(f"argument --scale-active: at most {pool} of --registered {args.registered} "
                f"adapters can be active (the cold-load probes and the PEFT check use others), "
                f"got {args.scale_active}")
    return args


# ------------------------------------------------------------------------------------------ adapters


def build_adapters(model_path: Path, root: Path, count: int,
                   ranks: tuple[int, ...] = RANKS) -> list[Path]:
    """`count` PEFT-format adapter folders, ranks cycling through `ranks`. The first len(ranks) are
    made by PEFT itself (get_peft_model + save_pretrained); the rest copy the config of the same
    rank and write fresh random tensors under the same names and shapes. Cached on disk."""
    root.mkdir(parents=True, exist_ok=True)
    folders = [root / f"adapter-{i:04d}" for i in range(count)]
    for i, rank in enumerate(ranks):
        if (folders[i] / "adapter_model.safetensors").exists():
            continue
        torch.manual_seed(1000 + i)
        base = load_hf_model(model_path)
        peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=LORA_ALPHA, target_modules=TARGETS,
                                                     lora_dropout=0.0))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, B_STD)
        tmp = folders[i].with_name(folders[i].name + ".tmp")
        peft_model.save_pretrained(tmp)
        tmp.rename(folders[i])
    templates = {}
    for i, rank in enumerate(ranks):
        with safe_open(folders[i] / "adapter_model.safetensors", "pt") as f:
            templates[rank] = {k: f.get_tensor(k).shape for k in f.keys()}
    gen = torch.Generator().manual_seed(7)
    for i in range(len(ranks), count):
        if (folders[i] / "adapter_model.safetensors").exists():
            continue
        rank = ranks[i % len(ranks)]
        gen.manual_seed(10_000 + i)
        tensors = {}
        for name, shape in templates[rank].items():
            if "lora_A" in name:  # PEFT's default init: kaiming-uniform(a=sqrt(5)), bound 1/sqrt(d_in)
                bound = 1.0 / shape[1] ** 0.5
                tensors[name] = (torch.rand(shape, generator=gen) * 2 - 1) * bound
            else:
                tensors[name] = torch.randn(shape, generator=gen) * B_STD
        tmp = folders[i].with_name(folders[i].name + ".tmp")
        tmp.mkdir(exist_ok=True)
        shutil.copy(folders[i % len(ranks)] / "adapter_config.json", tmp / "adapter_config.json")
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        tmp.rename(folders[i])
    return folders


def rank_of(folder: Path) -> int:
    return json.loads((folder / "adapter_config.json").read_text())["r"]


def linear_dims(spec: ModelSpec) -> list[tuple[int, int]]:
    """(d_in, d_out) of a layer's q, k, v, o, gate, up and down projections."""
    h, inter = spec.hidden_size, spec.intermediate_size
    kv = h // spec.num_attention_heads * spec.num_key_value_heads
    return [(h, h), (h, kv), (h, kv), (h, h), (h, inter), (h, inter), (inter, h)]


def adapter_bytes_per_rank(spec: ModelSpec) -> int:
    """float32 bytes of one rank of A and B on all seven linears of every layer: (d_in + d_out) * 4 each."""
    return sum(d_in + d_out for d_in, d_out in linear_dims(spec)) * spec.num_hidden_layers * 4


def layer_weight_bytes(spec: ModelSpec) -> int:
    """float32 bytes of the seven linears of every layer: what a decode step reads of the base model,
    less the lm_head."""
    return sum(d_in * d_out for d_in, d_out in linear_dims(spec)) * spec.num_hidden_layers * 4


def decode_adapter_bytes(spec: ModelSpec, workload: list[WorkloadRequest], adapters: list[int],
                         ranks: dict[int, int]) -> int:
    """Adapter bytes the decode steps must read when every unfinished request decodes each step (the
    first token comes from prefill): each distinct adapter among them, once a step, at its own rank."""
    total = 0
    for step in range(1, max(r.output_len for r in workload)):
        running = {a for a, r in zip(adapters, workload) if r.output_len > step}
        total += sum(ranks[a] for a in running)
    return total * adapter_bytes_per_rank(spec)


def power_law_indices(num: int, n: int, alpha: float, seed: int) -> list[int]:
    """S-LoRA's sampling: floor(n * u), u ~ power(alpha) on [0, 1); alpha = 1 is uniform."""
    rng = np.random.default_rng(seed)
    return [min(n - 1, int(u * n)) for u in rng.power(alpha, num)]


# ------------------------------------------------------------------------------------------ runners


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_switchboard(llm: LLM, workload: list[WorkloadRequest],
                    loras: list[LoraRequest | None]) -> tuple[float, list[list[int]], dict]:
    llm.engine.kv_manager.reset_prefix_cache()
    before = llm.engine.metrics()
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in workload], [greedy(r.output_len) for r in workload],
                        use_tqdm=False, lora=loras)
    seconds = time.perf_counter() - start
    after = llm.engine.metrics()
    delta = {k: getattr(after, k) - getattr(before, k)
             for k in ("adapter_hits", "adapter_misses", "adapter_evictions", "adapter_page_ins",
                       "adapter_disk_loads")
             if hasattr(after, k)}
    outputs = [o.output_token_ids for o in outs]
    got, want = [len(o) for o in outputs], [r.output_len for r in workload]
    if got != want:
        raise RuntimeError(f"Switchboard produced lengths {got}, expected {want}")
    return seconds, outputs, delta


def fmt_metrics(d: dict) -> str:
    if not d:
        return ""
    return (f"hits {d.get('adapter_hits', 0)}, misses {d.get('adapter_misses', 0)}, "
            f"evictions {d.get('adapter_evictions', 0)}, page-ins {d.get('adapter_page_ins', 0)}, "
            f"disk loads {d.get('adapter_disk_loads', 0)}")


@torch.inference_mode()
def run_peft(model: PeftModel, workload: list[WorkloadRequest], names: list[str],
             batch_size: int) -> tuple[float, list[list[int]]]:
    """Left-padded batches of `batch_size` in input order, one adapter name per row (mixed batch)."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(workload), batch_size):
        batch, batch_names = workload[i:i + batch_size], names[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        max_new = max(r.output_len for r in batch)
        pads = [width - len(r.prompt_token_ids) for r in batch]
        input_ids = torch.tensor([[PAD_TOKEN_ID] * p + r.prompt_token_ids for p, r in zip(pads, batch)])
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads])
        out = model.generate(input_ids=input_ids, attention_mask=mask, adapter_names=batch_names,
                             do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new,
                             pad_token_id=PAD_TOKEN_ID)
        outputs += [out[row, width:width + r.output_len].tolist() for row, r in enumerate(batch)]
    return time.perf_counter() - start, outputs


def cold_ttft(llm: LLM, prompt: list[int], lora: LoraRequest | None, request_id: str) -> float:
    """Seconds from engine.add_request to the step output carrying the request's first token."""
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(request_id, prompt, greedy(2), lora=lora)
    while True:
        outs = engine.step()
        if any(o.request_id == request_id and o.new_token_ids for o in outs):
            seconds = time.perf_counter() - start
            break
    while engine.has_unfinished_requests():
        engine.step()
    return seconds


# ------------------------------------------------------------------------------------------ main


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    print(machine_summary())
    print(load_summary())
    model_path = ensure_model(SPEC, args.work_dir)
    base = load_hf_model(model_path)
    vocab = SPEC.vocab_size
    print(f"model: random-weight Llama ({SPEC.name}), {num_params(base) / 1e6:.1f}M params, float32")

    t0 = time.perf_counter()
    folders = build_adapters(model_path, args.work_dir / f"{SPEC.name}-adapters",
                             num_adapters(args.registered))
    loras = [LoraRequest(digest_files(f), str(f)) for f in folders]  # a registry digests every file set
    print(f"adapters: {len(folders)} PEFT-format folders on disk (first {len(RANKS)} written by PEFT "
          f"save_pretrained, the rest same names/shapes with fresh random values), ranks cycling "
          f"{'/'.join(map(str, RANKS))}, lora_alpha {LORA_ALPHA}, targets {','.join(TARGETS)}; "
          f"built/loaded and digested in {time.perf_counter() - t0:.1f} s", flush=True)

    workload = make_offline_workload(args.num_requests, args.scale, vocab, seed=args.seed)
    warmup = make_offline_workload(4, args.scale, vocab, seed=args.seed + 1)
    useful = sum(r.output_len for r in workload)
    p_lo, p_hi = scaled_range(8, 512, args.scale)
    o_lo, o_hi = scaled_range(8, 256, args.scale)
    print(f"workload: {len(workload)} requests, prompt len uniform [{p_lo}, {p_hi}), output len uniform "
          f"[{o_lo}, {o_hi}) [SCALED x{args.scale} from PERF.md for CPU], greedy, ignore EOS, seed {args.seed}; "
          f"{sum(len(r.prompt_token_ids) for r in workload)} prompt / {useful} output tokens", flush=True)

    ns = [1, 8, 32] + ([128] if args.with_128 else [])
    n_max = max(ns)
    # Cold-load probes use adapters no other part of the run touches: the last ones on disk.
    cold_folders = folders[-args.cold_repeats - 1:]
    slots = n_max + 32  # every config's adapters (the width-scaled 32 too) stay resident: timed runs page nothing
    llm = LLM(str(model_path), show_progress=False, dtype="float32", device="cpu", max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              lora=AdapterConfig(max_lora_rank=64, max_gpu_adapters=slots,
                                 max_cpu_adapters=max(args.cpu_adapters, n_max), num_load_threads=1))

    # ---- 1. Switchboard: base vs n adapters
    configs: dict[str, list[LoraRequest | None]] = {"base (no adapters)": [None] * len(workload)}
    assignments: dict[str, list[int]] = {}
    for alpha in args.alphas:
        for n in ns:
            idx = power_law_indices(len(workload), n, alpha, args.seed + n)
            key = f"n={n} alpha={alpha:g}"
            assignments[key] = idx
            configs[key] = [loras[i] for i in idx]
    # Diagnostic: the n = 32 requests again, on adapters whose ranks are S-LoRA's fractions of the
    # model width (see WIDTH_SCALED_RANKS). Not a PEFT row, not part of the target.
    scaled_folders = build_adapters(model_path, args.work_dir / f"{SPEC.name}-adapters-width-scaled", 32,
                                    WIDTH_SCALED_RANKS)
    scaled_key = f"n=32 alpha=1, ranks {'/'.join(map(str, WIDTH_SCALED_RANKS))}"
    scaled_idx = power_law_indices(len(workload), 32, 1.0, args.seed + 32)
    configs[scaled_key] = [LoraRequest(digest_files(scaled_folders[i]), str(scaled_folders[i])) for i in scaled_idx]
    indices = {**assignments, scaled_key: scaled_idx}  # every adapter config's per-request adapters
    ranks_of = {key: {a: rank_of((scaled_folders if key == scaled_key else folders)[a]) for a in set(idx)}
                for key, idx in indices.items()}  # by adapter index
    print(f"\n== 1. Switchboard offline throughput: useful tokens/s, best of {args.rounds} "
          f"(after one untimed warm-up run per config that also loads its adapters); "
          f"{slots} device slots, {max(args.cpu_adapters, n_max)} host ==", flush=True)
    results: dict[str, list[tuple[float, dict]]] = {k: [] for k in configs}
    sb_outputs: dict[str, list[list[int]]] = {}
    for key, lr in configs.items():
        w_loras = [lr[i % len(lr)] for i in range(len(warmup))]
        run_switchboard(llm, warmup, w_loras)
        _, _, d = run_switchboard(llm, workload, lr)
        print(f"  warm-up {key}: {fmt_metrics(d)}", flush=True)
    for _ in range(args.rounds):
        for key, lr in configs.items():
            s, outs, d = run_switchboard(llm, workload, lr)
            results[key].append((s, d))
            sb_outputs[key] = outs
    best = {k: min(s for s, _ in v) for k, v in results.items()}
    base_key = "base (no adapters)"
    for key in configs:
        distinct = len(set(indices.get(key, [])))
        runs = ", ".join(f"{s:.2f}" for s, _ in results[key])
        ratio = "" if key == base_key else f"  multi/base {best[base_key] / best[key]:.2f}"
        print(f"  {key:<30} {distinct:3d} distinct  {best[key]:6.2f} s {useful / best[key]:7.1f} tok/s{ratio}"
              f"   (runs {runs} s; last run {fmt_metrics(results[key][-1][1])})")
    key32 = "n=32 alpha=1" if "n=32 alpha=1" in best else [k for k in best if k.startswith("n=32")][0]
    print(f"  target: multi/base >= 0.85 at n=32 -> {best[base_key] / best[key32]:.2f}", flush=True)
    sb_tps = {k: useful / v for k, v in best.items()}
    bandwidth = copy_bandwidth(1 << 28)
    print(f"  floor: decode steps must read each distinct adapter of the batch once a step; at the copy "
          f"bandwidth measured now ({bandwidth / 1e9:.1f} GB/s, bytes read + written) that alone bounds "
          "multi/base:")
    for key, idx in indices.items():
        nbytes = decode_adapter_bytes(SPEC, workload, idx, ranks_of[key])
        floor = nbytes / bandwidth
        print(f"  {key:<30} {nbytes / 1e9:5.2f} GB -> >= {floor:.2f} s more than base -> multi/base <= "
              f"{best[base_key] / (best[base_key] + floor):.2f}", flush=True)

    print("  adapter weight bytes one decode step reads with every request running (each distinct adapter once), "
          "as a share of the base model's layer weights (PERF.md: about 18% for Llama-3-8B, rank 16 on all "
          "seven linears, 32 adapters in a batch of 64):")
    for key, ranks in ranks_of.items():
        step_bytes = sum(ranks.values()) * adapter_bytes_per_rank(SPEC)
        print(f"  {key:<30} {100 * step_bytes / layer_weight_bytes(SPEC):5.0f}%", flush=True)
    # ---- 2. PEFT mixed-adapter generate
    print(f"\n== 2. PEFT mixed-adapter generate (PeftModel with {n_max} adapters loaded, left-padded "
          f"batches of {args.peft_batch_size}, adapter_names per row, useful tokens only) ==", flush=True)
    t0 = time.perf_counter()
    peft_model = PeftModel.from_pretrained(base, str(folders[0]), adapter_name="a0").eval()
    for i in range(1, n_max):
        peft_model.load_adapter(str(folders[i]), adapter_name=f"a{i}")
    print(f"  loaded {n_max} adapters into PEFT in {time.perf_counter() - t0:.1f} s")
    pw = workload[:args.peft_requests]
    p_useful = sum(r.output_len for r in pw)
    if len(pw) < len(workload):
        print(f"  NOTE: PEFT runs the first {len(pw)} of the {len(workload)} requests ({p_useful} useful tokens), "
              "one round, to keep the run short; throughput is per useful token, so it compares")
    run_peft(peft_model, warmup[:2], ["a0", "a0"], args.peft_batch_size)  # warm-up
    peft_tps = {}
    for key, idx in assignments.items():
        s, _ = run_peft(peft_model, pw, [f"a{i}" for i in idx[:len(pw)]], args.peft_batch_size)
        peft_tps[key] = p_useful / s
        print(f"  {key:<22} PEFT {s:6.2f} s {peft_tps[key]:7.1f} tok/s   Switchboard {sb_tps[key]:7.1f} tok/s"
              f"   Switchboard/PEFT {sb_tps[key] / peft_tps[key]:5.1f}x", flush=True)
    print("  target: Switchboard/PEFT >= 10x")

    # correctness: one adapter, one prompt, batch 1, no padding
    check_idx = CHECK_ADAPTER
    prompt = workload[0].prompt_token_ids
    n_check = 16
    peft_model.set_adapter(f"a{check_idx}")
    with torch.inference_mode():
        ref = peft_model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=n_check,
                                  min_new_tokens=n_check, pad_token_id=PAD_TOKEN_ID)[0, len(prompt):].tolist()
    llm.engine.kv_manager.reset_prefix_cache()
    got = llm.generate([prompt], [greedy(n_check)], use_tqdm=False, lora=[loras[check_idx]])[0].output_token_ids
    got_base = llm.generate([prompt], [greedy(n_check)], use_tqdm=False)[0].output_token_ids
    print(f"  correctness: adapter {check_idx} (rank {rank_of(folders[check_idx])}), prompt of {len(prompt)} "
          f"tokens, {n_check} greedy tokens: Switchboard matches PEFT on {sum(a == b for a, b in zip(got, ref))}"
          f"/{n_check}; same prompt on the base model differs from the adapter output on "
          f"{sum(a != b for a, b in zip(got_base, got))}/{n_check} tokens (the adapter is not a no-op)",
          flush=True)
    del peft_model

    # ---- 3. Cold adapter load-to-first-token
    rng = random.Random(args.seed + 3)
    probe_len = max(2, (p_lo + p_hi) // 2)
    print(f"\n== 3. Load-to-first-token (engine.add_request -> step output with the first token), "
          f"prompt {probe_len} tokens, median of {args.cold_repeats} ==", flush=True)
    cold, warm, basel = [], [], []
    for i in range(args.cold_repeats):
        f = cold_folders[i]
        lr = LoraRequest(digest_files(f), str(f))
        cold.append(cold_ttft(llm, random_prompt(probe_len, vocab, rng), lr, f"cold-{i}"))
        warm.append(cold_ttft(llm, random_prompt(probe_len, vocab, rng), lr, f"warm-{i}"))
        basel.append(cold_ttft(llm, random_prompt(probe_len, vocab, rng), None, f"base-{i}"))
    ranks = [rank_of(cold_folders[i]) for i in range(args.cold_repeats)]
    print(f"  fresh adapter (never seen, ranks {ranks}) : {statistics.median(cold) * 1e3:7.1f} ms "
          f"(all: {', '.join(f'{x * 1e3:.0f}' for x in cold)})")
    print(f"  same adapter again (resident)          : {statistics.median(warm) * 1e3:7.1f} ms")
    print(f"  base model                             : {statistics.median(basel) * 1e3:7.1f} ms")
    m = llm.engine.metrics()
    print(f"  engine adapter counters (whole run so far): hits {m.adapter_hits}, misses {m.adapter_misses}, "
          f"evictions {m.adapter_evictions}, page-ins {m.adapter_page_ins}", flush=True)
    del llm

    # ---- 4. S-LoRA scale point
    n_active = args.scale_active
    sw = make_offline_workload(max(args.num_requests, n_active), args.scale, vocab, seed=args.seed)
    s_useful = sum(r.output_len for r in sw)
    pool = scale_point_pool(args.registered, args.cold_repeats)
    active = random.Random(args.seed + 4).sample(pool, n_active)
    s_idx = [active[i % n_active] for i in range(len(sw))]
    random.Random(args.seed + 5).shuffle(s_idx)
    print(f"\n== 4. Scale point: {args.registered} adapters on disk (all digested above), {n_active} active "
          f"(each request a different one: {len(sw)} requests, {s_useful} output tokens), "
          f"{args.scale_slots} device slots, {args.cpu_adapters} host; each config runs once untimed first "
          "(warm-up: reads its adapters from disk into the host tier) ==", flush=True)
    llm = LLM(str(model_path), show_progress=False, dtype="float32", device="cpu", max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
              lora=AdapterConfig(max_lora_rank=64, max_gpu_adapters=args.scale_slots,
                                 max_cpu_adapters=args.cpu_adapters, num_load_threads=1))
    active_key, same32_key = f"{n_active} active adapters", "n=32 alpha=1, same requests"
    rows = {"base (no adapters)": [None] * len(sw),
            active_key: [loras[i] for i in s_idx],
            same32_key: [loras[i] for i in power_law_indices(len(sw), 32, 1.0, args.seed + 32)]}
    for key, lr in rows.items():
        _, _, d = run_switchboard(llm, sw, lr)
        print(f"  warm-up {key}: {fmt_metrics(d)}", flush=True)
    sres: dict[str, list[tuple[float, dict]]] = {k: [] for k in rows}
    for _ in range(args.rounds):
        for key, lr in rows.items():
            s, _, d = run_switchboard(llm, sw, lr)
            sres[key].append((s, d))
    sbest = {k: min(s for s, _ in v) for k, v in sres.items()}
    for key in rows:
        runs = "; ".join(f"{s:.2f} s {fmt_metrics(d)}" for s, d in sres[key])
        print(f"  {key:<28} {sbest[key]:6.2f} s {s_useful / sbest[key]:7.1f} tok/s   (runs: {runs})")
    s_tps = s_useful / sbest[active_key]
    print(f"  vs the n=32 figure of section 1 ({sb_tps[key32]:.1f} tok/s): {s_tps / sb_tps[key32]:.2f}x   "
          "(target >= 0.85)")
    print(f"  vs n=32 on these same {len(sw)} requests: {sbest[same32_key] / sbest[active_key]:.2f}x")
    print(f"  vs base on these requests: {sbest['base (no adapters)'] / sbest[active_key]:.2f}x")
    print(f"\n{load_summary()}; total run {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
