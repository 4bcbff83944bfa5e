"""``kvlab validate``: published figures beside kvlab's, replayed here, one row per figure.

Each check replays what it needs (a bundled trace, a few prompts through a ``BlockManager`` configured as the
source's system was) and returns ``Row`` values: the figure, where it was published, the published value,
kvlab's value measured in this run, the gap, the tolerance and, where they differ, why. A row whose gap leaves
its tolerance fails the command (exit status 1). A row without a tolerance is reported, not checked (its
source measured something kvlab cannot replay the same way, said in its note); a row without a published
value is a figure kvlab reports that nobody published; a row without a measured value says why it cannot be
reproduced offline. Fast rows take a second or so each on two CPU cores; ``--full`` adds the slow ones.

The sources were read, not remembered: the quotes in each row's note are from the page, paper or thread named.
Imports no torch: every check is a trace study or a block-manager replay.
"""

import argparse
import json
import math
import sys
import textwrap
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd

from kvlab.blocks.manager import BlockManager
from kvlab.blocks.sequence import Sequence
from kvlab.errors import InvalidArgumentError

PERCENT, TOKENS = "%", "tokens"


@dataclass(frozen=True)
class Row:
    """One published figure beside kvlab's. ``published`` and ``measured`` are numbers in ``unit``, or tuples of
    them for a law checked at several points (the gap is then the largest gap of any point); None where there
    is none (see the module docstring). ``tolerance``: the largest gap allowed, in ``unit``; None: not checked."""
    check: str
    figure: str
    source: str
    published: object
    measured: object
    unit: str
    tolerance: float | None
    note: str
    slow: bool = False

    @property
    def gap(self) -> float | None:
        """measured - published (the largest in size over a law's points), None where either is missing."""
        if self.published is None or self.measured is None:
            return None
        gaps = np.subtract(self.measured, self.published, dtype=float).ravel()
        return float(gaps[np.argmax(np.abs(gaps))])

    @property
    def status(self) -> str:
        if self.measured is None:
            return "not reproduced"
        if self.published is None:
            return "kvlab only"
        if self.tolerance is None:
            return "reported"
        return "ok" if abs(self.gap) <= self.tolerance + 1e-9 else "OUT"


# ---- Mooncake conversation and synthetic traces ---------------------------------------------------------

def _prefix_hash_id_share(trace: pd.DataFrame) -> float:
    """Hash ids a never-evicting cache already holds as a prefix of their request, over all hash ids, the partial
    last block's id included (Mooncake's ids are 512-token blocks, so this is a share of blocks)."""
    seen: set = set()
    hits = total = 0
    for ids in trace["hash_ids"]:
        ids = ids.tolist()
        hits += next((k for k, h in enumerate(ids) if h not in seen), len(ids))
        total += len(ids)
        seen.update(ids)
    return hits / total


def _per_request_mean(trace: pd.DataFrame) -> float:
    """aiperf's ``PrefixAnalyzer`` "theoretical cache hit rate": the mean over requests of the same prefix share."""
    seen: set = set()
    rates = []
    for ids in trace["hash_ids"]:
        ids = ids.tolist()
        rates.append(next((k for k, h in enumerate(ids) if h not in seen), len(ids)) / len(ids))
        seen.update(ids)
    return float(np.mean(rates))


def _mean_cached_share(trace: pd.DataFrame, block_size: int) -> float:
    """The mean over requests of the share of the prompt's tokens a never-evicting cache hits (full blocks, the
    last token computed): the ceiling averaged per request instead of per token."""
    from kvlab.studies.reuse import block_keys

    keys, request = block_keys(trace, block_size)
    lengths = trace["input_length"].to_numpy(np.int64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    seen_before = request[first][inverse] < request  # keys name whole prefixes: the blocks before were seen too
    num_full = lengths // block_size
    position = np.arange(len(keys)) - (np.cumsum(num_full) - num_full)[request]
    hits = seen_before & (position < (lengths[request] - 1) // block_size)
    return float((np.bincount(request[hits], minlength=len(lengths)) * block_size / lengths).mean())


def check_mooncake() -> list[Row]:
    from kvlab.studies.reuse import reuse_profile
    from kvlab.studies.traces import load_trace

    conversation, synthetic = load_trace("mooncake_conversation"), load_trace("mooncake_synthetic")
    ceiling = {name: reuse_profile(trace, 512) for name, trace in
               (("conversation", conversation), ("synthetic", synthetic))}
    conv = ceiling["conversation"]
    dynamo = _prefix_hash_id_share(conversation)
    rows = [Row(
        "dynamo_cache_efficiency", "Mooncake conversation trace: \"cache efficiency\"",
        "NVIDIA Dynamo docs, Qwen3-32B KV Routing A/B benchmark and Qwen3-32B recipe (docs.nvidia.com/dynamo, "
        "benchmarks/qwen3-32b-kv-routing): \"12,031 requests over ~59 min, 12,035 avg ISL, 343 avg OSL, 36.64% "
        "cache efficiency\"",
        36.64, round(100 * dynamo, 2), PERCENT, 0.01,
        "Dynamo does not define the term; kvlab matches it to the hundredth as the share of all hash ids (512-token "
        "blocks, each prompt's partial last block included) that a cache which never evicts already holds as a "
        "prefix of the request. kvlab's own infinite-cache ceiling is lower, "
        f"{100 * conv['ceiling_hit_rate_tokens']:.2f}% of prompt tokens ({100 * conv['ceiling_hit_rate_blocks']:.2f}% "
        "of full blocks), because a partial block is never cached and a prompt's last token is always computed "
        "(vLLM's rule); aiperf's per-request mean of the same share (its PrefixAnalyzer) gives "
        f"{100 * _per_request_mean(conversation):.2f}%.")]
    means = {name: 100 * _mean_cached_share(trace, 512) for name, trace in
             (("conversation", conversation), ("synthetic", synthetic))}
    quotes = {"conversation": "\"an average of approximately 40% prefix caching ratio brought about by multi-turn "
                              "conversations\"",
              "synthetic": "\"Despite having the highest proportion of prefix caching, its cache hits are quite "
                           "dispersed\""}
    for name, published in (("conversation", 40), ("synthetic", 66)):
        profile = ceiling[name]
        rows.append(Row(
            f"mooncake_{name}_cache_ratio", f"Mooncake {name} trace: cache ratio (infinite cache, full 512-token "
                                            "blocks)",
            f"Qin et al., Mooncake, USENIX FAST'25, Table 2 (\"Cache Ratio 40% 59% 66%\" for Conversation, "
            f"Tool&Agent, Synthetic) and section 5.2.1: {quotes[name]}; the traces are the paper's release "
            "(FAST25-release/traces, 12,031 and 3,993 requests as in Table 2)",
            published, round(100 * profile["ceiling_hit_rate_blocks"], 2), PERCENT, 2.5,
            "The paper rounds to whole percents and does not define the ratio. kvlab's figure is the share of full "
            "512-token blocks a never-evicting cache hits (the last token computed); by tokens it is "
            f"{100 * profile['ceiling_hit_rate_tokens']:.1f}%. No one definition gives both published values: the "
            f"per-request mean of the cached share is {means['conversation']:.1f}% (conversation) but "
            f"{means['synthetic']:.1f}% (synthetic). The Tool&Agent trace (59%) is not bundled."))
    return rows


# ---- PagedAttention (Kwon et al., SOSP'23) --------------------------------------------------------------

PAGED_SOURCE = ("Kwon et al., Efficient Memory Management for LLM Serving with PagedAttention, SOSP'23, Figure 2 "
                "(average share of KV-cache memory holding token states); kvlab.studies.memory_waste, notebook 07")


def check_memory_waste() -> list[Row]:
    from kvlab.studies.memory_waste import PAPER_TOKEN_STATES, memory_waste

    table = memory_waste("azure_conv", block_sizes=(16,)).set_index("scheme")
    workload = ("kvlab's workload is the Azure conversation trace (2023) as a backlog in a 48,000-slot budget, max "
                "length 8,192; the paper's was its section 6.2 experiment (requests synthesized from ShareGPT and "
                "Alpaca lengths, Orca's maximum 2,048)")
    rows = [Row("paged_attention_token_states", "token-state share of KV memory, paged (vLLM, 16-token blocks)",
                PAGED_SOURCE, 100 * PAPER_TOKEN_STATES["Paged 16"],
                round(100 * table.loc["Paged 16", "token_states"], 2),
                PERCENT, 2.0,
                f"Paging wastes at most a request's last block whatever the workload, so the share barely depends "
                f"on it; {workload}.")]
    for scheme in ("Max", "Pow2", "Oracle"):
        rows.append(Row(f"contiguous_token_states_{scheme.lower()}", f"token-state share, contiguous ({scheme})",
                        PAGED_SOURCE, 100 * PAPER_TOKEN_STATES[scheme],
                        round(100 * table.loc[scheme, "token_states"], 2), PERCENT, None,
                        f"Not checked: a contiguous scheme's waste is set by the workload's lengths; {workload}, "
                        "whose outputs are a small share of each request (so Pow2 and Oracle reserve little) and "
                        "whose lengths span two orders of magnitude (so Max, which reserves 8,192, wastes more)."))
    return rows


#: Kwon et al., SOSP'23, Figure 15 (section 6.3): memory saved by sharing on Alpaca, in %.
PAPER_SHARING = {("parallel sampling", 2): 6.09, ("parallel sampling", 4): 8.53, ("parallel sampling", 6): 9.79,
                 ("beam search", 2): 37.56, ("beam search", 4): 53.13, ("beam search", 6): 55.16}
ALPACA_MEANS, ALPACA_REQUESTS, SHARING_BLOCK_SIZE = (19.31, 58.45), 200, 16


def _lognormal_lengths(gen, mean: float, size: int, sigma: float = 1.0) -> np.ndarray:
    return np.clip(np.rint(gen.lognormal(np.log(mean) - sigma**2 / 2, sigma, size)), 1, 2048).astype(int)


def _sharing_saving(method: str, n: int, seed: int = 0, alpha: float = 0.3, vocab: int = 32) -> float:
    """Notebook 03b's sharing study (section 3), without tensors: the same draws, so the same numbers. Returns the
    memory saved by sharing in %: 1 - (blocks in use) / (blocks the sequences would hold unshared), summed over
    every decode step of every request."""
    gen = np.random.default_rng(seed)
    manager = BlockManager(2 * 2048 * 6 // SHARING_BLOCK_SIZE, SHARING_BLOCK_SIZE, enable_prefix_caching=False)
    used = unshared = 0

    def in_use():
        return manager.num_blocks - manager.num_free_blocks

    def fork(parent):
        child = Sequence([], SHARING_BLOCK_SIZE)
        manager.fork(parent, child)
        return child

    def step(tokens):
        for seq, token in tokens.items():
            seq.append_token(int(token))
            manager.append_slots(seq)

    for prompt_len in _lognormal_lengths(gen, ALPACA_MEANS[0], ALPACA_REQUESTS):
        if method == "parallel sampling":
            lengths = _lognormal_lengths(gen, ALPACA_MEANS[1], n)
            parent = Sequence(gen.integers(0, 30000, size=int(prompt_len)), SHARING_BLOCK_SIZE)
            manager.allocate(parent)
            live = {parent: lengths[0], **{fork(parent): k for k in lengths[1:]}}
            t = 0
            while live:
                t += 1
                step({seq: gen.integers(30000, 60000) for seq in live})
                used, unshared = used + in_use(), unshared + sum(seq.num_blocks for seq in live)
                for seq in [s for s, k in live.items() if k <= t]:
                    manager.free(seq)
                    del live[seq]
            continue
        output_len = int(_lognormal_lengths(gen, ALPACA_MEANS[1], 1)[0])
        beams = [Sequence(gen.integers(0, 30000, size=int(prompt_len)), SHARING_BLOCK_SIZE)]
        manager.allocate(beams[0])
        scores = np.zeros(1)
        for _ in range(output_len):
            candidates = scores[:, None] + np.log(gen.dirichlet(np.full(vocab, alpha), size=len(beams)) + 1e-12)
            parents, tokens = np.unravel_index(np.argsort(candidates, axis=None)[::-1][:n], candidates.shape)
            chosen: dict = {}
            for p, token in zip(parents.tolist(), tokens.tolist()):
                chosen.setdefault(p, []).append(token)
            new_beams, new_scores, tokens_of = [], [], {}
            for p, picks in chosen.items():  # fork before anyone appends
                for i, token in enumerate(picks):
                    beam = beams[p] if i == 0 else fork(beams[p])
                    new_beams.append(beam)
                    new_scores.append(candidates[p, token])
                    tokens_of[beam] = token
            for p, beam in enumerate(beams):
                if p not in chosen:
                    manager.free(beam)
            step(tokens_of)
            beams, scores = new_beams, np.array(new_scores)
            used, unshared = used + in_use(), unshared + sum(b.num_blocks for b in beams)
        for beam in beams:
            manager.free(beam)
    return 100 * (1 - used / unshared)


def check_sharing() -> list[Row]:
    rows = []
    for (method, n), published in PAPER_SHARING.items():
        beam = method == "beam search"
        rows.append(Row(
            f"sharing_{method.split()[0]}_{n}", f"memory saved by sharing, Alpaca, {method}, n = {n}",
            "Kwon et al., PagedAttention, SOSP'23, Figure 15 / section 6.3; notebook 03b, section 3",
            published, round(_sharing_saving(method, n), 1), PERCENT, 12.0 if beam else None,
            "kvlab's figure is notebook 03b's model, not the paper's OPT-13B run: log-normal lengths with Alpaca's "
            "means (19.31 in / 58.45 out), 200 requests, 16-token blocks, and a Dirichlet(0.3) stand-in for the model "
            "over 32 tokens. How far back beams share their history is the model's, not the paging's (notebook 03b), "
            "so the row is checked loosely; the saving is at most (n - 1) / n." if beam else
            "Reported, not checked: in parallel sampling only the prompt's full blocks are shared, and kvlab's drawn "
            "Alpaca prompts are short (many fill no 16-token block), so the saving hinges on the length spread "
            "(notebook 03b: 10.3% at sigma 0.5, 3.9% at 1.0 for n = 4).", slow=True))
    return rows


# ---- vLLM's hit laws ------------------------------------------------------------------------------------

def _repeat_hit(block_size: int, shared: int, length: int, *, use_eagle: bool = False) -> int:
    """Tokens hit by a prompt of ``length`` tokens whose first ``shared`` tokens an earlier prompt (of the same
    length) had, on a fresh manager that never evicts."""
    blocks = 2 * -(-length // block_size) + 2
    manager = BlockManager(blocks, block_size, use_eagle=use_eagle)
    first = Sequence(np.arange(length), block_size)
    manager.allocate(first)
    manager.free(first)
    second = Sequence(np.concatenate([np.arange(shared), np.arange(length - shared) + 10**6]), block_size)
    return manager.allocate(second).num_cached_tokens


def check_hybrid_block() -> list[Row]:
    probes = [(500, 500), (480, 530), (552, 552), (979, 979)]  # (shared prefix, prompt) tokens
    measured = tuple(round(100 * _repeat_hit(528, shared, length) / length, 2) for shared, length in probes)
    return [Row(
        "vllm_hybrid_528_block", "hit rate of a repeated prompt, hybrid model with 528-token attention blocks: a "
                                 "500-token prompt sent again, a 480-token shared prefix (+ 50 new tokens), a 552- "
                                 "and a 979-token prompt sent again",
        "vLLM issue #40696 (Qwen/Qwen3.5-4B, vLLM 0.19.1: \"Setting attention block size to 528 tokens\"; \"Prompt "
        "with < 528 tokens: 0% prefix cache hit\", \"552 tokens: ~95% hit (1 block cached, only 24 tokens "
        "recomputed)\", \"979 tokens: ~54% hit (1 block cached, 451 tokens recomputed)\")",
        (0.0, 0.0, 95.0, 54.0), measured, PERCENT, 1.0,
        "BlockManager(block_size=528): only full blocks are cached, and a prefix shorter than one block shares "
        "none (the 500-token prompt and the 480-token prefix end inside the first block). The issue rounds "
        "(\"~\"); exactly, one block of 552 is 95.65% and of 979 is 53.93%. vLLM's Mamba group also caches at "
        "these block boundaries (align mode); kvlab models the attention group, which sets the hit. vLLM #54607 "
        "(784-token blocks) was not found in the searchable sources, so it has no row (784-token blocks do appear in "
        "others' vLLM logs for Qwen3.5/3.8-27B, without published hit rates).")]


def check_inert_block() -> list[Row]:
    return [Row(
        "vllm_hybrid_8320_block", "tokens hit by a 4,096-token prompt sent again, hybrid model with 8,320-token "
                                  "attention blocks (max_model_len 4,096)",
        "vLLM issue #48401 (nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-NVFP4: \"max_model_len 4096 (< block size "
        "8320): prefix_cache_hits = 0 out of 10608 queries\")",
        0, _repeat_hit(8320, 4096, 4096), TOKENS, 0,
        "BlockManager(block_size=8320): no prompt the model accepts fills a block, so nothing is ever cached. The "
        "issue's other figure (16,640 hits of 38,448 queried tokens at max_model_len 16,384, two whole blocks) comes "
        "from a workload it does not describe, so it is not replayed.")]


EAGLE_BLOCK = 2144
#: vLLM issue #54360 (chiptoe-svg's comment, v0.28.0): exact-repeat probes, (prompt tokens, repeat hits).
EAGLE_PROBES = ((3784, 0), (7542, 4288), (11292, 8576), (15019, 12864), (18770, 15008))


def check_eagle() -> list[Row]:
    lengths = [length for length, _ in EAGLE_PROBES]
    hits = tuple(_repeat_hit(EAGLE_BLOCK, length, length, use_eagle=True) for length in lengths)
    plain = [_repeat_hit(EAGLE_BLOCK, length, length) for length in lengths]
    return [Row(
        "vllm_eagle_last_block_drop", "tokens hit by an exact repeat with MTP (EAGLE-family) speculation, "
                                      f"{EAGLE_BLOCK}-token blocks, prompts of {', '.join(map(str, lengths))} tokens",
        "vLLM issue #54360 (nvidia/Qwen3.6-35B-A3B-NVFP4, MTP k=3, v0.28.0: \"Fits hits = max(0, floor((L-1)/2144) "
        "- 1) x 2144 at every row\")",
        tuple(h for _, h in EAGLE_PROBES), hits, TOKENS, 0.0,
        "BlockManager(block_size=2144, use_eagle=True) gives up the hit's last block, as vLLM's "
        f"find_longest_cache_hit does: exactly the published hits. Without use_eagle: {', '.join(map(str, plain))}.")]


def check_eagle_workload() -> list[Row]:
    return [Row(
        "vllm_eagle_harness_drop", "prefix-cache hit rate with EAGLE/MTP speculation, against no speculation "
                                   "(97.5% -> 86.9-91.7%)",
        "vLLM issue #53670 (Qwen3.8-27B, 1,648-token scheduler block: \"97.5% -> 86.9-91.7% in our harness\")",
        97.5, None, PERCENT, None,
        "Not replayed: the issue's harness (its prompts, their lengths and what they share) is not published. The law "
        "above says each hit loses exactly one 1,648-token block, so if every request hits, a 5.8- to 10.6-point drop "
        "means prompts of about 15,500 to 28,400 tokens on average (1,648 / 0.106 and 1,648 / 0.058), which the "
        "issue does not state.")]


# ---- agentic sessions (kv-cache-tester) -----------------------------------------------------------------

def check_agentic() -> list[Row]:
    from kvlab.studies.reuse import consecutive_hit_rates
    from kvlab.studies.traces import load_trace

    streams = consecutive_hit_rates(load_trace("agentic_coding"), 64).xs("main", level="agent")["hit_rate_blocks"]
    source = ("kv-cache-tester README (callanjfox/kv-cache-tester, commit c9b3da5), \"Cache hit rates\" table, "
              "\"Conversation-only (no warm prefix)\" row over its 739 sessions, \"computed from hash_id overlap "
              "between consecutive requests within each conversation\"")
    note = ("Same traces (WEKA's Claude Code sessions), but kvlab bundles 40 of them (no file over 2 MB, so not "
            "the longest, which hit most); on the 710 sessions of a full snapshot kvlab measured median 95.5%, mean "
            "92.9% (docs/studies.md). Per session, its own requests (sub-agents apart), 64-token blocks; a stream's "
            "first request misses.")
    return [Row("agentic_consecutive_median", "consecutive-request hit rate, per session: median", source, 96.0,
                round(100 * float(streams.median()), 2), PERCENT, 2.5, note),
            Row("agentic_consecutive_mean", "consecutive-request hit rate, per session: mean", source, 93.0,
                round(100 * float(streams.mean()), 2), PERCENT, 1.5, note)]


AGENTIC_GPU_BLOCKS = 16_000  # 64-token blocks: the largest bundled prompt (12,811 blocks) plus a quarter


def check_agentic_tier(share: float = 0.95, steps: int = 16) -> list[Row]:
    """The CPU tier (LRU, every eviction admitted) behind a fixed GPU pool from which on the agentic subset's replay
    reaches ``share`` of the infinite-cache ceiling, on a grid of ``steps`` tier sizes up to the trace's distinct
    blocks (a tier that never evicts). Not bisection: the hit rate is not monotone in the tier's size."""
    from kvlab.studies.reuse import reuse_profile
    from kvlab.studies.study import cache_hit_study
    from kvlab.studies.traces import load_trace

    trace = load_trace("agentic_coding")
    profile = reuse_profile(trace, 64)
    ceiling, distinct = profile["ceiling_hit_rate_tokens"], profile["distinct_blocks"]
    step = -(-distinct // steps)
    rows = cache_hit_study(("agentic_coding", trace), block_sizes=[64], capacities=[AGENTIC_GPU_BLOCKS],
                           policies=["lru"], offload_capacities=[k * step for k in range(steps + 1)], jobs=-1,
                           progress=False)
    rates = rows.set_index("offload_capacity_blocks")["hit_rate_tokens"].sort_index()
    reached = rates >= share * ceiling
    first = int(reached.idxmax())
    steady = int(rates.index[~reached].max() + step) if not reached.all() else 0  # every tier from here on reaches it
    dips = [f"{blocks:,}: {100 * rate:.1f}%" for blocks, rate in rates.items() if first < blocks < steady]
    return [Row(
        "agentic_cpu_tier_95", f"CPU tier (64-token blocks) from which a {AGENTIC_GPU_BLOCKS:,}-block GPU pool "
                               f"reaches {100 * share:.0f}% of the infinite-cache ceiling, agentic subset",
        "issue 40, section 3 (a figure kvlab reports; none is published)", None, steady, "blocks", None,
        f"GPU pool alone: {100 * rates.iloc[0]:.1f}% of prompt tokens; ceiling {100 * ceiling:.1f}%, target "
        f"{100 * share * ceiling:.1f}%. From {steady:,} tier blocks ({steady * 64 / 1e6:.1f} M tokens, "
        f"{100 * steady / distinct:.0f}% of the {distinct:,} distinct blocks) every tier on a grid of {step:,}-block "
        "steps reaches it" + (f"; {first:,} blocks already did, but larger tiers fell back below it ("
                              f"{'; '.join(dips)}): with the GPU pool in front, LRU is not a stack algorithm"
                              if first < steady else "") +
        ". The 40 sessions start together and interleave by their recorded times (think and API times included); the "
        "replay is sequential, so think time orders the requests but holds nothing longer.",
        slow=True)]


def check_speculation() -> list[Row]:
    return [Row(
        "ngram_suffix_acceptance", "n-gram or suffix speculation acceptance on a named public workload",
        "SuffixDecoding (Oliaro et al., arXiv 2411.04975) and vLLM's ngram/suffix methods", None, None, PERCENT, None,
        "Not reproduced: acceptance depends on the tokens a model writes, and no bundled trace carries token content "
        "(Mooncake and kv-cache-tester give hash ids and lengths, Azure lengths only); the agentic traces' outputs "
        "are counts, so \"suffix against n-gram on repeated agent outputs\" cannot be measured from them. kvlab's "
        "proposers (kvlab.engine.proposers) run on a model's real outputs in the engine "
        "(docs/speculative_decoding.md).")]


#: Every check, in table order: (name, slow, function returning its rows).
CHECKS = [("mooncake", False, check_mooncake), ("memory_waste", False, check_memory_waste),
          ("sharing", True, check_sharing), ("hybrid_block", False, check_hybrid_block),
          ("inert_block", False, check_inert_block), ("eagle", False, check_eagle),
          ("eagle_workload", False, check_eagle_workload), ("agentic", False, check_agentic),
          ("agentic_tier", True, check_agentic_tier), ("speculation", False, check_speculation)]


def validate(full: bool = False, checks=None) -> list[Row]:
    """The rows of every fast check (``full``: and of the slow ones), or of the checks named in ``checks``."""
    known = {name: function for name, _, function in CHECKS}
    if checks is not None:
        checks = list(checks)
        unknown = [name for name in checks if name not in known]
        if unknown or not checks:
            raise InvalidArgumentError((f"unknown check {unknown[0]!r}" if unknown else "no check named") +
                                       f"; known: {', '.join(known)}")
        return [row for name in checks for row in known[name]()]
    return [row for _, slow, function in CHECKS if full or not slow for row in function()]


COLUMNS = ["check", "figure", "source", "published", "measured", "gap", "tolerance", "unit", "status", "note"]


def table(rows: list[Row]) -> pd.DataFrame:
    return pd.DataFrame([{**asdict(row), "gap": row.gap, "status": row.status} for row in rows], columns=COLUMNS)


def _number(value, unit: str = "") -> str:
    """``value`` as the table shows it, with ``unit`` after it ("%" joined, a word after a space)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, (tuple, list)):  # a law's points: the unit once, after the last
        return ", ".join(_number(v) for v in value) + _number(0, unit)[1:]
    text = f"{value:,.2f}".rstrip("0").rstrip(".") if isinstance(value, float) else f"{value:,}"
    return text + (unit if unit in ("", PERCENT) else f" {unit}")


def _points(unit: str) -> str:
    """The unit of a gap or a tolerance: percentage points for percentages."""
    return "pts" if unit == PERCENT else unit


def markdown(rows: list[Row]) -> str:
    """The table as Markdown, one row per figure (the text docs/validate.md shows)."""
    lines = ["| figure | source | published | kvlab | gap | tolerance | status | why they differ |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for row in rows:
        cells = [row.figure, row.source, _number(row.published, row.unit), _number(row.measured, row.unit),
                 _number(row.gap, _points(row.unit)),
                 "±" + _number(row.tolerance, _points(row.unit)) if row.tolerance is not None else "-",
                 row.status, row.note]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def text(rows: list[Row], width: int = 110) -> str:
    """The table for a terminal: the figures side by side, then each row's source and why they differ."""
    frame = pd.DataFrame({"check": [row.check for row in rows],
                          "published": [_number(row.published, row.unit) for row in rows],
                          "kvlab": [_number(row.measured, row.unit) for row in rows],
                          "gap": [_number(row.gap, _points(row.unit)) for row in rows],
                          "tolerance": [_number(row.tolerance, _points(row.unit)) for row in rows],
                          "status": [row.status for row in rows]})
    parts = [frame.to_string(index=False), ""]
    for row in rows:
        parts.append(textwrap.fill(f"{row.check}: {row.figure}", width))
        parts += [textwrap.fill(f"{label}: {words}", width, initial_indent="  ", subsequent_indent="    ")
                  for label, words in (("source", row.source), ("why", row.note))]
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvlab validate",
        description="Reproduce published prefix-cache figures (Dynamo, Mooncake, PagedAttention, vLLM's hit laws, "
                    "WEKA's agentic sessions) and print each beside kvlab's, with the gap and why they differ. "
                    "Exits 1 when a figure leaves its tolerance.")
    parser.add_argument("--full", action="store_true", help="also run the slow rows (about two minutes of CPU)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--csv", action="store_true", help="print the table as CSV")
    output.add_argument("--json", action="store_true", help="print the table as JSON, one object per row")
    output.add_argument("--markdown", action="store_true", help="print the table as Markdown (docs/validate.md)")
    parser.add_argument("--check", action="append", choices=[name for name, _, _ in CHECKS], metavar="NAME",
                        help="run only this check (repeatable): " + ", ".join(name for name, _, _ in CHECKS))
    args = parser.parse_args(argv)
    rows = validate(args.full, args.check)
    if args.csv:
        table(rows).to_csv(sys.stdout, index=False)
    elif args.json:
        print(json.dumps([{**asdict(row), "gap": row.gap, "status": row.status} for row in rows], indent=1))
    elif args.markdown:
        print(markdown(rows))
    else:
        print(text(rows))
    out = [row.check for row in rows if row.status == "OUT"]
    if out:
        print(f"kvlab validate: {len(out)} figure(s) outside their tolerance: {', '.join(out)}", file=sys.stderr)
        return 1
    return 0
