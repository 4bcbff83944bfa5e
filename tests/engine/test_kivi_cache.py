"""``LLM(kv_cache_dtype="kivi_int4" | "kivi_int2")``: KIVI in the paged cache (kvlab.kernels.torch_paged_quant).

A query at position p reads its own R-chunk in full precision and everything before it KIVI-quantized, so a
sequence's K/V depend on its tokens alone: a prefix hit gives the tokens of recomputing (and quantizing) the
prefix, the engine's greedy tokens are those of one teacher-forced prefill, and the open chunks' windows
follow copy-on-write, swaps, preemption and the offload tier."""

import random

import pytest

from engine_helpers import make_llm
from kvlab.engine import SamplingParams
from kvlab.errors import InvalidArgumentError

GREEDY = dict(temperature=0.0, ignore_eos=True)
#: (format, block_size, R): R below the block size, and R = block size.
SETTINGS = [("kivi_int4_g16", 32, 16), ("kivi_int2", 32, 32)]


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(n)] for n in lengths]


def tokens(llm, batch, max_tokens=12, n=1):
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, n=n, **GREEDY), use_tqdm=False)
    return [[o.token_ids for o in out.outputs] for out in outs]


def kivi_llm(path, name, block_size, residual, **options):
    return make_llm(path, kv_cache_dtype=name, block_size=block_size, kv_residual_length=residual, **options)


@pytest.mark.parametrize("name, block_size, residual", SETTINGS)
def test_a_prefix_hit_gives_the_tokens_of_recomputing_the_prefix(tiny_model, name, block_size, residual):
    path, _ = tiny_model
    system = prompts(0, (70,))[0]                     # two full blocks of 32 are cached, six tokens are not
    first, second = system + [5, 6, 7], system + [9, 8]
    cached = kivi_llm(path, name, block_size, residual, num_blocks=32)
    tokens(cached, [first])
    hit = tokens(cached, [second])
    assert cached.make_prefix_cache_stats().hit_blocks == 2
    recomputed = kivi_llm(path, name, block_size, residual, num_blocks=32, enable_prefix_caching=False)
    assert tokens(recomputed, [second]) == hit
    assert tokens(recomputed, [second]) == hit          # deterministic
    assert tokens(kivi_llm(path, name, block_size, residual, num_blocks=32,
                           max_num_seqs=4, max_num_batched_tokens=24), [second]) == hit  # a chunked prefill


@pytest.mark.parametrize("name, block_size, residual", SETTINGS)
def test_greedy_tokens_are_those_of_one_teacher_forced_prefill(llama, name, block_size, residual):
    """Decoding a token at a time reads the cache as one prefill over the whole text does (kv_accuracy's)."""
    from kvlab.studies.kv_accuracy import prefill_hidden

    llm = kivi_llm(llama[0], name, block_size, residual, num_blocks=32)
    prompt = prompts(1, (20,))[0]
    generated = tokens(llm, [prompt], max_tokens=40)[0][0]        # 20 + 40 tokens: past two chunks
    hidden = prefill_hidden(llm, prompt + generated[:-1])
    assert llm.model.compute_logits(hidden[len(prompt) - 1:]).argmax(-1).tolist() == generated


def test_the_window_keeps_the_newest_tokens_exact(llama):
    """Within the first R tokens nothing is quantized yet: the tokens are fp32's; past them they differ."""
    path, _ = llama
    prompt = prompts(2, (10,))[0]
    exact = tokens(make_llm(path, block_size=64), [prompt], max_tokens=50)
    kivi = tokens(kivi_llm(path, "kivi_int2", 64, 64), [prompt], max_tokens=50)
    assert kivi[0][0][:54] == exact[0][0][:54]
    shorter_window = tokens(kivi_llm(path, "kivi_int2", 64, 32), [prompt], max_tokens=50)
    assert shorter_window != exact


@pytest.mark.parametrize("name, block_size, residual", [("kivi_int4_g16", 16, 16), ("kivi_int2_g16", 32, 16)])
def test_swaps_forks_preemption_and_the_tier_keep_the_tokens(llama, name, block_size, residual):
    """A pool too small for the batch swaps sequences out and back (their open chunks' windows go with their
    blocks) or preempts and recomputes them; n > 1 copies a shared open block on write; a system prompt
    evicted to the offload tier and promoted back is read as codes. Every run gives a roomy pool's tokens."""
    path, _ = llama
    batch = prompts(8, (9, 10, 11))
    options = dict(name=name, block_size=block_size, residual=residual)
    roomy = tokens(kivi_llm(path, num_blocks=64, **options), batch, max_tokens=30)
    for mode in ("swap", "recompute"):
        small = kivi_llm(path, num_blocks=5 if block_size == 16 else 3, preemption_mode=mode, max_num_seqs=3,
                         **options)
        assert tokens(small, batch, max_tokens=30) == roomy
        records = small.step_dataframe()
        moved = "blocks_swapped_out" if mode == "swap" else "preempted"
        assert records[moved].sum() > 0, records.columns
    forked = kivi_llm(path, num_blocks=64, **options)
    assert tokens(forked, batch[:1], max_tokens=30, n=2) == [roomy[0] * 2]
    assert forked.step_dataframe()["cow_copies"].sum() > 0

    system = prompts(3, (2 * block_size + 3,))[0]
    second, evictor = system + [7, 8, 9], prompts(4, (4 * block_size,))[0]
    expected = [tokens(kivi_llm(path, num_blocks=64, **options), [p], max_tokens=4)[0] for p in (system, second)]
    tiered = kivi_llm(path, num_blocks=6, num_offload_blocks=16, **options)
    got = [tokens(tiered, [prompt], max_tokens=4)[0] for prompt in (system, evictor, second)]
    assert [got[0], got[2]] == expected and tiered.block_manager.tier_stats.tier_hit_blocks >= 1


@pytest.mark.slow  # 10-25 s each on 2 cores: the interpreter runs every program of both kernels in Python
@pytest.mark.parametrize("name, block_size, residual, check_every_layer", [("kivi_int4_g16", 32, 16, "0"),
                                                                        ("kivi_int2", 32, 32, "1")])
def test_the_triton_backend_gives_the_torch_paths_tokens(llama, monkeypatch, name, block_size, residual,
                                                         check_every_layer):
    """``attention_backend="triton"`` (interpreted here) seals chunks with ``kivi_seal`` and reads with
    ``kivi_paged_attention``: greedy tokens of a batch decoding past several chunks, then of a prefix hit read in
    a chunked prefill, are the torch path's (with the per-layer checks on, the checked launchers run)."""
    monkeypatch.setenv("KVLAB_CHECK_EVERY_LAYER", check_every_layer)
    path, _ = llama
    batch = prompts(10, (20, 2 * block_size + 5))
    second = batch[1][:block_size + 3] + [4, 5]                    # its first block is a prefix hit
    runs = {}
    for backend in ("torch", "triton"):
        llm = kivi_llm(path, name, block_size, residual, num_blocks=16, max_num_seqs=4, max_num_batched_tokens=24,
                       attention_backend=backend)
        runs[backend] = tokens(llm, batch, max_tokens=14) + tokens(llm, [second], max_tokens=4)
        assert llm.make_prefix_cache_stats().hit_blocks == 1
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache_dtype="int4_kivi"), "'int4_kivi' was not KIVI .* now 'int4_calibrated_channel'. KIVI itself is "
                                       "'kivi_int4' or 'kivi_int2'"),
    (dict(kv_cache_dtype="kivi_int4"), "block_size must be a multiple of 32, got 8"),
    (dict(kv_cache_dtype="kivi_int4", block_size=32, kv_residual_length=64), "divides block_size 32"),
    (dict(kv_cache_dtype="kivi_int4", block_size=32, kv_calibration_prompts=[[1, 2]]), "computes its scales"),
    (dict(kv_cache_dtype="fp8", kv_residual_length=32), "kv_residual_length is the full-precision window"),
    (dict(kv_cache_dtype="kivi_int4", block_size=32,
          speculative_config=dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)),
     "does not take speculative_config"),
    (dict(kv_cache_dtype="kivi_int4", block_size=32, prefix_match_unit=16), "prefix_match_unit does not combine"),
])
def test_bad_kivi_settings_are_refused(llama, options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        make_llm(llama[0], **options)


def test_the_pool_leaves_room_for_the_windows(llama):
    """Sized by memory, a KIVI pool is what is left of the budget once every running sequence's window (R
    fp32 tokens in each layer) is set aside, in blocks of the KIVI rows."""
    from kvlab.engine.kv_cache import CPU_KV_CACHE_BYTES

    llm = kivi_llm(llama[0], "kivi_int4_g16", 32, 16, num_blocks=None, max_num_seqs=8192)
    window = 8192 * 16 * 2 * (2 * 2 * 32) * 4  # sequences x R x layers x (K and V x kv heads x head_dim) x fp32
    per_block = 32 * 2 * 2 * (16 + 8 + 16 + 8)  # tokens x layers x kv heads x (K codes + scales, V codes + scales)
    assert llm.kv_cache.bytes_per_block == per_block
    assert llm.kv_cache.num_blocks == (CPU_KV_CACHE_BYTES - window) // per_block < 8192 * 256 // 32


def test_a_forward_pass_that_raises_part_way_leaves_the_windows_as_they_were(llama, monkeypatch):
    """A pass that fails after some layers ran is run again sequence by sequence (kvlab.engine.isolation):
    the windows only take a pass's changes once every layer ran, so the rerun reads what the first try read
    and the tokens are those of a run without the failure."""
    from kvlab.engine import attention

    path, _ = llama
    batch = prompts(9, (20, 21))
    expected = tokens(kivi_llm(path, "kivi_int4_g16", 32, 16, num_blocks=32), batch, max_tokens=20)
    llm = kivi_llm(path, "kivi_int4_g16", 32, 16, num_blocks=32)
    second_layer = llm.model.model.layers[1].self_attn.kv_window
    real, raised = attention.kivi_attention, []

    def fails_once(query, key, value, kv_cache, step, quantizer, window, scale=None):
        sealing_a_read_chunk = any(seq.read_key is not None and seq.next_start > seq.open_start for seq in step.seqs)
        if window is second_layer and sealing_a_read_chunk and not raised:
            raised.append(True)
            raise RuntimeError("a failure after the first layer ran")
        return real(query, key, value, kv_cache, step, quantizer, window, scale)

    monkeypatch.setattr(attention, "kivi_attention", fails_once)
    assert tokens(llm, batch, max_tokens=20) == expected and raised


def test_a_freed_sequences_window_entries_go_with_it(llama):
    """A finished, aborted or recompute-preempted sequence's open chunk leaves every layer's window when its
    blocks are freed (not when another sequence happens to take the block), on the GPU and, for a sequence
    aborted while swapped out, on the host; two samples sharing their open block keep it until both are gone."""
    path, _ = llama
    llm = kivi_llm(path, "kivi_int4_g16", 32, 16, num_blocks=32)
    windows = [layer.self_attn.kv_window for layer in llm.model.model.layers]
    tokens(llm, prompts(11, (20, 27)), max_tokens=5, n=2)   # 24 and 31 tokens with K/V: open chunks of 8, 15
    assert [(len(w.entries), len(w.swapped)) for w in windows] == [(0, 0)] * len(windows)

    small = kivi_llm(path, "kivi_int4_g16", 16, 16, num_blocks=5, preemption_mode="swap", max_num_seqs=3)
    windows = [layer.self_attn.kv_window for layer in small.model.model.layers]
    for prompt in prompts(8, (9, 10, 11)):
        small.add_request(prompt, SamplingParams(max_tokens=30, **GREEDY))
    while not small.scheduler.swapped:
        small.step()
    swapped = small.scheduler.owner[small.scheduler.swapped[0].seq_id].request_id
    assert all(w.swapped for w in windows)
    small.abort_request(swapped)
    small.step()
    assert [len(w.swapped) for w in windows] == [0] * len(windows)
    while small.has_unfinished_requests():
        small.step()
    assert [(len(w.entries), len(w.swapped)) for w in windows] == [(0, 0)] * len(windows)
