"""Turn a step's sequences into tensors, move blocks, run the model, return logits.

For each sequence the block manager says where its tokens live: ``slot_mapping`` for the tokens computed in
this step, ``get_block_table`` for the whole context. A prefill computes only the tokens after the cached
prefix (``num_cached_tokens``); a decode computes the one token that has no K/V yet (the last sampled one).
"""

import torch

from kvlab.blocks.manager import BlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.engine.attention import AttentionBatch
from kvlab.engine.kv_cache import BlockMoves, PagedKVCache
from kvlab.engine.model import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, manager: BlockManager, device,
                 attention_backend: str):
        self.model, self.kv_cache, self.manager, self.device = model, kv_cache, manager, device
        self.attention_backend = attention_backend

    def apply_moves(self, moves: BlockMoves) -> None:
        """The step's swaps and copy-on-write copies, once, before any forward pass of the step."""
        self.kv_cache.apply(moves)

    @staticmethod
    def new_tokens(kind: str, seq: Sequence) -> range:
        """Positions whose K/V this step computes: prefill, every token after the cached prefix; decode, the
        last token, which has no K/V yet."""
        return range(seq.num_cached_tokens if kind == "prefill" else seq.num_tokens - 1, seq.num_tokens)

    def written_blocks(self, kind: str, seq: Sequence) -> set[int]:
        span = self.new_tokens(kind, seq)
        return {slot // self.manager.block_size for slot in self.manager.slot_mapping(seq, span.start, span.stop)}

    def forward(self, kind: str, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits ``[len(seqs), vocab]``: each sequence's distribution for its next token ("prefill" or
        "decode" sequences, after ``apply_moves``). Running some of them again is harmless: each new token's
        K/V is written again, the same, into the same slot."""
        input_ids, positions, slots, query_lens = [], [], [], []
        for seq in seqs:
            span = self.new_tokens(kind, seq)
            input_ids += seq.token_ids[span.start:] if kind == "prefill" else [seq.last_token]
            positions += span
            slots += self.manager.slot_mapping(seq, span.start, span.stop)
            query_lens.append(len(span))
        tables = [self.manager.get_block_table(seq) for seq in seqs]
        width = max(len(t) for t in tables)
        block_tables = [t + [0] * (width - len(t)) for t in tables]  # padding is never read

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        cu_query_lens = tensor([0] + query_lens, torch.int32).cumsum(0, dtype=torch.int32)
        batch = AttentionBatch.for_backend(
            self.attention_backend, self.kv_cache.gpu[0], is_prefill=kind == "prefill",
            slot_mapping=tensor(slots, torch.int64), block_tables=tensor(block_tables, torch.int32),
            seq_lens=tensor([s.num_tokens for s in seqs], torch.int32), cu_query_lens=cu_query_lens)
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64), batch, self.kv_cache.gpu)
        return self.model.compute_logits(hidden[cu_query_lens[1:].long() - 1])  # each sequence's last row
