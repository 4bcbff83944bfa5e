"""The capstone: serve SmolLM2-135M on a paged engine built from the parts you wrote in the puzzles (notebook 16).

``engine_with(parts)`` takes your solutions by puzzle name and returns a ``kvlab.engine.LLM`` in which each one
replaces kvlab's own at a real seam (``kvlab.engine.parts``: the slots new K/V are written to, prefix caching's
hashes, the free blocks' reuse order, torch attention over the block tables and the merge of a split-K decode,
speculative decoding's drafts and their verification, the scheduler's admission of a waiting prompt and its
preemption by recompute and its token budget's chunks, and Triton
kernels: the K/V write, decode attention, a split-K decode's partitions, block copies). A part you did not give is
kvlab's, and the call says which are yours and which are kvlab's. Each part you give is first graded by its
puzzle's ``check``: one that fails is named, with the failing case, before any model loads::

    from kvlab.course import engine_with, check_engine
    llm = engine_with({"slot_mapping": slot_mapping, "lru_policy": MyLRU})
    llm.chat([{"role": "user", "content": "Name a primary colour."}])

``check_engine(parts)`` is the capstone's test: it serves a few chat prompts that share their system prompt
(so prefix caching hits) with speculative decoding on, and compares the greedy tokens with Hugging Face
transformers' ``generate``, which must match exactly (with your ``can_allocate``, in a pool small enough that the
second prompt waits: ``ADMISSION_OPTIONS``). On a mismatch it serves them again with one of your parts at a time
(kvlab's for the others) and names the part whose engine goes wrong. A part the engine catches breaking its
contract, such as an admission other than kvlab's on the same numbers, is named at once. Your ``preemption`` and
``v1_step`` are served apart, with kvlab's other parts, under options that make their seams fire
(``SCHEDULER_PART_OPTIONS``: a pool that makes the V1 scheduler preempt; a budget that chunks the prompts).
``check_engine()`` with no parts is the reference: kvlab's own engine.

Triton kernels (``TRITON_PARTS``) run in Triton's interpreter on a CPU (compiled on a GPU), where SmolLM2 would take
minutes a token. So ``check_engine`` serves SmolLM2 with your other parts, and, given any kernel, serves
``KERNEL_PROMPTS`` (token ids sharing two blocks, two greedy samples each) again with all your parts on a tiny
random-weight model (``kvlab.engine.random_model``, "tiny": 2 layers, 4 query heads over 2 KV heads) compared with
Hugging Face there too. A decode step runs one decode path, so given both ``triton_decode_attention`` and a split-K
part, the tiny model serves twice: once without the split-K parts, once without that kernel.

A copy-on-write plan that leaves a shared block uncopied changes no greedy token (both samples write the same
K/V). So given ``copy_on_write``, the tiny model also serves ``KERNEL_PROMPTS`` with two samples each at
temperature 1, seeded (``FORK_SEED``): they differ from their first token on, so a missing copy makes one
sample read the other's K/V; their tokens must equal kvlab's own engine's on the same seed.

``window_release`` needs a model with a sliding window: given it, a tiny random-weight model whose every layer
sees the last ``WINDOW`` tokens serves ``KERNEL_PROMPTS`` with your parts but the attention ones (their contracts
have no window) and ``tier_promotion`` (an offload tier holds full-attention blocks), against Hugging Face,
which applies the window itself: a block released while a query still sees it reads as stale K/V. Releasing too
late costs memory, not tokens: the puzzle's check names it.

``kv_cost_router`` routes a fleet: given it, two replicas (kvlab's own engines on the tiny model, publishing KV
events) serve ``FLEET_WAVES`` one wave after the other: the router places each request of a wave (first
prompts, then follow-ups sharing their two leading blocks, then a new prompt) while the wave's earlier ones still
queue, seeing each replica only as a ``ReplicaView`` (the hashes its events say it caches, its queue). Each
choice must be kvlab's ``kv_cost`` router's on the same views (a wrong cost or tie-break is named with the views),
and every request's tokens Hugging Face's.

Given ``tier_promotion``, the engine has an LRU offload tier, and after each admission the tier keeps the order
your answer gives (which decides what later offloads drop). The questions are then served one at a time in a
small pool (``TIER_OPTIONS``), a filler prompt between them evicting the first's blocks to the tier, so the
second question's system-prompt block is promoted back from it. What the tier promotes and holds is decided
before your answer's inputs exist (the blocks the admission overwrites), so your answer must name the same, and
its order must be kvlab's on the same numbers (a wrong order changes no token): else the engine raises at once.
"""

import functools
from dataclasses import dataclass, field

from kvlab.errors import InvalidArgumentError, LearnerPartError

__all__ = ["PARTS", "CapstoneRun", "check_engine", "describe", "engine_with"]

#: The parts a learner can plug in (``kvlab.engine.parts.EngineParts``' fields), each the name of its puzzle
#: (``kvlab.puzzles.puzzle(name)``); named here so that importing the course loads no torch.
PARTS: tuple[str, ...] = ("slot_mapping", "block_hashes", "lru_policy", "copy_on_write", "window_release",
                          "decode_attention", "prefill_attention", "ngram_proposer", "rejection_sampling",
                          "split_k_merge", "triton_reshape_and_cache", "triton_decode_attention",
                          "triton_split_k_decode", "triton_copy_blocks", "can_allocate", "tier_promotion",
                          "preemption", "v1_step", "kv_cost_router")
#: The parts of a fleet rather than of one engine: the router that picks each request's replica.
FLEET_PARTS = ("kv_cost_router",)
#: The parts that are Triton kernels: checked on the tiny model (see the module docstring).
TRITON_PARTS = tuple(name for name in PARTS if name.startswith("triton_"))
#: The attention parts: their contracts have no sliding window, so the windowed run leaves them out.
ATTENTION_PARTS = ("decode_attention", "prefill_attention", "split_k_merge", "triton_reshape_and_cache",
                   "triton_decode_attention", "triton_split_k_decode")
#: The windowed model's window (tokens): the prompts and outputs run well past it.
WINDOW = 16

#: The engine's settings unless given: small blocks so the prompts fill several, and n-gram speculation, so
#: the proposer and the verification run.
DEFAULT_OPTIONS = dict(block_size=16, num_blocks=96, speculative_config={
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})

#: check_engine's pool when ``can_allocate`` is yours (the engine then keeps half its blocks free at admission,
#: ``kvlab.engine.parts.ADMISSION_WATERMARK``): 8 blocks, 4 kept free. The first question's 4 blocks leave
#: exactly those 4 (OK, at the boundary), so the second waits while the first runs (LATER) and is admitted once
#: it finished (OK, its system-prompt block a free cached hit taken back).
ADMISSION_OPTIONS = dict(num_blocks=8)

#: check_engine's engine when ``tier_promotion`` is yours: an LRU offload tier of 8 slots behind a pool of 8 blocks.
#: The questions are then served one at a time, each followed by a filler prompt (``_filler``) taking every block
#: a prompt may hold, so the pool evicts the question's cached blocks to the tier, and the second question's
#: system-prompt block is a tier hit, promoted back (the learner's answer then orders the tier).
TIER_OPTIONS = dict(num_blocks=8, num_offload_blocks=8)

#: check_engine's run of your ``preemption`` (served apart from your other parts, with kvlab's): the V1
#: scheduler asks it only in steps of plain decodes of blocks each request holds alone, so speculation and
#: prefix caching are off. In blocks of 8 the questions' 49 and 35 prompt tokens take 7 and 5 of the 13: the
#: second's 6th token takes the last free one, and the first's 8th needs one: the second is preempted (it
#: frees its 6), recomputed once the first finished (its answer is 11 tokens).
PREEMPTION_OPTIONS = dict(block_size=8, num_blocks=13, enable_prefix_caching=False, speculative_config=None)

#: check_engine's run of your ``v1_step`` (apart, as ``preemption``): a budget of 24 tokens a step, so the
#: questions' 49 and 35 prompt tokens are prefilled in chunks beside decodes (two seats: a budget is at least
#: the seats, a decode each); speculation off (drafts are not
#: in the spec), prefix caching off (a waiting prompt's hit is not either).
V1_STEP_OPTIONS = dict(max_num_batched_tokens=24, max_num_seqs=2, enable_prefix_caching=False, speculative_config=None)

#: The parts served apart from the others, each with kvlab's other parts and the options that make it run.
SCHEDULER_PART_OPTIONS = {"preemption": PREEMPTION_OPTIONS, "v1_step": V1_STEP_OPTIONS}

#: check_engine's prompts: SmolLM2's chat template puts the same system prompt before each (a shared prefix of
#: full blocks), and the first answer quotes its question (so drafts are proposed and accepted).
QUESTIONS = ("Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "Name a primary colour.")

#: The fleet's requests on the tiny model, in waves (see the module docstring): two first prompts of 40 tokens (2
#: full blocks and 8 tokens); four follow-ups, two per first prompt, sharing its first 32 tokens; a new prompt,
#: which finds both replicas idle and caching none of it (a tie: the replica after the last one chosen takes it).
_FIRST = (tuple(range(101, 141)), tuple(range(201, 241)))
FLEET_WAVES = (_FIRST, tuple(first[:32] + tail for first in _FIRST for tail in (tuple(range(7, 12)),
                                                                                tuple(range(300, 309)))),
               (tuple(range(401, 441)),))

#: The seed of the forks' samples (see the module docstring).
FORK_SEED = 1

#: The kernels' prompts on the tiny model: 36 shared tokens (two 16-token blocks hit), then 5 and 9 of their own.
KERNEL_PROMPTS = tuple(tuple(range(101, 137)) + tail for tail in (tuple(range(7, 12)), tuple(range(300, 309))))


def engine_with(parts: dict | None = None, model=None, *, check: bool = True, verbose: bool = True,
                **llm_options):
    """An ``LLM`` serving ``model`` (None: SmolLM2-135M-Instruct, ``kvlab.models.smollm2()``) with ``parts``, a
    dict from part names (``PARTS``) to your solutions (the function, or for ``lru_policy`` the class, each
    puzzle asks for); None or ``{}``: kvlab's own parts throughout. ``check``: grade each part by its puzzle
    first (a part that fails raises ``LearnerPartError`` naming it and its failing case). With your
    ``tier_promotion`` the engine has an LRU offload tier (of ``TIER_OPTIONS``' slots unless given). Prints which parts
    are yours and which kvlab's (``verbose=False``: not). ``llm_options``: ``LLM``'s keyword arguments, over
    ``DEFAULT_OPTIONS``."""
    given = _checked_parts(parts)
    if check:
        _grade(given)
    from kvlab.engine import LLM  # torch and the model code load here, after the fast checks
    from kvlab.engine.parts import EngineParts
    from kvlab.models import smollm2

    tier = {"num_offload_blocks": TIER_OPTIONS["num_offload_blocks"]} if "tier_promotion" in given else {}
    engine_parts = EngineParts(**{name: part for name, part in given.items() if name not in FLEET_PARTS})
    llm = LLM(smollm2() if model is None else model, parts=engine_parts, **{**DEFAULT_OPTIONS, **tier, **llm_options})
    if verbose:
        print(describe(given))
    return llm


def describe(parts: dict) -> str:
    """Which parts are the learner's and which kvlab's, in one line (and, with their ``can_allocate``, that the
    engine keeps a watermark, which kvlab's own engine does not; with their ``tier_promotion``, that it has an
    offload tier)."""
    yours = [name for name in PARTS if name in parts]
    kvlabs = [name for name in PARTS if name not in parts]
    notes = ("; with your can_allocate the pool keeps a watermark of free blocks at admission "
             "(kvlab.engine.parts.ADMISSION_WATERMARK)" if "can_allocate" in parts else "")
    if "tier_promotion" in parts:
        notes += "; with your tier_promotion the engine has an LRU offload tier, kept in your answer's order"
    return (f"engine_with: your parts: {', '.join(yours) or 'none'}; kvlab's own parts (not given): "
            f"{', '.join(kvlabs) or 'none'}{notes}")


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
    kernels: list = field(default_factory=list)  # the Triton parts' runs on the tiny model (module docstring)
    forks: "CapstoneRun | None" = None  # the seeded samples' run, where copy_on_write was given
    windowed: "CapstoneRun | None" = None  # the sliding-window model's run, where window_release was given
    fleet: "CapstoneRun | None" = None  # the routed fleet's run, where kv_cost_router was given
    preemption: "CapstoneRun | None" = None  # the run of a learner's preemption (PREEMPTION_OPTIONS)
    v1_step: "CapstoneRun | None" = None  # the run of a learner's v1_step (V1_STEP_OPTIONS)

    @property
    def matches(self) -> bool:
        return self.tokens == self.expected


def check_engine(parts: dict | None = None, *, questions=QUESTIONS, max_tokens: int = 20, model=None,
                 check: bool = True, verbose: bool = True, **llm_options) -> CapstoneRun:
    """Serve ``questions`` (as chat prompts, greedy, ``max_tokens`` each) on ``engine_with(parts)`` and compare
    the tokens with Hugging Face transformers' greedy ``generate`` on the same prompt tokens. Returns the run
    when they are equal; else raises ``LearnerPartError`` naming the part whose engine goes wrong, found by
    serving again with one of your parts at a time (``check``, ``model``, ``verbose``, ``llm_options``: as
    ``engine_with``). Your Triton kernels are left out of this run and checked with all your parts on the tiny
    model (see the module docstring): those runs are the returned run's ``kernels``; a ``copy_on_write`` is
    checked by seeded samples there too (``forks``), a ``window_release`` on a sliding-window model
    (``windowed``), a ``kv_cost_router`` routing a fleet (``fleet``); a ``preemption`` and a ``v1_step`` are
    served apart, each with kvlab's other parts and the options that make it run (``SCHEDULER_PART_OPTIONS``;
    the run's ``preemption`` and ``v1_step``)."""
    given = _checked_parts(parts)
    if verbose:
        print(describe(given))
    if check:
        _grade(given)  # every part, kernels included, before any model loads
    router = given.pop("kv_cost_router", None)
    apart = {name: given.pop(name) for name in SCHEDULER_PART_OPTIONS if name in given}  # served apart, below
    # The windowed run: no attention part (their contracts have no window), no offload tier (full attention's).
    windowed = {name: part for name, part in given.items() if name not in ATTENTION_PARTS + ("tier_promotion",)}
    given = {name: part for name, part in given.items() if name != "window_release"}
    run = _compared({name: part for name, part in given.items() if name not in TRITON_PARTS}, questions,
                    max_tokens, model, llm_options)
    for name, part in apart.items():
        setattr(run, name, _compared({name: part}, questions, max_tokens, model,
                                     {**SCHEDULER_PART_OPTIONS[name], **llm_options}))
    if any(name in TRITON_PARTS for name in given):
        split_k = {"split_k_merge", "triton_split_k_decode"}
        decode_paths = ([{n: p for n, p in given.items() if n not in split_k},
                         {n: p for n, p in given.items() if n != "triton_decode_attention"}]
                        if "triton_decode_attention" in given and split_k & given.keys() else [given])
        run.kernels = [_compared(parts, KERNEL_PROMPTS, max_tokens, _tiny_model(), llm_options)
                       for parts in decode_paths]
    if "copy_on_write" in given:
        run.forks = _compared(given, KERNEL_PROMPTS, max_tokens, _tiny_model(), llm_options, seed=FORK_SEED)
    if "window_release" in windowed:
        run.windowed = _compared(windowed, KERNEL_PROMPTS, max_tokens, _tiny_model(window=WINDOW), llm_options)
    if router is not None:
        run.fleet = _routed(router, max_tokens, llm_options)
    return run


def _compared(given: dict, prompts, max_tokens: int, model, llm_options, seed=None) -> CapstoneRun:
    """The run of ``given`` on ``prompts`` if its tokens are the reference's (greedy: Hugging Face's; with a
    ``seed``, samples at temperature 1: kvlab's own engine's), else LearnerPartError naming the part whose
    engine goes wrong."""
    run = _serve(given, prompts, max_tokens, model, llm_options, seed)
    if seed is None:
        reference = "Hugging Face's"
        run.expected = [list(tokens) for tokens in _hf_greedy(tuple(map(tuple, run.prompt_token_ids)), max_tokens,
                                                              model)]
    else:
        reference = f"kvlab's own engine's (seed {seed})"
        run.expected = _serve({}, prompts, max_tokens, model, llm_options, seed).tokens
    if run.matches:
        return run
    culprits = list(given) if len(given) == 1 else [
        name for name in given
        if _serve({name: given[name]}, prompts, max_tokens, model, llm_options, seed).tokens != run.expected]
    i = next(i for i, (got, want) in enumerate(zip(run.tokens, run.expected)) if got != want)
    first = next((j for j, (g, w) in enumerate(zip(run.tokens[i], run.expected[i])) if g != w),
                 min(len(run.tokens[i]), len(run.expected[i])))
    what = "question" if isinstance(prompts[0], str) else "sample"
    where = (f"on {what} {i} the engine's {'greedy ' if seed is None else ''}tokens differ from {reference} "
             f"from token {first} on: "
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


def _serve(parts, prompts, max_tokens, model, llm_options, seed=None) -> CapstoneRun:
    """``prompts``: questions (strings, served as chats, one sample each) or token-id prompts (two greedy samples
    each: forked from the prompt, they share its last block until each writes its first token, which copies
    it, copy-on-write: the copies ``triton_copy_blocks`` makes); greedy, or with a ``seed`` at temperature 1.
    The run has one row per sample. Every cache slot starts as NaN, as in the puzzles' checks: a part that
    reads a slot no step wrote changes the tokens (left as they are, the slots may hold what an earlier engine
    in this process wrote there, right by luck)."""
    from kvlab.engine import SamplingParams

    chats = isinstance(prompts[0], str)
    params = SamplingParams(temperature=0.0 if seed is None else 1.0, seed=seed, max_tokens=max_tokens,
                            n=1 if chats else 2)
    # With the learner's admission, the chats run in a pool small enough that the second one waits.
    options = {**ADMISSION_OPTIONS, **llm_options} if "can_allocate" in parts and chats else llm_options
    tiered = "tier_promotion" in parts and chats  # one question at a time, the pool evicting to the tier between
    if tiered:
        options = {**TIER_OPTIONS, **options}
    llm = engine_with(parts, model, check=False, verbose=False, **options)
    for cache in llm.kv_cache.gpu:
        cache.fill_(float("nan"))
    if tiered:
        outputs = []
        for i, question in enumerate(prompts):
            if i:
                llm.generate([_filler(llm)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
            outputs += llm.chat([[{"role": "user", "content": question}]], params, use_tqdm=False)
    elif chats:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in prompts], params, use_tqdm=False)
    else:
        outputs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    samples = [(o, sample) for o in outputs for sample in o.outputs]
    return CapstoneRun([o.prompt_token_ids for o, _ in samples], [sample.token_ids for _, sample in samples], [],
                       [o.metrics.num_cached_prompt_tokens for o, _ in samples],
                       [o.metrics.num_accepted_tokens for o, _ in samples],
                       [sample.abort_reason for _, sample in samples])


def _filler(llm) -> list[int]:
    """A prompt sharing no block with the questions that needs every block one prompt may hold (its one output
    token fits in its last block): admitted, it evicts the pool's cached blocks to the offload tier."""
    bs = llm.block_manager.block_size
    return [llm.tokenizer.eos_token_id] + [1000 + i for i in range((llm.block_manager.usable_blocks - 1) * bs)]


class _EngineReplica:
    """A replica as a router sees it (``kvlab.studies.routers.ReplicaView``): the hashes its KV events say it
    caches, its requests not finished and the prompt tokens waiting to be admitted."""

    def __init__(self, llm):
        from kvlab.blocks.events import CachedHashes

        self._scheduler, self.cached = llm.scheduler, CachedHashes()
        llm.kv_events.subscribe(self.cached)

    def in_flight(self) -> int:
        return len(self._scheduler.waiting) + len(self._scheduler.running)

    @property
    def waiting_tokens(self) -> int:
        return sum(seq.num_prompt_tokens for seq in self._scheduler.waiting)


def _routed(router_class, max_tokens: int, llm_options) -> CapstoneRun:
    """``FLEET_WAVES`` routed over two replicas by the learner's router (see the module docstring);
    LearnerPartError at the first choice other than kvlab's ``kv_cost`` (tokens other than HF's show in the run)."""
    from array import array

    from kvlab.blocks.prefix_cache import block_hashes
    from kvlab.engine import SamplingParams
    from kvlab.studies.routers import ROUTERS, RouterSettings

    model, bs = _tiny_model(), DEFAULT_OPTIONS["block_size"]
    replicas = [engine_with({}, model, check=False, verbose=False, kv_events=True, **llm_options) for _ in range(2)]
    views = [_EngineReplica(llm) for llm in replicas]
    theirs, ours = router_class(RouterSettings(), bs), ROUTERS["kv_cost"](RouterSettings(), bs)
    params, placed, outputs = SamplingParams(temperature=0.0, max_tokens=max_tokens), [], {}
    for wave in FLEET_WAVES:
        for prompt in wave:
            hashes = block_hashes(array("q", prompt), bs, 0, len(prompt) // bs, None)[0]
            seen = [f"replica {i}: {view.cached.prefix_match(hashes, len(hashes))} blocks cached, "
                    f"{view.waiting_tokens} tokens waiting, {view.in_flight()} in flight"
                    for i, view in enumerate(views)]
            got = _call_router(theirs, views, len(prompt), hashes)
            expected = ours.choose(views, len(prompt), hashes)
            if got != expected:
                raise LearnerPartError(f"kv_cost_router chose {got!r} for a request of {len(prompt)} tokens "
                                       f"({len(hashes)} full blocks), expected replica {expected}; it saw "
                                       f"{'; '.join(seen)} (request {len(placed)} of the fleet)")
            placed.append((expected, replicas[expected].add_request(list(prompt), params)))
        for llm in replicas:  # the wave is served; the next one is routed on what it left cached
            while llm.has_unfinished_requests():
                outputs.update(((id(llm), output.request_id), output) for output in llm.step())
    ordered = [outputs[id(replicas[i]), request_id] for i, request_id in placed]
    prompts = tuple(prompt for wave in FLEET_WAVES for prompt in wave)
    return CapstoneRun([o.prompt_token_ids for o in ordered], [o.outputs[0].token_ids for o in ordered],
                       [list(t) for t in _hf_greedy(prompts, max_tokens, model)],
                       [o.metrics.num_cached_prompt_tokens for o in ordered],
                       [o.metrics.num_accepted_tokens for o in ordered], [o.outputs[0].abort_reason for o in ordered])


def _call_router(router, views, num_tokens: int, hashes) -> int:
    try:
        return router.choose(views, num_tokens, hashes)
    except Exception as error:
        raise LearnerPartError(f"kv_cost_router: choose raised {error!r}") from error


@functools.lru_cache(maxsize=2)
def _tiny_model(window: int | None = None) -> str:
    """The kernels' model: a tiny random-weight Qwen3 (seeded; no end-of-text token; with a ``window``, every
    layer sliding-window attention), written once per process to a temporary folder."""
    import tempfile

    from kvlab.engine.random_model import save_random_model

    windowed = {} if window is None else dict(use_sliding_window=True, sliding_window=window, max_window_layers=0,
                                              layer_types=["sliding_attention"] * 2)
    return str(save_random_model(tempfile.mkdtemp(prefix="kvlab-capstone-"), "tiny", seed=0, **windowed))


@functools.lru_cache(maxsize=8)  # the reference for the same prompts: loaded and run once per process
def _hf_greedy(prompts: tuple[tuple[int, ...], ...], max_tokens: int, model) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from kvlab.models import smollm2

    hf = AutoModelForCausalLM.from_pretrained(smollm2() if model is None else model).float().eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
