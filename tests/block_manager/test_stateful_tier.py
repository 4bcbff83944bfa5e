"""Model check of the offload tier: the block-manager machine of test_stateful, with a third fake KV store.

The engine's fake caches are keyed by tier and slot: ``gpu`` and ``cpu`` (the swap space) as before, and
``tier`` (the offload tier's CPU slots). After every manager call the machine applies the tier's moves (the
``tier_moves`` each call returns) in order, before the moves the call returned and before the step writes, as the
engine does. Every read check of the base machine then also checks promotion: a prefix hit served from the tier reads,
position by position, exactly the value the step that computed it wrote (salts and keys included), after an
offload to the tier and a promotion back. Pools are small, so GPU eviction, tier eviction (LRU and ARC, every
admission) and promotion into blocks whose old content is offloaded in the same call all happen often.
"""

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, precondition, rule
from helpers import TierMoves
from test_kv_events import EventMachine, chained
from test_stateful import STEPS, ManagerMachine, PoolRules, kv_values

from kvlab.blocks.events import BlockStored


class TierMachine(ManagerMachine):
    def __init__(self):
        super().__init__()
        self.tier = {}  # slot -> value: the engine's view of the offload tier
        self.prompts = []  # (token ids, keys) of every prompt admitted, to ask for again once evicted
        self.contents = {}  # content id -> the values its block was written with: one id, one K/V
        self.tier_moves = TierMoves(self.manager)  # the tier's copies each call returns

    def _apply_tier_moves(self):
        batches = self.tier_moves.take(batches=True)
        # Each batch is one kind's copies in order, consecutive copies of one kind always in one batch.
        assert all(a.kind != b.kind for a, b in zip(batches, batches[1:])), batches
        for kind, sources, targets in batches:
            assert sources and len(sources) == len(targets), (sources, targets)
            if kind == "offload":
                PoolRules._copy(self, self.gpu, self.tier, zip(sources, targets))
            else:
                assert kind == "promote", kind
                PoolRules._copy(self, self.tier, self.gpu, zip(sources, targets))

    def _allocate(self, token_ids, data=None, **keys):
        self.prompts.append((list(token_ids), keys))
        super()._allocate(token_ids, data, **keys)

    @precondition(lambda self: self.prompts)
    @rule(data=st.data(), free_first=st.booleans())
    def allocate_an_earlier_prompt_again(self, data, free_first):
        """The same prompt and keys as an earlier request (a shared system prompt): its blocks may be on the GPU,
        in the tier or gone. With ``free_first``, free the oldest running sequence before, so the pool cycles."""
        if free_first and self.running:
            seq = self.running[0]
            self._forget(seq)
            self.manager.free(seq)
        token_ids, keys = data.draw(st.sampled_from(self.prompts[-6:]))
        self._allocate(token_ids, **keys)

    def _copy(self, src_cache, dst_cache, pairs):
        self._apply_tier_moves()  # the call's tier moves come first
        super()._copy(src_cache, dst_cache, pairs)

    def _step(self, seq, first_query, lookahead=0, end=None, drafts=()):
        self._apply_tier_moves()
        super()._step(seq, first_query, lookahead, end, drafts)
        self._remember_contents(seq)

    def _remember_contents(self, seq):
        """The values of ``seq``'s sealed blocks (all written: sealed blocks hold verified tokens only), by
        content id."""
        index, bs, values = self.manager._pool.index, self.manager.block_size, kv_values(seq)
        for i, block in enumerate(seq.block_table[:self.written[seq] // bs]):
            if index.content_id(block) > 0:
                assert self.contents.setdefault(index.content_id(block), values[i * bs:(i + 1) * bs]) == \
                    values[i * bs:(i + 1) * bs], f"content id {index.content_id(block)} stands for two K/V"

    @invariant()
    def the_tier_holds_what_was_offloaded(self):
        """Checked at once, not only when a promotion reads it back: an offload copied after its block was
        overwritten (moves out of order) is caught here. (Blocks sealed outside a step, by ``accept_drafts``,
        are remembered here too, before any of them can be freed and offloaded.)"""
        for seq in self.running:
            self._remember_contents(seq)
        index, bs = self.manager._tier.index, self.manager.block_size
        for slot in index.cached.values():
            held = [self.tier.get(slot * bs + offset) for offset in range(bs)]
            assert held == self.contents[index.content_id(slot)], f"CPU slot {slot} holds other K/V"


class TierEventMachine(TierMachine, EventMachine):
    """The KV events stay exact with a tier: replaying them rebuilds the GPU's cached hashes and the tier's."""

    @invariant()
    def events_rebuild_the_tiers_hashes(self):
        assert self.replayed.cpu_hashes == set(self.manager._tier.index.cached)

    @invariant()
    def stored_blocks_chain_from_their_parent(self):
        bs = self.manager.block_size
        for event in self.unchecked:
            if type(event) is BlockStored and event.medium == "CPU":   # one block, no parent (as vLLM's)
                assert len(event.block_hashes) == 1 and event.parent_block_hash is None
                assert len(event.token_ids) == bs
            elif type(event) is BlockStored:
                assert event.medium == "GPU" and len(event.token_ids) == bs * len(event.block_hashes)
                if self.manager.hash_fn is None:
                    assert event.block_hashes == chained(event.parent_block_hash, event.token_ids, bs, event.extra_keys)


def _machine(name, **config):
    return type(name, (TierMachine,), {"config": config})


MACHINES = [
    _machine("TierLRU", num_blocks=10, block_size=2, num_cpu_blocks=6, num_offload_blocks=6),
    _machine("TierARC", num_blocks=10, block_size=2, num_cpu_blocks=6, num_offload_blocks=4, offload_policy="arc"),
    _machine("TierReusedARC", num_blocks=12, block_size=2, num_cpu_blocks=6, num_offload_blocks=5,
             offload_policy="arc", offload_admission="reused"),
    _machine("TierOneSlotFIFO", num_blocks=8, block_size=3, num_cpu_blocks=4, num_offload_blocks=1,
             eviction="fifo"),
    _machine("TierEagle", num_blocks=10, block_size=2, num_cpu_blocks=6, num_offload_blocks=6, use_eagle=True),
    _machine("TierConstantHash", num_blocks=10, block_size=2, num_cpu_blocks=6, num_offload_blocks=6,
             hash_fn=lambda parent, ids: 7),
]

EVENT_MACHINES = [type(f"Events{m.__name__}", (TierEventMachine,), {"config": {**m.config, "kv_events": True}})
                  for m in MACHINES[:3]]

for _machine_class in MACHINES + EVENT_MACHINES:
    _case = _machine_class.TestCase
    _case.settings = settings(stateful_step_count=STEPS, deadline=None)
    # The event machines' faulty subscribers warn by design (test_kv_event_subscribers checks the warning).
    _case = pytest.mark.filterwarnings("ignore::kvlab.errors.KVEventSubscriberWarning")(_case)
    globals()[f"Test{_machine_class.__name__}"] = _case
del _case
