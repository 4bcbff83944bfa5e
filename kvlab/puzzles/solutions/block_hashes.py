"""A solution of kvlab.puzzles.block_hashes."""


def block_hashes(tokens, block_size, hash_fn):
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):  # full blocks only
        parent = hash_fn(parent, tuple(tokens[start:start + block_size]))
        hashes.append(parent)
    return hashes
