"""The documented pipeline end to end under a sliding window: the block manager's slots and tables, K/V
written by ``reshape_and_cache``, attention by ``paged_prefill`` / ``paged_attention_decode``, against the
plain-torch reference on the full, unpaged K/V.

Each request is served in steps: its prompt in one allocate (or in chunks, with ``append_slots`` for each
further chunk), then a few decode steps. Every step writes only its new tokens, and every query must see
exactly the window's keys, prefix hits included. Unused cache memory is NaN, so a key that was released (or
never written) while a query could still see it shows up as NaN or a wrong value.
"""

import pytest
import torch

from kvlab import BlockManager, Sequence
from kvlab.device import DEVICE
from kvlab.kernels import paged_attention_decode, paged_prefill, reshape_and_cache
from kvlab.kernels.reference import attention_ref

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 32


def _tensor(values, dtype):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


class Engine:
    """One attention layer over a paged cache; the token at position p has K/V/query row p of its sequence."""

    def __init__(self, manager, num_blocks, block_size):
        self.manager = manager
        self.cache = torch.full((num_blocks, 2, block_size, KV_HEADS, HEAD_DIM), float("nan"), device=DEVICE)

    def step(self, seq, qkv, first_query):
        """Write positions first_query.. of ``seq`` and return attention of those queries (kernel, reference)."""
        q, k, v = qkv
        n, window = seq.num_tokens, self.manager.sliding_window
        slots = _tensor(self.manager.slot_mapping(seq, first_query, n), torch.int64)
        assert bool((slots >= 0).all()), "every new token must get a slot"
        reshape_and_cache(k[first_query:n], v[first_query:n], self.cache, slots)
        table = _tensor([seq.block_table], torch.int32)
        seq_lens = _tensor([n], torch.int32)
        if n - first_query == 1:
            out = paged_attention_decode(q[n - 1:n], self.cache, table, seq_lens, sliding_window=window)
        else:
            cu = _tensor([0, n - first_query], torch.int32)
            out = paged_prefill(q[first_query:n], self.cache, table, seq_lens, cu, sliding_window=window)
        ref = attention_ref(q[first_query:n], k[:n], v[:n], torch.arange(first_query, n), sliding_window=window)
        return out, ref


def _qkv(length, generator):
    shapes = ((length, HEADS, HEAD_DIM), (length, KV_HEADS, HEAD_DIM), (length, KV_HEADS, HEAD_DIM))
    return [torch.randn(*shape, generator=generator).to(DEVICE) for shape in shapes]


def _check(step_result):
    out, ref = step_result
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-3, rtol=2e-3)


def serve(manager, engine, tokens, qkv, prompt_len, chunk):
    """Prefill the prompt (at once, or ``chunk`` tokens a step), then decode the rest one token a step,
    checking every step's attention."""
    seq = Sequence(tokens[:prompt_len if chunk is None else chunk], manager.block_size)
    manager.allocate(seq)
    _check(engine.step(seq, qkv, seq.num_cached_tokens))
    while seq.num_tokens < len(tokens):
        start = seq.num_tokens
        end = min(prompt_len, start + chunk) if chunk and start < prompt_len else start + 1
        for t in tokens[start:end]:
            seq.append_token(t)
        manager.append_slots(seq)
        _check(engine.step(seq, qkv, start))
    manager.check_invariants()
    return seq


@pytest.mark.parametrize("window, block_size, prompt_len, chunk", [
    (8, 8, 40, None),    # the case: a 40-token prompt, window 8, block size 8, one-shot prefill
    (5, 8, 23, None),
    (16, 8, 37, 9),      # chunked prefill: 9 new tokens a step
    (3, 16, 40, 17),
    (1, 8, 12, 5),
])
def test_windowed_prefill_and_decode_match_the_reference(window, block_size, prompt_len, chunk):
    generator = torch.Generator().manual_seed(window * 1000 + prompt_len)
    num_blocks = 4 * (-(-prompt_len // block_size) + 2)
    manager = BlockManager(num_blocks, block_size, sliding_window=window)
    engine = Engine(manager, num_blocks, block_size)
    a_tokens = torch.randint(0, 50, (prompt_len + 4,), generator=generator).tolist()
    a_qkv = _qkv(len(a_tokens), generator)
    serve(manager, engine, a_tokens, a_qkv, prompt_len, chunk)
    # B repeats A's first 3/4 and goes on differently: its prefill starts after a prefix hit, and the hit's
    # K/V is what A wrote, so B's rows for the shared part are A's.
    shared = 3 * prompt_len // 4
    b_tokens = a_tokens[:shared] + torch.randint(50, 99, (prompt_len - shared + 4,), generator=generator).tolist()
    b_qkv = _qkv(len(b_tokens), generator)
    for own, a in zip(b_qkv, a_qkv):
        own[:shared] = a[:shared]
    b = serve(manager, engine, b_tokens, b_qkv, prompt_len, chunk)
    assert chunk is not None or b.num_cached_tokens == shared // block_size * block_size


def test_prefix_hit_prefill_reads_the_window_from_the_cache():
    """allocate's own step: the prompt's first uncached query must see keys the hit brought in."""
    window, block_size = 8, 8
    manager = BlockManager(16, block_size, sliding_window=window)
    engine = Engine(manager, 16, block_size)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 50, (30,), generator=generator).tolist()
    qkv = _qkv(30, generator)
    first = Sequence(tokens[:24], block_size)
    manager.allocate(first)
    torch.testing.assert_close(*[t.cpu() for t in engine.step(first, qkv, 0)], atol=2e-3, rtol=2e-3)
    second = Sequence(tokens, block_size)
    manager.allocate(second)
    assert second.num_cached_tokens == 24
    out, ref = engine.step(second, qkv, second.num_cached_tokens)
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-3, rtol=2e-3)
