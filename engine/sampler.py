"""Per-request sampling from next-token logits: penalties and logit biases, greedy, temperature,
top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs
from engine.scheduler import SampledToken


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def make_request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(_mixed_seed(seed))

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [num_requests, vocab] float32, row i belongs to requests[i]. A request whose row
        cannot be sampled gets a SampledToken with `error` set; the other rows are unaffected."""
        # A row with NaN or +inf (the model's activations overflowed) fails its request, greedy or
        # not: argmax would silently pick token 0 of a NaN row. (A row's max is NaN if any of its
        # values is; it costs a fifth of isfinite().all().)
        errors = {i: "sampling failed: the model's logits are not finite (NaN or inf)"
                  for i in torch.nonzero(~torch.isfinite(logits.amax(dim=-1))).flatten().tolist()}
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            # NOTE: logprobs describe the model's own distribution, before penalties and temperature.
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._adjust(logits, requests)
        token_ids = torch.argmax(logits, dim=-1)  # [num_requests]
        for i, request in enumerate(requests):
            if not request.sampling_params.is_greedy and i not in errors:
                try:
                    token_ids[i] = self._sample_row(logits[i], request)
                except RuntimeError as error:  # e.g. a non-finite row: fail its request, not the batch
                    errors[i] = f"sampling failed: {error}"
        token_list = token_ids.tolist()
        return [
            SampledToken(token, self._logprobs(raw_logprobs[i], token, request)
                         if request.sampling_params.logprobs is not None else None, errors.get(i))
            for i, (token, request) in enumerate(zip(token_list, requests))
        ]

    def _sample_row(self, row: torch.Tensor, request: Request) -> torch.Tensor:
        params = request.sampling_params
        row = row / params.temperature
        if params.top_k:
            kth = torch.topk(row, min(params.top_k, row.numel())).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the tokens before it already cover top_p; the first always stays,
            # even for a top_p that is 0 in float32 (nothing would be left to sample).
            drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            drop[0] = False
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        generator = request.generator or self.generator
        return torch.multinomial(probs, 1, generator=generator)[0]

    @staticmethod
    def _adjust(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """The logits after each request's biases and penalties (a copy if any has one), in
        vLLM's and transformers' order: logit_bias, then repetition (multiplicative, so it
        scales the biased logit), then presence and frequency; tokens the request must not
        sample yet (before min_tokens) at -inf."""
        banned = [r.unsampleable_token_ids for r in requests]
        rows = [i for i, r in enumerate(requests) if r.sampling_params.adjusts_logits or banned[i]]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            request, row = requests[i], logits[i]
            if banned[i]:
                row[torch.tensor(sorted(banned[i]), device=logits.device)] = float("-inf")
            params = request.sampling_params
            if params.logit_bias:
                ids = torch.tensor(list(params.logit_bias), device=logits.device)
                row[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device)
            if params.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(request.all_token_ids)), device=logits.device)
                values = row[seen]
                # As in CTRL and transformers: shrink positive logits, push negative ones further down.
                row[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                        values * params.repetition_penalty)
            if (params.presence_penalty or params.frequency_penalty) and request.output_token_ids:
                ids, counts = torch.tensor(request.output_token_ids, device=logits.device).unique(
                    return_counts=True)
                row[ids] -= params.frequency_penalty * counts + params.presence_penalty
        return logits

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], k: int) -> list[TokenLogprobs]:
        """logits: [n, vocab], row i read at the position before next_tokens[i]: each token's
        logprob there and the top-k alternatives (the model's own distribution, like `logprobs`)."""
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = torch.tensor(next_tokens, device=logits.device)
        chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
        # NOTE: k up to the vocabulary's size: a model of fewer than 20 tokens lists them all.
        k = min(k, logprobs.shape[-1])
        top_values, top_ids = torch.topk(logprobs, k) if k else (logprobs[:, :0], logprobs[:, :0].long())
        return [TokenLogprobs(token, value, list(zip(ids, values)))
                for token, value, ids, values in zip(next_tokens, chosen, top_ids.tolist(), top_values.tolist())]

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, request: Request) -> TokenLogprobs:
        k = request.sampling_params.logprobs
        top = []
        if k:
            values, ids = torch.topk(row, min(k, row.numel()))  # (see prompt_logprobs)
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprobs(token, float(row[token]), top)


_UINT64 = (1 << 64) - 1


def _mixed_seed(seed: int) -> int:
    """`seed` (any 64-bit integer) through splitmix64's mixer. torch's CPU generator seeds its
    Mersenne Twister with the low 32 bits alone, so seeds 0 and 2**32 (or -1 and 2**63 - 1) would
    sample the same; mixed first, every bit of the seed counts."""
    z = (seed + 0x9E3779B97F4A7C15) & _UINT64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _UINT64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _UINT64
    return z ^ (z >> 31)
