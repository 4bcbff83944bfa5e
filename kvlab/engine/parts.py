"""Parts of the engine a learner may replace with their own (the course's capstone: ``kvlab.course.engine_with``).

``LLM(..., parts=EngineParts(...))``: each field that is set replaces kvlab's own at one seam, for that engine
only (nothing global: two engines in one process never see each other's parts); a field left None keeps
kvlab's. The signatures are the puzzles' (``kvlab.puzzles``, one per part), and so is the name each part is
known by:

* ``slot_mapping(block_table, block_size, start, end)``: the runner writes a step's new K/V at these slots;
* ``block_hashes(tokens, block_size, hash_fn)``: the block manager's chained hashes, what prefix caching looks
  blocks up by (the lookup still compares tokens, so a wrong hash costs hits, not correctness);
* ``lru_policy``: an ``EvictionPolicy`` class, one instance per engine: the free blocks' reuse order;
* ``copy_on_write(block_table, ref_counts, num_computed_tokens, num_tokens, block_size)`` (puzzle
  ``copy_on_write``'s ``plan_append``): which entries of a sequence's table the block manager copies before a
  step writes them, and how many blocks it appends. The manager does what the plan says where that keeps the
  pool consistent (it refuses a wrong count of new blocks, or a copy of a block the sequence holds alone); a
  shared block left uncopied is written in place, so a fork's other sample reads the K/V of the wrong tokens;
* ``window_release(block_table, num_released, first_query, window, block_size)`` (puzzle ``window_release``'s
  ``released_blocks``): the blocks a sliding-window model's step gives back to the pool. The manager releases
  what the answer says where that keeps the table whole (the next entries of the table, in order, none the step
  writes); a block released while a query still sees it reads as the null block's stale K/V;
* ``decode_attention(query, kv_cache, block_tables, seq_lens, scale)`` and ``prefill_attention(query,
  kv_cache, block_table, seq_len, scale)``: the torch backend's attention over the block tables (after kvlab
  wrote the step's K/V), decode steps and steps of several query rows per sequence (prompt chunks, drafts);
* ``ngram_proposer(tokens, max_tokens, min_n, max_n)``: speculative decoding's drafts (``method="ngram"``);
* ``rejection_sampling(drafts, draft_probs, target_probs, uniforms, sample)``: the verification of drafts;
* ``split_k_merge(partial_out, partial_max, partial_sum, num_partitions)``: decode steps then run split-K, in
  partitions of ``SPLIT_K_BLOCKS`` blocks (each partition's output by ``decode_attention``, the learner's or
  kvlab's, over the partition's blocks alone), and the learner's merge makes one softmax of them;
* Triton kernels, each run through its puzzle's launcher (``kvlab.puzzles.triton_*.launch``; in Triton's
  interpreter on a CPU, compiled on a GPU): ``triton_reshape_and_cache`` writes every step's new K/V into the
  cache; ``triton_decode_attention`` is the decode steps' attention (before a torch ``decode_attention``, which
  then serves only a split-K decode's partitions); ``triton_split_k_decode`` computes a split-K decode's
  partitions (its three results), merged by ``split_k_merge`` (the learner's or kvlab's): decode steps run
  split-K when either is given; ``triton_copy_blocks`` makes the step's block copies (a prefix hit's partial
  block with ``prefix_match_unit``, copy-on-write), one launch per layer's cache.
* ``can_allocate(num_tokens, block_size, num_free_blocks, num_blocks, watermark)``: the scheduler's admission of
  a waiting prompt (both schedulers), in a pool that then keeps ``ADMISSION_WATERMARK`` of its blocks free at
  admission. The puzzle's prompt has no prefix hit, so the learner is asked about the tokens that need new
  blocks after the hit, with the free blocks less the free cached hits the prompt takes back: on those numbers
  the spec's answer is kvlab's (``kvlab.blocks.manager.admission``), and an answer that differs raises. The
  scheduler acts on the learner's answer, save that a prompt kvlab finds can never finish (its whole prompt,
  hits and later chunks counted, which the spec does not see) is aborted, as kvlab's NEVER.
* ``tier_promotion(tier, num_slots, num_tokens, block_size, prompt_hashes, num_gpu_hits, overwritten)``: the
  offload tier's order (least recently used first) after each admission, which the block manager keeps: it
  decides which entries later offloads drop (``LLM(num_offload_blocks=...)``, LRU only). The promotions and the
  entries are the tier's own (its lookup and offers ran before the overwritten hashes, an input, exist): the
  learner's must equal them, and its order kvlab's on the same numbers, else ``LearnerPartError``.
* ``preemption(blocks_held, needs_block, num_free_blocks)``: which running requests decode and which are
  preempted by recompute (and their order at the front of the waiting queue), in the V1 scheduler's steps where
  the puzzle's spec applies: every running request a plain decode of one token (no drafts, no prompt chunk),
  none waiting, recompute, each block held by one request alone (so a victim frees all it holds; check_engine
  serves it with prefix caching off). The scheduler acts on the learner's answer; one other than the spec's on
  the same numbers raises. Other steps are kvlab's.
* ``v1_step(running, waiting, token_budget, max_num_seqs)``: the V1 scheduler's tokens for each running
  sequence and each waiting prompt it admits (chunked prefill under the budget), in steps where the puzzle's
  spec applies: no drafts, one seat per sequence, kvlab's FCFS admission, no waiting prompt with a prefix hit,
  and room in the pool for the spec's step (checked on kvlab's answer first: then the learner is asked). The
  scheduler acts on the learner's answer; one other than the spec's raises.

A part that raises, or answers what its contract does not allow, raises ``LearnerPartError`` naming it (where
the engine calls it: a forward pass or a verification aborts that request with the error as its reason).
"""

from array import array
from dataclasses import dataclass, fields
from typing import Callable

import torch
import xxhash

from kvlab.blocks.manager import AllocStatus, admission
from kvlab.blocks.prefix_cache import HashChain
from kvlab.engine.proposers import Proposer
from kvlab.errors import InvalidArgumentError, LearnerPartError

#: Blocks per partition of the split-K decode a learner's ``split_k_merge`` finishes: small, so that a chat's
#: short contexts already make several partitions.
SPLIT_K_BLOCKS = 2

#: The watermark of an engine with a learner's ``can_allocate``: the fraction of the pool kept free at
#: admission. kvlab's engine keeps none (as vLLM V1), which would leave the puzzle's watermark untested.
ADMISSION_WATERMARK = 0.5


@dataclass(frozen=True)
class EngineParts:
    slot_mapping: Callable | None = None
    block_hashes: Callable | None = None
    lru_policy: type | None = None
    copy_on_write: Callable | None = None
    window_release: Callable | None = None
    decode_attention: Callable | None = None
    prefill_attention: Callable | None = None
    ngram_proposer: Callable | None = None
    rejection_sampling: Callable | None = None
    split_k_merge: Callable | None = None
    triton_reshape_and_cache: Callable | None = None
    triton_decode_attention: Callable | None = None
    triton_split_k_decode: Callable | None = None
    triton_copy_blocks: Callable | None = None
    can_allocate: Callable | None = None
    tier_promotion: Callable | None = None
    preemption: Callable | None = None
    v1_step: Callable | None = None

    def __post_init__(self):
        for name, part in self.given().items():
            if not callable(part):
                raise InvalidArgumentError(f"the part {name!r} must be callable (a function, or for lru_policy an "
                                           f"EvictionPolicy class), got {type(part).__name__}")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def given(self) -> dict:
        """The parts that are set, by name."""
        return {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}

    @property
    def replaces_attention(self) -> bool:
        return any(part is not None for part in (
            self.decode_attention, self.prefill_attention, self.split_k_merge, self.triton_reshape_and_cache,
            self.triton_decode_attention, self.triton_split_k_decode))

    @property
    def split_k(self) -> bool:
        """Whether decode steps run split-K (a part of it is the learner's)."""
        return self.split_k_merge is not None or self.triton_split_k_decode is not None

    # ---- the block manager's parts ------------------------------------------------------------------------
    def block_manager_options(self) -> dict:
        """The block manager's ``hash_fn``, ``eviction``, ``plan_append``, ``plan_window_release``, ``watermark``
        and ``order_tier`` for these parts (none: kvlab's)."""
        options = {} if self.copy_on_write is None else {"plan_append": self._plan_append}
        if self.window_release is not None:
            options["plan_window_release"] = self._plan_release
        if self.can_allocate is not None:
            options["watermark"] = ADMISSION_WATERMARK
        if self.tier_promotion is not None:
            options["order_tier"] = self._order_tier
        if self.block_hashes is not None:
            options["hash_fn"] = HashChain(self._chained_hashes, _xxh64_block)
        if self.lru_policy is not None:
            try:
                options["eviction"] = self.lru_policy()
            except Exception as error:
                raise LearnerPartError(f"lru_policy: building {self.lru_policy!r}() raised {error!r}") from error
        return options

    def _chained_hashes(self, tokens: list[int], block_size: int, hash_fn) -> list[int]:
        hashes = _call("block_hashes", self.block_hashes, list(tokens), block_size, hash_fn)
        wanted = len(tokens) // block_size
        if not isinstance(hashes, list) or len(hashes) != wanted or any(type(h) is not int for h in hashes):
            raise LearnerPartError(f"block_hashes returned {_short(hashes)} for {len(tokens)} tokens in blocks of "
                                   f"{block_size}: expected a list of {wanted} ints, one per full block")
        return hashes

    def _plan_append(self, table: list[int], ref, num_computed_tokens: int, num_tokens: int,
                     block_size: int) -> tuple[set, int]:
        """The learner's ``copy_on_write`` plan for a step writing positions ``num_computed_tokens ..
        num_tokens - 1`` of ``table`` (``ref``: the pool's reference counts), as the block manager takes it,
        refused where it would break the pool: a copy of a block held alone (its reference would drop to 0
        without it being freed), an entry the step does not write, or a count of new blocks other than the one
        that gives every position a slot."""
        refs = {block: ref[block] for block in table}
        args = (list(table), refs, num_computed_tokens, num_tokens, block_size)
        plan = _call("copy_on_write", self.copy_on_write, *args)
        written = range(num_computed_tokens // block_size, min(len(table), -(-num_tokens // block_size)))
        needed = max(0, -(-num_tokens // block_size) - len(table))
        copies = plan[0] if isinstance(plan, tuple) and len(plan) == 2 and isinstance(plan[0], list) else None
        problem = ("expected (copies, num_new_blocks)" if copies is None
                   else "a copy that is not an int index of a written entry" if any(
                       type(i) is not int or i not in written for i in copies)
                   else "copies repeated" if len(set(copies)) != len(copies)
                   else "a copy of a block this sequence holds alone (write it in place)" if any(
                       refs[table[i]] == 1 for i in copies)
                   else f"num_new_blocks {plan[1]!r}, not {needed}" if plan[1] != needed or type(plan[1]) is not int
                   else None)
        if problem:
            raise LearnerPartError(f"copy_on_write{args} returned {_short(plan)}: {problem}")
        return set(copies), needed

    def _plan_release(self, table: list[int], num_released: int, first_query: int, window: int,
                      block_size: int) -> int:
        """The table's ``num_released`` after the learner's ``window_release`` for a step computing positions
        from ``first_query`` on, refused where it would break the table: anything but its next entries, in
        order, or a block the step writes."""
        args = (list(table), num_released, first_query, window, block_size)
        released = _call("window_release", self.window_release, *args)
        upto = num_released + len(released) if isinstance(released, list) else -1
        if released != table[num_released:upto] or upto > first_query // block_size:
            raise LearnerPartError(f"window_release{args} returned {_short(released)}: expected the blocks released "
                                   f"now, in table order: the next entries from index {num_released} on, none of them "
                                   f"one the step writes (index {first_query // block_size} on)")
        return upto

    def _order_tier(self, tier: list, num_slots: int, num_tokens: int, block_size: int, prompt_hashes: list,
                    num_gpu_hits: int, overwritten: list, promoted: list, after: list) -> list:
        """The offload tier's order after an admission, least recently used first, by the learner's
        ``tier_promotion`` on the admission's numbers (``KVCacheManager(order_tier=...)``): the block manager keeps
        it, so it decides which entries later offloads drop. Its promoted hashes must be the ones the tier
        promoted, and its tier the hashes the tier holds (the lookup chose the promotions, and the offers the
        entries, before the hashes the new blocks overwrite, an input, were known); its order must be kvlab's on
        the same numbers, since a wrong one changes no token, only later hits. Else ``LearnerPartError``."""
        args = (list(tier), num_slots, num_tokens, block_size, list(prompt_hashes), num_gpu_hits, list(overwritten))
        got = _call("tier_promotion", self.tier_promotion, *args)
        answer = got if isinstance(got, (tuple, list)) and len(got) == 2 and all(
            isinstance(part, list) for part in got) else None
        problem = ("expected (promoted, tier), two lists" if answer is None
                   else f"promoted {answer[0]}, but the tier promoted {promoted}" if answer[0] != promoted
                   else f"tier {answer[1]}: expected {after} (least recently used first)" if answer[1] != after
                   else None)
        if problem:
            raise LearnerPartError(f"tier_promotion(tier={args[0]}, num_slots={num_slots}, num_tokens={num_tokens}, "
                                   f"block_size={block_size}, prompt_hashes={args[4]}, num_gpu_hits={num_gpu_hits}, "
                                   f"overwritten={args[6]}) returned {_short(got)}: {problem}")
        return answer[1]

    # ---- the scheduler's part -----------------------------------------------------------------------------
    def admit(self, manager, seq, hit, num_new_tokens: int | None, status: AllocStatus) -> AllocStatus:
        """What the scheduler acts on to admit ``seq`` with ``hit`` (``manager.lookup(seq)``), its first step
        computing ``num_new_tokens`` tokens after the hit (None: the rest of its prompt), where kvlab's
        ``manager.can_allocate`` said ``status``: the learner's ``can_allocate`` on the tokens that need new
        blocks, the blocks free once the prompt took back its hit's free cached ones, the pool and its
        watermark. An answer other than the one kvlab's rule gives on the same numbers raises
        ``LearnerPartError``; kvlab's NEVER stands (see the module docstring)."""
        bs, hits, num_blocks = manager.block_size, hit.hits[0], manager.num_blocks
        scheduled = seq.num_tokens if num_new_tokens is None else hit.num_tokens + num_new_tokens
        num_tokens = scheduled - len(hits) * bs  # the hit's blocks are there; tier hits and the rest need new ones
        free_hits = sum(manager.ref_count(block) == 0 for block in hits)  # cached, free: the prompt takes them back
        num_free = manager.num_free_blocks - free_hits
        needed = -(-num_tokens // bs)
        expected = admission(needed, needed, num_free, num_blocks, int(ADMISSION_WATERMARK * num_blocks))
        got = _call("can_allocate", self.can_allocate, num_tokens, bs, num_free, num_blocks, ADMISSION_WATERMARK)
        if got is not expected:
            shown = got if isinstance(got, AllocStatus) else _short(got)
            raise LearnerPartError(
                f"can_allocate(num_tokens={num_tokens}, block_size={bs}, num_free_blocks={num_free}, "
                f"num_blocks={num_blocks}, watermark={ADMISSION_WATERMARK}) returned {shown}, expected {expected}: "
                f"admitting sequence {seq.seq_id} ({seq.num_tokens} tokens, {len(hits)} full blocks of them a "
                f"prefix hit), the tokens after its hit need new blocks, and {num_free} blocks are free (the pool's "
                f"{manager.num_free_blocks}, less {free_hits} free cached blocks of the hit that it takes back)")
        return status if status is AllocStatus.NEVER else got

    def preempt(self, manager, running: list) -> tuple[list[int], list[int]]:
        """``(scheduled, waiting)``, indices into ``running`` (each a plain decode of one token, its blocks its
        own: see the module docstring), by the learner's ``preemption``, checked against the spec's answer on
        the same numbers."""
        bs = manager.block_size
        held = [len(manager.get_block_table(seq)) for seq in running]
        needs = [-(-(seq.num_computed_tokens + 1) // bs) > blocks for seq, blocks in zip(running, held)]
        free = manager.num_free_blocks
        expected = _preempted_by_recompute(held, needs, free)
        got = _call("preemption", self.preemption, list(held), list(needs), free)
        answer = _pair_of_lists(got)
        if answer != expected:
            raise LearnerPartError(
                f"preemption(blocks_held={held}, needs_block={needs}, num_free_blocks={free}) returned "
                f"{_short(got)}, expected {expected}: the V1 scheduler's running sequences "
                f"{[seq.seq_id for seq in running]} each decode one token")
        return expected

    def allocate_tokens(self, manager, running: list, waiting: list, budget: int,
                        max_num_seqs: int) -> tuple[list[int], list[int]] | None:
        """``(running_tokens, admitted_tokens)`` by the learner's ``v1_step``, checked against the spec's answer
        on the same numbers; None (the learner is not asked) where the pool has no room for that step."""
        left = [seq.num_tokens - seq.num_computed_tokens for seq in running]
        prompts = [seq.num_tokens for seq in waiting]
        expected = _v1_step(left, prompts, budget, max_num_seqs)
        bs = manager.block_size
        needed = (sum(-(-(seq.num_computed_tokens + tokens) // bs) - len(manager.get_block_table(seq))
                      for seq, tokens in zip(running, expected[0]))
                  + sum(-(-tokens // bs) for tokens in expected[1]))
        if needed > manager.num_free_blocks:
            return None
        got = _call("v1_step", self.v1_step, list(left), list(prompts), budget, max_num_seqs)
        answer = _pair_of_lists(got)
        if answer != expected:
            raise LearnerPartError(
                f"v1_step(running={left}, waiting={prompts}, token_budget={budget}, max_num_seqs={max_num_seqs}) "
                f"returned {_short(got)}, expected {expected}: the V1 scheduler's step of running sequences "
                f"{[seq.seq_id for seq in running]} and waiting ones {[seq.seq_id for seq in waiting]}")
        return expected

    # ---- the runner's parts -------------------------------------------------------------------------------
    def slots(self, block_table: list[int], block_size: int, start: int, end: int) -> list[int]:
        """The cache slots of positions ``start .. end - 1`` by the learner's ``slot_mapping``."""
        slots = _call("slot_mapping", self.slot_mapping, list(block_table), block_size, start, end)
        blocks = set(block_table)
        if (not isinstance(slots, list) or len(slots) != end - start
                or any(type(s) is not int or s < 0 or s // block_size not in blocks for s in slots)):
            raise LearnerPartError(f"slot_mapping({list(block_table)}, {block_size}, {start}, {end}) returned "
                                   f"{_short(slots)}: expected a list of {end - start} slots in the table's blocks")
        return slots

    def write(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, batch) -> None:
        """The step's new K/V ``[T, H_kv, D]`` into ``kv_cache`` at ``batch.slot_mapping``: by the learner's
        ``triton_reshape_and_cache``, else kvlab's torch write."""
        if self.triton_reshape_and_cache is None:
            from kvlab.kernels.torch_paged import write_cache

            write_cache(key, value, kv_cache, batch.cache_write)
            return
        from kvlab.puzzles import triton_reshape_and_cache

        _call("triton_reshape_and_cache", triton_reshape_and_cache.launch, self.triton_reshape_and_cache,
              key.contiguous(), value.contiguous(), kv_cache, batch.slot_mapping)

    def copy_blocks(self, kv_caches: list[torch.Tensor], pairs: list[tuple[int, int]]) -> None:
        """Block dst becomes a copy of block src in every layer's cache, for each (src, dst) of ``pairs`` (no dst
        repeated, none also a src), by the learner's ``triton_copy_blocks``."""
        from kvlab.puzzles import triton_copy_blocks

        block_mapping = torch.tensor(pairs, dtype=torch.int64, device=kv_caches[0].device)
        for cache in kv_caches:
            _call("triton_copy_blocks", triton_copy_blocks.launch, self.triton_copy_blocks, cache, block_mapping)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, batch, scale: float) -> torch.Tensor:
        """``out [T, H, D]``: the step's attention (``batch``: its ``AttentionBatch``, the cache already
        written) by the learner's decode or prefill attention, kvlab's torch twin for the one not given."""
        from kvlab.kernels.torch_paged import paged_prefill_torch

        if not batch.is_prefill:  # one query row per sequence
            if not self.split_k:
                return self._decode(query, kv_cache, batch.block_tables, batch.seq_lens, scale)
            return self._split_k_decode(query, kv_cache, batch.block_tables, batch.seq_lens, scale)
        if self.prefill_attention is None:
            return paged_prefill_torch(query, kv_cache, batch.block_tables, batch.seq_lens, batch.cu_query_lens,
                                       scale)
        cu, lens = batch.cu_query_lens.tolist(), batch.seq_lens.tolist()
        outs = [_call("prefill_attention", self.prefill_attention, query[cu[s]:cu[s + 1]], kv_cache,
                      batch.block_tables[s], seq_len, scale) for s, seq_len in enumerate(lens)]
        return torch.cat([_checked_output("prefill_attention", out, query[cu[s]:cu[s + 1]])
                          for s, out in enumerate(outs)])

    def _decode(self, query, kv_cache, block_tables, seq_lens, scale: float, kernel: bool = True) -> torch.Tensor:
        """Decode attention by the learner's ``triton_decode_attention`` (``kernel``: where it may serve), else
        their ``decode_attention``, else kvlab's torch twin."""
        from kvlab.kernels.torch_paged import paged_attention_decode_torch

        if kernel and self.triton_decode_attention is not None:
            from kvlab.puzzles import triton_decode_attention

            out = _call("triton_decode_attention", triton_decode_attention.launch, self.triton_decode_attention,
                        query.contiguous(), kv_cache, block_tables, seq_lens, scale)
            return _checked_output("triton_decode_attention", out, query)
        if self.decode_attention is None:
            return paged_attention_decode_torch(query, kv_cache, block_tables, seq_lens, scale)
        out = _call("decode_attention", self.decode_attention, query, kv_cache, block_tables, seq_lens, scale)
        return _checked_output("decode_attention", out, query)

    def _split_k_decode(self, query, kv_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
        """``out [S, H, D]``: decode attention in partitions of ``SPLIT_K_BLOCKS`` blocks of each sequence's keys
        (``kv_cache [num_blocks, 2, block_size, H_kv, D]``), merged by the learner's ``split_k_merge`` (else
        kvlab's). The partitions are the learner's ``triton_split_k_decode`` kernel's where given; else each
        partition's maximum and sum of exponentials are kvlab's and its output is a decode over its blocks
        alone, the learner's ``decode_attention`` where given (so both parts run). A shorter sequence's unused
        partitions hold NaN, as a real split-K buffer holds stale values."""
        from kvlab.kernels.torch_paged import split_k_partitions

        block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
        (num_seqs, num_heads, _), part_len, lens = query.shape, SPLIT_K_BLOCKS * block_size, seq_lens.tolist()
        num_partitions = [-(-n // part_len) for n in lens]
        if self.triton_split_k_decode is not None:
            from kvlab.puzzles import triton_split_k_decode

            partials = _call("triton_split_k_decode", triton_split_k_decode.launch, self.triton_split_k_decode,
                             query.contiguous(), kv_cache, block_tables, seq_lens, scale, SPLIT_K_BLOCKS)
            return self._merge(*partials, num_partitions, query)
        shape = (num_seqs, max(num_partitions), num_heads)
        partial_out = query.new_full((*shape, query.shape[2]), float("nan"), dtype=torch.float32)
        partial_max, partial_sum = (query.new_full(shape, float("nan"), dtype=torch.float32) for _ in range(2))
        for s, n in enumerate(lens):
            positions = torch.arange(n, device=query.device)
            blocks, offsets = block_tables[s].long()[positions // block_size], positions % block_size
            k, v = (kv_cache[blocks, i, offsets].float().repeat_interleave(num_heads // num_kv_heads, 1)
                    for i in (0, 1))                                                 # [n, H, D] each
            scores = torch.einsum("hd,nhd->hn", query[s].float(), k) * scale         # [H, n]
            used = num_partitions[s]
            partial_out[s, :used], partial_max[s, :used], partial_sum[s, :used] = split_k_partitions(scores, v,
                                                                                                     part_len)
        if self.decode_attention is not None:  # each partition: a decode over its SPLIT_K_BLOCKS blocks alone
            rows = [(s, j) for s, used in enumerate(num_partitions) for j in range(used)]
            seqs, parts = [s for s, _ in rows], [j for _, j in rows]
            device = block_tables.device
            columns = (torch.tensor(parts, device=device)[:, None] * SPLIT_K_BLOCKS
                       + torch.arange(SPLIT_K_BLOCKS, device=device)).clamp(max=block_tables.shape[1] - 1)
            tables = block_tables[torch.tensor(seqs, device=device)[:, None], columns]  # [rows, SPLIT_K_BLOCKS]
            part_lens = torch.tensor([min(part_len, lens[s] - j * part_len) for s, j in rows], dtype=seq_lens.dtype,
                                     device=seq_lens.device)
            partial_out[seqs, parts] = self._decode(query[seqs], kv_cache, tables, part_lens, scale,
                                                    kernel=False).float()
        return self._merge(partial_out, partial_max, partial_sum, num_partitions, query)

    def _merge(self, partial_out, partial_max, partial_sum, num_partitions: list[int], query) -> torch.Tensor:
        """The split-K partitions merged into ``out [S, H, D]`` by the learner's ``split_k_merge``, else kvlab's."""
        from kvlab.kernels.torch_paged import merge_split_k

        num_partitions = torch.tensor(num_partitions, device=query.device)
        if self.split_k_merge is None:
            return merge_split_k(partial_out, partial_max, partial_sum, num_partitions)
        out = _call("split_k_merge", self.split_k_merge, partial_out, partial_max, partial_sum, num_partitions)
        return _checked_output("split_k_merge", out, query)

    # ---- speculative decoding's parts -------------------------------------------------------------------
    def proposer(self, min_n: int, max_n: int) -> "LearnerNgramProposer":
        """A ``Proposer`` proposing by the learner's ``ngram_proposer`` with these bounds."""
        return LearnerNgramProposer(self.ngram_proposer, min_n, max_n)

    def accept(self, logits: torch.Tensor, drafts: tuple[int, ...], params, generator) -> list[int]:
        """``kvlab.engine.speculative.accept`` by the learner's ``rejection_sampling``: a model-free proposer's
        draft distribution is a point mass on its draft; greedy, the target's is a point mass on its argmax."""
        from kvlab.engine.sampler import noise_row, probabilities, race

        vocab = logits.shape[-1]
        if params.greedy:
            target = torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()

            def sample(probs):
                return max(range(len(probs)), key=probs.__getitem__)
        else:
            target = probabilities(logits, [params] * len(logits))

            def sample(probs):
                row = torch.tensor([float(p) for p in probs], device=logits.device)
                return int(race(row, noise_row(generator, row)))
        draft_probs = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.int64), vocab).float().tolist()
        uniforms = (1 - torch.rand(len(drafts), generator=generator, device=logits.device)).tolist()  # (0, 1]
        kept = _call("rejection_sampling", self.rejection_sampling, list(drafts), draft_probs, target.tolist(),
                     uniforms, sample)
        if (not isinstance(kept, list) or not 1 <= len(kept) <= len(drafts) + 1
                or any(type(t) is not int or not 0 <= t < vocab for t in kept)
                or kept[:-1] != list(drafts[:len(kept) - 1])):
            raise LearnerPartError(f"rejection_sampling returned {_short(kept)} for the drafts {list(drafts)}: "
                                   "expected the accepted drafts (a prefix of them), then one token")
        return kept


class LearnerNgramProposer(Proposer):
    """``method="ngram"``'s proposer by a learner's ``propose(tokens, max_tokens, min_n, max_n)``; one that
    raises or answers no token ids costs that step's drafts, with a ``ProposerWarning`` (greedy output is
    unchanged: drafts are verified)."""

    def __init__(self, propose, min_n: int, max_n: int):
        self._propose, self.min_n, self.max_n = propose, min_n, max_n

    def propose(self, tokens: list[int], max_tokens: int) -> list[int]:
        return self._propose(list(tokens), max_tokens, self.min_n, self.max_n)


def check_parts(parts, *, speculation, attention_backend, kv_cache_dtype: str) -> EngineParts:
    """``LLM``'s ``parts`` (None: none of them), checked against the engine's other settings."""
    if parts is None:
        return EngineParts()
    if not isinstance(parts, EngineParts):
        raise InvalidArgumentError(f"parts must be None or a kvlab.engine.parts.EngineParts, got "
                                   f"{type(parts).__name__} (kvlab.course.engine_with takes a dict)")
    if parts.replaces_attention and (attention_backend not in (None, "torch") or kv_cache_dtype != "auto"):
        raise InvalidArgumentError(f"parts: a learner's attention runs on the torch backend over an unquantized "
                                   f"cache; got attention_backend={attention_backend!r}, "
                                   f"kv_cache_dtype={kv_cache_dtype!r}")
    if parts.ngram_proposer is not None and (speculation is None or speculation.method != "ngram"):
        raise InvalidArgumentError("parts: ngram_proposer proposes for speculative_config={'method': 'ngram', ...}; "
                                   f"this engine's is {speculation and speculation.method!r}")
    if parts.rejection_sampling is not None and speculation is None:
        raise InvalidArgumentError("parts: rejection_sampling verifies drafts: give a speculative_config too")
    return parts


def check_model_for_parts(parts: EngineParts, groups, path) -> None:
    """``parts`` plug into a model with one kind of layer without MLA: full attention (as SmolLM2), or a sliding
    window for the parts that are not attention; ``window_release`` only into a sliding-window one."""
    if not parts.given():
        return
    window = groups[0].attention.sliding_window
    if len(groups) > 1 or groups[0].mla_latent_dim is not None or (window is not None and parts.replaces_attention):
        raise InvalidArgumentError(f"parts: a learner's parts plug into a model with one kind of layer without MLA, "
                                   f"full attention (as SmolLM2) or, for parts other than attention, a sliding window; "
                                   f"{path} has other layers")
    if parts.window_release is not None and window is None:
        raise InvalidArgumentError(f"parts: window_release releases a sliding window's blocks; {path} has no window")


def _preempted_by_recompute(held: list[int], needs: list[bool], free: int) -> tuple[list[int], list[int]]:
    """The preemption puzzle's spec: requests in order; one short of a block preempts the last request not yet
    scheduled (possibly itself, then it stops), which frees all it holds and goes to the waiting queue's front."""
    queue, scheduled, waiting = list(range(len(held))), [], []
    while queue:
        request = queue.pop(0)
        while needs[request] and free == 0:
            victim = queue.pop() if queue else request
            free += held[victim]
            waiting.insert(0, victim)
            if victim == request:
                break
        else:
            free -= needs[request]
            scheduled.append(request)
    return scheduled, waiting


def _v1_step(running: list[int], waiting: list[int], budget: int, max_num_seqs: int) -> tuple[list[int], list[int]]:
    """The v1_step puzzle's spec: running requests first, each min(tokens left, budget left); then waiting
    prompts in order while budget and seats last, the last admitted possibly with a chunk."""
    running_tokens = []
    for left in running:
        running_tokens.append(min(left, budget))
        budget -= running_tokens[-1]
    admitted = []
    for prompt in waiting:
        if not budget or len(running) + len(admitted) >= max_num_seqs:
            break
        admitted.append(min(prompt, budget))
        budget -= admitted[-1]
    return running_tokens, admitted


def _pair_of_lists(got):
    """``got`` as a tuple of its two lists where it is two lists (a list or a tuple of them), else unchanged:
    the form a scheduler part's answer is compared in."""
    if isinstance(got, (tuple, list)) and len(got) == 2 and all(type(part) is list for part in got):
        return tuple(list(part) for part in got)
    return got


def _xxh64_block(parent, block: tuple) -> int:
    """The hash the learner's chain is given: xxh64 of the block's tokens (int64 bytes, as kvlab's default)
    seeded by the parent's hash."""
    return xxhash.xxh64_intdigest(array("q", block).tobytes(), parent or 0)


def _call(name: str, part, *args):
    try:
        return part(*args)
    except LearnerPartError:
        raise
    except Exception as error:
        raise LearnerPartError(f"{name} raised {error!r}") from error


def _checked_output(name: str, out, query: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.shape != query.shape or not bool(out.isfinite().all()):
        what = (f"a {tuple(out.shape)} tensor" + ("" if out.shape != query.shape else " with NaN or inf")
                if isinstance(out, torch.Tensor) else _short(out))
        raise LearnerPartError(f"{name} returned {what}: expected a finite {tuple(query.shape)} tensor (as the query)")
    return out.to(query.dtype)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
