"""``LLM(kv_cache_dtype=...)``: every quantized format serves end to end on CPU (torch path), its cache holds the
format's bytes and the pool sizes itself with them; "auto" is today's unquantized engine; block moves (swap,
copy-on-write) carry the quantized bytes; bad settings are refused before anything loads."""

import random

import pytest
import torch

from engine_helpers import make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.config import load_model_config
from kvlab.engine.kv_cache import blocks_for_memory, engine_kv_cache_groups
from kvlab.sizing import kv_cache_groups
from kvlab.sizing.groups import bytes_per_block
from kvlab.device import DEVICE
from kvlab.engine import attention, settings
from kvlab.errors import InvalidArgumentError, UnsupportedError
from kvlab.kernels.kv_quant import FP8_CODECS, KVQuantizer
from kvlab.kernels.torch_paged_quant import reshape_and_cache_quantized
from kvlab.sizing.hf_config import read_model_shape
from kvlab.sizing.kv_dtypes import ENGINE_KV_CACHE_DTYPES, kivi_settings

#: Every format but KIVI's other group sizes (tests/engine/test_kivi_cache.py).
FORMATS = [name for name in ENGINE_KV_CACHE_DTYPES if name != "auto" and (kivi_settings(name) is None
                                                                          or name in ("kivi_int4", "kivi_int2"))]
GREEDY = dict(temperature=0.0, ignore_eos=True)
CALIBRATION = [list(range(1, 60)), list(range(60, 128))]


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 128) for _ in range(n)] for n in lengths]


def tokens(llm, batch, max_tokens=10, n=1):
    outs = llm.generate(batch, SamplingParams(max_tokens=max_tokens, n=n, **GREEDY), use_tqdm=False)
    return [[o.token_ids for o in out.outputs] for out in outs]


def test_auto_is_the_unquantized_engine(tiny_model):
    path, _ = tiny_model
    batch = prompts(0, (5, 17, 30))
    default, auto = make_llm(path), make_llm(path, kv_cache_dtype="auto")
    assert auto.kv_quantizers is None and auto.kv_cache.gpu[0].dtype == torch.float32
    assert all(layer.self_attn.kv_quantizer is None for layer in auto.model.model.layers)
    assert tokens(auto, batch) == tokens(default, batch)


@pytest.mark.parametrize("name", FORMATS)
def test_each_format_serves_end_to_end_with_its_bytes(tiny_model, name):
    path, _ = tiny_model
    kivi = kivi_settings(name) is not None  # KIVI: blocks of whole key groups, scales from the data
    llm = make_llm(path, kv_cache_dtype=name, **(dict(block_size=32) if kivi else
                                                 dict(kv_calibration_prompts=CALIBRATION)))
    cache = llm.kv_cache
    quantizer = llm.kv_quantizers[0]
    assert cache.gpu[0].dtype == quantizer.storage_dtype and cache.gpu[0].shape[-1] == quantizer.storage_width
    assert sum(t.nbytes for t in cache.gpu) == cache.num_blocks * cache.bytes_per_block
    sized = kv_cache_groups(read_model_shape(path).layout(name), cache.block_size)
    assert sized == llm.kv_cache_config.groups and bytes_per_block(sized) == cache.bytes_per_block
    assert llm.attention_backend == "torch"
    batch = prompts(1, (5, 17, 30))
    out = tokens(llm, batch)
    assert [len(o[0]) for o in out] == [10] * 3


@pytest.mark.parametrize("name, ratio", [("fp8", 4), ("k_fp16_v_fp8", 8 / 3), ("int4_calibrated_channel", 256 / 36)])
def test_the_pool_holds_more_blocks_in_the_same_bytes(llama, name, ratio):
    """Per (token, KV head) with head_dim 32 against fp32's 256 bytes: fp8 64, fp16 K + fp8 V 96,
    int4_calibrated_channel 16 + 16 packed codes + 4 bytes of value scale and zero = 36."""
    config = load_model_config(llama[0])
    sized = {dtype: blocks_for_memory(engine_kv_cache_groups(config, torch.float32, dtype, 8), config, torch.float32,
                                      torch.device("cpu"), gpu_memory_utilization=0.9, max_num_batched_tokens=64,
                                      max_num_seqs=4, max_useful_blocks=10**9) for dtype in ("auto", name)}
    assert sized[name] == pytest.approx(sized["auto"] * ratio, abs=1)


@pytest.mark.parametrize("name", ["fp8_e4m3", "int4_calibrated_channel"])
def test_swapped_and_forked_blocks_keep_their_quantized_bytes(llama, name):
    """A pool too small for the batch swaps sequences out and back; n > 1 copies shared blocks on write. Both
    move bytes of quantized blocks: the tokens are those of a pool where nothing moves."""
    path, _ = llama
    batch = prompts(8, (9, 10, 11))
    options = dict(kv_cache_dtype=name, kv_calibration_prompts=CALIBRATION, block_size=4)
    roomy = tokens(make_llm(path, num_blocks=64, **options), batch, max_tokens=12)
    small = make_llm(path, num_blocks=12, preemption_mode="swap", max_num_seqs=3, **options)
    assert tokens(small, batch, max_tokens=12) == roomy
    records = small.step_dataframe()
    assert records["blocks_swapped_out"].sum() > 0 and records["blocks_swapped_in"].sum() > 0
    forked = make_llm(path, num_blocks=64, **options)
    assert tokens(forked, batch[:1], max_tokens=12, n=2) == [roomy[0] * 2]
    assert forked.step_dataframe()["cow_copies"].sum() > 0


def test_per_head_scales_differ_per_head_and_unit_scales_are_vllms_default(llama):
    path, _ = llama
    per_head = make_llm(path, kv_cache_dtype="fp8", kv_scale_granularity="head", kv_calibration_prompts=CALIBRATION)
    per_tensor = make_llm(path, kv_cache_dtype="fp8", kv_calibration_prompts=CALIBRATION)
    unit = make_llm(path, kv_cache_dtype="fp8")
    head, tensor = per_head.kv_quantizers[0].k_scale, per_tensor.kv_quantizers[0].k_scale
    assert head[0] != head[1] and tensor[0] == tensor[1] == head.max()
    assert all(bool((q.k_scale == 1).all() and (q.v_scale == 1).all()) for q in unit.kv_quantizers)


@pytest.mark.parametrize("options, error, message", [
    (dict(kv_cache_dtype="int8"), InvalidArgumentError, "kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3'"),
    (dict(kv_cache_dtype="fp8", kv_scale_granularity="channel"), InvalidArgumentError, "kv_scale_granularity"),
    (dict(kv_cache_dtype="fp8", kv_calibration_prompts=[]), InvalidArgumentError, "kv_calibration_prompts"),
    (dict(kv_calibration_prompts=[[1, 2]]), InvalidArgumentError, "nothing to calibrate"),
    (dict(kv_cache_dtype="int4_calibrated_channel"), InvalidArgumentError, "pass kv_calibration_prompts"),
    (dict(kv_cache_dtype="fp8", kv_calibration_prompts=[[1, 500]]), InvalidArgumentError, "an id in"),
    (dict(kv_cache_dtype="int4_calibrated_channel", kv_calibration_prompts=CALIBRATION, attention_backend="triton"),
     UnsupportedError, "cannot run on the triton backend: .* none reads the other integer or asymmetric"),
])
def test_bad_kv_cache_settings_are_refused(llama, options, error, message):
    with pytest.raises(error, match=message):
        make_llm(llama[0], **options)


@pytest.mark.skipif(settings.fp8_writes_compile(DEVICE), reason="this GPU writes fp8 caches compiled")
def test_fp8_on_the_triton_backend_says_where_it_runs(llama):
    with pytest.raises(UnsupportedError, match=r"cannot run on the triton backend on cpu: .*\(sm_89\+\) only"):
        make_llm(llama[0], kv_cache_dtype="fp8", attention_backend="triton")


def torch_twin_write(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
    """``reshape_and_cache_unchecked``'s fp8 write by its torch twin (the same rounding), for the interpreter,
    which cannot run the kernel's."""
    name = {dtype: name for name, dtype in FP8_CODECS.items()}[kv_cache.dtype]
    quantizer = KVQuantizer(name, key.shape[-1], k_scale=k_scale, v_scale=v_scale)
    return reshape_and_cache_quantized(key, value, kv_cache, slot_mapping, quantizer)


def test_the_triton_backend_serves_fp8_as_the_torch_path(llama, monkeypatch):
    """Prefill (whole prompts, chunks, prefix hits) and decode through the Triton kernels with each layer's
    scales give the torch path's tokens. On CPU the write is the torch twin's (the interpreter rounds float ->
    fp8 wrongly, so there the backend is refused); the reads are the Triton kernels' (both fp8 formats:
    tests/kernels/test_kv_quant.py)."""
    if not settings.fp8_writes_compile(DEVICE):
        monkeypatch.setattr(settings, "fp8_writes_compile", lambda device: True)
        monkeypatch.setattr(attention, "reshape_and_cache_unchecked", torch_twin_write)
    system = prompts(4, (20,))[0]
    batch = [system + p for p in prompts(5, (3, 9))] + prompts(6, (30,))
    runs = {}
    for backend in ("torch", "triton"):
        llm = make_llm(llama[0], kv_cache_dtype="fp8", kv_calibration_prompts=CALIBRATION, attention_backend=backend,
                       max_num_seqs=4, max_num_batched_tokens=24)  # the 30-token prompt in two chunks
        assert llm.attention_backend == backend
        runs[backend] = tokens(llm, batch[:1]) + tokens(llm, batch[1:])  # the others hit the first's blocks
    assert runs["triton"] == runs["torch"]


@pytest.mark.parametrize("name", ["auto", "fp8_e4m3"])
def test_the_accuracy_studys_prefill_reads_the_cache_as_the_engine(llama, name):
    """kvlab.studies.kv_accuracy's teacher-forced prefill gives the engine's first greedy token."""
    from kvlab.studies.kv_accuracy import compare_logits, prefill_hidden

    path, _ = llama
    llm = make_llm(path, kv_cache_dtype=name, kv_calibration_prompts=None if name == "auto" else CALIBRATION)
    prompt = prompts(3, (20,))[0]
    hidden = prefill_hidden(llm, prompt)
    first = int(llm.model.compute_logits(hidden[-1:]).argmax())
    assert first == tokens(llm, [prompt], max_tokens=1)[0][0][0]
    kl, nll_ref, nll, top1 = compare_logits(llm, hidden[:-1], hidden[:-1], torch.tensor(prompt[1:]))
    assert bool((kl.abs() < 1e-6).all() and top1.all() and (nll_ref == nll).all())


def test_offloaded_and_promoted_blocks_keep_their_quantized_bytes(llama):
    """The offload tier holds the format's bytes: a system prompt evicted to it and promoted back gives the
    tokens of a pool that never evicted it."""
    path, _ = llama
    rng = random.Random(3)
    system = [rng.randrange(1, 128) for _ in range(24)]
    second, evictor = system + [7, 8, 9], [rng.randrange(1, 128) for _ in range(60)]
    options = dict(kv_cache_dtype="fp8_e4m3", kv_calibration_prompts=CALIBRATION)
    roomy = make_llm(path, num_blocks=64, **options)
    expected = tokens(roomy, [system + [1, 2]], max_tokens=4) + tokens(roomy, [second], max_tokens=4)
    tiered = make_llm(path, num_blocks=8, num_offload_blocks=16, **options)
    got = [tokens(tiered, [prompt], max_tokens=4)[0] for prompt in (system + [1, 2], evictor, second)]
    assert tiered.kv_cache.tier[0].dtype == torch.float8_e4m3fn
    assert [got[0], got[2]] == expected and tiered.block_manager.tier_stats.tier_hit_blocks == 3
