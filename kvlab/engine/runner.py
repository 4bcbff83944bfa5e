"""Turn a step's entries into tensors, move blocks, run the model, return logits.

Everything comes from the frozen step (``kvlab.engine.step``): for each sequence the positions it computes
(after the cached prefix, one chunk of a prompt, or a decode's one token without K/V), their slots, and what
changed in its block tables, as the scheduler read them from the block manager; the runner keeps each
sequence's tables from those edits (``begin_step``). A model with several kinds of layer
(``kvlab.engine.hybrid``) gets one attention batch per KV cache group, from that group's tables and slots,
with its window; each layer runs with its group's batch on its cache tensor (the cache's ``KVCacheConfig``).
"""

from collections.abc import Sequence

import torch

from kvlab.engine.attention import AttentionBatch
from kvlab.engine.kv_cache import PagedKVCache
from kvlab.engine.model import CausalLM
from kvlab.engine.step import ScheduledStep, SeqStep


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedKVCache, device, attention_backend: str, *,
                 check_every_layer: bool = False, kivi=None, parts=None):
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.attention_backend = attention_backend
        self.query_dtype = model.lm_head.weight.dtype  # the model's (an fp8 cache's Triton prefill tile follows it)
        self.check_every_layer = check_every_layer  # Triton's debug switch (kvlab.engine.attention)
        self.kivi = kivi  # a KIVI cache's quantizer (any layer's): the Triton kernels' steps are checked for it
        self.layer_groups = kv_cache.config.layer_groups
        self.windows = [group.sliding_window for group in kv_cache.config.groups]  # None: full attention
        # MLA: the groups' pages are latent rows (an MLA model has one group, of full-attention layers)
        self.latent_pages = kv_cache.config.groups[0].mla_latent_dim is not None
        self._tables: dict[int, list[list[int]]] = {}  # seq_id -> [groups][blocks], from the steps' edits
        # A learner's slot mapping and attention (kvlab.engine.parts; one full-attention group), else None.
        self.parts = parts

    def begin_step(self, step: ScheduledStep) -> None:
        """Once per step, before any forward pass of it: drop the tables of the sequences the step forgot, apply
        its table edits, then its block moves (swaps, copy-on-write copies, the offload tier's copies)."""
        for seq_id in step.forgotten:
            self._tables.pop(seq_id, None)
        for entry in step.entries:
            tables = self._tables.setdefault(entry.seq.seq_id, [[] for _ in entry.table_edits])
            for table, (start, blocks) in zip(tables, entry.table_edits):
                table[start:] = blocks
        self.kv_cache.apply(step.moves)

    def block_tables(self, seq_id: int) -> list[list[int]]:
        """``[groups][blocks]``: the runner's tables of a sequence its steps have scheduled."""
        return self._tables[seq_id]

    def forward(self, step: ScheduledStep, entries: Sequence[SeqStep]) -> torch.Tensor:
        """fp32 logits ``[sum(1 + entry.num_draft_tokens), vocab]``, entry by entry: each sequence's
        distribution after the last token this step computes for it, and with d drafts, d + 1 rows: after its
        last token and after each draft (``entries``: some or all of ``step.entries``, after ``begin_step``).
        Prompt chunks, decode tokens and drafts go through one forward pass: a decode row is query length 1
        over its cached context, a decode with d drafts query length d + 1 (as a prompt chunk is). Running
        some of them again is harmless: each new token's K/V is written again, the same, into the same slot.
        Reads only the step, never the block manager."""
        input_ids, positions, query_lens, context_lens = [], [], [], []
        slots = [[] for _ in self.windows]  # [groups][T]
        for entry in entries:
            input_ids += entry.input_ids()
            positions += range(entry.start, entry.end)
            if self.parts is not None and self.parts.slot_mapping is not None:
                slots[0] += self.parts.slots(self._tables[entry.seq.seq_id][0], self.kv_cache.block_size,
                                             entry.start, entry.end)
            else:
                for group, group_slots in zip(slots, entry.slots):
                    group += group_slots
            query_lens.append(entry.num_tokens)
            context_lens.append(entry.end)  # a chunk sees its prompt up to its own last token, no further
        tables = list(zip(*(self._tables[entry.seq.seq_id] for entry in entries)))  # [groups][S]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype, device=self.device)

        def padded(group_tables):  # padding is never read
            width = max(len(t) for t in group_tables)
            return tensor([t + [0] * (width - len(t)) for t in group_tables], torch.int32)

        cu_query_lens = tensor([0] + query_lens, torch.int32).cumsum(0, dtype=torch.int32)
        seq_lens = tensor(context_lens, torch.int32)
        longest = max(context_lens)  # known here, so no layer reads it back from seq_lens
        # a decode step with drafts has several query rows per sequence: the prefill path's layout
        multi_row = step.kind != "decode" or any(entry.num_draft_tokens for entry in entries)
        if self.latent_pages:  # the model's kv_lora_rank splits a row into the latent and the key's rope part
            batches = [AttentionBatch.for_latent_cache(
                self.attention_backend, self.kv_cache.gpu[0], self.model.config.mla.kv_lora_rank,
                is_prefill=multi_row, slot_mapping=tensor(slots[0], torch.int64), block_tables=padded(tables[0]),
                seq_lens=seq_lens, cu_query_lens=cu_query_lens, check_every_layer=self.check_every_layer)]
        else:
            batches = [AttentionBatch.for_backend(
                self.attention_backend, self.kv_cache.gpu[0], is_prefill=multi_row,
                slot_mapping=tensor(group_slots, torch.int64), block_tables=padded(group_tables), seq_lens=seq_lens,
                cu_query_lens=cu_query_lens, max_seq_len=longest, num_heads=self.model.config.num_heads,
                sliding_window=window, check_every_layer=self.check_every_layer, query_dtype=self.query_dtype,
                kivi=self.kivi, parts=self.parts)
                for group_slots, group_tables, window in zip(slots, tables, self.windows)]
        for window in self.kv_cache.windows:  # a KIVI cache: what a pass that raised staged is dropped
            window.discard()
        hidden = self.model(tensor(input_ids, torch.int64), tensor(positions, torch.int64),
                            [batches[g] for g in self.layer_groups], self.kv_cache.layer_caches)
        for window in self.kv_cache.windows:  # ... and what this one staged kept, once every layer ran
            window.commit()
        return self.model.compute_logits(hidden[_sampled_rows(entries, query_lens)])


def _sampled_rows(entries: Sequence[SeqStep], query_lens: list[int]) -> list[int]:
    """The query rows whose logits the step needs: each sequence's last row, and with d drafts its last d + 1."""
    rows, end = [], 0
    for entry, length in zip(entries, query_lens):
        end += length
        rows += range(end - 1 - entry.num_draft_tokens, end)
    return rows
