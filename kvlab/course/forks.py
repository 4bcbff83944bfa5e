"""The small fork engine of notebooks 03a and 03b: what a scheduler asks of the block manager when sequences
fork, decode and free (``Blocks``), and the same with a one-layer KV cache whose copies and swaps really move
data (``TinyEngine``), so that every sequence can be read back through its block table and compared with the
keys and values its tokens produced.

Prefix caching is off: the point is sharing by ``fork``. The copy-on-write pairs that ``append_slots``
returns are applied with ``copy_blocks`` *before* the forward pass writes the new token, as an engine must.
"""

import torch

from kvlab.blocks import BlockManager, Sequence
from kvlab.device import DEVICE
from kvlab.kernels import copy_blocks, swap_blocks
from kvlab.kernels.reference import gather_kv_ref, reshape_and_cache_ref


class Blocks:
    """Forks, decode steps and frees on a BlockManager, without tensors (fast enough for studies)."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, record_events: bool = False):
        self.manager = BlockManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                                    enable_prefix_caching=False, record_events=record_events)

    def prefill(self, seq: Sequence) -> None:
        self.manager.allocate(seq)

    def fork(self, parent: Sequence) -> Sequence:
        child = Sequence([], parent.block_size)
        self.manager.fork(parent, child)
        return child

    def step(self, tokens: dict) -> list[tuple[int, int]]:
        """One decode step: ``tokens`` maps each sequence to its new token. Returns the copy-on-write pairs."""
        pairs = []
        for seq, token in tokens.items():
            seq.append_token(int(token))
            pairs += self.manager.append_slots(seq)
        return pairs

    def free(self, seq: Sequence) -> None:
        self.manager.free(seq)

    def blocks_in_use(self) -> int:
        return self.manager.num_blocks - self.manager.num_free_blocks


class TinyEngine(Blocks):
    """Blocks plus the cache tensors: copies and swaps really move data, and ``wrong_reads`` proves they moved
    right. The GPU cache is ``[num_blocks, 2, block_size, heads, head_dim]`` (on kvlab's DEVICE), the CPU one
    the same with ``num_cpu_blocks``; ``truth[seq_id]`` is ``[num_tokens, 2, heads, head_dim]``, the K/V
    of the sequence's tokens in order."""

    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, heads: int = 2,
                 head_dim: int = 32):
        super().__init__(num_blocks, block_size, num_cpu_blocks, record_events=True)
        self.gpu = torch.zeros(num_blocks, 2, block_size, heads, head_dim, device=DEVICE)
        self.cpu = torch.zeros(max(1, num_cpu_blocks), 2, block_size, heads, head_dim)
        self.token_kv_shape = (2, heads, head_dim)  # one token's K and V
        self.truth = {}

    def _forward(self, seq: Sequence, start: int) -> None:
        """The model's forward pass for positions start..end: fresh K/V, written into their slots."""
        kv = torch.randn(seq.num_tokens - start, *self.token_kv_shape, device=DEVICE)
        slots = torch.tensor(self.manager.slot_mapping(seq, start, seq.num_tokens), device=DEVICE)
        reshape_and_cache_ref(kv[:, 0], kv[:, 1], self.gpu, slots)
        self.truth[seq.seq_id] = torch.cat([self.truth.get(seq.seq_id, kv[:0]), kv])

    def prefill(self, seq: Sequence) -> None:
        super().prefill(seq)
        self._forward(seq, 0)

    def fork(self, parent: Sequence) -> Sequence:
        child = super().fork(parent)
        self.truth[child.seq_id] = self.truth[parent.seq_id].clone()
        return child

    def step(self, tokens: dict, apply_copies: bool = True) -> list[tuple[int, int]]:
        """A decode step; ``apply_copies=False`` skips the copy-on-write copies, to show what they prevent."""
        pairs = super().step(tokens)
        if pairs and apply_copies:  # before the forward pass writes: the copies must carry the old content
            copy_blocks([self.gpu], pairs)
        for seq in tokens:
            self._forward(seq, seq.num_tokens - 1)
        return pairs

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        del self.truth[seq.seq_id]

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        mapping = self.manager.swap_out(seq)
        swap_blocks(self.gpu, self.cpu, mapping)
        return mapping

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        mapping = self.manager.swap_in(seq)
        swap_blocks(self.cpu, self.gpu, mapping)
        return mapping

    def wrong_reads(self, seqs) -> list[int]:
        """Ids of the sequences whose K/V, read through their block tables, differ from what their tokens
        produced."""
        wrong = []
        for seq in seqs:
            k, v = gather_kv_ref(self.gpu, torch.tensor(seq.block_table), seq.num_tokens)
            if not torch.equal(torch.stack([k, v], 1), self.truth[seq.seq_id]):
                wrong.append(seq.seq_id)
        return wrong
