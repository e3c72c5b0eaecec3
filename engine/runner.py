"""ModelRunner: turns a SchedulerOutput into flat tensors, runs the model, samples.

The runner keeps no per-request state between steps: everything it needs is read from the
Request objects, so preemption and abort need nothing from it.
"""

from __future__ import annotations

import torch

from adapters.cache import AdapterCache
from engine.lora import LoraBatch
from engine.model.attention import AttentionMetadata
from engine.model.llama import ForwardBatch, LlamaModel
from engine.model.spec import ModelSpec
from engine.request import TokenLogprobs
from engine.sampler import Sampler
from engine.scheduler import RunnerOutput, ScheduledRequest, SchedulerOutput


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element_size


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int,
                 adapter_cache: AdapterCache | None = None):
        spec = model.spec
        self.model = model
        self.adapter_cache = adapter_cache
        self.block_size = block_size
        self.device = model.device
        shape = (num_blocks * block_size, spec.num_kv_heads, spec.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=model.dtype, device=self.device)
                         for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=model.dtype, device=self.device)
                         for _ in range(spec.num_layers)]
        self.sampler = Sampler(seed, self.device)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        if output.is_empty:
            return RunnerOutput({})
        items = self.batch_order(output)
        batch = self.prepare_batch(items)
        if batch.lora is not None:
            self.adapter_cache.wait_page_ins()
        logits = self.model.forward(batch, self.k_caches, self.v_caches)
        sampling = [item.request for item in items if item.samples]
        tokens = self.sampler.sample(logits[:len(sampling)], sampling) if sampling else []
        return RunnerOutput({r.request_id: t for r, t in zip(sampling, tokens)},
                            self._prompt_logprobs(items, logits[len(sampling):]))

    def _prompt_logprobs(self, items: list[ScheduledRequest],
                         logits: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """Split the prompt rows' logits (after the sampling rows, in item order) by request."""
        by_request, row = {}, 0
        for item in items:
            request, positions = item.request, item.prompt_logprob_positions
            if positions:
                rows = logits[row:row + len(positions)]
                next_tokens = request.prompt_token_ids[positions.start + 1:positions.stop + 1]
                by_request[request.request_id] = self.sampler.prompt_logprobs(
                    rows, next_tokens, request.sampling_params.prompt_logprobs)
                row += len(positions)
        return by_request

    @staticmethod
    def batch_order(output: SchedulerOutput) -> list[ScheduledRequest]:
        """Scheduled requests grouped by adapter slot, so each adapter is one SGMV segment."""
        return sorted(output.scheduled, key=lambda item: item.request.lora_slot)

    def prepare_batch(self, items: list[ScheduledRequest]) -> ForwardBatch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, block_tables, logits_rows = [], [], [], []
        for item in items:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_tokens
            input_ids.extend(request.token_ids_slice(start, end))
            positions.extend(range(start, end))
            query_lens.append(item.num_tokens)
            context_lens.append(end)
            block_tables.append(request.block_ids)
            if item.samples:
                logits_rows.append(len(input_ids) - 1)
        # Then the rows prompt logprobs are read from (NOTE: [rows, vocab] float32 logits: a
        # chunk's worth at most, which max_num_batched_tokens bounds).
        offset = 0
        for item in items:
            start = item.request.num_computed_tokens
            logits_rows.extend(offset + p - start for p in item.prompt_logprob_positions)
            offset += item.num_tokens
        attention = AttentionMetadata.build(query_lens, context_lens, block_tables, self.block_size,
                                            self.model.spec.sliding_window, self.device)
        lora = None
        if self.adapter_cache is not None:
            token_slots = [(item.num_tokens, item.request.lora_slot) for item in items]
            lora = LoraBatch.build(token_slots, self.adapter_cache.slots, self.device)
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attention=attention,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=self.device),
            lora=lora,
        )
