"""What a quantized KV cache costs in accuracy, on SmolLM2-135M-Instruct on CPU (issue 26 §2).

Against the unquantized cache ("auto": fp32 on CPU), for every format and scale setting of ``CONFIGS``:

* **greedy agreement**: ``num_prompts`` prompts (32-token passages of the text below, one per topic) are
  continued greedily for ``max_tokens`` tokens by the engine, on each cache; per prompt, the tokens generated
  before the first difference (``max_tokens`` when none).
* **next-token KL and perplexity**, teacher-forced: ``windows`` passages of ``context`` tokens each go through
  one prefill on each cache (the torch path writes every token's K/V to the cache, quantized, before any query
  reads it, so token t attends to the quantized K/V of tokens 0..t); KL(auto || format) of every position's
  next-token distribution, and both caches' perplexity on the passage's real next tokens.
* **error against position**: that KL, averaged over the windows, in position buckets (``POSITION_BUCKETS``).

Text: the topics of Python's own help (``pydoc_data.topics``, shipped with CPython; Python Software Foundation
License Version 2), read at run time, nothing downloaded. Evaluation passages come from the topics in sorted
order; the fp8 / int4 scales are calibrated on ``CALIBRATION_PROMPTS`` passages from the last topics, which no
evaluation passage uses.

Defaults (the committed run): 50 prompts x 32 greedy tokens and two 2,048-token passages (positions up to
2,046). Measured with ``OMP_NUM_THREADS=1 nice -n 10`` on two CPU cores shared with other jobs: 20 min 45 s
wall, 700 s of CPU for the twelve settings. KIVI with R >= 64 keeps every token of the greedy runs (32 + 32)
in its window, so those rows' greedy agreement is trivially complete: read their KL and perplexity, or the
R = 32 rows. ``--kivi-attribution`` (``kivi_attribution``, ``key_error_by_channel``) shows where 2-bit KIVI
loses: keys or values, which layer, which key channels.
``python -m kvlab.studies.kv_accuracy [--out data/kv_quant]`` writes ``smollm2_kv_accuracy.csv`` (one row per
setting) and ``smollm2_kv_error_by_position.csv``.
"""

import argparse
import gc
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from kvlab.engine import LLM, SamplingParams
from kvlab.engine.attention import AttentionBatch
from kvlab.engine.config import rope_parameters
from kvlab.engine.kv_cache import cache_storage, engine_layout
from kvlab.kernels import allocate_kv_cache
from kvlab.kernels.kv_quant import KVQuantizer
from kvlab.kernels.torch_paged_quant import ResidualWindow
from kvlab.sizing.kv_dtypes import kivi_format

#: (label, kv_cache_dtype, kv_scale_granularity, calibrated, KIVI's residual length R or None): the settings
#: compared with "auto". KIVI runs on blocks of R tokens (R must divide the block size).
CONFIGS = [("fp8_e4m3 unit scales", "fp8_e4m3", "tensor", False, None),
           ("fp8_e4m3 per-tensor", "fp8_e4m3", "tensor", True, None),
           ("fp8_e4m3 per-head", "fp8_e4m3", "head", True, None),
           ("fp8_e5m2 unit scales", "fp8_e5m2", "tensor", False, None),
           ("k_fp16_v_fp8 per-head", "k_fp16_v_fp8", "head", True, None),
           ("int4_calibrated_channel", "int4_calibrated_channel", "head", True, None),
           ("kivi_int4 G32 R128", "kivi_int4", "tensor", False, 128),
           ("kivi_int4 G32 R32", "kivi_int4", "tensor", False, 32),
           ("kivi_int4 G128 R128", "kivi_int4_g128", "tensor", False, 128),
           ("kivi_int2 G32 R128", "kivi_int2", "tensor", False, 128),
           ("kivi_int2 G32 R32", "kivi_int2", "tensor", False, 32),
           ("kivi_int2 G128 R128", "kivi_int2_g128", "tensor", False, 128)]
POSITION_BUCKETS = (0, 16, 64, 256, 512, 1024, 1536, 2048)
PROMPT_TOKENS = 32
CALIBRATION_PROMPTS = 4
CALIBRATION_TOKENS = 128
BLOCK_SIZE = 16


def pydoc_text() -> list[str]:
    """The help topics' texts, in sorted topic order."""
    from pydoc_data.topics import topics

    return [topics[name] for name in sorted(topics)]


@dataclass
class Corpus:
    prompts: list        # [num_prompts] token-id lists
    windows: list        # [windows] token-id lists of ``context`` tokens
    calibration: list    # token-id lists


def build_corpus(tokenizer, num_prompts: int, windows: int, context: int) -> Corpus:
    topics = [tokenizer.encode(text) for text in pydoc_text()]
    long_enough = [ids for ids in topics[:-CALIBRATION_PROMPTS] if len(ids) >= PROMPT_TOKENS]
    if len(long_enough) < num_prompts:
        raise SystemExit(f"only {len(long_enough)} help topics have {PROMPT_TOKENS} tokens; ask for fewer prompts")
    prompts = [ids[:PROMPT_TOKENS] for ids in long_enough[:num_prompts]]
    stream = [t for ids in topics[:-CALIBRATION_PROMPTS] for t in ids]
    stride = max(context, (len(stream) - context) // max(windows - 1, 1))
    spans = [stream[i * stride:i * stride + context] for i in range(windows)]
    calibration = [ids[:CALIBRATION_TOKENS] for ids in topics[-CALIBRATION_PROMPTS:]]
    return Corpus(prompts, [s for s in spans if len(s) == context], calibration)


def make_llm(path, kv_cache_dtype="auto", granularity="tensor", calibration=None, num_blocks=512,
             residual_length=None) -> LLM:
    """An engine on ``kv_cache_dtype``; KIVI (``residual_length`` R given) on blocks of R tokens, as many tokens."""
    block_size = residual_length or BLOCK_SIZE
    return LLM(path, block_size=block_size, num_blocks=num_blocks * BLOCK_SIZE // block_size,
               kv_cache_dtype=kv_cache_dtype, kv_scale_granularity=granularity, kv_calibration_prompts=calibration,
               kv_residual_length=residual_length, attention_backend="torch")


@torch.inference_mode()
def prefill_hidden(llm: LLM, token_ids: list[int]) -> torch.Tensor:
    """Final hidden states ``[T, hidden]`` of one prefill over ``token_ids`` on a fresh cache in ``llm``'s
    format (its layers hold their quantizers), read back from the cache as the engine reads it."""
    config, device = llm.model_config, llm.device
    n = len(token_ids)
    kv_config = llm.kv_cache_config
    block_size = kv_config.block_size
    num_blocks = -(-n // block_size)
    storage, width = cache_storage(kv_config.groups[0], llm.dtype)
    attention = [layer.self_attn for layer in llm.model.model.layers]
    # Each layer's width from its own quantizer: kivi_attribution mixes bits per layer (KIVI's reads and writes
    # index the pages by block and offset, never by the plan's rows, so the widths may differ).
    caches = [allocate_kv_cache(1, config.num_kv_heads, width if layer.kv_window is None else
                                layer.kv_quantizer.storage_width, block_size=block_size, dtype=storage,
                                device=device, num_blocks=num_blocks)[0] for layer in attention]
    batches = [AttentionBatch.for_backend(
        "torch", caches[0], is_prefill=True, slot_mapping=torch.arange(n, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None],
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        cu_query_lens=torch.tensor([0, n], dtype=torch.int32, device=device), max_seq_len=n,
        num_heads=config.num_heads, sliding_window=group.sliding_window) for group in kv_config.groups]
    # A KIVI cache's windows are keyed by block id: this throwaway cache gets windows of its own.
    engine_windows = [layer.kv_window for layer in attention]
    for layer, window in zip(attention, engine_windows):
        layer.kv_window = None if window is None else ResidualWindow()
    try:
        return llm.model(torch.tensor(token_ids, device=device), torch.arange(n, device=device),
                         [batches[g] for g in kv_config.layer_groups], caches)
    finally:
        for layer, window in zip(attention, engine_windows):
            layer.kv_window = window


@torch.inference_mode()
def compare_logits(llm: LLM, reference: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor, chunk=256):
    """Per position: KL(reference || this cache) of the next-token distributions, both caches' NLL of the real
    next token (``targets [T - 1]``) and whether their top choices agree. Logits are made ``chunk`` rows at a
    time (vocab 49,152)."""
    kl, nll_ref, nll, top1 = [], [], [], []
    for start in range(0, len(targets), chunk):
        rows = slice(start, min(start + chunk, len(targets)))
        ref = llm.model.compute_logits(reference[rows]).log_softmax(-1)
        out = llm.model.compute_logits(hidden[rows]).log_softmax(-1)
        kl.append((ref.exp() * (ref - out)).sum(-1))
        nll_ref.append(-ref.gather(1, targets[rows, None])[:, 0])
        nll.append(-out.gather(1, targets[rows, None])[:, 0])
        top1.append(ref.argmax(-1) == out.argmax(-1))
    return torch.cat(kl), torch.cat(nll_ref), torch.cat(nll), torch.cat(top1)


def error_by_position(kl: torch.Tensor, top1: torch.Tensor) -> list[dict]:
    """``kl``, ``top1 [windows, positions]`` summed up per bucket of ``POSITION_BUCKETS`` (a last bucket cut
    short at the passage's end): one row per bucket that holds a position."""
    rows = []
    for lo, hi in zip(POSITION_BUCKETS, POSITION_BUCKETS[1:]):
        if lo < kl.shape[1]:
            bucket = kl[:, lo:hi].flatten()
            rows.append(dict(positions=f"{lo}-{min(hi, kl.shape[1]) - 1}", samples=bucket.numel(),
                             kl_mean=float(bucket.mean()), kl_p99=float(bucket.quantile(0.99)),
                             top1_agreement=round(float(top1[:, lo:hi].float().mean()), 4)))
    return rows


class MixedKivi(KVQuantizer):
    """A diagnostic KIVI quantizer with keys and values at their own bits (``kivi_attribution``); not a cache
    format the engine serves."""

    def __init__(self, key_bits: int, value_bits: int, group: int, head_dim: int, residual_length: int):
        self.key_bits, self.value_bits = key_bits, value_bits
        super().__init__(kivi_format(4, group), head_dim, residual_length=residual_length)

    @property
    def codecs(self) -> tuple:
        group = self.kivi[1]
        return f"kivi{self.key_bits}_key_g{group}", f"kivi{self.value_bits}_value_g{group}"


def kivi_attribution(path, *, windows=2, context=2048, group=32, residual_length=128):
    """Where 2-bit KIVI's loss comes from, on the study's passages: keys at 2 bits with values at 4, the
    reverse, and each layer alone at 2 bits (keys and values) with every other layer at 4. One row each:
    perplexity (against fp32's) and mean KL."""
    auto = make_llm(path)
    corpus = build_corpus(auto.tokenizer, 1, windows, context)
    reference = [prefill_hidden(auto, window) for window in corpus.windows]
    targets = [torch.tensor(window[1:]) for window in corpus.windows]
    del auto
    llm = make_llm(path, kivi_format(4, group), residual_length=residual_length)
    layers = [layer.self_attn for layer in llm.model.model.layers]
    head_dim = llm.model_config.head_dim

    def measure(label, bits, layer=None):
        for attention, (key_bits, value_bits) in zip(layers, bits):
            attention.kv_quantizer = MixedKivi(key_bits, value_bits, group, head_dim, residual_length)
        compared = zip(*(compare_logits(llm, ref[:-1], prefill_hidden(llm, window)[:-1], target)
                         for ref, window, target in zip(reference, corpus.windows, targets)))
        kl, nll_ref, nll, _ = (torch.stack(x) for x in compared)
        row = dict(setting=label, layer=layer, key_bits=bits[layer or 0][0], value_bits=bits[layer or 0][1],
                   ppl=float(nll.mean().exp()), ppl_auto=float(nll_ref.mean().exp()), kl_mean=float(kl.mean()))
        print(f"{label:>32}: ppl {row['ppl']:.3f} (fp32 {row['ppl_auto']:.3f}), KL {row['kl_mean']:.4f}",
              file=sys.stderr)
        return row

    n = len(layers)
    rows = [measure(f"K {k} bits, V {v} bits, every layer", [(k, v)] * n) for k, v in ((4, 4), (2, 4), (4, 2), (2, 2))]
    rows += [measure(f"layer {i} at 2 bits, the rest at 4", [(2, 2) if j == i else (4, 4) for j in range(n)], i)
             for i in range(n)]
    return pd.DataFrame(rows)


@torch.inference_mode()
def key_error_by_channel(path, *, windows=2, context=2048, group=32, bits=(2, 4)):
    """Per key channel, over every layer, KV head and position of the study's passages: KIVI's relative error
    on the keys the model writes (after the rotary embedding), at each of ``bits`` with key groups of
    ``group`` tokens, beside the channel's rotary frequency and how much it moves from one token to the next
    (RMS of k[t] - k[t - 1] over RMS of k): a channel that turns fast spreads over its group's range."""
    llm = make_llm(path)
    config = llm.model_config
    corpus = build_corpus(llm.tokenizer, 1, windows, context)
    layers = [layer.self_attn for layer in llm.model.model.layers]
    keys = [[] for _ in layers]
    for attention, seen in zip(layers, keys):
        attention.kv_observer = lambda key, value, seen=seen: seen.append(key.float().clone())
    try:
        for window in corpus.windows:
            prefill_hidden(llm, window)
    finally:
        for attention in layers:
            attention.kv_observer = None
    d = config.head_dim
    whole = context // group * group
    sums = {b: torch.zeros(2, d) for b in bits}                            # per channel: |error|^2, |k|^2
    moves = torch.zeros(2, d)
    for layer_keys in keys:
        for key in layer_keys:                                              # one passage of one layer
            key = key[:whole]
            for b in bits:
                decoded = KVQuantizer(kivi_format(b, group), d).decode(KVQuantizer(kivi_format(b, group), d)
                                                                       .encode(key, key))[0]
                sums[b] += torch.stack(((decoded - key).square().sum((0, 1)), key.square().sum((0, 1))))
            moves += torch.stack(((key[1:] - key[:-1]).square().sum((0, 1)), key[1:].square().sum((0, 1))))
    half = torch.arange(d) % (d // 2)                                       # rotate-half pairs channel c, c + D/2
    frequency = rope_parameters(config.hf_config)["rope_theta"] ** (-2 * half / d)
    return pd.DataFrame(dict(channel=range(d), rope_radians_per_token=frequency.tolist(),
                             step_change=(moves[0] / moves[1]).sqrt().tolist(),
                             **{f"kivi{b}_rel_error": (sums[b][0] / sums[b][1]).sqrt().tolist() for b in bits}))


def greedy(llm: LLM, prompts, max_tokens: int) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def tokens_to_divergence(reference: list[int], tokens: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b), len(reference))


def run_study(path, *, num_prompts=50, max_tokens=32, windows=2, context=2048):
    """Returns (one row per setting, KL by position bucket per setting), both DataFrames."""
    started = time.perf_counter()
    auto = make_llm(path)
    corpus = build_corpus(auto.tokenizer, num_prompts, windows, context)
    reference_tokens = greedy(auto, corpus.prompts, max_tokens)
    reference_hidden = [prefill_hidden(auto, window) for window in corpus.windows]
    targets = [torch.tensor(window[1:]) for window in corpus.windows]
    bytes_auto = engine_layout(auto.model_config, auto.dtype).bytes_per_token
    bytes_bf16 = engine_layout(auto.model_config, torch.bfloat16).bytes_per_token
    rows, by_position = [], []
    for label, name, granularity, calibrated, residual_length in CONFIGS:
        llm = make_llm(path, name, granularity, corpus.calibration if calibrated else None,
                       residual_length=residual_length)
        agreement = [tokens_to_divergence(r, t) for r, t in zip(reference_tokens, greedy(llm, corpus.prompts,
                                                                                          max_tokens))]
        compared = zip(*(compare_logits(llm, ref[:-1], prefill_hidden(llm, window)[:-1], target)
                         for ref, window, target in zip(reference_hidden, corpus.windows, targets)))
        kl, nll_ref, nll, top1 = (torch.stack(x) for x in compared)  # each [windows, context - 1]
        bytes_per_token = engine_layout(llm.model_config, llm.dtype, name).bytes_per_token
        rows.append(dict(
            setting=label, kv_cache_dtype=name,
            scales=("from the data" if residual_length else granularity if calibrated else "unit (1.0)"),
            residual_length=residual_length,
            bytes_per_token=bytes_per_token, vs_bf16=round(bytes_bf16 / bytes_per_token, 2),
            vs_fp32=round(bytes_auto / bytes_per_token, 2), prompts=len(agreement),
            mean_tokens_to_divergence=round(float(np.mean(agreement)), 2),
            median_tokens_to_divergence=float(np.median(agreement)),
            share_identical=round(float(np.mean([a == max_tokens for a in agreement])), 3),
            kl_mean=float(kl.mean()), kl_p99=float(kl.flatten().quantile(0.99)),
            top1_agreement=round(float(top1.float().mean()), 4), ppl=float(nll.mean().exp()),
            ppl_auto=float(nll_ref.mean().exp())))
        by_position += [dict(setting=label, **row) for row in error_by_position(kl, top1)]
        print(f"{label:>24}: {rows[-1]['mean_tokens_to_divergence']:5.1f} tokens to divergence, "
              f"KL {rows[-1]['kl_mean']:.2e}, ppl {rows[-1]['ppl']:.3f} (auto {rows[-1]['ppl_auto']:.3f}) "
              f"[{time.perf_counter() - started:.0f} s]", file=sys.stderr)
        del llm
        gc.collect()
    return pd.DataFrame(rows), pd.DataFrame(by_position)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.studies.kv_accuracy", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="a SmolLM2-like model directory (default: kvlab.models.smollm2())")
    parser.add_argument("--prompts", type=int, default=50, help="greedy prompts (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt (default: %(default)s)")
    parser.add_argument("--windows", type=int, default=2, help="teacher-forced passages (default: %(default)s)")
    parser.add_argument("--context", type=int, default=2048, help="tokens per passage (default: %(default)s)")
    parser.add_argument("--out", default="data/kv_quant", help="output directory (default: %(default)s)")
    parser.add_argument("--kivi-attribution", action="store_true",
                        help="instead: where 2-bit KIVI's loss comes from (keys or values, layer by layer; "
                             "key error by channel), written to smollm2_kivi2_attribution.csv and "
                             "smollm2_kivi_key_error_by_channel.csv")
    args = parser.parse_args(argv)
    if args.model is None:
        from kvlab.models import smollm2
        args.model = smollm2()
    torch.manual_seed(0)
    out = Path(args.out)
    if args.kivi_attribution:
        table = kivi_attribution(args.model, windows=args.windows, context=args.context)
        out.mkdir(parents=True, exist_ok=True)
        table.to_csv(out / "smollm2_kivi2_attribution.csv", index=False, float_format="%.6g")
        print(table.to_string(index=False))
        channels = key_error_by_channel(args.model, windows=args.windows, context=args.context)
        channels.to_csv(out / "smollm2_kivi_key_error_by_channel.csv", index=False, float_format="%.6g")
        print(channels.to_string(index=False))
        return 0
    summary, by_position = run_study(args.model, num_prompts=args.prompts, max_tokens=args.max_tokens,
                                     windows=args.windows, context=args.context)
    out.mkdir(parents=True, exist_ok=True)
    summary.to_csv(out / "smollm2_kv_accuracy.csv", index=False, float_format="%.6g")
    by_position.to_csv(out / "smollm2_kv_error_by_position.csv", index=False, float_format="%.6g")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(summary.drop(columns=["kv_cache_dtype"]).to_string(index=False))
        print(by_position.pivot(index="positions", columns="setting", values="kl_mean").to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
