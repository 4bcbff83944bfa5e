"""``BlockManager.check_invariants()``: an O(pool) audit of the manager's bookkeeping, for tests.

Checked: every GPU block is free xor used; each ref count equals the number of block-table entries
pointing at it; the free set holds exactly the blocks at ref count 0, once each, each filed as cached
exactly when the prefix-cache map points at it; the map and the blocks agree; the same holds for the CPU
pool; twin links join live blocks both ways.
"""

from collections import Counter

from kvlab.block_pool import ROOT
from kvlab.errors import InvariantViolation


def _fail(message: str):
    raise InvariantViolation(message)


def check_manager(manager) -> None:
    pool, cpu, twins = manager._pool, manager._cpu, manager._twins
    gpu_refs, cpu_refs = Counter(), Counter()
    for seq_id, alloc in manager._allocs.items():
        seq = alloc.seq
        if seq.seq_id != seq_id:
            _fail(f"allocation keyed {seq_id} holds sequence {seq.seq_id}")
        table = seq.block_table
        if len(table) < seq.num_blocks:
            _fail(f"sequence {seq_id} has {seq.num_tokens} tokens but only {len(table)} blocks")
        if any(b != 0 for b in table[:alloc.num_released]):
            _fail(f"sequence {seq_id}: released entries must point at the null block")
        (cpu_refs if alloc.on_cpu else gpu_refs).update(table[alloc.num_released:])

    for block in range(pool.num_blocks):
        expected = gpu_refs.get(block, 0)
        if pool.ref[block] != expected:
            _fail(f"GPU block {block}: ref count {pool.ref[block]}, but {expected} table entries use it")
    reserved = range(pool.first_block)
    if any(pool.ref[b] for b in reserved):
        _fail("the reserved null block must never be referenced")
    free = list(pool.policy)
    if len(free) != len(set(free)) or len(free) != len(pool.policy):
        _fail("the free set lists a block twice or miscounts")
    expected_free = {b for b in range(pool.first_block, pool.num_blocks) if pool.ref[b] == 0}
    if set(free) != expected_free:
        _fail(f"free set {sorted(set(free) ^ expected_free)[:10]}... disagrees with ref counts "
              "(a block must be free xor used)")

    for h, block in pool.cached.items():
        if pool.hash[block] != h or pool.tokens[block] is None or pool.content[block] <= ROOT:
            _fail(f"prefix cache maps hash {h} to block {block}, which does not hold that sealed content")
    if sum(pool.registered) != len(pool.cached) or any(
            pool.registered[b] != (pool.cached.get(pool.hash[b]) == b) for b in range(pool.num_blocks)):
        _fail("a block's registered flag disagrees with the prefix cache map")
    misfiled = [b for b in free if pool.policy.filed_as_cached(b) not in (None, pool.registered[b])]
    if misfiled:
        _fail(f"free blocks {misfiled[:10]} are filed as cached/uncached against the prefix cache map")

    for block in range(cpu.num_blocks):
        if cpu.ref[block] != cpu_refs.get(block, 0):
            _fail(f"CPU block {block}: ref count {cpu.ref[block]}, {cpu_refs.get(block, 0)} entries use it")
    cpu_free = cpu.free_ids()
    if len(cpu_free) != len(set(cpu_free)) or set(cpu_free) != {b for b in range(cpu.num_blocks)
                                                                 if cpu.ref[b] == 0}:
        _fail("CPU free list disagrees with CPU ref counts")

    if len(twins.cpu_of) != len(twins.gpu_of) or any(twins.gpu_of.get(c) != g for g, c in twins.cpu_of.items()):
        _fail("twin links are not one-to-one both ways")
    for gpu, cpu_block in twins.cpu_of.items():
        if pool.ref[gpu] == 0 or cpu.ref[cpu_block] == 0:
            _fail(f"twin link {gpu}<->{cpu_block} outlived one of its blocks")
