"""``kvlab size``: what a model's KV cache costs per token and per block, and how many blocks, tokens and
concurrent requests a GPU's memory holds (``kvlab.sizing.plan``), every figure with its arithmetic.

``kvlab size --model DIR_OR_CONFIG_JSON [--kv-cache-dtype auto] [--gpu-memory 80GiB] [--max-model-len N]
[--block-size 16] [--kv-residual-length R]``. Nothing is loaded but ``config.json`` (and the sizes of a
directory's safetensors).
"""

import argparse
import sys

from kvlab.cli.options import option, whole_number
from kvlab.errors import InvalidArgumentError, KvlabError
from kvlab.sizing.budget import GPU_MEMORY_UTILIZATION, parse_memory
from kvlab.sizing.hf_config import MAX_TOKENS, read_model_shape
from kvlab.sizing.kv_dtypes import KV_FORMATS
from kvlab.sizing.plan import size_model
from kvlab.sizing.report import format_sizing
from kvlab.validation import check_int, check_number

KV_CACHE_DTYPES = ("auto", *KV_FORMATS)


def count(name: str):
    """An option of tokens or sequences: a whole number from 1 to ``MAX_TOKENS``."""
    return option(lambda text: check_int(name, whole_number(text), 1, MAX_TOKENS))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab size", description="How much KV cache memory a model needs per token and per block, and how "
                                       "many blocks, tokens and concurrent requests a GPU's memory holds after "
                                       "the weights and activations (from its Hugging Face config.json).")
    parser.add_argument("--model", required=True, help="a model directory or its config.json")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="the cache's format: vLLM's names, or kvlab's kivi_int4 / kivi_int2 (KIVI, key groups of "
                             "32 tokens; _g64, _g128, _g16 for others), int4_calibrated_channel and k_fp16_v_fp8 "
                             "(auto: the model's dtype; default: %(default)s)")
    parser.add_argument("--kv-residual-length", type=count("kv residual length"), default=None,
                        help="a KIVI cache's R: the newest tokens of each running sequence kept in the model's "
                             "dtype beside the pages, counted before the blocks (default: the block size)")
    parser.add_argument("--gpu-memory", type=option(parse_memory), default="80GiB",
                        help="the GPU's memory, e.g. 80GiB, 80GB, 24e9 (default: %(default)s)")
    parser.add_argument("--gpu-memory-utilization", default=GPU_MEMORY_UTILIZATION,
                        type=option(lambda t: check_number("gpu memory utilization", float(t), 0, 1, min_open=True)),
                        help="the share of that memory used, as vLLM's (default: %(default)s)")
    parser.add_argument("--max-model-len", type=count("max model len"), default=None,
                        help="tokens per request (default: the config's max_position_embeddings)")
    parser.add_argument("--block-size", type=count("block size"), default=16,
                        help="tokens per block (default: %(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=count("max num batched tokens"), default=8192,
                        help="tokens per step, for the activations and the windows (default: %(default)s)")
    parser.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "float32", "float16", "bfloat16"),
                        default="auto", help="a hybrid state model's recurrent state dtype, as vLLM's (auto: the "
                                             "model's dtype; default: %(default)s)")
    parser.add_argument("--max-num-seqs", type=count("max num seqs"), default=256,
                        help="sequences per step, for the logits (default: %(default)s)")
    return parser


def main(argv=None) -> int:
    """Entry point of ``kvlab size``; ``argv`` are the arguments after ``size``."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        shape = read_model_shape(args.model)
        if args.max_model_len is not None and args.max_model_len > shape.max_position_embeddings:
            raise InvalidArgumentError(f"--max-model-len {args.max_model_len} is longer than the model's context "
                                       f"({shape.max_position_embeddings} positions)")
        sizing = size_model(shape, kv_cache_dtype=args.kv_cache_dtype, gpu_memory=args.gpu_memory,
                            gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
                            block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_num_seqs=args.max_num_seqs, mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype,
                            kv_residual_length=args.kv_residual_length)
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
