"""A learned router: predicts from the prompt alone whether the small model will get it wrong.

Logistic regression on hashed features of the prompt (character 1-4-grams, word 1-2-grams, and a
few shape signals: length, digit count), trained from a JSONL of past prompts and outcomes, as
RouteLLM's cheap routers do. The threshold on its score is calibrated to a target share of
strong-model calls: with target 0.3, the 30% of prompts it finds hardest go to the strong model.
A router is saved as one `router.json` (settings, threshold, the non-zero weights); nothing is
pickled. Scoring is plain Python over a few hundred features per prompt, so the gateway needs no
torch; only training imports it.

Training data, one JSON object per line:
    {"prompt": "12+7=", "small_correct": true}
"""

from __future__ import annotations

import json
import math
import random
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import msgspec

ROUTER_FILE = "router.json"
_WORD = re.compile(r"\w+|[^\w\s]")
_NUM_SHAPE_FEATURES = 3


@dataclass(frozen=True)
class RouterSettings:
    """How prompts become features, and the calibrated decision threshold."""

    num_buckets: int = 1 << 16
    char_ngrams: tuple[int, ...] = (1, 2, 3, 4)
    word_ngrams: tuple[int, ...] = (1, 2)
    threshold: float = 0.5  # send to the strong model when the score is at or above it
    target_strong_share: float | None = None  # what the threshold was calibrated for


_NGram = Annotated[int, msgspec.Meta(ge=1)]
_Share = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# Scores are in [0, 1]; a threshold calibrated to send nothing strong lies just above the top one.
_Threshold = Annotated[float, msgspec.Meta(ge=0.0, le=math.nextafter(1.0, math.inf))]


class _SavedRouter(msgspec.Struct, forbid_unknown_fields=True):
    """router.json, as `LearnedRouter.save` writes it."""

    num_buckets: Annotated[int, msgspec.Meta(ge=1)]
    char_ngrams: tuple[_NGram, ...]
    word_ngrams: tuple[_NGram, ...]
    threshold: _Threshold
    bias: float
    weights: dict[int, float]
    target_strong_share: _Share | None = None


@dataclass(frozen=True)
class Example:
    prompt: str
    small_correct: bool


class LearnedRouter:
    """Scores prompts in [0, 1]: the predicted probability that the small model is wrong."""

    def __init__(self, settings: RouterSettings, weights: dict[int, float], bias: float):
        self.settings = settings
        self._weights = weights  # feature index -> weight; absent features weigh 0
        self._bias = bias

    def score(self, prompt: str) -> float:
        logit = self._bias + sum(self._weights.get(i, 0.0) * v
                                 for i, v in featurize(prompt, self.settings).items())
        return 1.0 / (1.0 + math.exp(-max(min(logit, 60.0), -60.0)))

    def scores(self, prompts: Sequence[str]) -> list[float]:
        return [self.score(p) for p in prompts]

    def wants_strong(self, prompt: str, threshold: float | None = None) -> tuple[bool, float]:
        """(send to the strong model?, score) at `threshold` (the calibrated one when None)."""
        score = self.score(prompt)
        return score >= (self.settings.threshold if threshold is None else threshold), score

    def calibrated(self, prompts: Sequence[str], target_strong_share: float) -> "LearnedRouter":
        """This router with its threshold set so that `target_strong_share` of `prompts` score at
        or above it (prompts like the traffic it will see: held-out data or recent requests)."""
        threshold = threshold_for_share(self.scores(prompts), target_strong_share)
        settings = RouterSettings(**{**asdict(self.settings), "threshold": threshold,
                                     "target_strong_share": target_strong_share})
        return LearnedRouter(settings, self._weights, self._bias)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        weights = {str(i): w for i, w in sorted(self._weights.items())}
        document = {**asdict(self.settings), "bias": self._bias, "weights": weights}
        (folder / ROUTER_FILE).write_text(json.dumps(document) + "\n")

    @classmethod
    def load(cls, folder: Path) -> "LearnedRouter":
        """The router saved in `folder`; ValueError, saying what is wrong, for a file that is not
        one (each field is checked here, so a bad file fails at startup, not on requests)."""
        try:
            saved = msgspec.json.decode((Path(folder) / ROUTER_FILE).read_bytes(), type=_SavedRouter)
        except (OSError, msgspec.DecodeError) as error:
            raise ValueError(f"{folder} holds no router made by `switchboard router train` "
                             f"({error})") from None
        settings = RouterSettings(saved.num_buckets, saved.char_ngrams, saved.word_ngrams,
                                  saved.threshold, saved.target_strong_share)
        return cls(settings, saved.weights, saved.bias)


def featurize(prompt: str, settings: RouterSettings) -> dict[int, float]:
    """Hashed n-gram counts, scaled to unit length, then the shape features (after the buckets)."""
    counts: dict[int, float] = {}
    for n in settings.char_ngrams:
        for i in range(len(prompt) - n + 1):
            _count(counts, f"c{n}:{prompt[i:i + n]}", settings.num_buckets)
    words = _WORD.findall(prompt.lower())
    for n in settings.word_ngrams:
        for i in range(len(words) - n + 1):
            _count(counts, "w:" + " ".join(words[i:i + n]), settings.num_buckets)
    norm = math.sqrt(sum(v * v for v in counts.values())) or 1.0
    features = {k: v / norm for k, v in counts.items()}
    digits = sum(ch.isdigit() for ch in prompt)
    shape = (math.log1p(len(prompt)), math.log1p(len(words)), math.log1p(digits))
    for i, value in enumerate(shape):
        features[settings.num_buckets + i] = value
    return features


def train(examples: Sequence[Example], settings: RouterSettings = RouterSettings(), *,
          epochs: int = 60, learning_rate: float = 0.05, l2: float = 1e-5,
          seed: int = 0) -> LearnedRouter:
    """Fit the logistic regression (label: the small model was wrong) with full-batch Adam."""
    import torch  # NOTE: only training needs it; scoring is plain Python

    _require_both_outcomes(examples)
    torch.manual_seed(seed)
    indices, offsets, values = _batch(torch, [featurize(e.prompt, settings) for e in examples])
    labels = torch.tensor([0.0 if e.small_correct else 1.0 for e in examples])
    bag = torch.nn.EmbeddingBag(settings.num_buckets + _NUM_SHAPE_FEATURES, 1, mode="sum")
    torch.nn.init.zeros_(bag.weight)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([bag.weight, bias], lr=learning_rate)
    for _ in range(epochs):
        optimizer.zero_grad()
        logits = bag(indices, offsets, per_sample_weights=values).view(-1) + bias
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss = loss + l2 * bag.weight.pow(2).sum()
        loss.backward()
        optimizer.step()
    trained = bag.weight.detach().view(-1).tolist()
    return LearnedRouter(settings, {i: w for i, w in enumerate(trained) if w != 0.0},
                         float(bias.item()))


def threshold_for_share(scores: Sequence[float], share: float) -> float:
    """The score at or above which `share` of `scores` lie (ties may add a few more)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the strong-model share must be in [0, 1], got {share}")
    if not scores:
        raise ValueError("calibration needs at least one prompt")
    ordered = sorted(scores, reverse=True)
    count = round(share * len(ordered))
    if count == 0:
        return math.nextafter(ordered[0], math.inf)  # above every score: nothing goes strong
    return ordered[count - 1]


def read_examples(lines: Iterable[str], source: str = "the data") -> list[Example]:
    """Examples from JSONL lines; a ValueError naming the line for anything malformed."""
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt, correct = row["prompt"], row["small_correct"]
            if not isinstance(prompt, str) or not isinstance(correct, bool):
                raise TypeError("prompt must be a string and small_correct a boolean")
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{source}, line {number}: expected "
                             f'{{"prompt": "...", "small_correct": true}} ({error})') from None
        examples.append(Example(prompt, correct))
    return examples


def _count(counts: dict[int, float], feature: str, num_buckets: int) -> None:
    # NOTE: crc32, not hash(): Python salts str hashes per process, and features must be stable.
    bucket = zlib.crc32(feature.encode()) % num_buckets
    counts[bucket] = counts.get(bucket, 0.0) + 1.0


def _batch(torch, rows: list[dict[int, float]]):
    """EmbeddingBag inputs (indices, offsets, per-sample weights) for sparse feature rows."""
    indices, values, offsets = [], [], []
    for row in rows:
        offsets.append(len(indices))
        indices.extend(row)
        values.extend(row.values())
    return (torch.tensor(indices, dtype=torch.long), torch.tensor(offsets, dtype=torch.long),
            torch.tensor(values, dtype=torch.float32))


@dataclass(frozen=True)
class TrainingReport:
    """What `train_router` did, for the command's output."""

    num_train: int
    num_holdout: int
    threshold: float
    strong_share: float  # of the held-out prompts, at the calibrated threshold
    auc: float  # of the held-out scores against "the small model was wrong"


def train_router(examples: Sequence[Example], target_strong_share: float, *,
                 holdout_fraction: float = 0.2, seed: int = 0,
                 epochs: int = 60) -> tuple[LearnedRouter, TrainingReport]:
    """Train on a seeded split of `examples` and calibrate the threshold on the held-out rest."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout fraction must be in (0, 1), got {holdout_fraction}")
    if not 0.0 <= target_strong_share <= 1.0:  # NOTE: before training, not once it is done
        raise ValueError(f"the strong-model share must be in [0, 1], got {target_strong_share}")
    _require_both_outcomes(examples)  # NOTE: _split needs at least one example
    holdout, training = _split(examples, holdout_fraction, seed)
    router = train(training, epochs=epochs, seed=seed)
    router = router.calibrated([e.prompt for e in holdout], target_strong_share)
    scores = router.scores([e.prompt for e in holdout])
    share = sum(s >= router.settings.threshold for s in scores) / len(scores)
    auc = roc_auc(scores, [not e.small_correct for e in holdout])
    return router, TrainingReport(len(training), len(holdout), router.settings.threshold, share, auc)


def _require_both_outcomes(examples: Sequence[Example]) -> None:
    """ValueError unless `examples` hold prompts of both outcomes: none can be learned from one."""
    if len({e.small_correct for e in examples}) < 2:
        raise ValueError("training needs prompts the small model got right and prompts it got "
                         "wrong")


def _split(examples: Sequence[Example], holdout_fraction: float, seed: int
           ) -> tuple[list[Example], list[Example]]:
    """(held out, training): a seeded shuffle of each outcome's examples, `holdout_fraction` of
    each held out, so that the held-out part has both outcomes in their share of the whole (the
    calibration reads it as the traffic to come). Training keeps at least one example of each
    outcome (it learns nothing from one alone), and at least one is held out: ValueError when
    the examples are too few for both."""
    rng = random.Random(seed)
    groups = [[e for e in examples if e.small_correct is outcome] for outcome in (False, True)]
    holdout: list[Example] = []
    training: list[Example] = []
    for group in groups:
        rng.shuffle(group)
        cut = min(round(len(group) * holdout_fraction), len(group) - 1)
        holdout += group[:cut]
        training += group[cut:]
    if not holdout:
        spare = [e for group in groups if len(group) > 1 for e in group[-1:]]
        if not spare:
            raise ValueError(f"{len(examples)} prompts are too few to hold some out to calibrate "
                             "on and train on both outcomes: give at least 3")
        holdout.append(spare[0])
        training.remove(spare[0])
    return holdout, training


def roc_auc(scores: Sequence[float], positives: Sequence[bool]) -> float:
    """The probability that a random positive scores above a random negative (ties count half)."""
    pos = [s for s, p in zip(scores, positives) if p]
    neg = [s for s, p in zip(scores, positives) if not p]
    if not pos or not neg:
        return float("nan")
    ranked = sorted((s, p) for s, p in zip(scores, positives))
    rank_sum, i = 0.0, 0
    while i < len(ranked):  # average ranks over ties
        j = i
        while j < len(ranked) and ranked[j][0] == ranked[i][0]:
            j += 1
        average_rank = (i + j + 1) / 2
        rank_sum += average_rank * sum(1 for k in range(i, j) if ranked[k][1])
        i = j
    return (rank_sum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))
