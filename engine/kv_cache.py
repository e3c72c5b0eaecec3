"""Block pool of the paged KV cache: refcounted fixed-size blocks, block tables, prefix caching.

The manager only hands out block ids; the tensors live in the model runner. A block's KV is
addressed by slot `block_id * block_size + offset`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hash_block(parent: bytes, tenant: str | None, adapter_id: str | None,
               token_ids: list[int]) -> bytes:
    """Chained hash of one full block: the prefix before it, the tenant, the adapter, its tokens.

    NOTE: the adapter identity is part of the key because LoRA changes K and V; two requests share a
    block only if they used the same adapter version (or none) on the same prefix. The tenant is
    because a hit shows (in `cached_tokens`, and in the time to the first token) that the prefix
    was sent before: shared across tenants, one could probe another's prompts. Requests without a
    tenant (the engine used directly) share among themselves.
    """
    digest = hashlib.sha256(parent)
    for scope in (tenant, adapter_id):
        encoded = (scope or "").encode()
        digest.update(len(encoded).to_bytes(4, "little") + encoded)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class PrefixCacheStats:
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    """Allocates KV blocks to requests; shares full blocks between requests with the same prefix.

    Free blocks sit in an LRU queue. A freed block keeps its hash (and so its cached KV) until it is
    reused for something else, so a later request, or the same request after preemption, can hit it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.cached_blocks: dict[bytes, int] = {}
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def get_computed_blocks(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of `request` (full blocks only).

        At least one token is always left to compute, because the step that computes the last
        prompt token is the one that produces logits.
        """
        if not self.enable_prefix_caching:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, max_hit_blocks)
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.cached_blocks.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               computed_blocks: list[int] = ()) -> int:
        num_computed = len(computed_blocks) * self.block_size or request.num_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        return max(0, num_required - len(request.block_ids) - len(computed_blocks))

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_blocks: list[int] = ()) -> bool:
        # Hit blocks that nobody references sit in the free queue; taking them shrinks it.
        num_free_hits = sum(1 for b in computed_blocks if self.ref_counts[b] == 0)
        needed = self.num_blocks_to_allocate(request, num_new_tokens, computed_blocks)
        return needed <= self.num_free_blocks - num_free_hits

    def allocate(self, request: Request, num_new_tokens: int,
                 computed_blocks: list[int] | None = None) -> None:
        """Give `request` room for `num_new_tokens` more tokens. Check `can_allocate` first.

        `computed_blocks` (from `get_computed_blocks`) is passed when the request is admitted: the
        hit blocks are shared and `num_computed_tokens` jumps past them.
        """
        if computed_blocks is not None:
            assert not request.block_ids, "admission of a request that still holds blocks"
            for block_id in computed_blocks:
                self._touch(block_id)
            request.block_ids.extend(computed_blocks)
            request.num_computed_tokens = len(computed_blocks) * self.block_size
            # NOTE: a request back from a preemption finds its own blocks: counting it would raise
            # the hit rate with what says nothing of how clients' prompts share prefixes. One
            # asking for prompt logprobs never looks (it needs every prompt position's logits).
            if request.num_preemptions == 0 and not request.needs_prompt_logprobs:
                self.prefix_stats.num_queried_tokens += request.num_tokens
                self.prefix_stats.num_hit_tokens += request.num_computed_tokens
        for _ in range(self.num_blocks_to_allocate(request, num_new_tokens)):
            request.block_ids.append(self._pop_free_block())

    def free(self, request: Request) -> None:
        """Release every block of `request`; cached ones stay findable until reused."""
        # NOTE: reversed, so a sequence's tail blocks are evicted before its (more shareable) head.
        for block_id in reversed(request.block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
        request.block_ids = []

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's computed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        self._extend_block_hashes(request, num_full)
        for index in range(num_full):
            block_id = request.block_ids[index]
            if self.hash_of_block[block_id] is not None:
                continue
            block_hash = request.block_hashes[index]
            if block_hash not in self.cached_blocks:
                self.cached_blocks[block_hash] = block_id
                self.hash_of_block[block_id] = block_hash

    def full_block_hashes(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the request's first `num_tokens` tokens."""
        num_full = num_tokens // self.block_size
        self._extend_block_hashes(request, num_full)
        return request.block_hashes[:num_full]

    def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (e.g. after a weight update)."""
        self.cached_blocks.clear()
        self.hash_of_block = [None] * self.num_blocks

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, request.tenant, request.adapter_id,
                                     request.token_ids_slice(i * bs, (i + 1) * bs)))

    def _touch(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        stale_hash = self.hash_of_block[block_id]
        if stale_hash is not None:
            # Reused for new content: its old KV is about to be overwritten.
            if self.cached_blocks.get(stale_hash) == block_id:
                del self.cached_blocks[stale_hash]
            self.hash_of_block[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id
