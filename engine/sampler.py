"""Per-request sampling from next-token logits: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import torch

from engine.request import Request, TokenLogprobs
from engine.scheduler import SampledToken


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def make_request_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """logits: [num_requests, vocab] float32, row i belongs to requests[i]."""
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            # NOTE: logprobs describe the model's own distribution, before penalties and temperature.
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_repetition_penalty(logits, requests)
        token_ids = torch.argmax(logits, dim=-1)  # [num_requests]
        for i, request in enumerate(requests):
            if not request.sampling_params.is_greedy:
                token_ids[i] = self._sample_row(logits[i], request)
        token_list = token_ids.tolist()
        return [
            SampledToken(token, self._logprobs(raw_logprobs[i], token, request)
                         if request.sampling_params.logprobs is not None else None)
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
            # Drop a token when the tokens before it already cover top_p; the first always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
            row = row.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
        probs = torch.softmax(row, dim=-1)
        generator = request.generator or self.generator
        return torch.multinomial(probs, 1, generator=generator)[0]

    @staticmethod
    def _apply_repetition_penalty(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            request = requests[i]
            penalty = request.sampling_params.repetition_penalty
            seen = torch.tensor(sorted(set(request.all_token_ids)), device=logits.device)
            values = logits[i, seen]
            # As in CTRL and transformers: shrink positive logits, push negative ones further down.
            logits[i, seen] = torch.where(values > 0, values / penalty, values * penalty)
        return logits

    @staticmethod
    def _logprobs(row: torch.Tensor, token: int, request: Request) -> TokenLogprobs:
        k = request.sampling_params.logprobs
        top = []
        if k:
            values, ids = torch.topk(row, k)
            top = list(zip(ids.tolist(), values.tolist()))
        return TokenLogprobs(token, float(row[token]), top)
