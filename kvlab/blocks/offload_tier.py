"""The CPU offload tier: a second prefix cache behind the GPU pool (vLLM V1's ``vllm/v1/kv_offload/``).

When the GPU pool reuses a cached block for new content (``BlockPool.fill`` evicts it from the GPU index), the
block is offered here: if admitted (kvlab.blocks.offload_policies), it is copied to a CPU slot, dropping the
policy's victim when the tier is full. A prompt whose lookup misses on the GPU goes on looking here, from the
GPU hits' last content on; each tier hit is *promoted*: ``allocate`` gives it a new GPU block and a CPU -> GPU
copy. The tier keeps its copy (vLLM's CPU tier is inclusive too), so evicting the promoted block again costs
no copy.

The verified-hash guarantee holds across tiers: the tier's entries live in a ``PrefixIndex`` sharing the GPU
index's content ids, and an entry keeps its content id and its parent's in both directions, so a tier hit is
checked against its bytes (tokens and keys) and the exact prefix before it, like a GPU hit, and the blocks
sealed after a promoted one chain to it.

Copies are data for the engine: ``moves`` lists ``("offload", gpu_block, cpu_slot)`` and ``("promote", cpu_slot,
gpu_block)`` in the order made; the manager hands them out with ``take_tier_moves()``. Applying them in that
order, before the moves the same call returns (copy-on-write, swap-in) and before the step's forward pass, is
always right: an offload reads a GPU block before anything of the call writes it, and a slot being promoted
by a call is never the victim of that call's offloads (``pinned``).

Speed: a GPU eviction hands the tier a batch of blocks, and ``offer`` takes it at once where the policy can name
every victim up front (``make_room``): admission, victims, slots, the index's fields and the moves are whole-list
operations, mostly in C. Where it cannot (a batch that would drop its own entries, an ARC ghost among the new
hashes), the batch is taken block by block (LRU: halved first); both give the same state, moves and reports
(``tests/block_manager/test_offload_tier_at_once.py``).

A *shared* tier (``make_shared_tier``; Mooncake's global store) serves several managers, a fleet's replicas:
``BlockManager(..., shared_tier=tier)``. Their GPU indexes and the tier draw content ids from one
``InternedContentIds``, so the id of a (parent, bytes) is the same on every replica and an entry replica A
offloaded is verified on replica B exactly as a GPU hit is. Its moves and stats are the fleet's: a manager's
``take_tier_moves()`` hands out the copies made since anyone last took them (one manager's call at a time),
its ``tier_stats`` count every replica's lookups, and it reports to no manager's KV events (every replica
reaches it alike). ``reset_prefix_cache`` on any of them clears it (it may hold blocks never written).
"""

from itertools import compress, repeat
from typing import Optional

from kvlab.blocks.offload_policies import OFFLOAD_POLICIES, REUSE_THRESHOLD, ReuseFilter, check_offload_options
from kvlab.blocks.prefix_index import ROOT, ContentIds, Evicted, InternedContentIds, PrefixIndex
from kvlab.blocks.records import TierHitStats
from kvlab.errors import InvariantViolation
from kvlab.validation import check_int

#: The reuse filter remembers this many hashes per tier slot (vLLM's default table is 64k entries).
REUSE_ENTRIES_PER_SLOT = 4
#: The largest shared tier (the manager's MAX_BLOCKS: ~100 bytes of Python state per slot).
MAX_SHARED_SLOTS = 1 << 24


class OffloadTier:
    def __init__(self, num_slots: int, ids: ContentIds, policy: str, admission: str):
        self.num_slots = num_slots
        self.index = PrefixIndex(num_slots, ids, name="CPU slot")
        self.order = OFFLOAD_POLICIES[policy](num_slots)
        self.filter = ReuseFilter(REUSE_ENTRIES_PER_SLOT * num_slots) if admission == "reused" else None
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self.moves: list[tuple[str, int, int]] = []
        self.pinned: frozenset = frozenset()  # hashes the current call promotes: never its offloads' victims
        self.sink = None  # the manager's EventSink, None when nobody listens
        self.stats = TierHitStats()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lookup(self, hashes, contents, limit: int, gpu_hits: list, gpu_index: PrefixIndex) -> list[int]:
        """The tier slots continuing the GPU's hits ``gpu_hits`` on the prompt's blocks, verified like a GPU
        lookup (at most ``limit`` blocks in all). Pure."""
        start = len(gpu_hits)
        parent = gpu_index.content[gpu_hits[-1]] if gpu_hits else ROOT
        return self.index.lookup(hashes[start:], contents[start:], limit - start, parent)

    def looked_up(self, num_tokens: int, hashes, num_gpu_hits: int, num_tier_hits: int, block_size: int,
                  counted: bool = True) -> None:
        """``allocate`` looked up the block ``hashes`` of a prompt of ``num_tokens`` tokens: the first
        ``num_gpu_hits`` hit on the GPU, the next ``num_tier_hits`` here. The reuse filter counts them all;
        the replacement policy sees those the tier was asked about; ``stats`` only a ``counted`` lookup (not
        a recomputation after preemption)."""
        if self.filter is not None:
            self.filter.record(hashes)
        self.order.touch(hashes[num_gpu_hits:])
        if counted:
            self.stats.count_lookup(num_tokens, len(hashes), num_gpu_hits, num_tier_hits, block_size)

    def offer(self, evicted: Evicted) -> None:
        """Copy the admitted ones of the GPU's ``evicted`` blocks in, in order, dropping victims as needed. A
        hash the tier holds already is not stored twice (one slot per hash, like the GPU index)."""
        if self._offer_at_once(evicted):
            return
        if len(evicted.slots) == 1 or not self.order.split_batches:
            self._offer_one_by_one(evicted)
            return
        # Each half on its own, in order, is the same as the loop over the whole: most of it goes at once still.
        half = len(evicted.slots) // 2
        self.offer(Evicted(*(column[:half] for column in evicted)))
        self.offer(Evicted(*(column[half:] for column in evicted)))

    def _offer_at_once(self, evicted: Evicted) -> bool:
        """``_offer_one_by_one``'s result, reached with whole-list operations that run in C: what makes a GPU
        eviction with a tier cost less. Returns False, having changed nothing, when the policy cannot name the
        victims up front (``make_room``: e.g. the batch would drop its own entries); the sink's reports come
        after the changes, in the one-by-one loop's order (its consumers only record what they are told)."""
        gpus, hashes, contents, cids, parents = evicted
        index, free = self.index, self._free
        cached = index.cached
        held = not cached.keys().isdisjoint(hashes)
        resident = cached.keys() & hashes if held else ()  # skipped as held already
        if held or self.filter is not None:
            if self.filter is None:
                keep = [h not in cached for h in hashes]
            else:  # ReuseFilter.admits, inlined: it runs for every block the GPU evicts
                counts = self.filter.counts
                keep = [h not in cached and counts.get(h, 0) >= REUSE_THRESHOLD for h in hashes]
                if not any(keep):
                    return True
            gpus, hashes, contents, cids, parents = (list(compress(column, keep))
                                                     for column in (gpus, hashes, contents, cids, parents))
        count = len(hashes)
        if not count:
            return True
        from_free = min(count, len(free))
        victims = self.order.make_room(count - from_free, hashes, resident, self.pinned)
        if victims is None:
            return False
        slots = free[len(free) - from_free:][::-1]  # what free.pop() would hand out, in that order
        del free[len(free) - from_free:]
        registered = index.registered
        for slot in slots:  # a victim's slot is registered already: cached again below
            registered[slot] = True
        if victims:
            slots += map(cached.pop, victims)
        hash_of, content_of, parent_of, bytes_of = index.hash, index.content, index.parent_content, index.block_bytes
        for slot, h, cid, parent, content in zip(slots, hashes, cids, parents, contents):
            hash_of[slot], content_of[slot], parent_of[slot], bytes_of[slot] = h, cid, parent, content
        cached.update(zip(hashes, slots))
        self.moves.extend(zip(repeat("offload"), gpus, slots))
        self.stats.offloaded_blocks += count
        sink = self.sink
        if sink is not None:
            for i, (gpu, slot, h, content) in enumerate(zip(gpus, slots, hashes, contents)):
                if i >= from_free:
                    sink.tier_removed([slot], [victims[i - from_free]])
                sink.offloaded(gpu, slot, h, content)
        return True

    def _offer_one_by_one(self, evicted: Evicted) -> None:
        index, order, sink, admission, free = self.index, self.order, self.sink, self.filter, self._free
        cached, moves, before = index.cached, self.moves, len(self.moves)
        # PrefixIndex.put of one entry, inlined: this loop runs for every block the GPU evicts.
        hash_of, content_of, parent_of, bytes_of = index.hash, index.content, index.parent_content, index.block_bytes
        registered = index.registered
        for gpu, h, content, cid, parent in zip(*evicted):
            if h in cached or (admission is not None and not admission.admits(h)):
                continue
            if free:
                slot = free.pop()
            else:
                victim = order.victim(self.pinned)
                if victim is None:
                    continue
                slot = cached.pop(victim)  # registered[slot] stays True: the slot is cached again below
                if sink is not None:
                    sink.tier_removed([slot], [victim])
            hash_of[slot], content_of[slot], parent_of[slot], bytes_of[slot] = h, cid, parent, content
            cached[h] = slot
            registered[slot] = True
            order.insert(h)
            moves.append(("offload", gpu, slot))
            if sink is not None:
                sink.offloaded(gpu, slot, h, content)
        self.stats.offloaded_blocks += len(moves) - before

    def promote(self, pool, slots: list[int], blocks: list[int]) -> int:
        """Fill the fresh GPU ``blocks`` (popped by the caller's transaction) with the entries of ``slots``:
        ref count 1, registered in the GPU index with the entries' content ids, and one CPU -> GPU copy each.
        Returns the last one's content id (the next block's parent)."""
        index = self.index
        hashes = [index.hash[slot] for slot in slots]
        self.pinned = frozenset(hashes)
        try:
            pool.fill(blocks)  # what these blocks held is offered to the tier first: offloads precede promotions
        finally:
            self.pinned = frozenset()
        pool.index.put(blocks, hashes, [index.block_bytes[s] for s in slots], [index.content[s] for s in slots],
                       [index.parent_content[s] for s in slots])
        self.moves.extend(("promote", slot, block) for slot, block in zip(slots, blocks))
        if self.sink is not None:
            self.sink.promoted(slots, blocks)
        return index.content[slots[-1]]

    def take_moves(self) -> list[tuple[str, int, int]]:
        moves, self.moves = self.moves, []
        return moves

    def clear(self) -> None:
        """Forget every entry and reset the counters (``reset_prefix_cache``)."""
        self.index.forget_all()
        self.order.clear()
        self.stats = TierHitStats()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check(self, gpu_index: PrefixIndex) -> None:
        """Raise InvariantViolation unless the slots, the index and the policy agree, and one content id means
        one (parent, bytes) in both tiers."""
        index = self.index
        index.check()
        held = [slot for slot in range(self.num_slots) if index.registered[slot]]
        if len(self._free) != len(set(self._free)) or sorted(self._free + held) != list(range(self.num_slots)):
            raise InvariantViolation("a CPU slot of the offload tier is both free and held, or neither")
        resident = self.order.resident()
        if len(resident) != len(set(resident)) or set(resident) != set(index.cached):
            raise InvariantViolation("the offload tier's replacement policy disagrees with its index")
        self.order.check()
        sealed = {}
        for tier_index, name in ((gpu_index, "GPU block"), (index, "CPU slot")):
            for slot in range(tier_index.num_slots):
                cid = tier_index.content[slot]
                what = (tier_index.parent_content[slot], tier_index.block_bytes[slot])
                if cid > ROOT and sealed.setdefault(cid, what) != what:
                    raise InvariantViolation(f"{name} {slot} has content id {cid} but not the parent and bytes "
                                             "it has in the other tier")


def make_tier(num_slots: int, gpu_index: PrefixIndex, policy: str, admission: str) -> Optional[OffloadTier]:
    return OffloadTier(num_slots, gpu_index.ids, policy, admission) if num_slots else None


def make_shared_tier(num_slots: int, policy: str = "lru", admission: str = "always") -> OffloadTier:
    """A tier of ``num_slots`` CPU/remote slots for several managers (``BlockManager(shared_tier=...)``)."""
    check_int("num_slots", num_slots, 1, MAX_SHARED_SLOTS)
    check_offload_options(policy, admission)
    return OffloadTier(num_slots, InternedContentIds(), policy, admission)


def is_shared(tier) -> bool:
    return isinstance(tier, OffloadTier) and tier.index.ids.interned is not None
