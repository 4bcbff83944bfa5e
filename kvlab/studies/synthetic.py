"""Seeded synthetic workloads with known sharing patterns, in the trace DataFrame shape.

Each generator returns the normalised trace columns (``kvlab.studies.traces``: timestamp in ms, input_length,
output_length, hash_ids = None) plus ``token_ids``: each prompt's explicit int64 token ids. Every piece of
text (a system prompt, a few-shot example, a user message) is a run of fresh token ids, so two prompts
share a prefix exactly when the generator made them share it. Arrivals are Poisson at ``rate_per_s``.

Patterns (the classic wins of prefix caching):
- ``shared_system_prompt``: one system prompt, then a private user message.
- ``few_shot``: an instruction, then ``shots`` examples drawn from a pool in varying order and
  combination, then a question. Only the leading run of identical examples can be shared.
- ``multi_turn_chat``: each turn's prompt is the previous prompt + the assistant's reply + a new user
  message. The reply tokens are fresh here, and a replay generates different ones while decoding, so a
  turn hits its previous *prompt* (as in the Mooncake traces, whose ids share input with input).
- ``parallel_sampling``: every prompt is submitted ``samples`` times at the same moment.
"""

import numpy as np
import pandas as pd

from kvlab.errors import InvalidArgumentError
from kvlab.studies.traces import COLUMNS, MAX_REQUEST_TOKENS
from kvlab.validation import check_int, check_number, is_int


class _Text:
    """Fresh token ids: every call returns ids never returned before, so sharing is only by reuse."""

    def __init__(self, rng: np.random.Generator):
        self.rng = rng
        self._next = 0

    def length(self, bounds) -> int:
        pair = (bounds, bounds) if is_int(bounds) else bounds
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(is_int(x) for x in pair)
                and 1 <= pair[0] <= pair[1] <= MAX_REQUEST_TOKENS):
            raise InvalidArgumentError(f"a length must be an int in [1, {MAX_REQUEST_TOKENS}] or a (low, high) "
                                       f"range of them, got {bounds!r}")
        return int(self.rng.integers(pair[0], pair[1] + 1))

    def fresh(self, bounds) -> np.ndarray:
        n = self.length(bounds)
        self._next += n
        return np.arange(self._next - n, self._next, dtype=np.int64)


def _arrivals_ms(rng, n: int, rate_per_s: float) -> np.ndarray:
    rate_per_s = check_number("rate_per_s", rate_per_s, 0, min_open=True)
    return np.cumsum(rng.exponential(1000.0 / rate_per_s, size=n))


def _frame(timestamps, prompts, output_lengths) -> pd.DataFrame:
    frame = pd.DataFrame({
        "timestamp": np.asarray(timestamps, dtype=np.float64),
        "input_length": np.array([len(p) for p in prompts], dtype=np.int64),
        "output_length": np.asarray(output_lengths, dtype=np.int64),
        "hash_ids": None,
        "token_ids": prompts,
    })
    # Stable sort: requests arriving together keep their generation order.
    return frame[COLUMNS + ["token_ids"]].sort_values("timestamp", kind="stable").reset_index(drop=True)


def shared_system_prompt(num_requests=200, system_tokens=1024, user_tokens=(64, 512), output_tokens=(32, 256),
                         rate_per_s=4.0, seed=0) -> pd.DataFrame:
    """Every prompt = one shared system prompt + a private user message."""
    check_int("num_requests", num_requests, 1)
    text = _Text(np.random.default_rng(seed))
    system = text.fresh(system_tokens)
    prompts = [np.concatenate([system, text.fresh(user_tokens)]) for _ in range(num_requests)]
    outputs = [text.length(output_tokens) for _ in range(num_requests)]
    return _frame(_arrivals_ms(text.rng, num_requests, rate_per_s), prompts, outputs)


def few_shot(num_requests=200, num_examples=8, shots=3, instruction_tokens=256, example_tokens=(128, 384),
             question_tokens=(32, 128), output_tokens=(16, 128), rate_per_s=4.0, seed=0) -> pd.DataFrame:
    """Instruction + ``shots`` distinct examples (random order and choice from a pool) + a question."""
    check_int("num_requests", num_requests, 1)
    check_int("num_examples", num_examples, 1)
    check_int("shots (at most num_examples)", shots, 1, num_examples)
    text = _Text(np.random.default_rng(seed))
    instruction = text.fresh(instruction_tokens)
    examples = [text.fresh(example_tokens) for _ in range(num_examples)]
    prompts = []
    for _ in range(num_requests):
        chosen = text.rng.choice(num_examples, size=shots, replace=False)
        prompts.append(np.concatenate([instruction, *(examples[k] for k in chosen), text.fresh(question_tokens)]))
    outputs = [text.length(output_tokens) for _ in range(num_requests)]
    return _frame(_arrivals_ms(text.rng, num_requests, rate_per_s), prompts, outputs)


def multi_turn_chat(num_conversations=25, turns=8, system_tokens=256, user_tokens=(32, 256),
                    reply_tokens=(64, 384), think_time_s=30.0, rate_per_s=0.5, seed=0) -> pd.DataFrame:
    """Conversations starting at Poisson times; turn k+1 arrives an exponential think time after turn k
    and its prompt extends turn k's prompt with the reply and a new user message."""
    check_int("num_conversations", num_conversations, 1)
    check_int("turns", turns, 1)
    check_number("think_time_s", think_time_s, 0)
    text = _Text(np.random.default_rng(seed))
    system = text.fresh(system_tokens)  # shared by all conversations, as a chat product's would be
    starts = _arrivals_ms(text.rng, num_conversations, rate_per_s)
    times, prompts, outputs = [], [], []
    for start in starts:
        prompt, now = np.concatenate([system, text.fresh(user_tokens)]), start
        for _ in range(turns):
            reply = text.fresh(reply_tokens)
            times.append(now)
            prompts.append(prompt)
            outputs.append(len(reply))
            prompt = np.concatenate([prompt, reply, text.fresh(user_tokens)])
            now += text.rng.exponential(think_time_s * 1000.0)
    return _frame(times, prompts, outputs)


def parallel_sampling(num_prompts=50, samples=4, prompt_tokens=(256, 2048), output_tokens=(64, 256),
                      rate_per_s=1.0, seed=0) -> pd.DataFrame:
    """Each prompt submitted ``samples`` times at once (n > 1 sampling issued as separate requests)."""
    check_int("num_prompts", num_prompts, 1)
    check_int("samples", samples, 1)
    text = _Text(np.random.default_rng(seed))
    times, prompts, outputs = [], [], []
    for when in _arrivals_ms(text.rng, num_prompts, rate_per_s):
        prompt = text.fresh(prompt_tokens)
        for _ in range(samples):
            times.append(when)
            prompts.append(prompt)
            outputs.append(text.length(output_tokens))
    return _frame(times, prompts, outputs)


#: Synthetic workloads by name (accepted wherever a trace name is), with their default parameters.
WORKLOADS = {
    "synthetic_system_prompt": shared_system_prompt,
    "synthetic_few_shot": few_shot,
    "synthetic_chat": multi_turn_chat,
    "synthetic_parallel": parallel_sampling,
}
