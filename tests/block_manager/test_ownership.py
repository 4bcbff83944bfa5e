"""Who owns what: a sequence lives in at most one manager, only the manager writes its block table, ids stay
unique across pickling, threads may share a manager, and every state the API can reach passes the checker."""

import pickle
import subprocess
import sys
import threading

import pytest

from kvlab import BlockManager, Sequence, SequenceStateError

from helpers import allocated, snapshot


def test_a_sequence_live_in_another_manager_is_refused_everywhere():
    first, second = BlockManager(8, block_size=4), BlockManager(8, block_size=4)
    seq = allocated(first, range(6))
    parent = allocated(second, range(3))
    before = snapshot(first), snapshot(second), seq.block_table
    for action in (lambda: second.allocate(seq), lambda: second.fork(parent, seq),
                   lambda: second.can_allocate(seq)):
        with pytest.raises(SequenceStateError, match="another BlockManager"):
            action()
    for action in (lambda: second.free(seq), lambda: second.append_slots(seq), lambda: second.swap_out(seq)):
        with pytest.raises(SequenceStateError, match="not allocated in this manager"):
            action()
    assert (snapshot(first), snapshot(second), seq.block_table) == before
    first.free(seq)
    second.allocate(seq)                    # free in the first, then the second may take it
    first.check_invariants()
    second.check_invariants()


def test_the_block_table_is_read_only():
    manager = BlockManager(8, block_size=4)
    seq = allocated(manager, range(6))
    with pytest.raises(AttributeError):
        seq.block_table.append(7)
    with pytest.raises(AttributeError):
        seq.block_table = [0, 1, 2]
    assert manager.get_block_table(seq) == list(seq.block_table)
    manager.get_block_table(seq).append(7)  # a copy: the manager's table is untouched
    manager.free(seq)
    manager.check_invariants()
    assert manager.num_free_blocks == 8


def _python(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_unpickled_sequences_keep_ids_that_new_ones_never_reuse(tmp_path):
    # Sender and receiver are both fresh processes, so both start counting sequence ids at 0.
    pickled = tmp_path / "seqs.pkl"
    _python(f"""
import pickle
from kvlab import Sequence
open({str(pickled)!r}, "wb").write(pickle.dumps([Sequence(range(5), 4) for _ in range(3)]))
""")
    out = _python(f"""
import pickle
from kvlab import BlockManager, Sequence
received = pickle.loads(open({str(pickled)!r}, "rb").read())
made_here = [Sequence([1, 2], 4) for _ in range(3)]
manager = BlockManager(16, block_size=4)
for seq in received + made_here:
    manager.allocate(seq)
manager.check_invariants()
print([s.seq_id for s in received + made_here])
""")
    ids = eval(out)
    assert len(set(ids)) == len(ids) == 6


def test_threads_sharing_a_manager_keep_it_consistent():
    manager = BlockManager(64, block_size=2, num_cpu_blocks=16)
    errors = []

    def worker(offset):
        try:
            for i in range(300):
                seq = Sequence([i % 3, 1, 2, 3, offset], 2)  # threads share prefixes
                manager.allocate(seq)
                for t in range(4):
                    seq.append_token(t)
                    manager.append_slots(seq)
                child = Sequence([])
                manager.fork(seq, child)
                manager.free(child)
                manager.free(seq)
        except Exception as e:  # reported below: a thread's exception would otherwise vanish
            errors.append(e)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)   # switch threads as often as possible, so unsynchronised updates interleave
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert errors == []
    manager.check_invariants()
    assert manager.num_free_blocks == 64


def test_the_checker_accepts_tokens_that_have_no_slot_yet():
    manager = BlockManager(12, block_size=2, num_cpu_blocks=8)
    seq = allocated(manager, range(3))
    for t in range(5):
        seq.append_token(t)               # sampled, not yet given slots: a legal state
    manager.check_invariants()
    child = Sequence([])
    manager.fork(seq, child)
    manager.swap_out(seq)
    manager.check_invariants()
    manager.append_slots(child)
    manager.swap_in(seq)
    manager.append_slots(seq)
    manager.check_invariants()
