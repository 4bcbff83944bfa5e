"""A solution of kvlab.puzzles.tier_promotion."""


def tier_promotion(tier, num_slots, num_tokens, block_size, prompt_hashes, num_gpu_hits, overwritten):
    lru = list(tier)  # least recently used first
    limit = (num_tokens - 1) // block_size
    promoted = []
    for block_hash in prompt_hashes[num_gpu_hits:limit]:
        if block_hash not in lru:
            break
        promoted.append(block_hash)
    for i, block_hash in enumerate(overwritten):
        if block_hash is None or block_hash in lru:
            continue
        if len(lru) == num_slots:
            pinned = promoted if i < len(promoted) else []
            victims = [entry for entry in lru if entry not in pinned]
            if not victims:
                continue
            lru.remove(victims[0])
        lru.append(block_hash)
    for block_hash in reversed(prompt_hashes[num_gpu_hits:]):
        if block_hash in lru:
            lru.remove(block_hash)
            lru.append(block_hash)
    return promoted, lru
