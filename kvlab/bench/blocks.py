"""Block-manager throughput: replay the Mooncake conversation trace through ``BlockManager``.

Each request is allocated and freed in turn (one at a time), so the pool's cache carries prefixes from
request to request exactly as the trace's hash ids say. Timed: ``allocate`` + ``free`` only (hashing
included; building the ``Sequence`` from the trace is not). Reported per block: the blocks each request's
prompt occupies. Wall time and process CPU time are both printed; on a shared machine trust CPU time.
"""

import argparse
import platform
import time

from kvlab import BlockManager, Sequence
from kvlab.traces import PromptTokens, load_trace


def replay(prompts: PromptTokens, num_blocks: int, block_size: int) -> dict:
    manager = BlockManager(num_blocks, block_size)
    wall = cpu = 0.0
    blocks = 0
    for i in range(len(prompts)):
        seq = Sequence(prompts[i], block_size)
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        manager.allocate(seq)
        manager.free(seq)
        wall += time.perf_counter() - wall_start
        cpu += time.process_time() - cpu_start
        blocks += seq.num_blocks
    return dict(pool_blocks=num_blocks, requests=len(prompts), blocks=blocks, us_per_block_wall=wall / blocks * 1e6,
                us_per_block_cpu=cpu / blocks * 1e6, hit_rate=manager.stats.hit_rate,
                evictions=manager.num_evictions)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench blocks", description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="mooncake_conversation", help="bundled trace name or path")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--pools", default="10000,100000,1000000", help="comma-separated pool sizes (blocks)")
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    args = parser.parse_args(argv)
    prompts = PromptTokens(load_trace(args.trace, limit=args.limit))
    print(f"{args.trace}: {len(prompts)} requests, block size {args.block_size}, "
          f"python {platform.python_version()} on {platform.machine()} ({platform.processor() or 'cpu'})")
    print(f"{'pool blocks':>12} {'blocks':>10} {'us/block cpu':>13} {'us/block wall':>14} {'hit rate':>9} "
          f"{'evictions':>10}")
    for pool in (int(p) for p in args.pools.split(",")):
        r = replay(prompts, pool, args.block_size)
        print(f"{pool:>12,} {r['blocks']:>10,} {r['us_per_block_cpu']:>13.3f} {r['us_per_block_wall']:>14.3f} "
              f"{r['hit_rate']:>9.3f} {r['evictions']:>10,}")
    return 0
