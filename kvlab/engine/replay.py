"""Replay a timed workload through an engine, and read per request what its scheduler did.

``replay(llm, workload)`` adds each request before the engine step it arrives at and steps the engine until
every output is back: traffic that arrives while other requests run, on an offline ``LLM``. Time is counted
in engine steps: an engine with nothing to do runs no step, so a request that arrives while the engine is
idle is added before the next step that runs (``Replay.arrived`` keeps the step it really joined).

The ``Replay`` reads only ``llm.decisions`` (the engine must be made with ``record_decisions=True``) and
``llm.step_dataframe()``, and answers per request: its state in every step (``schedule_frame()``, the input
of ``kvlab.viz.draw_schedule``), the steps that gave it a token, its time to first token, its latency and
the waits between two of its tokens, and what preemption by recompute made the engine compute again.

Durations take an optional per-step ``cost``, one number per step (``cost[i]`` for step ``i``): omitted,
every step costs 1 and durations are in steps; a step-time model's milliseconds or each step's
``num_tokens`` give them in milliseconds or in tokens computed. A duration covers the steps it spans,
both ends included: a request added before step ``a`` that gets its first token in step ``b`` waited
``cost[a] + ... + cost[b]``.
"""

from typing import NamedTuple

import numpy as np
import pandas as pd

from kvlab.errors import InvalidArgumentError
from kvlab.validation import is_int

# A request's state in one step, for ``kvlab.viz.draw_schedule`` (its SCHEDULE_STATES): it ran as a
# prefill (its first, or a chunk of it), a recompute (a prefill again after a preemption by recompute) or
# a decode; or it did not run while running (paused), queued (waiting) or swapped out to CPU memory.
RAN_STATES = ("prefill", "recompute", "decode")


class Arrival(NamedTuple):
    prompt: list[int]   # token ids
    step: int           # added before this engine step (0: before the first)
    params: object      # its SamplingParams (n = 1: one sequence per request)


class Replay:
    """What ``replay`` saw: ``arrived``, ``first_token`` and ``finished`` map request id to step,
    ``token_steps`` to every step that sampled one of its tokens, ``outputs`` to its generated token ids.
    ``recomputed_tokens``: tokens prefilled again after preemptions by recompute (prefix hits excluded);
    ``recompute_hits``: tokens those re-prefills found in the prefix cache instead (the victim's own freed
    blocks, mostly)."""

    def __init__(self, llm, arrived: dict[str, int], finished: dict[str, int], outputs: dict[str, list[int]]):
        self.llm, self.arrived, self.finished, self.outputs = llm, arrived, finished, outputs
        self.token_steps: dict[str, list[int]] = {}
        self.recomputed_tokens = self.recompute_hits = 0
        self._rows = []  # (step, request, state, preempted in this step)
        preempted_before = set()  # requests preempted by recompute and not yet prefilled again
        recomputed = set()        # requests that have ever been preempted by recompute
        for decision in llm.decisions:
            for seq in decision.ran:
                state = "decode"
                if seq.prefill:
                    state = "recompute" if seq.request_id in recomputed else "prefill"
                    if seq.request_id in preempted_before:  # the first prefill entry after its preemption
                        preempted_before.discard(seq.request_id)
                        self.recompute_hits += seq.start  # a prefill starts after its prefix hits
                    if state == "recompute":
                        self.recomputed_tokens += seq.num_tokens
                if seq.samples:
                    self.token_steps.setdefault(seq.request_id, []).append(decision.step)
                self._rows.append((decision.step, seq.request_id, state, False))
            ran = {seq.request_id for seq in decision.ran}
            preempted = {name for name, _ in decision.preempted}
            swapped = {name for name, _ in decision.swapped}
            for name in preempted - swapped:  # by recompute: back to waiting, its blocks freed
                preempted_before.add(name)
                recomputed.add(name)
            for queue, state in ((decision.running, "paused"), (decision.waiting, "waiting"),
                                 (decision.swapped, "swapped")):
                for name, _ in queue:  # (request id, sample): one sample per request
                    if name not in ran:
                        self._rows.append((decision.step, name, state, name in preempted))
        self.first_token = {name: steps[0] for name, steps in self.token_steps.items()}

    @property
    def num_steps(self) -> int:
        return len(self.llm.decisions)

    def schedule_frame(self) -> pd.DataFrame:
        """One row per step and request present in it: columns step, request, state, preempted."""
        return pd.DataFrame(self._rows, columns=["step", "request", "state", "preempted"])

    def _cost(self, cost) -> np.ndarray:
        if cost is None:
            return np.ones(self.num_steps)
        values = np.asarray(cost, dtype=float)
        if values.shape != (self.num_steps,):
            raise InvalidArgumentError(f"cost must hold one number per step ({self.num_steps}), "
                                       f"got shape {values.shape}")
        return values

    def time_to_first_token(self, cost=None) -> dict[str, float]:
        """Per request with a token: from the step it was added to the step of its first token."""
        values = self._cost(cost)
        return {name: values[self.arrived[name]:step + 1].sum() for name, step in self.first_token.items()}

    def latency(self, cost=None) -> dict[str, float]:
        """Per finished request: from the step it was added to the step of its last token."""
        values = self._cost(cost)
        return {name: values[self.arrived[name]:step + 1].sum() for name, step in self.finished.items()}

    def gaps(self, cost=None, requests=None) -> pd.DataFrame:
        """Every wait between two consecutive tokens of one request (of ``requests``, default all): columns
        request, start and end (the steps of the two tokens), steps (end - start) and cost (of the steps
        after start up to end: what ran while the request waited, and the step that gave its token)."""
        values = self._cost(cost)
        names = self.token_steps if requests is None else requests
        rows = [(name, a, b, b - a, values[a + 1:b + 1].sum()) for name in names
                for a, b in zip(self.token_steps.get(name, []), self.token_steps.get(name, [])[1:])]
        return pd.DataFrame(rows, columns=["request", "start", "end", "steps", "cost"])

    def longest_gap(self, cost=None, requests=None) -> pd.Series:
        """The row of ``gaps(cost, requests)`` with the largest cost (the first such)."""
        gaps = self.gaps(cost, requests)
        if gaps.empty:
            raise InvalidArgumentError("no request of these got two tokens: there is no gap between tokens")
        return gaps.loc[gaps["cost"].idxmax()]

    def recompute_steps(self) -> tuple[int, int]:
        """(steps that re-prefill a request preempted by recompute, steps that run nothing else): the latter
        exist only because of a preemption, and each pays a step's fixed cost again."""
        frame = self.schedule_frame()
        ran = frame[frame["state"].isin(RAN_STATES)].groupby("step")["state"]
        return (int(ran.apply(lambda s: (s == "recompute").any()).sum()),
                int(ran.apply(lambda s: (s == "recompute").all()).sum()))


def _check_workload(llm, workload) -> None:
    if getattr(llm, "decisions", None) is None:
        raise InvalidArgumentError("replay reads the scheduler's decisions: make the engine with "
                                   "LLM(..., record_decisions=True)")
    if llm.step_records or llm.has_unfinished_requests():
        raise InvalidArgumentError("replay needs a fresh engine (no step run, no request queued): its steps "
                                   "are the workload's clock")
    if not isinstance(workload, dict) or not workload:
        raise InvalidArgumentError("workload must be a non-empty dict {request id: Arrival(prompt, step, params)}")
    for name, arrival in workload.items():
        if not isinstance(name, str):
            raise InvalidArgumentError(f"request ids must be strings, got {name!r}")
        if not isinstance(arrival, Arrival):
            raise InvalidArgumentError(f"workload[{name!r}] must be an Arrival(prompt, step, params), "
                                       f"got {type(arrival).__name__}")
        if not is_int(arrival.step) or arrival.step < 0:
            raise InvalidArgumentError(f"workload[{name!r}].step must be an int >= 0, got {arrival.step!r}")
        if getattr(arrival.params, "n", None) != 1:
            raise InvalidArgumentError(f"workload[{name!r}].params must be a SamplingParams with n=1 (a replay "
                                       "follows one sequence per request)")


def replay(llm, workload: dict[str, Arrival]) -> Replay:
    """Run ``workload`` ({request id: Arrival}) on ``llm`` (fresh, made with ``record_decisions=True``)
    until every request is done; the engine keeps what it recorded. Raises InvalidArgumentError for an
    engine or a workload that does not qualify before anything runs; each prompt itself is checked by
    ``llm.add_request`` when it arrives."""
    _check_workload(llm, workload)
    pending = dict(sorted(workload.items(), key=lambda item: item[1].step))  # in order of arrival
    arrived, finished, outputs = {}, {}, {}
    while pending or llm.has_unfinished_requests():
        step = len(llm.step_records)
        # An idle engine runs no step, so its clock stands still: the next arrivals join now.
        now = step if llm.has_unfinished_requests() else max(step, min(a.step for a in pending.values()))
        for name in [n for n, a in pending.items() if a.step <= now]:
            arrival = pending.pop(name)
            llm.add_request(arrival.prompt, arrival.params, request_id=name)
            arrived[name] = step
        for out in llm.step():
            finished[out.request_id] = step
            outputs[out.request_id] = out.outputs[0].token_ids
    return Replay(llm, arrived, finished, outputs)
