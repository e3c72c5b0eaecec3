"""Train the arithmetic fixtures: three Llamas of different sizes on multi-digit addition.

Each model is a LlamaForCausalLM trained from scratch (plain torch, AdamW, loss on the answer tokens
and EOS only) on problems from `benchmarks.arithmetic`, with the demo model's byte tokenizer, on one
curriculum (1- and 2-digit sums first, then 3-digit ones) and a step budget that grows with the model.
Held-out problems never enter training (the split is a hash of the prompt). The models are saved as
Hugging Face folders in float16 under `--out` (default tests/fixtures/arithmetic/{small,medium,large}),
then evaluated through Switchboard's own engine: greedy accuracy per difficulty, each model's
token probabilities on right and wrong answers, and a cascade probe. Run from the repository root:

    python -m benchmarks.train_arithmetic                  # all three models, then the report
    python -m benchmarks.train_arithmetic --report-only    # evaluate the saved fixtures again

Training is seeded and single-threaded by default, so a rerun on the same machine and library
versions writes the same weights.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from benchmarks import arithmetic
from benchmarks.arithmetic import Problem
from benchmarks.common import positive_int, random_seed
from engine.demo import build_byte_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "arithmetic"
IGNORE_INDEX = -100
CURRICULUM = ((0, {1: 1.0, 2: 2.0}), (600, {1: 1.0, 2: 2.0, 3: 3.0}))
"""(first step, difficulty -> weight in the batch from then on). Each operand length needs its own
alignment, and a model facing all lengths at once learns them in a random order; adding one length
at a time makes every model learn short sums first. Every model sees the same stream of batches;
a smaller budget sees a prefix of it."""
WARMUP_STEPS = 100
DECAY_SHARE = 0.2
MAX_SMALL_QUALITY = 0.7
MIN_CASCADE_QUALITY = 0.95
MAX_ESCALATION_RATE = 0.4
"""The routing benchmark's targets: small alone at most 70% of the large model's accuracy, the cascade
at least 95% of it with at most 40% of the requests escalated."""
FIT_ESCALATION_RATE = 0.38
"""The probe's threshold escalates at most this share of the fit set, a margin under
MAX_ESCALATION_RATE for the sampling noise between the fit set and the test set."""
PROBE_MIXES = ({1: 0.1, 2: 0.5, 3: 0.4}, {1: 0.1, 2: 0.55, 3: 0.35})
"""Difficulty -> share of a cascade probe: 60% (65%) sums the small fixture gets right, 40% (35%)
it gets wrong."""


@dataclass(frozen=True)
class ModelSize:
    """One fixture's architecture and training budget."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    num_steps: int
    learning_rate: float


SIZES = {
    size.name: size
    for size in (
        ModelSize("small", hidden_size=48, num_layers=2, num_heads=4, intermediate_size=128,
                  num_steps=1800, learning_rate=1e-3),
        ModelSize("medium", hidden_size=96, num_layers=3, num_heads=6, intermediate_size=256,
                  num_steps=2400, learning_rate=1e-3),
        ModelSize("large", hidden_size=128, num_layers=4, num_heads=8, intermediate_size=344,
                  num_steps=4000, learning_rate=1e-3),
    )
}


def model_config(size: ModelSize, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
        num_hidden_layers=size.num_layers, num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_heads, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


def encode(tokenizer: PreTrainedTokenizerFast, problem: Problem) -> tuple[list[int], int]:
    """Token ids of prompt + answer + EOS, and the number of prompt tokens (BOS included)."""
    prompt_ids = tokenizer.encode(problem.prompt)
    answer_ids = tokenizer.encode(problem.answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    return prompt_ids + answer_ids, len(prompt_ids)


def make_batch(tokenizer: PreTrainedTokenizerFast,
               problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded inputs and labels; labels are IGNORE_INDEX except where the next token is an
    answer token or EOS. Right padding needs no attention mask: causal attention never looks ahead."""
    encoded = [encode(tokenizer, p) for p in problems]
    length = max(len(ids) for ids, _ in encoded)
    input_ids = torch.full((len(problems), length), tokenizer.eos_token_id)  # [B, S]
    labels = torch.full((len(problems), length), IGNORE_INDEX)  # [B, S]
    for row, (ids, num_prompt) in enumerate(encoded):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, num_prompt - 1 : len(ids) - 1] = torch.tensor(ids[num_prompt:])
    return input_ids, labels


def difficulty_weights(step: int) -> dict[int, float]:
    return [weights for start, weights in CURRICULUM if start <= step][-1]


def sample_batch(rng: random.Random, batch_size: int, step: int) -> list[Problem]:
    weights = difficulty_weights(step)
    difficulties = rng.choices(list(weights), weights=list(weights.values()), k=batch_size)
    return [arithmetic.sample_train_problem(rng, d) for d in difficulties]


def learning_rate(size: ModelSize, step: int) -> float:
    """Linear warmup, constant, then linear decay to zero over the last DECAY_SHARE of the steps
    (a cosine would already have halved the rate when the longest sums enter the curriculum)."""
    warmup = min(1.0, (step + 1) / WARMUP_STEPS)
    decay = min(1.0, (size.num_steps - step) / (DECAY_SHARE * size.num_steps))
    return size.learning_rate * warmup * decay


@torch.no_grad()
def greedy_answers(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                   problems: list[Problem]) -> list[str]:
    """Greedy completions, decoded up to EOS. NOTE: all prompts must have the same token count
    (true within one difficulty), so the batch needs no padding."""
    input_ids = torch.tensor([tokenizer.encode(p.prompt) for p in problems])  # [B, S]
    max_new = arithmetic.MAX_DIFFICULTY + 2
    for _ in range(max_new):
        next_ids = model(input_ids=input_ids).logits[:, -1].argmax(-1)  # [B]
        input_ids = torch.cat([input_ids, next_ids[:, None]], dim=1)
    answers = []
    for row in input_ids[:, -max_new:].tolist():
        end = row.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in row else len(row)
        answers.append(tokenizer.decode(row[:end]))
    return answers


def accuracy_by_difficulty(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
                           eval_sets: dict[int, list[Problem]]) -> dict[int, float]:
    was_training = model.training
    model.eval()
    scores = {d: arithmetic.accuracy(ps, greedy_answers(model, tokenizer, ps)) for d, ps in eval_sets.items()}
    model.train(was_training)
    return scores


def format_scores(scores: dict[int, float]) -> str:
    return "  ".join(f"{d}-digit {acc:6.1%}" for d, acc in sorted(scores.items()))


def train(size: ModelSize, tokenizer: PreTrainedTokenizerFast, seed: int, batch_size: int,
          eval_sets: dict[int, list[Problem]], log_every: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(model_config(size, tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=size.learning_rate, betas=(0.9, 0.98),
                                  weight_decay=0.0)
    rng = random.Random(seed)
    start = time.perf_counter()
    for step in range(size.num_steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(size, step)
        input_ids, labels = make_batch(tokenizer, sample_batch(rng, batch_size, step))
        logits = model(input_ids=input_ids).logits  # [B, S, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if (step + 1) % log_every == 0 or step + 1 == size.num_steps:
            scores = accuracy_by_difficulty(model, tokenizer, eval_sets)
            print(f"  {size.name} step {step + 1:5d}/{size.num_steps}  loss {loss.item():.4f}  "
                  f"{format_scores(scores)}  [{time.perf_counter() - start:.0f}s]", flush=True)
    return model


def save_fixture(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """float16 safetensors (half the bytes of float32; the engine upcasts on load), tokenizer files,
    and a generation config that stops at EOS."""
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     do_sample=False, max_new_tokens=arithmetic.MAX_DIFFICULTY + 2).save_pretrained(folder)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def hf_accuracy(folder: Path, tokenizer: PreTrainedTokenizerFast,
                eval_sets: dict[int, list[Problem]]) -> dict[int, float]:
    """Accuracy of the saved (float16) weights under transformers, upcast to float32 like the engine."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return accuracy_by_difficulty(model, tokenizer, eval_sets)


def engine_answers(folder: Path, problems: list[Problem]) -> list[arithmetic.GradedAnswer]:
    from engine.llm import LLM

    llm = LLM(str(folder), show_progress=False, num_kv_blocks=256)
    return arithmetic.answer_with_engine(llm, problems)


def print_confidence(answers: list[arithmetic.GradedAnswer]) -> None:
    for label, group in (("right", [a for a in answers if a.is_correct]),
                         ("wrong", [a for a in answers if not a.is_correct])):
        if not group:
            print(f"    {label}: none")
            continue
        probs = [a.min_token_prob for a in group]
        mean_logprob = statistics.fmean(a.mean_logprob for a in group)
        print(f"    {label}: {len(group):4d} answers  mean logprob/token {mean_logprob:7.3f}  "
              f"min token prob: mean {statistics.fmean(probs):.3f}, median {statistics.median(probs):.3f}, "
              f"share < 0.5 {sum(p < 0.5 for p in probs) / len(probs):.1%}")


def print_probe(small_dir: Path, large_dir: Path, mix: dict[int, float], num: int) -> None:
    """The cascade on one mix: threshold fitted on one held-out sample of it, scored on another."""
    fit_set = arithmetic.mixed_problems(1, mix, num)
    test_set = arithmetic.mixed_problems(2, mix, num)
    small_fit, small_test = (engine_answers(small_dir, ps) for ps in (fit_set, test_set))
    large_fit, large_test = (engine_answers(large_dir, ps) for ps in (fit_set, test_set))
    threshold = arithmetic.best_threshold(small_fit, large_fit, FIT_ESCALATION_RATE)
    result = arithmetic.cascade(small_test, large_test, threshold)
    meets = (result.small_to_large <= MAX_SMALL_QUALITY and result.cascade_to_large >= MIN_CASCADE_QUALITY
             and result.escalation_rate <= MAX_ESCALATION_RATE)
    print(f"probe: mix {mix} (difficulty: share), {num} problems; threshold fitted on another {num} "
          f"(at most {FIT_ESCALATION_RATE:.0%} escalated): min token prob < {threshold:.3f} escalates")
    print(f"  small {result.small_accuracy:.1%}  large {result.large_accuracy:.1%}  "
          f"small/large {result.small_to_large:.3f}")
    print(f"  cascade {result.cascade_accuracy:.1%} = {result.cascade_to_large:.3f} of large, "
          f"{result.escalation_rate:.1%} escalated; small/large <= {MAX_SMALL_QUALITY:.2f}, cascade >= "
          f"{MIN_CASCADE_QUALITY:.0%} of large with <= {MAX_ESCALATION_RATE:.0%} escalated: "
          f"{'yes' if meets else 'no'}")


def print_report(out: Path, names: list[str], num_per_difficulty: int, probe_size: int) -> None:
    """Per-difficulty held-out accuracy of each saved fixture, under transformers and the engine."""
    tokenizer = build_byte_tokenizer()
    eval_sets = {d: arithmetic.held_out_problems(20_000 + d, d, num_per_difficulty)
                 for d in range(1, arithmetic.MAX_DIFFICULTY + 1)}
    problems = [p for d in sorted(eval_sets) for p in eval_sets[d]]
    sizes = ", ".join(f"{d}-digit: {len(ps)}" for d, ps in eval_sets.items())
    print(f"held-out accuracy (greedy; {sizes} problems)")
    for name in names:
        answers = engine_answers(out / name, problems)
        engine_scores = {d: arithmetic.accuracy(ps, [a.text for a in answers if a.problem.difficulty == d])
                         for d, ps in eval_sets.items()}
        print(f"  {name:6s} transformers  {format_scores(hf_accuracy(out / name, tokenizer, eval_sets))}")
        print(f"  {name:6s} engine        {format_scores(engine_scores)}")
        print("  confidence of its answers (engine):")
        print_confidence(answers)
    if "small" in names and "large" in names:
        for mix in PROBE_MIXES:
            print_probe(out / "small", out / "large", mix, probe_size)


def size_names(text: str) -> list[str]:
    """An argparse type: comma-separated names of SIZES."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in SIZES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown sizes {', '.join(map(repr, unknown))}; the "
                                         f"sizes are {', '.join(SIZES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture root (one folder per size)")
    parser.add_argument("--sizes", type=size_names, default=list(SIZES),
                        help=f"comma-separated sizes to train (default {','.join(SIZES)})")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="override every size's step count")
    parser.add_argument("--batch-size", type=positive_int, default=64, help="problems per training step")
    parser.add_argument("--seed", type=random_seed, default=0, help="seed of weights and training data")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads")
    parser.add_argument("--eval-size", type=positive_int, default=200,
                        help="held-out problems per difficulty for the progress log")
    parser.add_argument("--log-every", type=positive_int, default=250, help="steps between progress lines")
    parser.add_argument("--report-size", type=positive_int, default=500,
                        help="held-out problems per difficulty in the final report")
    parser.add_argument("--probe-size", type=positive_int, default=1000,
                        help="problems in each cascade probe mix")
    parser.add_argument("--report-only", action="store_true", help="skip training; evaluate --out")
    args = parser.parse_args(argv)
    untrained = [name for name in args.sizes if not (args.out / name / "config.json").is_file()]
    if args.report_only and untrained:
        parser.error(f"argument --report-only: no trained {', '.join(untrained)} in {args.out}; "
                     "train them first (leave out --report-only), or name the fixture root with --out")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    transformers_logging.disable_progress_bar()
    tokenizer = build_byte_tokenizer()
    names = args.sizes
    eval_sets = {d: arithmetic.held_out_problems(10_000 + d, d, args.eval_size)
                 for d in range(1, arithmetic.MAX_DIFFICULTY + 1)}
    if not args.report_only:
        for name in names:
            size = SIZES[name]
            if args.steps is not None:
                size = replace(size, num_steps=args.steps)
            start = time.perf_counter()
            model = train(size, tokenizer, args.seed, args.batch_size, eval_sets, args.log_every)
            save_fixture(model, tokenizer, args.out / name)
            num_params = sum(p.numel() for p in model.parameters())
            print(f"{name}: {num_params:,} parameters, trained in {time.perf_counter() - start:.0f}s, "
                  f"{folder_bytes(args.out / name):,} bytes on disk", flush=True)
    print_report(args.out, names, args.report_size, args.probe_size)


if __name__ == "__main__":
    main()
