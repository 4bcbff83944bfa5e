"""``kvlab size``: what a model's KV cache costs per token and per block, and how many blocks, tokens and
concurrent requests a GPU's memory holds (``kvlab.sizing.plan``), every figure with its arithmetic.

``kvlab size --model DIR_OR_CONFIG_JSON [--kv-cache-dtype auto] [--gpu-memory 80GiB] [--max-model-len N]
[--block-size 16]``. Nothing is loaded but ``config.json`` (and the sizes of a directory's safetensors).
"""

import argparse
import sys
from collections import Counter

from kvlab.cli_options import option, whole
from kvlab.errors import InvalidArgumentError, KvlabError
from kvlab.sizing.budget import GPU_MEMORY_UTILIZATION, parse_memory
from kvlab.sizing.groups import ENGINE, VLLM, blocks_per_request
from kvlab.sizing.layout import DTYPE_BYTES
from kvlab.sizing.plan import Pool, Sizing, size_model
from kvlab.validation import check_int, check_number

KV_CACHE_DTYPES = ("auto", *DTYPE_BYTES)


def _size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``2.00 MiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:,.0f} B"


def _kind(window) -> str:
    return "full" if window is None else f"sliding {window}"


def describe_layers(s: Sizing) -> str:
    layout, shape = s.layout, s.shape
    kinds = [f"{layout.full_layers} full attention"] if layout.full_layers else []
    kinds += [f"{count} sliding-window ({window} tokens)" for window, count in layout.windows.items()]
    heads = (f"MLA: one latent of {layout.mla_latent_dim} per token for {shape.num_heads} heads"
             if layout.mla_latent_dim else f"{shape.num_heads} query heads share {shape.num_kv_heads} kv heads")
    return (f"{shape.name}: {shape.model_type} ({shape.architecture}), {layout.num_layers} layers: "
            f"{', '.join(kinds)}; {heads}")


def _per_request(pool: Pool, s: Sizing) -> str:
    counts = Counter(pool.groups.groups)
    terms = [f"{'' if n == 1 else f'{n} x '}{blocks_per_request(w, s.max_model_len, s.block_size, s.max_num_batched_tokens):,} "
             f"({_kind(w)})" for w, n in counts.items()]
    return " + ".join(terms)


def format_sizing(s: Sizing, kv_dtype_note: str) -> str:
    layout, b = s.layout, s.block_size
    per_layer = layout.bytes_per_token_per_layer
    lines = [describe_layers(s), f"KV cache dtype: {layout.dtype}{kv_dtype_note}", "",
             f"per token and layer: {layout.per_layer_formula()}",
             f"per token, model:    {per_layer:,} B x {layout.num_layers} layers = {layout.bytes_per_token:,} B "
             f"({_size(layout.bytes_per_token)})" + (" while every window still holds the token" if layout.windows else "")]
    if layout.windows:
        lines.append(f"  past the windows:  {per_layer:,} B x {layout.full_layers} full-attention layers = "
                     f"{layout.bytes_per_token_past_windows:,} B ({_size(layout.bytes_per_token_past_windows)}): a "
                     "sliding-window layer keeps at most its window's tokens")
        lines.append(f"  one request of {s.max_model_len:,} tokens, token-exact: "
                     f"{layout.bytes_for_tokens(s.max_model_len):,} B ({_size(layout.bytes_for_tokens(s.max_model_len))}),"
                     f" against {_size(layout.bytes_per_token * s.max_model_len)} if every layer kept every token")
    lines.append(f"per page (one layer, one block of {b} tokens): {per_layer:,} B x {b} = {layout.page_bytes(b):,} B")
    for pool in s.pools:
        groups = pool.groups
        where = (f"a page in each of the {groups.pages_per_block} layers" if groups.name == ENGINE else
                 f"groups of {groups.pages_per_block} layers, {len(groups.groups)} groups"
                 + (f" ({groups.padding_layers} padding layer{'s' * (groups.padding_layers != 1)})"
                    if groups.padding_layers else "") + f", a page in each of the {groups.pages_per_block} tensors")
        lines.append(f"per block id, {groups.name}: {layout.page_bytes(b):,} B x {groups.pages_per_block} = "
                     f"{pool.bytes_per_block:,} B ({_size(pool.bytes_per_block)}); {where}")
    usable = s.gpu_memory * s.gpu_memory_utilization
    lines += ["", f"memory: {_size(s.gpu_memory)} x {s.gpu_memory_utilization:g} gpu_memory_utilization = {_size(usable)}",
              f"  - weights      {_size(s.weights):>12}  ({s.weights_source})",
              f"  - activations  {_size(s.activations):>12}  (a bound for {s.max_num_batched_tokens:,} batched tokens "
              f"and {s.max_num_seqs} sequences)",
              f"  = KV cache     {_size(s.kv_memory):>12}"]
    if s.kv_memory <= 0:
        lines.append("  no room for the KV cache: the weights and activations take the whole budget")
    for pool in s.pools:
        lines.append(f"{pool.groups.name}: {_size(max(s.kv_memory, 0))} / {pool.bytes_per_block:,} B = "
                     f"{pool.num_blocks:,} blocks of {b} tokens ({pool.num_blocks * b:,} token slots"
                     + (f"; vLLM logs 'KV cache size: {pool.num_blocks // len(pool.groups.groups) * b:,} tokens', "
                        f"the blocks over its {len(pool.groups.groups)} groups" if pool.groups.name == VLLM else "")
                     + ")")
        lines.append(f"  a request of {s.max_model_len:,} tokens holds {_per_request(pool, s)} = "
                     f"{pool.blocks_per_request:,} blocks: Maximum concurrency for {s.max_model_len:,} tokens per "
                     f"request: {pool.max_concurrency:.2f}x")
    lines += ["", "assumptions: the budget is gpu_memory_utilization of the GPU's memory; weights as stated above; "
              "activations are kvlab's engine's bound (2 x batched tokens x (3 hidden + (heads + 2 kv heads) x "
              "head_dim + 2 intermediate) x dtype bytes, plus fp32 logits x 3 per sequence); a sliding-window "
              f"group holds cdiv(min(window - 1 + {s.max_num_batched_tokens:,}, max_model_len), block_size) + 1 "
              "blocks per request (vLLM's bound, chunked prefill included)."]
    if len(s.pools) > 1:
        lines.append("hybrid model: kvlab's engine keeps one cache tensor per layer for every block id, so a "
                     "block id costs a page in every layer; vLLM V1 shares each tensor between one layer of every "
                     "group, so a block id costs a page in only group-size layers, but a request takes blocks in "
                     "every group.")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab size", description="How much KV cache memory a model needs per token and per block, and how "
                                       "many blocks, tokens and concurrent requests a GPU's memory holds after "
                                       "the weights and activations (from its Hugging Face config.json).")
    parser.add_argument("--model", required=True, help="a model directory or its config.json")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the cache's element type, vLLM's names (auto: the model's dtype; default: %(default)s)")
    parser.add_argument("--gpu-memory", type=option(parse_memory), default="80GiB",
                        help="the GPU's memory, e.g. 80GiB, 80GB, 24e9 (default: %(default)s)")
    parser.add_argument("--gpu-memory-utilization", default=GPU_MEMORY_UTILIZATION,
                        type=option(lambda t: check_number("gpu memory utilization", float(t), 0, 1, min_open=True)),
                        help="the share of that memory used, as vLLM's (default: %(default)s)")
    parser.add_argument("--max-model-len", type=option(lambda t: check_int("max model len", whole(t), 1)),
                        default=None, help="tokens per request (default: the config's max_position_embeddings)")
    parser.add_argument("--block-size", type=option(lambda t: check_int("block size", whole(t), 1)), default=16,
                        help="tokens per block (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", default=8192,
                        type=option(lambda t: check_int("max num batched tokens", whole(t), 1)),
                        help="tokens per step, for the activations and the windows (default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=option(lambda t: check_int("max num seqs", whole(t), 1)),
                        default=256, help="sequences per step, for the logits (default: %(default)s)")
    return parser


def main(argv=None) -> int:
    """Entry point of ``kvlab size``; ``argv`` are the arguments after ``size``."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    from kvlab.sizing.hf_config import read_model_shape  # imports transformers: after the options are checked

    try:
        shape = read_model_shape(args.model)
        if args.max_model_len is not None and args.max_model_len > shape.max_position_embeddings:
            raise InvalidArgumentError(f"--max-model-len {args.max_model_len} is longer than the model's context "
                             f"({shape.max_position_embeddings} positions)")
        sizing = size_model(shape, kv_cache_dtype=args.kv_cache_dtype, gpu_memory=args.gpu_memory,
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs)
    except KvlabError as e:
        print(f"kvlab size: error: {e}", file=sys.stderr)
        return 2
    note = ""
    if args.kv_cache_dtype == "auto":
        note = (" (auto: the config's dtype)" if shape.dtype == sizing.layout.dtype else
                f" (auto: {sizing.layout.dtype} assumed; the config states "
                + (f"{shape.dtype}, not a cache dtype)" if shape.dtype else "no dtype)"))
    print(format_sizing(sizing, note))
    return 0
