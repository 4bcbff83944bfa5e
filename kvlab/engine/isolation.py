"""Keeping a failure to the request it belongs to: the batched forward pass and the batched sampler, and
what to do with each sequence when they fail.

Forward pass: if the batch raises, each sequence runs again on its own, in step order, to find the ones that
fail alone. That is sound because running a sequence again writes the same K/V into the same slots. One
thing cannot be run: a prefill sequence (or prompt chunk, in a V1 step) that hit a block a failed sequence
was to write in this very step (the same-step prefix hit of the block manager's ordering rule) would read
K/V that was never written. It goes back to the waiting queue, to be prefilled again once the prefix cache
has forgotten those blocks.

Sampling: if the vectorised sampler raises, each row is sampled alone, from generator states restored to
where the batch started, so that seeded rows draw the noise they would have drawn without the failure.
Rows without a seed share the engine's generator, so what they draw depends on the batch anyway.
"""

from dataclasses import dataclass, field

import torch

from kvlab.blocks.sequence import Sequence
from kvlab.engine.runner import ModelRunner
from kvlab.engine.sampler import Sampler
from kvlab.engine.step import ScheduledStep, SeqStep


@dataclass
class ForwardResult:
    entries: list[SeqStep]                       # the sequences that ran, in step order
    logits: torch.Tensor | None                  # [len(entries), vocab]; None if none ran
    failed: list = field(default_factory=list)   # (sequence, the exception it raised alone)
    blocked: list[Sequence] = field(default_factory=list)  # prefills that read blocks a failed one was to write


def run_forward(runner: ModelRunner, step: ScheduledStep, block_size: int) -> ForwardResult:
    """Logits for the step's sequences, each failing sequence set apart (``Exception`` only: an interrupt
    stops the step)."""
    try:
        return ForwardResult(list(step.entries), runner.forward(step, step.entries))
    except Exception:  # noqa: BLE001 - which sequence is at fault is found below, each raising its own error
        pass
    result, rows, unwritten = ForwardResult([], None), [], set()
    for entry in step.entries:
        if step.kind != "decode" and unwritten.intersection(
                block for table in runner.block_tables(entry.seq.seq_id) for block in table):
            result.blocked.append(entry.seq)
            unwritten |= entry.written_blocks(block_size)  # what hit its new blocks cannot run either
            continue
        try:
            rows.append(runner.forward(step, [entry]))
            result.entries.append(entry)
        except Exception as error:  # noqa: BLE001 - this sequence's failure, kept as its abort reason
            result.failed.append((entry.seq, error))
            unwritten |= entry.written_blocks(block_size)
    result.logits = torch.cat(rows) if rows else None
    return result


def sample_rows(sampler: Sampler, logits: torch.Tensor, params: list, generators: list) -> list:
    """``sampler``'s tokens, one per row; where the batch raises, the rows are sampled alone and a row that
    fails alone gets its exception instead of a token."""
    in_use = [sampler.generator] + list({id(g): g for g in generators if g is not None}.values())
    states = [g.get_state() for g in in_use]
    try:
        return sampler(logits, params, generators)
    except Exception:  # noqa: BLE001 - each row's own error is found below
        for generator, state in zip(in_use, states):
            generator.set_state(state)
    tokens = []
    for row in range(len(params)):
        try:
            tokens += sampler(logits[row:row + 1], params[row:row + 1], generators[row:row + 1])
        except Exception as error:  # noqa: BLE001 - this row's failure, kept as its abort reason
            tokens.append(error)
    return tokens
