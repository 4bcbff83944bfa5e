"""Turn a scheduled step into tensors, move blocks, run the model, return logits.

For each sequence the block manager says where its tokens live: ``slot_mapping`` for the tokens computed in
this step, ``get_block_table`` for the whole context. A prefill computes only the tokens after the cached
prefix (``num_cached_tokens``); a decode computes the one token that has no K/V yet (the last sampled one).
"""

import torch

from kvlab.blocks.manager import BlockManager
from kvlab.engine.attention import AttentionBatch
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import CausalLM
from kvlab.engine.scheduler import ScheduledStep


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, manager: BlockManager, device,
                 attention_backend: str):
        self.model, self.kv_cache, self.manager, self.device = model, kv_cache, manager, device
        self.attention_backend = attention_backend

    def run(self, step: ScheduledStep) -> torch.Tensor:
        """fp32 logits ``[len(step.seqs), vocab]``: each sequence's distribution for its next token."""
        self.kv_cache.apply(step.moves)  # swaps and copy-on-write land before any layer reads or writes
        input_ids, positions, slots, query_lens = [], [], [], []
        for seq in step.seqs:
            # Prefill: every token after the cached prefix. Decode: the last token, which has no K/V yet.
            start = seq.num_cached_tokens if step.kind == "prefill" else seq.num_tokens - 1
            end = seq.num_tokens
            input_ids += seq.token_ids[start:] if step.kind == "prefill" else [seq.last_token]
            positions += range(start, end)
            slots += self.manager.slot_mapping(seq, start, end)
            query_lens.append(end - start)
        tables = [self.manager.get_block_table(seq) for seq in step.seqs]
        width = max(len(t) for t in tables)
        block_tables = [t + [0] * (width - len(t)) for t in tables]  # padding is never read

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        cu_query_lens = tensor([0] + query_lens, torch.int32).cumsum(0, dtype=torch.int32)
        batch = AttentionBatch.for_backend(
            self.attention_backend, self.kv_cache.gpu[0], is_prefill=step.kind == "prefill",
            slot_mapping=tensor(slots, torch.int64), block_tables=tensor(block_tables, torch.int32),
            seq_lens=tensor([s.num_tokens for s in step.seqs], torch.int32), cu_query_lens=cu_query_lens)
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64), batch, self.kv_cache.gpu)
        return self.model.compute_logits(hidden[cu_query_lens[1:].long() - 1])  # each sequence's last row
