"""A solution of kvlab.puzzles.allocate_with_hits."""


def allocate_with_hits(num_tokens, block_size, prompt_hashes, cached, ref_counts, free_queue):
    refs, free = list(ref_counts), list(free_queue)
    hits = []
    for block_hash in prompt_hashes[:(num_tokens - 1) // block_size]:
        if block_hash not in cached:
            break
        hits.append(cached[block_hash])
    for block in hits:
        if refs[block] == 0:
            free.remove(block)
        refs[block] += 1
    num_new = -(-num_tokens // block_size) - len(hits)
    new, free = free[:num_new], free[num_new:]
    for block in new:
        refs[block] = 1
    return hits + new, refs, free
