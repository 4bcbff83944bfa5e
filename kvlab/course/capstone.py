"""The capstone: serve SmolLM2-135M on a paged engine built from the parts you wrote in the puzzles (notebook 16).

``engine_with(parts)`` takes your solutions by puzzle name and returns a ``kvlab.engine.LLM`` in which each one
replaces kvlab's own at a real seam (``kvlab.engine.parts``: the slots new K/V are written to, prefix caching's
hashes, the free blocks' reuse order, torch attention over the block tables and the merge of a split-K decode,
speculative decoding's drafts and their verification, the scheduler's admission of a waiting prompt). A part you
did not give is kvlab's, and the call says which are yours and which are kvlab's. Each part you give is first
graded by its puzzle's ``check``: one that fails is named, with the failing case, before any model loads::

    from kvlab.course import engine_with, check_engine
    llm = engine_with({"slot_mapping": slot_mapping, "lru_policy": MyLRU})
    llm.chat([{"role": "user", "content": "Name a primary colour."}])

``check_engine(parts)`` is the capstone's test: it serves a few chat prompts that share their system prompt
(so prefix caching hits) with speculative decoding on, and compares the greedy tokens with Hugging Face
transformers' ``generate``, which must match exactly (with your ``can_allocate``, in a pool small enough that the
second prompt waits: ``ADMISSION_OPTIONS``). On a mismatch it serves them again with one of your parts at a time
(kvlab's for the others) and names the part whose engine goes wrong. A part the engine catches breaking its
contract, such as an admission other than kvlab's on the same numbers, is named at once. ``check_engine()``
with no parts is the reference: kvlab's own engine.
"""

import functools
from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError, LearnerPartError

__all__ = ["PARTS", "CapstoneRun", "check_engine", "describe", "engine_with"]

#: The parts a learner can plug in (``kvlab.engine.parts.EngineParts``' fields), each the name of its puzzle
#: (``kvlab.puzzles.puzzle(name)``); named here so that importing the course loads no torch.
PARTS: tuple[str, ...] = ("slot_mapping", "block_hashes", "lru_policy", "decode_attention", "prefill_attention",
                          "ngram_proposer", "rejection_sampling", "split_k_merge", "can_allocate")

#: The engine's settings unless given: small blocks so the prompts fill several, and n-gram speculation, so
#: the proposer and the verification run.
DEFAULT_OPTIONS = dict(block_size=16, num_blocks=96, speculative_config={
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})

#: check_engine's pool when ``can_allocate`` is yours (the engine then keeps half its blocks free at admission,
#: ``kvlab.engine.parts.ADMISSION_WATERMARK``): 8 blocks, 4 kept free. The first question's 4 blocks leave
#: exactly those 4 (OK, at the boundary), so the second waits while the first runs (LATER) and is admitted once
#: it finished (OK, its system-prompt block a free cached hit taken back).
ADMISSION_OPTIONS = dict(num_blocks=8)

#: check_engine's prompts: SmolLM2's chat template puts the same system prompt before each (a shared prefix of
#: full blocks), and the first answer quotes its question (so drafts are proposed and accepted).
QUESTIONS = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "Name a primary colour.")


def engine_with(parts: dict | None = None, model=None, *, check: bool = True, verbose: bool = True,
                **llm_options):
    """An ``LLM`` serving ``model`` (None: SmolLM2-135M-Instruct, ``kvlab.models.smollm2()``) with ``parts``, a
    dict from part names (``PARTS``) to your solutions (the function, or for ``lru_policy`` the class, each
    puzzle asks for); None or ``{}``: kvlab's own parts throughout. ``check``: grade each part by its puzzle
    first (a part that fails raises ``LearnerPartError`` naming it and its failing case). Prints which parts
    are yours and which kvlab's (``verbose=False``: not). ``llm_options``: ``LLM``'s keyword arguments, over
    ``DEFAULT_OPTIONS``."""
    given = _checked_parts(parts)
    if check:
        _grade(given)
    from kvlab.engine import LLM  # torch and the model code load here, after the fast checks
    from kvlab.engine.parts import EngineParts
    from kvlab.models import smollm2

    llm = LLM(smollm2() if model is None else model, parts=EngineParts(**given), **{**DEFAULT_OPTIONS, **llm_options})
    if verbose:
        print(describe(given))
    return llm


def describe(parts: dict) -> str:
    """Which parts are the learner's and which kvlab's, in one line (and, with their ``can_allocate``, that the
    engine keeps a watermark, which kvlab's own engine does not)."""
    yours = [name for name in PARTS if name in parts]
    kvlabs = [name for name in PARTS if name not in parts]
    watermark = ("; with your can_allocate the pool keeps a watermark of free blocks at admission "
                 "(kvlab.engine.parts.ADMISSION_WATERMARK)" if "can_allocate" in parts else "")
    return (f"engine_with: your parts: {', '.join(yours) or 'none'}; kvlab's own parts (not given): "
            f"{', '.join(kvlabs) or 'none'}{watermark}")


@dataclass
class CapstoneRun:
    """What ``check_engine`` served: the prompts' token ids, the engine's greedy tokens and Hugging Face's, and
    the prompt tokens each request found in the prefix cache and the drafts it accepted; ``abort_reasons``: why
    a request was aborted (a part that raised or broke its contract in the engine says so there), None for one
    that was not."""
    prompt_token_ids: list[list[int]]
    tokens: list[list[int]]
    expected: list[list[int]]
    cached_prompt_tokens: list[int]
    accepted_drafts: list[int]
    abort_reasons: list[str | None]

    @property
    def matches(self) -> bool:
        return self.tokens == self.expected


def check_engine(parts: dict | None = None, *, questions=QUESTIONS, max_tokens: int = 20, model=None,
                 check: bool = True, verbose: bool = True, **llm_options) -> CapstoneRun:
    """Serve ``questions`` (as chat prompts, greedy, ``max_tokens`` each) on ``engine_with(parts)`` and compare
    the tokens with Hugging Face transformers' greedy ``generate`` on the same prompt tokens. Returns the run
    when they are equal; else raises ``LearnerPartError`` naming the part whose engine goes wrong, found by
    serving again with one of your parts at a time (``check``, ``model``, ``verbose``, ``llm_options``: as
    ``engine_with``)."""
    given = _checked_parts(parts)
    if verbose:
        print(describe(given))
    run = _serve(given, questions, max_tokens, model, check, llm_options)
    run.expected = [list(tokens) for tokens in _hf_greedy(tuple(map(tuple, run.prompt_token_ids)), max_tokens, model)]
    if run.matches:
        return run
    culprits = list(given) if len(given) == 1 else [
        name for name in given
        if _serve({name: given[name]}, questions, max_tokens, model, False, llm_options).tokens != run.expected]
    i = next(i for i, (got, want) in enumerate(zip(run.tokens, run.expected)) if got != want)
    first = next((j for j, (g, w) in enumerate(zip(run.tokens[i], run.expected[i])) if g != w),
                 min(len(run.tokens[i]), len(run.expected[i])))
    where = (f"on question {i} the engine's greedy tokens differ from Hugging Face's from token {first} on: "
             f"expected {run.expected[i]}, got {run.tokens[i]}"
             + (f" (aborted: {run.abort_reasons[i]})" if run.abort_reasons[i] else ""))
    if culprits:
        named = " and ".join(culprits)
        raise LearnerPartError(f"{named} {'is' if len(culprits) == 1 else 'are'} wrong: {where}. With only "
                               f"{'that part' if len(culprits) == 1 else 'each of them'} yours (kvlab's for the "
                               "others) the tokens differ too; its puzzle's spec says what it must do")
    raise LearnerPartError(f"{', '.join(given)}: {where}. Each of your parts alone (kvlab's for the others) gives "
                           "the right tokens, but not all of them together")


def _checked_parts(parts) -> dict:
    if parts is None:
        return {}
    if not isinstance(parts, dict):
        raise InvalidArgumentError(f"parts must be a dict from part names to your solutions, e.g. "
                                   f"{{'slot_mapping': slot_mapping}}, got {type(parts).__name__}")
    unknown = [name for name in parts if name not in PARTS]
    if unknown:
        raise InvalidArgumentError(f"unknown part {unknown[0]!r}; the parts are: {', '.join(PARTS)}")
    for name, part in parts.items():
        if not callable(part):
            raise InvalidArgumentError(f"the part {name!r} must be your solution (a function, or for lru_policy "
                                       f"the class), got {type(part).__name__}")
    return dict(parts)


def _grade(parts: dict) -> None:
    """Each part's puzzle check; the first that fails raises, naming the part and its failing case."""
    from kvlab.puzzles import puzzle

    for name, part in parts.items():
        report = puzzle(name).module.check(part)
        if not report.passed:
            raise LearnerPartError(f"{name} fails its puzzle's check, so the engine does not run it: {report.problem}")


def _serve(parts, questions, max_tokens, model, check, llm_options) -> CapstoneRun:
    from kvlab.engine import SamplingParams

    options = {**ADMISSION_OPTIONS, **llm_options} if "can_allocate" in parts else llm_options
    llm = engine_with(parts, model, check=check, verbose=False, **options)
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions],
                       SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return CapstoneRun([o.prompt_token_ids for o in outputs], [o.outputs[0].token_ids for o in outputs], [],
                       [o.metrics.num_cached_prompt_tokens for o in outputs],
                       [o.metrics.num_accepted_tokens for o in outputs],
                       [o.outputs[0].abort_reason for o in outputs])


@functools.lru_cache(maxsize=8)  # the reference for the same prompts: loaded and run once per process
def _hf_greedy(prompts: tuple[tuple[int, ...], ...], max_tokens: int, model) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvlab.models import smollm2

    hf = AutoModelForCausalLM.from_pretrained(smollm2() if model is None else model).float().eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
