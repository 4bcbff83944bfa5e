"""Block-manager throughput: replay the Mooncake conversation trace through ``BlockManager``.

Each request, one at a time: build a ``Sequence`` from its token list, ``can_allocate``, ``allocate``,
``free``. The pool's cache carries prefixes from request to request exactly as the trace's hash ids say.
The whole loop is timed (sequence construction and hashing included; turning the trace into token lists is
not) and reported per block a prompt occupies, in process CPU time (trust it over wall time on a shared
machine). With ``--vs-nano PATH`` nano-vllm's own BlockManager runs through the same driver in the same
process, on the same token lists (once per pool: it is slow), and the ratio is printed. With ``--offload-blocks N``
each pool is also replayed with an offload tier of N CPU blocks (``--offload-policy lru,arc``, ``--offload-admission
always,reused``; its copies are taken after each request, as the engine does), and each tier's cost per block is
printed against the single tier's of the same run (the runs take turns, so a slow spell slows them alike).
"""

import argparse
import gc
import importlib
import platform
import sys
import time
import types
from pathlib import Path

from kvlab import AllocStatus, BlockManager, Sequence
from kvlab.studies.traces import PromptTokens, load_trace


def replay_kvlab(token_lists, num_blocks: int, block_size: int, **tier) -> dict:
    """``tier``: BlockManager's offload-tier options (none: a single tier)."""
    manager = BlockManager(num_blocks, block_size, **tier)
    blocks = skipped = 0
    gc.collect()  # an earlier replay's manager (reference cycles) must not be collected on this one's clock
    cpu_start = time.process_time()
    for tokens in token_lists:
        seq = Sequence(tokens, block_size)
        hit = manager.lookup(seq)  # once, as the V1 scheduler does (the tier's copies allocate returns are dropped)
        if manager.can_allocate(seq, hit=hit) is not AllocStatus.OK:
            skipped += 1
            continue
        manager.allocate(seq, hit=hit)
        manager.free(seq)
        blocks += seq.num_blocks
    cpu = time.process_time() - cpu_start
    if not blocks:
        raise SystemExit(f"--pools: no request of the {len(token_lists)} replayed fits a pool of {num_blocks} blocks "
                         f"of {block_size} tokens; give larger pools")
    return dict(blocks=blocks, skipped=skipped, us_per_block=cpu / blocks * 1e6, hit_rate=manager.stats.hit_rate)


def fastest(runs) -> dict:
    return min(runs, key=lambda run: run["us_per_block"])


def load_nano(path: Path):
    """nano-vllm's block manager and sequence modules, without its package ``__init__`` (which imports the
    whole engine: torch, flash-attn, a GPU). They need only xxhash and numpy."""
    root = Path(path).resolve()
    if not (root / "nanovllm" / "engine" / "block_manager.py").is_file():
        raise SystemExit(f"--vs-nano: {root} is not a nano-vllm checkout (no nanovllm/engine/block_manager.py)")
    package = types.ModuleType("nanovllm")
    package.__path__ = [str(root / "nanovllm")]
    sys.modules.setdefault("nanovllm", package)
    return (importlib.import_module("nanovllm.engine.block_manager"),
            importlib.import_module("nanovllm.engine.sequence"))


def replay_nano(nano, token_lists, num_blocks: int, block_size: int) -> dict:
    block_manager, sequence = nano
    sequence.Sequence.block_size = block_size
    manager = block_manager.BlockManager(num_blocks, block_size)
    blocks = skipped = 0
    gc.collect()
    cpu_start = time.process_time()
    for tokens in token_lists:
        seq = sequence.Sequence(tokens)
        num_cached = manager.can_allocate(seq)
        if num_cached == -1:
            skipped += 1
            continue
        manager.allocate(seq, num_cached)
        # nano-vllm registers a prompt's full blocks after scheduling it (kvlab's allocate seals them itself).
        seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
        manager.hash_blocks(seq)
        manager.deallocate(seq)
        blocks += seq.num_blocks
    cpu = time.process_time() - cpu_start
    return dict(blocks=blocks, skipped=skipped, us_per_block=cpu / blocks * 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench blocks", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake_conversation", help="bundled trace name or path")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pools", default="10000,100000,1000000", help="comma-separated pool sizes (blocks)")
    parser.add_argument("--limit", type=int, default=300, help="replay the first N requests (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest is kept")
    parser.add_argument("--vs-nano", type=Path, metavar="PATH",
                        help="a nano-vllm checkout (e.g. ../shared/anchors/nano-vllm) to run side by side")
    parser.add_argument("--offload-blocks", type=int, default=0, help="an offload tier of N CPU blocks too (0: none)")
    parser.add_argument("--offload-policy", default="lru,arc", help="the tier's policies, comma-separated")
    parser.add_argument("--offload-admission", default="always,reused", help="the tier's admissions, comma-separated")
    args = parser.parse_args(argv)
    tiers = [dict(num_offload_blocks=args.offload_blocks, offload_policy=p, offload_admission=a)
             for p in args.offload_policy.split(",") for a in args.offload_admission.split(",")
             ] if args.offload_blocks else []
    token_lists = [prompt.tolist() for prompt in PromptTokens(load_trace(args.trace, limit=args.limit))]
    nano = load_nano(args.vs_nano) if args.vs_nano else None
    print(f"{args.trace}: {len(token_lists)} requests, block size {args.block_size}, best of {args.repeat}, "
          f"python {platform.python_version()} on {platform.machine()} ({platform.processor() or 'cpu'})")
    header = f"{'pool blocks':>12} {'blocks':>10} {'kvlab us/block':>15} {'hit rate':>9}"
    print(header + (f" {'nano us/block':>14} {'nano/kvlab':>11}" if nano else ""))
    for pool in (int(p) for p in args.pools.split(",")):
        # The single tier and each offload tier take turns, so a slow spell of a shared machine slows them alike.
        runs = [[replay_kvlab(token_lists, pool, args.block_size, **tier) for tier in [{}] + tiers]
                for _ in range(args.repeat)]
        ours, *with_tiers = map(fastest, zip(*runs))
        line = f"{pool:>12,} {ours['blocks']:>10,} {ours['us_per_block']:>15.3f} {ours['hit_rate']:>9.3f}"
        if nano:  # one run: at large pools nano-vllm takes minutes (its deque.remove is O(pool))
            theirs = replay_nano(nano, token_lists, pool, args.block_size)
            line += f" {theirs['us_per_block']:>14.3f} {theirs['us_per_block'] / ours['us_per_block']:>10.1f}x"
        print(line)
        for tier, run in zip(tiers, with_tiers):  # same run, same pool: the ratio to the single tier above
            print(f"{'':>12} {'+ tier ' + tier['offload_policy'] + '/' + tier['offload_admission']:>22} "
                  f"{run['us_per_block']:>8.3f} us/block: "
                  f"{run['us_per_block'] / ours['us_per_block']:.2f}x the single tier")
    return 0
