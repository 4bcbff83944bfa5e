"""The hit-rate doctor: every prompt token a block manager admits is a hit or a miss with a cause.

An observer beside a ``BlockManager`` (it reads what ``lookup`` and ``allocate`` return and keeps its own
history; the manager knows nothing of it). ``doctor.admitted(seq, hit)`` after each ``allocate(seq, hit=hit)``,
``doctor.freed(seq)`` before each ``free(seq)``; ``DoctorView(manager, doctor)`` does both for a scheduler.
Each admitted prompt's tokens go to exactly one column of ``CAUSES``, so the columns add up to the tokens
admitted (``doctor.tokens``; property-tested in tests/studies/test_doctor.py):

- ``hit_gpu`` / ``hit_tier``: the hit, from the GPU pool / promoted from the offload tier.
- ``speculative_drop``: the hit's last block, given up for an EAGLE/MTP drafter (``use_eagle``; vLLM #53670).
- ``group_cut``: blocks the first KV cache group held but another group could not serve (a hybrid model's hit
  is what every group serves; a sliding window's blocks must be contiguous up to the end of the hit).
- Then each missed unit (a full block after those, or the prompt's partial last block), by its own history:

  - ``evicted``: the block was cached here before (its reuse distance: admissions since it was last used),
    or its chain was: a block after an evicted one misses too. ``tier_miss`` instead when the offload tier
    took it in at some point: it was lost there too (or its chain was).
  - ``partial_block``: the prompt shares a prefix with an earlier one that ends inside this unit (its first
    token continued the same prefix before, but not all of its block did), or the unit is the partial tail of
    such a prompt, or the block holds the prompt's last token (always computed) and was seen before. A prompt
    shorter than a block (vLLM #40696's 528-token block) lands here, not in ``cold``.
  - ``isolated``: the same tokens were cached under another cache salt (kvlab.blocks.sequence), never shared.
  - ``cold``: none of that: these tokens after this prefix were never seen.
- ``recompute``: a sequence re-admitted after a preemption by recompute: all of it, never a hit (vLLM #25780).
- ``not_admitted``: a prompt that never fit the pool (a study's skipped request; ``doctor.not_admitted``).

What it keeps: each cached hash's last use (a dict), the probes (parent hash, first token) of every unit seen,
the salt-free hashes and probes of salted prompts (only when there are salts), and with an offload tier which
GPU block held which hash and which hashes went to the tier. It does not know which blocks the manager still
holds, so a block seen before is "evicted" when missed for a reason the lookup does not report (a one-group
sliding-window manager's window rule reads as evicted, not as group cut). A custom ``hash_fn`` ignores the
salt, so there salted blocks share hashes and "isolated" reads as "evicted". Imports no torch.
"""

from collections import Counter
from itertools import repeat

import numpy as np

from kvlab.blocks.manager import KVCacheManager, PrefixHit
from kvlab.blocks.prefix_cache import block_hashes, hashes_of
from kvlab.blocks.sequence import encode_key
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int

HITS = ("hit_gpu", "hit_tier")
MISSES = ("cold", "evicted", "partial_block", "group_cut", "speculative_drop", "isolated", "recompute",
          "tier_miss", "not_admitted")
CAUSES = HITS + MISSES
#: A study row's columns: tokens per cause, then the evicted blocks' median reuse distance (in admissions).
COLUMNS = [f"{cause}_tokens" for cause in CAUSES] + ["evicted_reuse_distance_p50"]


class HitDoctor:
    """``HitDoctor(manager, block_size=None)``: names the cause of every prompt token ``manager`` admits.
    ``block_size``: the real tokens per block when the manager sees compact prompts (a sequential study's,
    kvlab.studies.sequential), whose units then come with their probes (``admitted(..., probes=)``)."""

    def __init__(self, manager, block_size=None):
        if not isinstance(manager, KVCacheManager):
            raise InvalidArgumentError(f"a HitDoctor observes a KVCacheManager (or a BlockManager), got "
                                       f"{type(manager).__name__}")
        if len(set(manager.group_block_sizes)) > 1:
            raise InvalidArgumentError(f"a HitDoctor reads one block size; this manager's groups have "
                                       f"{list(manager.group_block_sizes)} (group_block_sizes)")
        self.manager_block_size = manager.block_size
        self.block_size = self.manager_block_size if block_size is None else check_int("block_size", block_size, 1)
        self.hash_fn = manager.hash_fn
        self.tier = manager.num_offload_blocks > 0
        self.manager = manager
        self.tokens = Counter(dict.fromkeys(CAUSES, 0))  # cause -> tokens; every admitted token in one
        self.reuse_distances: list[int] = []  # per evicted block: admissions since its last use
        self._now = 0                  # admissions so far: the clock of reuse distances
        self._last_use: dict = {}      # hash -> admission that last used or sealed it
        self._probes: set = set()      # (parent hash, first token) of every unit seen
        self._salt_free_blocks: set = set()  # salted prompts' blocks' hashes without their salt
        self._salt_free_probes: set = set()
        self._gpu_hash: dict = {}      # GPU block -> the hash it holds (with an offload tier only)
        self._offloaded: set = set()   # hashes the tier ever took in

    # ---- what the manager did ---------------------------------------------------------------------------
    def admitted(self, seq, hit, *, tier_moves=(), num_tokens=None, probes=None) -> None:
        """``seq`` was just allocated with ``hit`` (its ``lookup``); ``tier_moves``: ``allocate``'s. A compact
        prompt gives its real ``num_tokens`` and its units' ``probes`` (one hashable per unit, equal exactly
        when the units' first tokens continue equal prefixes)."""
        if not isinstance(hit, PrefixHit) or hit.seq_id != seq.seq_id:
            raise InvalidArgumentError(f"hit must be the manager's lookup(seq) of sequence {seq.seq_id}, got {hit!r}")
        self._now += 1
        mbs = self.manager_block_size
        length = seq.num_tokens if num_tokens is None else num_tokens
        num_full = seq.num_tokens // mbs
        hashes = hit.hashes[:num_full]
        if probes is None:
            probes = self._probes_of(seq, hashes)
        # A salted prompt's identities without its salt: what another tenant's same tokens are cached under.
        salt_free = self._salt_free(seq) if seq.cache_salt is not None else None
        if seq.num_preemptions:  # its own blocks again: recomputed, never a hit
            self.tokens["recompute"] += length
        else:
            self._classify(hit, hashes, length, probes, salt_free)
        # What the allocation wrote is cached now (a chunked prompt's later chunks: when freed).
        written = seq.num_computed_tokens
        self._remember(hashes[:written // mbs], probes[:-(-written // mbs)] if written < seq.num_tokens else probes)
        if salt_free is not None:
            self._salt_free_blocks.update(salt_free[0])
            self._salt_free_probes.update(salt_free[1])
        if self.tier:
            self._follow_tier(seq, hashes, tier_moves)

    def freed(self, seq) -> None:
        """``seq`` is about to be freed (finished or preempted): the blocks it sealed while decoding are cached."""
        written, mbs = seq.num_computed_tokens, self.manager_block_size
        if written:
            hashes = hashes_of(seq, mbs, self.hash_fn).hashes[:written // mbs]
            self._remember(hashes, self._probes_of(seq, hashes)[:-(-written // mbs)])

    def not_admitted(self, num_tokens: int) -> None:
        """A prompt of ``num_tokens`` tokens that never fit the pool (skipped or aborted)."""
        self.tokens["not_admitted"] += num_tokens

    # ---- the answer -------------------------------------------------------------------------------------
    def columns(self) -> dict:
        """A study row's ``COLUMNS``: tokens per cause and the median reuse distance of the evicted blocks."""
        return columns([self])

    def table(self):
        """Tokens and share per cause, hits first (a pandas DataFrame)."""
        import pandas as pd

        total = sum(self.tokens.values())
        return pd.DataFrame({"tokens": [self.tokens[c] for c in CAUSES],
                             "share": [self.tokens[c] / total if total else 0.0 for c in CAUSES]},
                            index=pd.Index(CAUSES, name="cause"))

    # ---- internals --------------------------------------------------------------------------------------
    def _classify(self, hit, hashes, length, probes, salt_free) -> None:
        bs, mbs, tokens = self.block_size, self.manager_block_size, self.tokens
        gpu, tier = len(hit.hits[0]), len(hit.tier_hits)
        eagle, cut = hit.num_eagle_tokens // mbs, hit.num_cut_tokens // mbs
        tokens["hit_gpu"] += gpu * bs
        tokens["hit_tier"] += tier * bs
        tokens["speculative_drop"] += eagle * bs
        tokens["group_cut"] += cut * bs
        first_miss, num_full = gpu + tier + eagle + cut, len(hashes)
        tail = length - num_full * bs
        if hit.num_partial_tokens:  # prefix_match_unit: the block after the hits gave its first units
            tokens["hit_gpu"] += hit.num_partial_tokens
            tokens["partial_block"] += (bs if first_miss < num_full else tail) - hit.num_partial_tokens
            first_miss += 1
        if first_miss == num_full and not tail:
            return
        # What was remembered is prefix-closed (a block's hash names its whole prefix, and every prompt is
        # remembered from its start): the missed blocks seen before come first, then one unit that may share
        # its first tokens (a partial block), then units never seen here (cold, or isolated by a salt).
        uses = list(map(self._last_use.get, hashes[first_miss:]))
        seen = uses.index(None) if None in uses else len(uses)
        lost = min(seen, max(0, (length - 1) // bs - first_miss))  # the block holding the last token never hits
        if self.tier:
            in_tier = sum(map(self._offloaded.__contains__, hashes[first_miss:first_miss + lost]))
            tokens["tier_miss"] += in_tier * bs
        else:
            in_tier = 0
        if lost > in_tier:
            tokens["evicted"] += (lost - in_tier) * bs
            now, offloaded = self._now, self._offloaded
            self.reuse_distances += [now - used for h, used in zip(hashes[first_miss:], uses[:lost])
                                     if h not in offloaded]
        tokens["partial_block"] += (seen - lost) * bs
        j = first_miss + seen  # the first unit not seen before
        units = num_full + (1 if tail else 0)
        if j == units:
            return
        if probes[j] in self._probes:
            tokens["partial_block"] += bs if j < num_full else tail
            j += 1
        if j < units and (salt_free or self._salt_free_blocks or self._salt_free_probes):
            j = self._isolated(hashes, probes, salt_free, j, units, tail)
        if j < units:  # the rest: the full blocks from j on, then the tail (the last unit)
            tokens["cold"] += max(0, num_full - j) * bs + tail

    def _isolated(self, hashes, probes, salt_free, j, units, tail) -> int:
        """Count the units from ``j`` on whose tokens another salt cached (a prefix of them); the first that is
        not. A salted prompt's salt-free identities may match an unsalted prompt's (``_last_use``, ``_probes``)
        or another salt's; an unsalted prompt's only a salted one's."""
        salted = salt_free is not None
        free_hashes, free_probes = salt_free if salted else (hashes, probes)
        bs, num_full, blocks, probes_seen = self.block_size, len(hashes), self._salt_free_blocks, self._salt_free_probes
        while j < units:
            if j < num_full and (free_hashes[j] in blocks or salted and free_hashes[j] in self._last_use):
                self.tokens["isolated"] += bs
            elif free_probes[j] in probes_seen or salted and free_probes[j] in self._probes:
                self.tokens["isolated"] += bs if j < num_full else tail
            else:
                break
            j += 1
        return j

    def _remember(self, hashes, probes) -> None:
        self._last_use.update(zip(hashes, repeat(self._now)))
        self._probes.update(probes)

    def _probes_of(self, seq, hashes, root=None) -> list:
        """Each unit's (parent hash, first token): the block's salt and keys stand in for block 0's parent."""
        keys = seq.key_bytes
        if root is None:
            root = keys.get(0, 0) if keys else 0
        firsts = seq.token_array[::self.manager_block_size]
        probes = list(zip([root, *hashes], firsts))
        if keys and len(keys) > (0 in keys):  # a block's own keys (an image) make its unit distinct too
            probes = [(*probe, keys.get(j)) if j else probe for j, probe in enumerate(probes)]
        return probes

    def _salt_free(self, seq) -> tuple[list, list]:
        """A salted prompt's hashes and probes as if it had no salt (what another tenant's prompt would have)."""
        keys = dict(seq.key_bytes)
        header = b"S" + encode_key(seq.cache_salt)
        keys[0] = keys[0][len(header):]  # the salt's encoding comes first (kvlab.blocks.sequence.cache_keys)
        if not keys[0]:
            del keys[0]
        num_full = seq.num_tokens // self.manager_block_size
        hashes, _ = block_hashes(seq.token_array, self.manager_block_size, 0, num_full, None, self.hash_fn,
                                 keys or None)
        return hashes, self._probes_of(seq, hashes, root=keys.get(0, 0))

    def _follow_tier(self, seq, hashes, tier_moves) -> None:
        """Which hashes the offload tier ever took in (its moves name GPU blocks)."""
        gpu_hash = self._gpu_hash
        for move in tier_moves:
            if move.kind == "offload":
                self._offloaded.update(gpu_hash[block] for block in move.sources if block in gpu_hash)
        gpu_hash.update(zip(self.manager.block_tables(seq)[0], hashes))


def columns(doctors) -> dict:
    """``COLUMNS`` of several doctors together (a fleet's replicas): tokens summed, reuse distances pooled."""
    distances = [d for doctor in doctors for d in doctor.reuse_distances]
    return {**{f"{cause}_tokens": sum(doctor.tokens[cause] for doctor in doctors) for cause in CAUSES},
            "evicted_reuse_distance_p50": float(np.median(distances)) if distances else None}  # None: nothing evicted


class DoctorView:
    """A ``BlockManager`` as a scheduler sees it, with ``doctor`` told of every admission and free; every
    other call and attribute is the manager's (so the engine's and the overlap replay's schedulers run as
    they are)."""

    def __init__(self, manager, doctor: HitDoctor):
        if not isinstance(doctor, HitDoctor):
            raise InvalidArgumentError(f"doctor must be a HitDoctor, got {type(doctor).__name__}")
        self.manager, self.doctor = manager, doctor

    def __getattr__(self, name):
        value = getattr(self.manager, name)
        if callable(value):  # a bound method: kept, so the next call skips this lookup (properties are not)
            setattr(self, name, value)
        return value

    def allocate(self, seq, encoder_seq=None, *, num_new_tokens=None, hit=None):
        hit = self.manager.lookup(seq) if hit is None else hit  # the doctor reads the hit allocate takes
        admitted = self.manager.allocate(seq, encoder_seq, num_new_tokens=num_new_tokens, hit=hit)
        self.doctor.admitted(seq, hit, tier_moves=admitted.tier_moves)
        return admitted

    def free(self, seq, *, preempted: bool = False) -> None:
        self.doctor.freed(seq)
        self.manager.free(seq, preempted=preempted)
