import pickle

import numpy as np
import pytest

from kvlab import InvalidArgumentError, Sequence, SequenceStateError, SequenceStatus


def test_fields_of_a_new_sequence():
    seq = Sequence([5, 6, 7, 8, 9], block_size=2)
    later = Sequence([1])
    assert later.seq_id == seq.seq_id + 1
    assert seq.status is SequenceStatus.WAITING
    assert seq.token_ids == [5, 6, 7, 8, 9]
    assert (seq.last_token, seq.num_tokens, len(seq), seq.num_prompt_tokens) == (9, 5, 5, 5)
    assert (seq.num_cached_tokens, seq.block_table, seq.block_size, seq.num_blocks) == (0, (), 2, 3)
    assert [seq.block(i) for i in range(3)] == [[5, 6], [7, 8], [9]]


def test_append_token_grows_the_sequence():
    seq = Sequence([1, 2, 3], block_size=4)
    seq.append_token(4)
    seq.append_token(np.int64(5))
    assert seq.token_ids == [1, 2, 3, 4, 5] and seq.last_token == 5
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_completion_tokens, seq.num_blocks) == (5, 3, 2, 2)


def test_token_slice_is_the_slice_of_token_ids():
    seq = Sequence([5, 6, 7], block_size=2)
    seq.append_token(8)
    for start, stop in [(3, 4), (0, 4), (1, 3), (2, 2), (0, 9)]:
        assert seq.token_slice(start, stop) == seq.token_ids[start:stop]


def test_numpy_prompt_takes_the_same_tokens():
    tokens = np.arange(1000, 1037, dtype=np.int32)
    assert Sequence(tokens).token_ids == tokens.tolist()


@pytest.mark.parametrize("bad", [[1, 2.5], ["a"], [1, None], [-1], "abc", np.array([1.0, 2.0]), np.array([[1]]),
                                 [2**64], [2**63], np.array([2**63], dtype=np.uint64), range(10**30)])
def test_non_integer_negative_huge_or_too_many_tokens_are_rejected(bad):
    with pytest.raises(InvalidArgumentError, match="token"):
        Sequence(bad)


@pytest.mark.parametrize("bad", [2.0, "x", None, -3, 2**63])
def test_bad_appended_token_is_rejected_and_changes_nothing(bad):
    seq = Sequence([1, 2])
    with pytest.raises(InvalidArgumentError):
        seq.append_token(bad)
    assert seq.token_ids == [1, 2] and seq.num_tokens == 2 and seq.last_token == 2


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True, None])
def test_bad_block_size_is_rejected(block_size):
    with pytest.raises(InvalidArgumentError, match="block_size"):
        Sequence([1], block_size=block_size)


@pytest.mark.parametrize("index", [2, -1, "0", 0.5, True])
def test_block_index_must_be_an_int_in_range(index):
    with pytest.raises(InvalidArgumentError, match="block index"):
        Sequence([1, 2, 3], block_size=2).block(index)


def test_waiting_sequence_pickles_its_prompt():
    seq = Sequence(list(range(100)), block_size=16)
    copy = pickle.loads(pickle.dumps(seq))
    assert copy.token_ids == seq.token_ids and copy.seq_id == seq.seq_id


def test_decoding_sequence_pickles_only_its_last_token():
    seq = Sequence(list(range(1000, 1100)), block_size=16)
    seq.append_token(2000)
    sizes = []
    for step in range(2000):
        seq.append_token(3000 + step % 7)
        sizes.append(len(pickle.dumps(seq)))
    # The token list grew by 2000 entries (>= 4 kB if it travelled); the message grew only by the width of
    # the num_tokens integer (block_table is empty here: nothing allocated).
    assert max(sizes) - min(sizes) <= 2
    assert len(pickle.dumps(Sequence(list(range(1000, 3100))))) > max(sizes) + 4000
    copy = pickle.loads(pickle.dumps(seq))
    assert (copy.last_token, copy.num_tokens, copy.num_prompt_tokens) == (seq.last_token, 2101, 100)
    with pytest.raises(SequenceStateError, match="decode-only"):
        copy.token_ids
