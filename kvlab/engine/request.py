"""A request as the engine tracks it (its samples' sequences, generators, finish state, timings) and the
outputs it returns (vLLM's names: ``RequestOutput.outputs[k].token_ids`` ...)."""

import time
from dataclasses import dataclass, field

from kvlab.blocks.sequence import Sequence
from kvlab.engine.sampling_params import SamplingParams


@dataclass
class RequestMetrics:
    """Timestamps are ``time.perf_counter()`` seconds."""
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_prompt_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache on admission
    num_generated_tokens: int = 0      # over all samples
    num_preemptions: int = 0           # times one of its sequences was preempted (recompute or swap)
    # Speculative decoding, over all samples (vLLM's spec-decode counters):
    num_draft_tokens: int = 0          # drafts proposed and verified
    num_accepted_tokens: int = 0       # drafts the target accepted (a stop inside the run keeps fewer)
    num_drafting_steps: int = 0        # verifications: steps in which one of its sequences had drafts

    def count_drafts(self, proposed: int, accepted: int) -> None:
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        self.num_drafting_steps += 1

    @property
    def num_rejected_draft_slots(self) -> int:
        """KV slots written for drafts the target rejected: what speculation cost in cache writes."""
        return self.num_draft_tokens - self.num_accepted_tokens

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over proposed ones; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification yields on average: 1 (the target's own token) + the drafts it accepted, as
        vLLM's "mean acceptance length"; None before any verification."""
        steps = self.num_drafting_steps
        return 1 + self.num_accepted_tokens / steps if steps else None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_time(self) -> float | None:
        """From the first token to the last sample finishing."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample. ``finish_reason``: "length" (max_tokens or the model's context), "stop" (end-of-sequence or
    a stop token, kept as the last token; ``stop_reason`` is its id) or "abort" (``abort_reason`` says why)."""
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    stop_reason: int | None = None
    abort_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclass
class Finish:
    reason: str
    stop_reason: int | None = None
    abort_reason: str | None = None


@dataclass(eq=False)  # compared and hashed by identity
class Request:
    """``seqs[k]`` is sample k's sequence. Until the prompt's prefill has run there is one (the prompt's);
    then, with ``n > 1``, the others are forked from it and share its blocks."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    generators: list
    metrics: RequestMetrics
    finishes: list = field(default_factory=list)

    @classmethod
    def create(cls, request_id, prompt, token_ids, params: SamplingParams, block_size: int, device):
        from kvlab.engine.sampler import sample_generator  # torch: the scheduler's imports of Request must not load it

        seed = params.seed
        return cls(request_id, prompt, list(token_ids), params, [Sequence(token_ids, block_size)],
                   [None if seed is None else sample_generator(seed, k, device) for k in range(params.n)],
                   RequestMetrics(time.perf_counter(), len(token_ids)), [None] * params.n)

    @property
    def needs_fork(self) -> bool:
        return len(self.seqs) < self.params.n

    @property
    def finished(self) -> bool:
        return all(f is not None for f in self.finishes)

    def stop_check(self, seq: Sequence, eos_token_ids, max_model_len: int) -> Finish | None:
        """Whether the sample of ``seq`` stops after the token it just appended."""
        token, params = seq.last_token, self.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
            return Finish("stop", stop_reason=token)
        if seq.num_completion_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
            return Finish("length")
        return None

    def output(self, tokenizer) -> RequestOutput:
        """A sample whose tokens the tokenizer cannot decode keeps them, with no text and finish_reason
        "abort" (the reason says why); the other samples' texts are unaffected."""
        outputs = []
        for k, finish in enumerate(self.finishes):
            seq = self.seqs[k] if k < len(self.seqs) else None  # aborted before the fork: no sequence
            ids = seq.token_slice(seq.num_prompt_tokens, seq.num_tokens) if seq is not None else []
            text = None
            if tokenizer is not None:
                try:
                    text = tokenizer.decode(ids, skip_special_tokens=True)
                except Exception as error:  # noqa: BLE001 - kept as this sample's abort reason
                    finish = Finish("abort", abort_reason=f"detokenizing failed for this sample: {error!r}")
            outputs.append(CompletionOutput(k, ids, text, finish and finish.reason, finish and finish.stop_reason,
                                            finish and finish.abort_reason))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, self.finished, self.metrics)
