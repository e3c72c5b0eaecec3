"""What a model costs per token, and so what a call costs, in US dollars."""

from __future__ import annotations

from dataclasses import dataclass

_PER = 1_000_000
# A dollar a token is 1e6: this leaves room for prices set high on purpose (to test budgets), while
# a call's cost (at most ~1e8 tokens) stays far from float overflow, which would bill inf.
MAX_USD_PER_MTOK = 1e9


@dataclass(frozen=True)
class Price:
    """A model's price per million prompt (input) and completion (output) tokens."""

    input_usd_per_mtok: float = 0.0
    output_usd_per_mtok: float = 0.0

    def __post_init__(self) -> None:
        for name in ("input_usd_per_mtok", "output_usd_per_mtok"):
            value = getattr(self, name)
            if not 0 <= value <= MAX_USD_PER_MTOK:
                raise ValueError(f"{name} must be in [0, {MAX_USD_PER_MTOK:g}] USD per million "
                                 f"tokens, got {value!r}")

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        """The price of a call that read `tokens_in` and wrote `tokens_out` tokens."""
        return (tokens_in * self.input_usd_per_mtok + tokens_out * self.output_usd_per_mtok) / _PER


FREE = Price()
