"""Plausible wrong solutions of each puzzle: what a learner might write, each with the words its check's
report must use to name the mistake (tests/puzzles/test_puzzles.py). Some are hostile to the grader: they loop
forever, exit, interrupt themselves, answer with NumPy values or with a bool for an index; each must still be a
failed case with a report, never a hang or a crash (the test runs them with a short time limit)."""

import sys

import kvlab.device  # noqa: F401 - first: it selects Triton's interpreter on a CPU, before triton loads
import numpy as np
import torch
import triton
import triton.language as tl

from kvlab.blocks import AllocStatus, EvictionPolicy
from kvlab.errors import OutOfBlocksError
from kvlab.puzzles.solutions.kv_cost_router import MyRouter
from kvlab.puzzles.solutions.lru_policy import MyLRU
from kvlab.puzzles.solutions.tier_promotion import tier_promotion
from kvlab.studies.routers import Router


# ---- slot_mapping -------------------------------------------------------------------------------------------
def slots_without_block_size(table, bs, start, end):
    return [table[p // bs] + p % bs for p in range(start, end)]  # forgot "x block_size"


def slots_one_too_many(table, bs, start, end):
    return [table[p // bs] * bs + p % bs for p in range(start, end + 1)]  # end is exclusive


def slots_without_block_size_in_numpy(table, bs, start, end):
    positions = np.arange(start, end)
    return np.asarray(table)[positions // bs] + positions % bs  # an array of np.int64: graded as numbers


def slots_forever(table, bs, start, end):
    slots, p = [], start
    while p < end:  # forgot p += 1
        slots.append(table[p // bs] * bs + p % bs)
    return slots


def slots_then_exit(table, bs, start, end):
    slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
    sys.exit(0 if slots else 1)  # a script's habit, which would stop the notebook's kernel


def slots_interrupting_itself(table, bs, start, end):
    raise KeyboardInterrupt  # a learner's own "stop here", not the user pressing Ctrl-C


# ---- block_hashes -------------------------------------------------------------------------------------------
def hashes_each_block_alone(tokens, bs, hash_fn):
    return [hash_fn(None, tuple(tokens[i:i + bs])) for i in range(0, len(tokens) - bs + 1, bs)]  # no parent


def hashes_the_partial_block_too(tokens, bs, hash_fn):
    hashes, parent = [], None
    for i in range(0, len(tokens), bs):  # a partial last block is never looked up
        parent = hash_fn(parent, tuple(tokens[i:i + bs]))
        hashes.append(parent)
    return hashes


# ---- allocate_with_hits -------------------------------------------------------------------------------------
def admit(num_tokens, bs, prompt_hashes, cached, refs, free, *, max_hits, from_back=False, unlink_hits=True):
    """allocate_with_hits, with one of three learner's slips as an option."""
    refs, free, hits = list(refs), list(free), []
    for block_hash in prompt_hashes[:max_hits]:
        if block_hash not in cached:
            break
        hits.append(cached[block_hash])
    for block in hits:
        if refs[block] == 0 and unlink_hits:
            free.remove(block)
        refs[block] += 1
    num_new = -(-num_tokens // bs) - len(hits)
    split = len(free) - num_new if from_back else num_new
    new, free = (free[split:], free[:split]) if from_back else (free[:split], free[split:])
    for block in new:
        refs[block] = 1
    return hits + new, refs, free


def hits_the_last_token(num_tokens, bs, prompt_hashes, cached, refs, free):
    return admit(num_tokens, bs, prompt_hashes, cached, refs, free, max_hits=len(prompt_hashes))  # no cap


def leaves_hits_in_the_free_queue(num_tokens, bs, prompt_hashes, cached, refs, free):
    return admit(num_tokens, bs, prompt_hashes, cached, refs, free, max_hits=(num_tokens - 1) // bs,
                 unlink_hits=False)  # a warm hit stays evictable: it may be handed out again as a new block


def takes_new_blocks_from_the_back(num_tokens, bs, prompt_hashes, cached, refs, free):
    return admit(num_tokens, bs, prompt_hashes, cached, refs, free, max_hits=(num_tokens - 1) // bs,
                 from_back=True)


# ---- can_allocate -------------------------------------------------------------------------------------------
def admits_without_watermark(num_tokens, bs, free, num_blocks, watermark):
    needed = -(-num_tokens // bs)
    return AllocStatus.NEVER if needed > num_blocks else AllocStatus.OK if needed <= free else AllocStatus.LATER


def admits_strictly_above_watermark(num_tokens, bs, free, num_blocks, watermark):
    needed, kept = -(-num_tokens // bs), int(watermark * num_blocks)
    if needed > num_blocks - kept:
        return AllocStatus.NEVER
    return AllocStatus.OK if free - needed > kept else AllocStatus.LATER  # > where kvlab has >=


# ---- lru_policy ---------------------------------------------------------------------------------------------
class OneQueue(MyLRU):
    """Forgets the cached flag: one queue in freeing order."""

    def add(self, block_id, cached):
        self.uncached[block_id] = None


class ForgetsRemove(MyLRU):
    """A prefix hit takes a free block back, but the policy keeps it."""

    def remove(self, block_id):
        pass


class PopsForever(MyLRU):
    """Scans the free blocks for a never-cached one, but never moves on from a cached one."""

    def pop(self):
        blocks, i = list(self), 0
        while i < len(blocks):
            if blocks[i] in self.uncached:
                del self.uncached[blocks[i]]
                return blocks[i]
            # forgot i += 1: when every free block is cached, this loops forever
        return self.cached.popitem(last=False)[0]


class ScansLists(EvictionPolicy):
    """The right order kept in two Python lists: ``in`` and ``list.remove`` scan the free blocks (O(n) a call)."""
    def __init__(self):
        self.uncached, self.cached = [], []

    def add(self, block_id, cached):
        (self.cached if cached else self.uncached).append(block_id)

    def remove(self, block_id):
        (self.cached if block_id in self.cached else self.uncached).remove(block_id)

    def pop(self):
        if not (self.uncached or self.cached):
            raise OutOfBlocksError("no free block")
        return (self.uncached or self.cached).pop(0)

    def __iter__(self):
        return iter(self.uncached + self.cached)

    def __len__(self):
        return len(self.uncached) + len(self.cached)


class EmptyPopRaisesKeyError(MyLRU):
    """Pops with ``popitem`` and lets its KeyError out when nothing is free, not kvlab's OutOfBlocksError."""
    def pop(self):
        queue = self.uncached if self.uncached else self.cached
        return queue.popitem(last=False)[0]


# ---- copy_on_write ------------------------------------------------------------------------------------------
def copies_every_written_block(table, refs, computed, n, bs):
    needed = -(-n // bs)  # ">= 1" where kvlab has "> 1": copies blocks nobody shares
    return [i for i in range(computed // bs, min(len(table), needed)) if refs[table[i]] >= 1], \
        max(0, needed - len(table))


def never_copies(table, refs, computed, n, bs):
    return [], max(0, -(-n // bs) - len(table))


def starts_one_position_early(table, refs, computed, n, bs):
    needed = -(-n // bs)  # (computed - 1) // bs: the block of the last computed token, not of the first new one
    return [i for i in range(max(0, computed - 1) // bs, min(len(table), needed)) if refs[table[i]] > 1], \
        max(0, needed - len(table))


def copies_only_the_last_block(table, refs, computed, n, bs):
    needed = -(-n // bs)  # the block of the last new token: misses an earlier shared block the step writes too
    last = min(len(table), needed) - 1
    return [last] if computed < n and last >= computed // bs and refs[table[last]] > 1 else [], \
        max(0, needed - len(table))


# ---- decode_attention ---------------------------------------------------------------------------------------
def attends_whole_blocks(query, kv_cache, block_tables, seq_lens, scale):
    """Reads every slot of the sequence's blocks, the unwritten tail of the last one included."""
    bs, heads, kv_heads, dim = kv_cache.shape[2], query.shape[1], kv_cache.shape[3], kv_cache.shape[4]
    out = torch.empty_like(query)
    for s, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[s, :-(-n // bs)].long()
        k = kv_cache[blocks, 0].reshape(-1, kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
        v = kv_cache[blocks, 1].reshape(-1, kv_heads, dim).repeat_interleave(heads // kv_heads, 1)
        out[s] = torch.einsum("hn,nhd->hd", (torch.einsum("hd,nhd->hn", query[s], k) * scale).softmax(-1), v)
    return out


def groups_heads_with_repeat(query, kv_cache, block_tables, seq_lens, scale):
    """``repeat`` where GQA needs ``repeat_interleave``: query head h reads KV head h % H_kv."""
    bs, heads, kv_heads = kv_cache.shape[2], query.shape[1], kv_cache.shape[3]
    out = torch.empty_like(query)
    for s, n in enumerate(seq_lens.tolist()):
        positions = torch.arange(n)
        blocks = block_tables[s].long()[positions // bs]
        k = kv_cache[blocks, 0, positions % bs].repeat(1, heads // kv_heads, 1)
        v = kv_cache[blocks, 1, positions % bs].repeat(1, heads // kv_heads, 1)
        out[s] = torch.einsum("hn,nhd->hd", (torch.einsum("hd,nhd->hn", query[s], k) * scale).softmax(-1), v)
    return out


# ---- prefill_attention --------------------------------------------------------------------------------------
def prefill_without_causal_mask(query, kv_cache, block_table, seq_len, scale):
    """Every new token sees every key, the later new tokens' too."""
    heads, bs, kv_heads = query.shape[1], kv_cache.shape[2], kv_cache.shape[3]
    positions = torch.arange(seq_len)
    blocks = block_table.long()[positions // bs]
    k = kv_cache[blocks, 0, positions % bs].repeat_interleave(heads // kv_heads, 1)
    v = kv_cache[blocks, 1, positions % bs].repeat_interleave(heads // kv_heads, 1)
    return torch.einsum("htn,nhd->thd", (torch.einsum("thd,nhd->htn", query, k) * scale).softmax(-1), v)


def prefill_counting_from_zero(query, kv_cache, block_table, seq_len, scale):
    """Row i sees positions 0 .. i: as if nothing were cached, the prefix's keys cut off."""
    new, heads, _ = query.shape
    bs, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    positions = torch.arange(seq_len)
    blocks = block_table.long()[positions // bs]
    k = kv_cache[blocks, 0, positions % bs].repeat_interleave(heads // kv_heads, 1)
    v = kv_cache[blocks, 1, positions % bs].repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,nhd->htn", query, k) * scale
    scores = scores.masked_fill(positions[None, :] > torch.arange(new)[:, None], float("-inf"))
    return torch.einsum("htn,nhd->thd", scores.softmax(-1), v)


# ---- split_k_merge ------------------------------------------------------------------------------------------
def merges_by_averaging(partial_out, partial_max, partial_sum, num_partitions):
    return torch.stack([partial_out[s, :int(n)].mean(0) for s, n in enumerate(num_partitions)])  # equal weights


def merges_without_the_maximum(partial_out, partial_max, partial_sum, num_partitions):
    merged = []
    for s, n in enumerate(num_partitions.tolist()):
        weights = partial_sum[s, :n] * partial_max[s, :n].exp()  # exp of a raw score overflows
        merged.append((weights[..., None] * partial_out[s, :n]).sum(0) / weights.sum(0)[..., None])
    return torch.stack(merged)


# ---- rejection_sampling -------------------------------------------------------------------------------------
def accepts_by_target_alone(drafts, draft_probs, target_probs, uniforms, sample):
    for i, draft in enumerate(drafts):
        if uniforms[i] <= target_probs[i][draft]:  # min(1, p) where the rule has min(1, p / q)
            continue
        residual = [max(p - q, 0.0) for p, q in zip(target_probs[i], draft_probs[i])]
        return list(drafts[:i]) + [sample([r / sum(residual) for r in residual])]
    return list(drafts) + [sample(target_probs[len(drafts)])]


def recovers_from_the_target(drafts, draft_probs, target_probs, uniforms, sample):
    for i, draft in enumerate(drafts):
        if uniforms[i] * draft_probs[i][draft] > target_probs[i][draft]:
            return list(drafts[:i]) + [sample(target_probs[i])]  # p itself: the rejected draft's odds counted twice
    return list(drafts) + [sample(target_probs[len(drafts)])]


def forgets_the_bonus_token(drafts, draft_probs, target_probs, uniforms, sample):
    for i, draft in enumerate(drafts):
        if uniforms[i] * draft_probs[i][draft] > target_probs[i][draft]:
            residual = [max(p - q, 0.0) for p, q in zip(target_probs[i], draft_probs[i])]
            return list(drafts[:i]) + [sample([r / sum(residual) for r in residual])]
    return list(drafts)


# ---- the Triton puzzles ---------------------------------------------------------------------------------------
@triton.jit
def caches_with_contiguous_heads(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, num_heads, head_dim, block_size,
                                 stride_block, stride_kv, stride_slot, stride_head,
                                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        row = t * num_heads * head_dim + heads * head_dim + dims
        dst = cache_ptr + (slot // block_size) * stride_block + (slot % block_size) * stride_slot \
            + heads * head_dim + dims  # head_dim where the cache's head stride is stride_head
        tl.store(dst, tl.load(key_ptr + row, mask=mask), mask=mask)
        tl.store(dst + stride_kv, tl.load(value_ptr + row, mask=mask), mask=mask)


@triton.jit
def caches_the_key_as_the_value_too(key_ptr, value_ptr, cache_ptr, slot_mapping_ptr, num_heads, head_dim, block_size,
                                    stride_block, stride_kv, stride_slot, stride_head,
                                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_D)[None, :]
        mask = (heads < num_heads) & (dims < head_dim)
        row = t * num_heads * head_dim + heads * head_dim + dims
        dst = cache_ptr + (slot // block_size) * stride_block + (slot % block_size) * stride_slot \
            + heads * stride_head + dims
        tl.store(dst, tl.load(key_ptr + row, mask=mask), mask=mask)
        tl.store(dst + stride_kv, tl.load(key_ptr + row, mask=mask), mask=mask)  # key_ptr where value_ptr belongs


@triton.jit
def copies_keys_only(cache_ptr, block_mapping_ptr, num_heads, head_dim, block_size,
                     stride_block, stride_kv, stride_slot, stride_head,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    pair = tl.program_id(0)  # forgets program_id(1): both programs of a pair copy K, nobody copies V
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    tile = heads * stride_head + dims
    for offset in range(block_size):
        values = tl.load(cache_ptr + src * stride_block + offset * stride_slot + tile, mask=mask)
        tl.store(cache_ptr + dst * stride_block + offset * stride_slot + tile, values, mask=mask)


@triton.jit
def attends_to_whole_blocks(out_ptr, query_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
                            num_query_heads, num_kv_heads, head_dim,
                            stride_table, stride_block, stride_kv, stride_slot, stride_head,
                            BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    s, h = tl.program_id(0), tl.program_id(1)
    kv_head = h // (num_query_heads // num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + s)
    dims = tl.arange(0, BLOCK_D)
    offsets = tl.arange(0, BLOCK_SIZE)
    row = (s * num_query_heads + h) * head_dim
    q = tl.load(query_ptr + row + dims, mask=dims < head_dim, other=0.0)
    best, total = -float("inf"), 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + s * stride_table + j).to(tl.int64)
        mask = dims[None, :] < head_dim  # forgets positions >= seq_len in the last block
        slots = cache_ptr + block * stride_block + offsets[:, None] * stride_slot + kv_head * stride_head \
            + dims[None, :]
        k = tl.load(slots, mask=mask, other=0.0)
        v = tl.load(slots + stride_kv, mask=mask, other=0.0)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        new_best = tl.maximum(best, tl.max(scores, axis=0))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best)
        total = total * rescale + tl.sum(weights, axis=0)
        acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
        best = new_best
    tl.store(out_ptr + row + dims, acc / total, mask=dims < head_dim)


@triton.jit
def every_partition_from_block_zero(partial_out_ptr, partial_max_ptr, partial_sum_ptr, query_ptr, cache_ptr,
                                    block_tables_ptr, seq_lens_ptr, scale, num_query_heads, num_kv_heads, head_dim,
                                    num_partitions, blocks_per_partition,
                                    stride_table, stride_block, stride_kv, stride_slot, stride_head,
                                    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    s, h, p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = h // (num_query_heads // num_kv_heads)
    seq_len = tl.load(seq_lens_ptr + s)
    first = p * blocks_per_partition
    last = tl.minimum(first + blocks_per_partition, tl.cdiv(seq_len, BLOCK_SIZE))
    if first < last:
        dims = tl.arange(0, BLOCK_D)
        offsets = tl.arange(0, BLOCK_SIZE)
        q = tl.load(query_ptr + (s * num_query_heads + h) * head_dim + dims, mask=dims < head_dim, other=0.0)
        best, total = -float("inf"), 0.0
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(0, last - first):  # forgets the partition's first block: every partition reads blocks 0 ..
            block = tl.load(block_tables_ptr + s * stride_table + j).to(tl.int64)
            valid = j * BLOCK_SIZE + offsets < seq_len
            mask = valid[:, None] & (dims[None, :] < head_dim)
            slots = cache_ptr + block * stride_block + offsets[:, None] * stride_slot + kv_head * stride_head \
                + dims[None, :]
            k = tl.load(slots, mask=mask, other=0.0)
            v = tl.load(slots + stride_kv, mask=mask, other=0.0)
            scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, -float("inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=0))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best)
            total = total * rescale + tl.sum(weights, axis=0)
            acc = acc * rescale + tl.sum(weights[:, None] * v, axis=0)
            best = new_best
        row = (s * num_partitions + p) * num_query_heads + h
        tl.store(partial_max_ptr + row, best)
        tl.store(partial_sum_ptr + row, total)
        tl.store(partial_out_ptr + row * head_dim + dims, acc / total, mask=dims < head_dim)


# ---- window_release -----------------------------------------------------------------------------------------
def releases_one_position_late(table, released, first, window, bs):
    return table[released:max(0, first - window) // bs]  # the first query still sees first - window + 1


def releases_a_block_still_seen(table, released, first, window, bs):
    return table[released:-(-max(0, first - window + 1) // bs)]  # rounds up: frees the block the window starts in


def releases_again(table, released, first, window, bs):
    return table[:max(0, first - window + 1) // bs]  # forgets the entries released by earlier steps


def releases_a_block_still_seen_in_numpy(table, released, first, window, bs):
    return np.array(releases_a_block_still_seen(table, released, first, window, bs), dtype=np.int64)


# ---- v1_step ------------------------------------------------------------------------------------------------
def admits_before_running(running, waiting, budget, max_num_seqs):
    admitted = []
    for prompt in waiting:  # waiting first: the running requests get what is left
        if not budget or len(running) + len(admitted) >= max_num_seqs:
            break
        admitted.append(min(prompt, budget))
        budget -= admitted[-1]
    running_tokens = []
    for left in running:
        running_tokens.append(min(left, budget))
        budget -= running_tokens[-1]
    return running_tokens, admitted


def step_without_counting_running_seats(running, waiting, budget, max_num_seqs):
    running_tokens = []
    for left in running:
        running_tokens.append(min(left, budget))
        budget -= running_tokens[-1]
    admitted = []
    for prompt in waiting:
        if not budget or len(admitted) >= max_num_seqs:  # forgets the running requests' seats
            break
        admitted.append(min(prompt, budget))
        budget -= admitted[-1]
    return running_tokens, admitted


def admits_whole_prompts_only(running, waiting, budget, max_num_seqs):
    running_tokens = []
    for left in running:
        running_tokens.append(min(left, budget))
        budget -= running_tokens[-1]
    admitted = []
    for prompt in waiting:
        if prompt > budget or len(running) + len(admitted) >= max_num_seqs:  # V0's rule: no chunk
            break
        admitted.append(prompt)
        budget -= prompt
    return running_tokens, admitted


# ---- preemption ---------------------------------------------------------------------------------------------
def preempt(blocks_held, needs_block, num_free_blocks, *, oldest=False, to_back=False):
    """preemption, with one of two learner's slips as an option."""
    queue, scheduled, waiting, free = list(range(len(blocks_held))), [], [], num_free_blocks
    while queue:
        request = queue.pop(0)
        while needs_block[request] and free == 0:
            victim = (queue.pop(0) if oldest else queue.pop()) if queue else request
            free += blocks_held[victim]
            waiting.append(victim) if to_back else waiting.insert(0, victim)
            if victim == request:
                break
        else:
            free -= needs_block[request]
            scheduled.append(request)
    return scheduled, waiting


def preempts_the_oldest_waiting(blocks_held, needs_block, num_free_blocks):
    return preempt(blocks_held, needs_block, num_free_blocks, oldest=True)  # the next in line, not the newest


def queues_victims_at_the_back(blocks_held, needs_block, num_free_blocks):
    return preempt(blocks_held, needs_block, num_free_blocks, to_back=True)


def preempts_itself_at_once(blocks_held, needs_block, num_free_blocks):
    scheduled, waiting, free = [], [], num_free_blocks
    for request in range(len(blocks_held)):
        if needs_block[request] and free == 0:  # gives up its own place instead of taking a newer one's
            free += blocks_held[request]
            waiting.insert(0, request)
        else:
            free -= needs_block[request]
            scheduled.append(request)
    return scheduled, waiting


# ---- tier_promotion -----------------------------------------------------------------------------------------
def promotes_past_the_last_token(tier, num_slots, num_tokens, bs, prompt_hashes, num_gpu_hits, overwritten):
    promoted, lru = tier_promotion(tier, num_slots, len(prompt_hashes) * bs + 1, bs, prompt_hashes, num_gpu_hits,
                                   overwritten)  # as if the last full block were never the last token's
    return promoted, lru


def uses_first_to_last(tier, num_slots, num_tokens, bs, prompt_hashes, num_gpu_hits, overwritten):
    promoted, lru = tier_promotion(tier, num_slots, num_tokens, bs, prompt_hashes, num_gpu_hits, overwritten)
    for block_hash in prompt_hashes[num_gpu_hits:]:  # first to last: the prompt's last block ends most recent
        if block_hash in lru:
            lru.remove(block_hash)
            lru.append(block_hash)
    return promoted, lru


def drops_a_block_being_promoted(tier, num_slots, num_tokens, bs, prompt_hashes, num_gpu_hits, overwritten):
    lru, limit, promoted = list(tier), (num_tokens - 1) // bs, []
    for block_hash in prompt_hashes[num_gpu_hits:limit]:
        if block_hash not in lru:
            break
        promoted.append(block_hash)
    for block_hash in overwritten:
        if block_hash is None or block_hash in lru:
            continue
        if len(lru) == num_slots:
            lru.pop(0)  # the least recently used, even one whose copy to the GPU is not made yet
        lru.append(block_hash)
    for block_hash in reversed(prompt_hashes[num_gpu_hits:]):
        if block_hash in lru:
            lru.remove(block_hash)
            lru.append(block_hash)
    return promoted, lru


# ---- kv_cost_router -----------------------------------------------------------------------------------------
class CountsBlocksAsTokens(Router):
    def choose(self, replicas, num_tokens, hashes):
        s = self.settings  # forgot "x block_size": prefix_match counts blocks
        return self.pick([(s.prefill_weight * (num_tokens - r.cached.prefix_match(hashes, len(hashes)))
                           + s.queue_weight * r.waiting_tokens, r.in_flight()) for r in replicas])


class FirstOfEquals(Router):
    def choose(self, replicas, num_tokens, hashes):
        s, bs = self.settings, self.block_size
        keys = [(s.prefill_weight * (num_tokens - bs * r.cached.prefix_match(hashes, len(hashes)))
                 + s.queue_weight * r.waiting_tokens, r.in_flight()) for r in replicas]
        return keys.index(min(keys))  # ties always to the first replica, not taking turns


class AnswersTrueForReplicaOne(MyRouter):
    """Replica 1 as ``True`` (say, from ``cost_1 < cost_0``): True == 1 in Python, but a bool is no index."""

    def choose(self, replicas, num_tokens, hashes):
        index = super().choose(replicas, num_tokens, hashes)
        return True if index == 1 else index


# ---- ngram_proposer -----------------------------------------------------------------------------------------
def first_occurrence(tokens, max_tokens, min_n, max_n):
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + max_tokens]
    return []


def shortest_n_first(tokens, max_tokens, min_n, max_n):
    for n in range(min_n, min(max_n, len(tokens) - 1) + 1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + max_tokens]
    return []


def first_occurrence_in_numpy(tokens, max_tokens, min_n, max_n):
    return np.array(first_occurrence(tokens, max_tokens, min_n, max_n), dtype=np.int64)


def matches_itself(tokens, max_tokens, min_n, max_n):
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        for start in range(len(tokens) - n, -1, -1):  # includes the last n tokens themselves
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + max_tokens]
    return []


#: (puzzle, wrong solution, words the report must contain)
WRONG = [
    ("slot_mapping", slots_without_block_size, "so its slot is"),
    ("slot_mapping", slots_one_too_many, "expected a list of"),
    ("slot_mapping", slots_without_block_size_in_numpy, "so its slot is"),
    ("slot_mapping", slots_forever, "your code ran past the time limit"),
    ("slot_mapping", slots_then_exit, "your code raised SystemExit(0) (sys.exit), which would stop"),
    ("slot_mapping", slots_interrupting_itself, "your code raised KeyboardInterrupt itself"),
    ("block_hashes", hashes_each_block_alone, "takes its parent's hash"),
    ("block_hashes", hashes_the_partial_block_too, "the last block is partial"),
    ("allocate_with_hits", hits_the_last_token, "is always computed"),
    ("allocate_with_hits", leaves_hits_in_the_free_queue, "the hits that were free leave it"),
    ("allocate_with_hits", takes_new_blocks_from_the_back, "from the front of free_queue"),
    ("can_allocate", admits_without_watermark, "the watermark keeps"),
    ("can_allocate", admits_strictly_above_watermark, "which is >="),
    ("lru_policy", OneQueue, "never-cached first"),
    ("lru_policy", ForgetsRemove, "through remove"),
    ("lru_policy", PopsForever, "your code ran past the time limit"),
    ("lru_policy", ScansLists, "every call must cost O(1)"),
    ("lru_policy", EmptyPopRaisesKeyError, "must raise kvlab.errors.OutOfBlocksError"),
    ("copy_on_write", copies_every_written_block, "held by this sequence alone: write in place"),
    ("copy_on_write", never_copies, "written by this step and shared: copy it"),
    ("copy_on_write", starts_one_position_early, "is not written by this step"),
    ("copy_on_write", copies_only_the_last_block, "written by this step and shared: copy it"),
    ("decode_attention", attends_whole_blocks, "has NaN: it read a slot that holds no token"),
    ("decode_attention", groups_heads_with_repeat, "max abs error"),
    ("prefill_attention", prefill_without_causal_mask, "no later one"),
    ("prefill_attention", prefill_counting_from_zero, "it must see positions 0 .."),
    ("split_k_merge", merges_by_averaging, "its share of the whole softmax"),
    ("split_k_merge", merges_without_the_maximum, "without subtracting the maximum"),
    ("window_release", releases_one_position_late, ": release it"),
    ("window_release", releases_a_block_still_seen, "is still seen"),
    ("window_release", releases_again, "released by an earlier step"),
    ("window_release", releases_a_block_still_seen_in_numpy, "is still seen"),
    ("v1_step", admits_before_running, "running requests come first"),
    ("v1_step", step_without_counting_running_seats, "seats"),
    ("v1_step", admits_whole_prompts_only, "the last one admitted with a chunk"),
    ("preemption", preempts_the_oldest_waiting, "preempts the last request not yet scheduled"),
    ("preemption", queues_victims_at_the_back, "the last one preempted is first"),
    ("preemption", preempts_itself_at_once, "preempts the last request not yet scheduled"),
    ("kv_cost_router", CountsBlocksAsTokens, "has the least (cost, in flight)"),
    ("kv_cost_router", FirstOfEquals, "return self.pick(keys)"),
    ("kv_cost_router", AnswersTrueForReplicaOne, "expected replica 1, got True: return a replica's index, an int"),
    ("ngram_proposer", first_occurrence, "not the first"),
    ("ngram_proposer", first_occurrence_in_numpy, "not the first"),
    ("ngram_proposer", shortest_n_first, "the longest n that matches wins"),
    ("ngram_proposer", matches_itself, "one must end before the last token"),
    ("rejection_sampling", accepts_by_target_alone, "is accepted: uniforms["),
    ("rejection_sampling", recovers_from_the_target, "the recovered token from max(target_probs["),
    ("rejection_sampling", forgets_the_bonus_token, "then one bonus token"),
    ("tier_promotion", promotes_past_the_last_token, "within (num_tokens - 1) // block_size"),
    ("tier_promotion", uses_first_to_last, "visited last to first"),
    ("tier_promotion", drops_a_block_being_promoted, "not being promoted"),
    ("triton_reshape_and_cache", caches_with_contiguous_heads, "step heads by stride_head"),
    ("triton_reshape_and_cache", caches_the_key_as_the_value_too, "the cache differs from the torch twin's"),
    ("triton_copy_blocks", copies_keys_only, "every one of its slots, K and V"),
    ("triton_decode_attention", attends_to_whole_blocks, "mask positions >= seq_len"),
    ("triton_split_k_decode", every_partition_from_block_zero, "from block p * blocks_per_partition on"),
]
