"""Turn a step's sequences into tensors, move blocks, run the model, return logits.

For each sequence the block manager says where its tokens live: ``slot_mapping`` for the tokens computed in
this step, ``get_block_table`` for the whole context. A prefill computes only the tokens after the cached
prefix (``num_cached_tokens``), or (V1 scheduling) one chunk of them; a decode computes the one token that
has no K/V yet (the last sampled one). A model with several kinds of layer (``kvlab.engine.hybrid``) gets
one attention batch per KV cache group, from that group's tables and slots, with its window.
"""

import torch

from kvlab.blocks.manager import BlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.engine.attention import AttentionBatch
from kvlab.engine.hybrid import EngineHybridManager, group_specs
from kvlab.engine.kv_cache import BlockMoves, PagedKVCache
from kvlab.engine.model import CausalLM
from kvlab.engine.scheduler import ScheduledStep


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, manager: BlockManager, device,
                 attention_backend: str, *, check_every_layer: bool = False):
        self.model, self.kv_cache, self.manager, self.device = model, kv_cache, manager, device
        self.attention_backend = attention_backend
        self.check_every_layer = check_every_layer  # Triton's debug switch (kvlab.engine.attention)
        specs, self.layer_groups = group_specs(model.config)
        self.windows = [spec.sliding_window for spec in specs]  # each group's window, None: full attention
        self.hybrid = isinstance(manager, EngineHybridManager)

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """Each group's block table."""
        return self.manager.block_tables(seq) if self.hybrid else [self.manager.get_block_table(seq)]

    def _slots(self, seq: Sequence, start: int, end: int) -> list[list[int]]:
        """Each group's slots for positions start..end-1 (-1 where a window released the block)."""
        return (self.manager.slot_mappings(seq, start, end) if self.hybrid
                else [self.manager.slot_mapping(seq, start, end)])

    def apply_moves(self, moves: BlockMoves) -> None:
        """The step's swaps and copy-on-write copies, once, before any forward pass of the step."""
        self.kv_cache.apply(moves)

    def new_tokens(self, step: ScheduledStep, seq: Sequence) -> range:
        """Positions whose K/V this step computes: from where the scheduler started it (after the cached
        prefix, after the chunks earlier steps computed, or a decode's last token, which has no K/V yet) up
        to the tokens it has slots for."""
        return range(step.starts[seq.seq_id], self.manager.num_scheduled_tokens(seq))

    def written_blocks(self, step: ScheduledStep, seq: Sequence) -> set[int]:
        span = self.new_tokens(step, seq)
        return {slot // self.manager.block_size for slots in self._slots(seq, span.start, span.stop)
                for slot in slots if slot >= 0}

    def forward(self, step: ScheduledStep, seqs: list[Sequence]) -> torch.Tensor:
        """fp32 logits ``[len(seqs), vocab]``: each sequence's distribution after the last token this step
        computes for it (``seqs``: some or all of ``step.seqs``, after ``apply_moves``). Prompt chunks and
        decode tokens go through one forward pass: a decode row is query length 1 over its cached context.
        Running some of them again is harmless: each new token's K/V is written again, the same, into the
        same slot."""
        input_ids, positions, query_lens, context_lens = [], [], [], []
        slots = [[] for _ in self.windows]  # [groups][T]
        for seq in seqs:
            span = self.new_tokens(step, seq)
            input_ids += seq.token_slice(span.start, span.stop)
            positions += span
            for group, group_slots in zip(slots, self._slots(seq, span.start, span.stop)):
                group += group_slots
            query_lens.append(len(span))
            context_lens.append(span.stop)  # a chunk sees its prompt up to its own last token, no further
        tables = list(zip(*(self._tables(seq) for seq in seqs)))  # [groups][S]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        def padded(group_tables):  # padding is never read
            width = max(len(t) for t in group_tables)
            return tensor([t + [0] * (width - len(t)) for t in group_tables], torch.int32)

        cu_query_lens = tensor([0] + query_lens, torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens = tensor(context_lens, torch.int32)
        longest = max(context_lens)  # known here, so no layer reads it back from seq_lens
        batches = [AttentionBatch.for_backend(
            self.attention_backend, self.kv_cache.gpu[0], is_prefill=step.kind != "decode",
            slot_mapping=tensor(group_slots, torch.int64), block_tables=padded(group_tables), seq_lens=seq_lens,
            cu_query_lens=cu_query_lens, max_seq_len=longest, num_heads=self.model.config.num_heads,
            sliding_window=window, check_every_layer=self.check_every_layer)
            for group_slots, group_tables, window in zip(slots, tables, self.windows)]
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64),
                            [batches[g] for g in self.layer_groups], self.kv_cache.gpu)
        return self.model.compute_logits(hidden[cu_query_lens[1:].long() - 1])  # each sequence's last row
