"""The CPU tiers: the swap space preempted sequences move to (vLLM V0's swapping), and the offload tier of
cached blocks (offload at GPU eviction, promote on a GPU miss) with its replacement and admission policies.
"""

from collections import Counter, deque
from itertools import compress, filterfalse, islice, repeat
from typing import Optional

from kvlab.blocks.prefix_cache import ContentIds, Evicted, InternedContentIds, PrefixIndex, ROOT
from kvlab.blocks.records import AllocStatus, TierHitStats, TierMove
from kvlab.errors import InvalidArgumentError, InvariantViolation, OutOfBlocksError
from kvlab.validation import check_int


# ==== the swap space ==================================================================================================
# The swap space: the CPU pool, and which GPU and CPU blocks hold the same bytes.
#
# Sequences that share blocks (forks, prefix hits) are swapped one at a time. When the first of them swaps
# out, a shared GPU block g is copied to a CPU block c and the pair (g, c) is remembered as *twins*: the
# second sequence swapping out reuses c instead of copying g again, and a sequence swapping in reuses g if it
# is still there. So a shared block moves once each way. Twins are forgotten as soon as either side is freed
# or g is written (an append into a partial block), because then they no longer hold the same bytes.
#
# The swap space owns the CPU side. Once the swap calls (kvlab.blocks.manager) made the GPU pool's policy
# calls, it moves a sequence's table (and its group's cross-attention table, which travels with the group's last
# sequence on the GPU) with ``moved_out`` / ``moved_in``, and returns the copy mappings for ``swap_blocks``. The
# manager calls ``forget_gpu`` for GPU blocks it frees or writes in place.

class SwapSpace:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._cpu_of: dict[int, int] = {}  # GPU block -> its CPU twin
        self._gpu_of: dict[int, int] = {}  # CPU block -> its GPU twin

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- moving a sequence ------------------------------------------------------------------------------
    @staticmethod
    def moving_out(alloc):
        """(GPU blocks a swap-out moves, the cross table moving with them or None): the cross table's blocks
        come last, if no other group member stays on the GPU."""
        cross = alloc.cross if alloc.cross is not None and alloc.cross.members_on_gpu() == 1 else None
        return alloc.live_blocks() + (cross.blocks if cross else []), cross

    @staticmethod
    def moving_in(alloc):
        """(CPU blocks a swap-in moves, the cross table moving with them or None)."""
        cross = alloc.cross if alloc.cross is not None and alloc.cross.on_cpu else None
        return alloc.live_blocks() + (cross.blocks if cross else []), cross

    def admission(self, needed: int) -> AllocStatus:
        """Whether a swap-out taking ``needed`` CPU blocks fits now, once others swap in (LATER), or never."""
        if needed > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if needed <= self.num_free else AllocStatus.LATER

    def moved_out(self, alloc, moving, freed) -> list[tuple[int, int]]:
        """A swap-out's bookkeeping once the pool released the GPU blocks of ``moving`` (``moving_out(alloc)``),
        ``freed`` of them becoming free; returns the (gpu, cpu) copies. Cannot fail (the caller checked room)."""
        gpu_blocks, cross = moving
        cpu_blocks, mapping = self.swap_out(gpu_blocks)
        self.forget_gpu(freed)            # after swap_out, which may reuse their twins
        self._place(alloc, cross, cpu_blocks, on_cpu=True)
        return mapping

    def blocks_needed_in(self, alloc) -> tuple[int, int]:
        """(GPU blocks the swapped-in sequence holds, free GPU blocks it takes: those without a twin)."""
        cpu_blocks, _ = self.moving_in(alloc)
        return len(cpu_blocks), self.gpu_twins(cpu_blocks).count(None)

    def moved_in(self, alloc, pool, new_blocks) -> list[tuple[int, int]]:
        """A swap-in's bookkeeping once the policy handed out ``new_blocks``, one per CPU block without a GPU
        twin; returns the (cpu, gpu) copies. Cannot fail."""
        cpu_blocks, cross = self.moving_in(alloc)
        twins = self.gpu_twins(cpu_blocks)
        pool.fill(new_blocks)
        pool.claim([gpu for gpu in twins if gpu is not None], 0)  # twins are in use: none was free
        gpu_blocks, mapping = self.swap_in(cpu_blocks, twins, new_blocks)
        self._place(alloc, cross, gpu_blocks, on_cpu=False)
        return mapping

    @staticmethod
    def _place(alloc, cross, blocks, on_cpu) -> None:
        """Point the table (and cross table) at ``blocks``, given in ``moving_*`` order."""
        num_live = len(alloc.table) - alloc.num_released
        if alloc.forked_drafts:  # the blocks a fork sibling may seal, under their ids in the other pool
            alloc.forked_drafts = frozenset(block for old, block in zip(alloc.table[alloc.num_released:], blocks)
                                            if old in alloc.forked_drafts)
        alloc.table[alloc.num_released:] = blocks[:num_live]
        alloc.on_cpu = on_cpu
        if cross is not None:
            cross.blocks, cross.on_cpu = blocks[num_live:], on_cpu

    # ---- GPU -> CPU -------------------------------------------------------------------------------------
    def blocks_needed_out(self, gpu_blocks) -> int:
        """CPU blocks a swap-out of ``gpu_blocks`` takes (those without a CPU twin)."""
        return len({g for g in gpu_blocks if g not in self._cpu_of})

    def swap_out(self, gpu_blocks) -> tuple[list[int], list[tuple[int, int]]]:
        """The CPU blocks now holding ``gpu_blocks`` (one per entry) and the (gpu, cpu) copies to make. The
        caller releases the GPU blocks afterwards and checked ``blocks_needed_out`` against ``num_free``."""
        cpu_blocks, mapping = [], []
        for gpu in gpu_blocks:
            cpu = self._cpu_of.get(gpu)
            if cpu is None:
                if not self._free:
                    raise OutOfBlocksError("no free CPU block")
                cpu = self._free.pop()
                self.ref[cpu] = 1
                self._link(gpu, cpu)
                mapping.append((gpu, cpu))
            else:
                self.ref[cpu] += 1
            cpu_blocks.append(cpu)
        return cpu_blocks, mapping

    # ---- CPU -> GPU -------------------------------------------------------------------------------------
    def gpu_twins(self, cpu_blocks) -> list:
        """For each CPU block, the GPU block still holding its bytes, or None (it needs a new GPU block)."""
        return [self._gpu_of.get(cpu) for cpu in cpu_blocks]

    def swap_in(self, cpu_blocks, twins, new_gpu_blocks) -> tuple[list[int], list[tuple[int, int]]]:
        """Bring ``cpu_blocks`` back: entries with a GPU twin (``twins = gpu_twins(cpu_blocks)``) reuse it,
        the others take ``new_gpu_blocks`` in order. Returns the GPU blocks (one per entry) and the
        (cpu, gpu) copies to make, and releases the CPU blocks."""
        fresh = iter(new_gpu_blocks)
        gpu_blocks, mapping = [], []
        for cpu, gpu in zip(cpu_blocks, twins):
            if gpu is None:
                gpu = next(fresh)
                self._link(gpu, cpu)
                mapping.append((cpu, gpu))
            gpu_blocks.append(gpu)
        self.release(cpu_blocks)
        return gpu_blocks, mapping

    # ---- bookkeeping ------------------------------------------------------------------------------------
    def release(self, cpu_blocks) -> None:
        """One reference less to each CPU block; a freed block forgets its twin."""
        for cpu in cpu_blocks:
            self.ref[cpu] -= 1
            if not self.ref[cpu]:
                self._free.append(cpu)
                gpu = self._gpu_of.pop(cpu, None)
                if gpu is not None:
                    del self._cpu_of[gpu]

    def forget_gpu(self, gpu_blocks) -> None:
        """These GPU blocks were freed or written in place: their CPU twins no longer hold the same bytes."""
        if self._cpu_of:
            for gpu in gpu_blocks:
                cpu = self._cpu_of.pop(gpu, None)
                if cpu is not None:
                    del self._gpu_of[cpu]

    def _link(self, gpu: int, cpu: int) -> None:
        self._cpu_of[gpu] = cpu
        self._gpu_of[cpu] = gpu

    def check(self, table_refs: Counter, gpu_ref) -> None:
        """Raise InvariantViolation unless CPU ref counts equal ``table_refs`` (CPU block -> entries using
        it), the free list is their complement, and every twin link joins two live blocks, both ways."""
        for block in range(self.num_blocks):
            if self.ref[block] != table_refs.get(block, 0):
                raise InvariantViolation(f"CPU block {block}: ref count {self.ref[block]}, "
                                         f"{table_refs.get(block, 0)} entries use it")
        if len(self._free) != len(set(self._free)) or set(self._free) != {
                b for b in range(self.num_blocks) if self.ref[b] == 0}:
            raise InvariantViolation("CPU free list disagrees with CPU ref counts")
        if len(self._cpu_of) != len(self._gpu_of) or any(self._gpu_of.get(c) != g for g, c in self._cpu_of.items()):
            raise InvariantViolation("twin links are not one-to-one both ways")
        for gpu, cpu in self._cpu_of.items():
            if gpu_ref[gpu] == 0 or self.ref[cpu] == 0:
                raise InvariantViolation(f"twin link {gpu}<->{cpu} outlived one of its blocks")


# ==== the offload tier's policies =====================================================================================
# Which entry the CPU offload tier drops when it needs a slot, and which evicted GPU blocks it admits.
#
# Replacement (``offload_policy``), over the hashes the tier holds:
#     "lru"  least recently stored or hit first (vLLM's ``LRUOffloadingManager``);
#     "arc"  Adaptive Replacement Cache (Megiddo & Modha, FAST'03), as vLLM's ``ARCOffloadingManager``: T1 holds
#            entries hit once since they were stored, T2 those hit again; B1 / B2 remember (hashes only) what
#            was dropped from each. A lookup that would have hit B1 says recency was undervalued (T1's target
#            grows), one in B2 says frequency was (it shrinks); the victim comes from T1 while T1 is at or above
#            its target, else from T2. The ghost lists are bounded by the tier's size.
# Admission (``offload_admission``):
#     "always"  every evicted cached GPU block is offered to the tier;
#     "reused"  only blocks whose hash ``allocate`` looked up at least ``REUSE_THRESHOLD`` times (vLLM's
#               ``FilterReusedOffloadingManager``, counting in a bounded LRU table). vLLM stores a block when
#               it is computed and counts the hashes its connector looks up past the GPU's hits; kvlab offloads
#               at GPU eviction, so it counts every full block of every prompt ``allocate`` looks up (a block
#               hit on the GPU was reused too).
#
# The policies keep their lists in plain dicts (a use moves a hash to the end by taking it out and putting it back): a
# batch goes through them in C. Every call but ``victim`` is O(1) per hash; ``victim`` walks past a dict's deleted
# slots at its front, so it runs for single blocks only: ``make_room`` takes a batch of GPU evictions at once, and
# a batch it refuses is halved. ``touch`` takes the hashes in prompt order and visits them last to first, as vLLM
# does, so a prompt's first block ends up most recently used.

REUSE_THRESHOLD = 2


class LRUOrder:
    """The tier's hashes, least recently used first: the order of the tier index's own hash -> slot map
    (``index.cached``), so recency costs no second map. The tier inserts an entry there (at the end: most recent)
    and pops a victim from there, so ``insert`` has nothing to do and ``victim`` / ``make_room`` only choose;
    a use moves a hash to the end by taking it out and putting it back."""

    def __init__(self, capacity: int, index):
        self.index = index  # read for its current map: ``forget_all`` replaces it

    def insert(self, block_hash) -> None:
        pass  # the tier's insertion into ``index.cached`` made it the most recent

    def touch(self, hashes) -> None:
        entries = self.index.cached
        for block_hash in filter(entries.__contains__, reversed(hashes)):  # most hashes miss: filtered in C
            entries[block_hash] = entries.pop(block_hash)

    def make_room(self, num_victims: int, hashes, resident, pinned=frozenset()) -> list | None:
        """The victims ``victim(pinned)`` would name for each of the last ``num_victims`` of ``hashes``, each
        followed by the insertion of its hash, after the insertion of the others: the tier pops them and inserts
        ``hashes``. None where that would drop an entry of this batch or one of ``resident`` (hashes the batch
        skipped as held, which the one-by-one loop would store again once dropped)."""
        entries = self.index.cached
        if num_victims > len(entries):
            return None
        candidates = filterfalse(pinned.__contains__, entries) if pinned else entries
        victims = list(islice(candidates, num_victims))
        if len(victims) < num_victims or (resident and not resident.isdisjoint(victims)):
            return None
        return victims

    def victim(self, pinned) -> object:
        """The entry to drop (never one of ``pinned``; the tier pops it), or None if every entry is pinned."""
        return next(filterfalse(pinned.__contains__, self.index.cached), None)

    def clear(self) -> None:
        pass  # ``index.forget_all`` emptied the order

    def reorder(self, hashes) -> None:
        """Keep the same entries in the order of ``hashes`` (least recently used first): a learner's order
        (``KVCacheManager(order_tier=...)``), which must hold exactly the resident hashes."""
        entries = self.index.cached
        if sorted(hashes) != sorted(entries):
            raise InvariantViolation("a reordered offload tier must hold the same hashes")
        slots = [entries[block_hash] for block_hash in hashes]
        entries.clear()  # the same map, reordered in place: it is the index's
        entries.update(zip(hashes, slots))

    def resident(self) -> list:
        return list(self.index.cached)

    def check(self) -> None:
        pass


class ARCOrder:
    """T1 / T2 (resident hashes, least recent first) and their ghost lists B1 / B2, with T1's adaptive target."""

    def __init__(self, capacity: int, index=None):  # ``index``: LRUOrder's; ARC keeps lists of its own
        self.capacity = capacity
        self.target_t1 = 0
        self.t1, self.t2, self.b1, self.b2 = {}, {}, {}, {}

    def insert(self, block_hash) -> None:
        self.t1[block_hash] = None
        self.b1.pop(block_hash, None)
        self.b2.pop(block_hash, None)

    def touch(self, hashes) -> None:
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        # Most hashes are in no list: the four are intersected with them in C first.
        known = (t1.keys() & hashes) | (t2.keys() & hashes) | (b1.keys() & hashes) | (b2.keys() & hashes)
        for block_hash in filter(known.__contains__, reversed(hashes)):
            if block_hash in t1:
                del t1[block_hash]
                t2[block_hash] = None
            elif block_hash in t2:
                t2[block_hash] = t2.pop(block_hash)
            elif block_hash in b1:
                self.target_t1 = min(self.target_t1 + max(1, len(b2) // len(b1)), self.capacity)
            elif block_hash in b2:
                self.target_t1 = max(self.target_t1 - max(1, len(b1) // len(b2)), 0)

    def make_room(self, num_victims: int, hashes, resident, pinned=frozenset()) -> list | None:
        """As ``LRUOrder.make_room``, and it moves the victims to their ghost lists and ``hashes`` into T1 itself.
        Victims come from T1 while T1 (which each insert grows) is at or above its target, else from T2, never
        ``pinned``; done at once only where that is exact: no new hash is a ghost (an insert would remove it
        from B1/B2 between two victims' appends), every victim is an entry from before the batch, and none is
        ``resident``."""
        t1, t2, b1, b2 = self.t1, self.t2, self.b1, self.b2
        if not (b1.keys().isdisjoint(hashes) and b2.keys().isdisjoint(hashes)):
            return None
        length = len(t1) + len(hashes) - num_victims  # T1's length when the first victim is chosen
        from_t2 = min(num_victims, max(0, self.target_t1 - length))
        from_t1 = num_victims - from_t2
        unpinned = (lambda part: filterfalse(pinned.__contains__, part)) if pinned else iter
        victims = list(islice(unpinned(t2), from_t2)) + list(islice(unpinned(t1), from_t1))
        if len(victims) < num_victims or (resident and not resident.isdisjoint(victims)):
            return None
        for resident_list, ghosts, dropped in ((t2, b2, victims[:from_t2]), (t1, b1, victims[from_t2:])):
            deque(map(resident_list.__delitem__, dropped), 0)
            ghosts.update(zip(dropped, repeat(None)))  # no temporary dict: one insertion per hash
            if len(ghosts) > self.capacity:  # the oldest ghosts go, as one popped per victim would
                deque(map(ghosts.__delitem__, list(islice(ghosts, len(ghosts) - self.capacity))), 0)
        t1.update(zip(hashes, repeat(None)))
        return victims

    def victim(self, pinned) -> object:
        """From T1 while it is at or above its target (falling back to T2), else from T2: the least recent entry
        not ``pinned``, remembered in that list's ghost list. None if every candidate is pinned."""
        if len(self.t1) >= self.target_t1:
            block_hash = self._drop_oldest(self.t1, self.b1, pinned)
            if block_hash is not None:
                return block_hash
        return self._drop_oldest(self.t2, self.b2, pinned)

    def _drop_oldest(self, resident: dict, ghosts: dict, pinned):
        block_hash = next(filterfalse(pinned.__contains__, resident), None)
        if block_hash is not None:
            del resident[block_hash]
            ghosts[block_hash] = None
            if len(ghosts) > self.capacity:  # only this ghost list grew, by one
                del ghosts[next(iter(ghosts))]
        return block_hash

    def clear(self) -> None:
        for part in (self.t1, self.t2, self.b1, self.b2):
            part.clear()
        self.target_t1 = 0

    def resident(self) -> list:
        return [*self.t1, *self.t2]

    def check(self) -> None:
        if not self.t1.keys().isdisjoint(self.t2) or len(self.b1) > self.capacity or len(self.b2) > self.capacity \
                or not 0 <= self.target_t1 <= self.capacity:
            raise InvariantViolation("the offload tier's ARC lists overlap, or a ghost list or the target is out "
                                     "of bounds")


OFFLOAD_POLICIES = {"lru": LRUOrder, "arc": ARCOrder}
OFFLOAD_ADMISSIONS = ("always", "reused")


class ReuseFilter:
    """How often each recent hash was looked up, in an LRU table of at most ``max_entries`` (a plain dict, least
    recent first), and the set of those looked up at least ``REUSE_THRESHOLD`` times: what the tier admits."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self.counts: dict = {}
        self.reused: set = set()

    def record(self, hashes) -> None:
        """Count each of ``hashes`` in order: a known hash moves to the end, one more; a new one goes at the end
        with 1, dropping the least recent entry when the table is full (vLLM's loop), done at once in C."""
        counts = self.counts
        known = counts.keys() & hashes
        # At most this many entries go (fewer if a new hash repeats), the least recent first. Where one of them is
        # a hash of this batch (the loop would drop it before its turn, then count it anew), each half is
        # recorded in turn, which is the same as the whole; a single hash always goes at once.
        most_dropped = len(counts) + len(hashes) - len(known) - self.max_entries
        if most_dropped > 0 and (most_dropped > len(counts) or not known.isdisjoint(islice(counts, most_dropped))):
            half = len(hashes) // 2
            self.record(hashes[:half])
            self.record(hashes[half:])
            return
        # Each hash popped and put back last with one more (a repeat pops what its first occurrence put back),
        # then the oldest entries dropped: none is a hash of this batch, which all moved to the end.
        num_before = len(counts)
        counts.update(zip(hashes, map((1).__add__, map(counts.pop, hashes, repeat(0)))))
        if len(counts) - num_before != len(hashes) - len(known):  # a hash repeats: a new one may be reused now
            known = set(hashes)
        if len(counts) > self.max_entries:
            dropped = list(islice(counts, len(counts) - self.max_entries))
            deque(map(counts.__delitem__, dropped), 0)
            self.reused.difference_update(dropped)
        self.reused.update(block_hash for block_hash in known if counts[block_hash] >= REUSE_THRESHOLD)

    def admits(self, block_hash) -> bool:
        return block_hash in self.reused


def check_offload_options(policy: str, admission: str) -> None:
    if not isinstance(policy, str) or policy not in OFFLOAD_POLICIES:  # a list would be unhashable in the dict
        raise InvalidArgumentError(f"offload_policy must be one of {sorted(OFFLOAD_POLICIES)}, got {policy!r}")
    if not isinstance(admission, str) or admission not in OFFLOAD_ADMISSIONS:
        raise InvalidArgumentError(f"offload_admission must be 'always' or 'reused', got {admission!r}")


# ==== the offload tier ================================================================================================
# The CPU offload tier: a second prefix cache behind the GPU pool (vLLM V1's ``vllm/v1/kv_offload/``).
#
# When the GPU pool reuses a cached block for new content (``BlockPool.fill`` evicts it from the GPU index), the
# block is offered here: if admitted (kvlab.blocks.tiers), it is copied to a CPU slot, dropping the
# policy's victim when the tier is full. A prompt whose lookup misses on the GPU goes on looking here, from the
# GPU hits' last content on; each tier hit is *promoted*: ``allocate`` gives it a new GPU block and a CPU -> GPU
# copy. The tier keeps its copy (vLLM's CPU tier is inclusive too), so evicting the promoted block again costs
# no copy.
#
# The verified-hash guarantee holds across tiers: the tier's entries live in a ``PrefixIndex`` sharing the GPU
# index's content ids, and an entry keeps its content id and its parent's in both directions, so a tier hit is
# checked against its bytes (tokens and keys) and the exact prefix before it, like a GPU hit, and the blocks
# sealed after a promoted one chain to it.
#
# Copies are data for the engine: ``moves`` lists ``TierMove``s, batches of copies of one kind (GPU block -> CPU slot
# for "offload", CPU slot -> GPU block for "promote", as vLLM's offloading worker takes a (source spec, destination
# spec) pair of block lists per transfer); consecutive copies of one kind share a batch, so a call's batches do not
# depend on how the tier split its work. The manager's call that made them returns them (``Admitted.tier_moves``,
# ``BlockCopies.tier_moves``) and the list is empty between calls. Applying the copies in that order, before the
# moves the same call returns (copy-on-write, swap-in) and before the step's forward pass, is always right: an
# offload reads a GPU block before anything of the call writes it, and a slot being promoted by a call is never
# the victim of that call's offloads (``pinned``). Within a batch a slot may be written twice (a tier smaller than
# the batch reuses its slots): the later copy wins, so apply them in order (the engine's ``BlockMoves`` does).
#
# Speed: a GPU eviction hands the tier a batch of blocks, and ``offer`` takes it at once where the policy can name
# every victim up front (``make_room``): admission, victims, slots, the index's fields and the moves are whole-list
# operations, mostly in C. Where it cannot (a batch that would drop its own entries, an ARC ghost among the new
# hashes), the batch is halved until it is (down to single blocks); both give the same state, moves and reports
# (``tests/block_manager/test_offload_tier_at_once.py``).
#
# A *shared* tier (``make_shared_tier``; Mooncake's global store) serves several managers, a fleet's replicas:
# ``BlockManager(..., shared_tier=tier)``. Their GPU indexes and the tier draw content ids from one
# ``InternedContentIds``, so the id of a (parent, bytes) is the same on every replica and an entry replica A
# offloaded is verified on replica B exactly as a GPU hit is. A call returns the copies it made (one manager's call
# at a time); its ``tier_stats`` count every replica's lookups, and it reports to no manager's KV events (every
# replica reaches it alike). ``reset_prefix_cache`` on any of them clears it (it may hold blocks never written).

#: The reuse filter remembers this many hashes per tier slot (vLLM's default table is 64k entries).
REUSE_ENTRIES_PER_SLOT = 4
#: The largest shared tier (the manager's MAX_BLOCKS: ~100 bytes of Python state per slot).
MAX_SHARED_SLOTS = 1 << 24


class OffloadTier:
    def __init__(self, num_slots: int, ids: ContentIds, policy: str, admission: str):
        self.num_slots = num_slots
        self.index = PrefixIndex(num_slots, ids, name="CPU slot")
        self.order = OFFLOAD_POLICIES[policy](num_slots, self.index)
        self.filter = ReuseFilter(REUSE_ENTRIES_PER_SLOT * num_slots) if admission == "reused" else None
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self.moves: list[TierMove] = []
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
        if len(evicted.slots) == 1:
            self._offer_one_by_one(evicted)
            return
        # Each half on its own, in order, is the same as the loop over the whole: most of it goes at once still,
        # and ``victim`` (which walks past a dict's deleted slots) runs for single blocks only.
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
            else:
                keep = list(map(self.filter.reused.__contains__, hashes))  # ReuseFilter.admits, in C
                if held:
                    keep = [admitted and h not in cached for admitted, h in zip(keep, hashes)]
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
        if victims:
            slots += map(cached.pop, victims)
            index.generation += 1  # a lookup's tier hits may be gone
        first, end = slots[0], slots[0] + count
        if slots[-1] == end - 1 and slots == list(range(first, end)):
            # One run of slots, the usual case: the tier fills its slots in order and an LRU tier drops them in
            # the order it filled them, until hits reorder it. Stored as slices, in C.
            index.hash[first:end], index.content[first:end], index.parent_content[first:end] = hashes, cids, parents
            index.block_bytes[first:end], index.registered[first:end] = contents, repeat(True, count)
            cached.update(zip(hashes, slots))
        else:
            index.put(slots, hashes, contents, cids, parents)  # registers each: none is held (skipped above)
        self._record("offload", gpus, slots)
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
        cached, sources, targets = index.cached, [], []
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
                self.index.generation += 1  # a lookup's tier hits may be gone
                if sink is not None:
                    sink.tier_removed([slot], [victim])
            hash_of[slot], content_of[slot], parent_of[slot], bytes_of[slot] = h, cid, parent, content
            cached[h] = slot
            registered[slot] = True
            order.insert(h)
            sources.append(gpu)
            targets.append(slot)
            if sink is not None:
                sink.offloaded(gpu, slot, h, content)
        self._record("offload", sources, targets)
        self.stats.offloaded_blocks += len(sources)

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
        self._record("promote", slots, blocks)
        if self.sink is not None:
            self.sink.promoted(slots, blocks)
        return index.content[slots[-1]]

    def _record(self, kind: str, sources, targets) -> None:
        """Copies to make, after those recorded before: they join the last batch if it is of the same kind."""
        if not sources:
            return
        moves = self.moves
        if moves and moves[-1].kind == kind:
            moves[-1].sources.extend(sources)
            moves[-1].targets.extend(targets)
        else:
            moves.append(TierMove(kind, list(sources), list(targets)))  # copies: the caller may keep its lists

    def take_moves(self) -> list[TierMove]:
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
