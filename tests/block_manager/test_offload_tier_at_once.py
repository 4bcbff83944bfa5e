"""The offload tier's whole-batch path (``OffloadTier._offer_at_once``) against its one-by-one loop: on random
workloads, every call leaves both tiers in the same state, with the same moves (in the same batches) and the
same events."""

import random

import pytest
from helpers import TierMoves

from kvlab import BlockManager, Sequence
from kvlab.blocks.tiers import OffloadTier


def tier_state(m, moves):
    tier = m._tier
    index, order = tier.index, tier.order
    policy = (order.resident(), *(list(part.items()) for part in (order.t1, order.t2, order.b1, order.b2)),
              order.target_t1) if hasattr(order, "t1") else (order.resident(),)
    return (list(index.cached.items()), index.hash, index.content, index.parent_content, index.block_bytes,
            index.registered, tier._free, policy, list(tier.filter.counts.items()) if tier.filter else None,
            vars(tier.stats), moves.take(batches=True), [(e.kind, e.block_id, e.other) for e in m.events])


def one_by_one(self, evicted):
    return False


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("admission", ["always", "reused"])
@pytest.mark.parametrize("seed", range(4))
def test_the_whole_batch_path_does_what_the_loop_does(policy, admission, seed, monkeypatch):
    rng = random.Random(seed)
    options = dict(num_blocks=rng.choice([6, 10, 16]), block_size=2, num_offload_blocks=rng.choice([1, 3, 8]),
                   offload_policy=policy, offload_admission=admission, record_events=True)
    batch, loop = BlockManager(**options), BlockManager(**options)
    batch_moves, loop_moves = TierMoves(batch), TierMoves(loop)
    monkeypatch.setattr(loop._tier, "_offer_at_once", one_by_one.__get__(loop._tier, OffloadTier))
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(1, 9))] for _ in range(6)]
    running = []
    for _ in range(300):
        if running and (rng.random() < 0.5 or len(running) > 2):
            i = rng.randrange(len(running))
            for m, seq in zip((batch, loop), running.pop(i)):
                m.free(seq)
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(0, 5))]
            pair = (Sequence(tokens, 2), Sequence(tokens, 2))
            if not batch.can_allocate(pair[0]):
                continue
            for m, seq in zip((batch, loop), pair):
                m.allocate(seq)
            running.append(pair)
        assert tier_state(batch, batch_moves) == tier_state(loop, loop_moves)
    batch.check_invariants()
