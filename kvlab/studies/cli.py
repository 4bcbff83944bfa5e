"""``kvlab study``: replay traces through the block manager and report prefix-cache hit rates.

With no arguments it runs the project's main job (about 30 s on two CPU cores): the bundled Mooncake
conversation trace (12,031 real requests, ~12k prompt tokens each) at its native 512-token blocks,
sequential replay, pools from 1,000 to 64,000 blocks (0.5 to 33 M tokens) plus an infinite one, under LRU,
FIFO and LFU. It prints a table and a summary, and writes ``results/study.csv`` and ``results/study.png``.

``--offload-capacity 0,8000`` (with ``--offload-policy``, ``--offload-admission``) puts a CPU offload tier behind
each pool (kvlab.studies.tiers: per-tier hit columns); ``--kv-cache-metrics-sample`` samples residency metrics
(kvlab.blocks.events). Every row carries the TTFT model's columns (kvlab.studies.ttft_model), whose
assumptions (``--ttft-model``, ``--kv-cache-dtype``, ``--prefill-tokens-per-s``, ``--h2d-gb-per-s``) are printed
with the results and written beside the CSV, in ``ttft_model.txt``.
"""

import argparse
import math
import sys
from pathlib import Path

import matplotlib.pyplot as plt

from kvlab.blocks.eviction import POLICIES
from kvlab.blocks.tiers import OFFLOAD_ADMISSIONS, OFFLOAD_POLICIES
from kvlab.errors import KvlabError, ReplayError
from kvlab.sizing.kv_dtypes import KV_FORMATS
from kvlab.studies.cli_options import (block_size_number, check_out, comma_list, count_of, directory, option,
                                      positive_number, retries, whole_number)
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.plots import plot_hit_rates
from kvlab.studies.simulator import MAX_CAPACITY, MODES, check_capacity, policy_factory
from kvlab.studies.study import cache_hit_study
from kvlab.studies.sweep import RETRIES
from kvlab.studies.summary import summary
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.tiers import check_offload_capacity
from kvlab.studies.traces import BUNDLED
from kvlab.studies.ttft_model import MODELS, TTFTModel
from kvlab.validation import check_number

DEFAULTS = dict(trace="mooncake_conversation", block_size="512",
                capacity="1000,2000,4000,8000,16000,32000,64000,inf", policy="lru,fifo,lfu", mode="sequential",
                out="results", offload_capacity="0", offload_policy="lru", offload_admission="always")
TTFT = TTFTModel()
#: What a study writes in ``--out``: the table, its figure and the TTFT model's assumptions.
OUTPUTS = ("study.csv", "study.png", "ttft_model.txt", "study_rows.jsonl")
MAIN_JOB = ("the Mooncake conversation trace at 512-token blocks, pools of 1,000 to 64,000 blocks and an "
            "infinite one, LRU, FIFO and LFU, one request at a time (about 30 s).")
SHOWN = ["trace", "block_size", "capacity_blocks", "policy", "hit_rate_tokens", "hit_rate_blocks",
         "ceiling_hit_rate_tokens", "evictions", "prefill_tokens_saved", "requests_skipped", "ttft_mean_ms"]
#: Shown after the policy when the sweep has an offload tier.
SHOWN_TIER = ["offload_capacity_blocks", "offload_policy", "offload_admission", "tier_hit_blocks", "ttft_tier_gain_ms"]
#: Shown in a second table when residency metrics were sampled (seconds on the trace's clock).
SHOWN_RESIDENCY = ["gpu_lifetime_s_p50", "gpu_lifetime_s_p90", "gpu_idle_s_p50", "gpu_idle_s_p90",
                   "gpu_reuse_gap_s_p50", "cpu_lifetime_s_p50", "cpu_idle_s_p50"]


def _capacity(text: str):
    if text.lower() in ("inf", "infinite"):
        return math.inf
    try:
        return check_capacity(whole_number(text))
    except ValueError:
        raise ValueError(f"expected a number of blocks in [1, {MAX_CAPACITY:,}] or 'inf', got {text!r}") from None


def _policy(text: str) -> str:
    return policy_factory(text)[0]


def _offload_capacity(text: str) -> int:
    try:
        return check_offload_capacity(whole_number(text))
    except ValueError:
        raise ValueError(f"expected a number of CPU blocks in [0, {MAX_CAPACITY:,}] (0: no tier), got "
                         f"{text!r}") from None


def _one_of(what: str, known):
    def parse(text: str) -> str:
        if text not in known:
            raise ValueError(f"unknown {what} {text!r}; known: {', '.join(known)}")
        return text
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvlab study", description="Replay traces through kvlab's block manager and report prefix-cache "
                                        "hit rates per block size, pool size and eviction policy.",
        epilog=f"With no options: {MAIN_JOB} Traces: {', '.join(BUNDLED)} (bundled), {', '.join(WORKLOADS)} "
               "(synthetic), or a path to a .jsonl (Mooncake shape) or .csv (Azure shape) file.")
    parser.add_argument("--trace", type=comma_list(str), default=DEFAULTS["trace"],
                        help="trace names or paths, comma-separated (default: %(default)s)")
    parser.add_argument("--block-size", type=comma_list(block_size_number), default=DEFAULTS["block_size"],
                        help="tokens per block, comma-separated (default: %(default)s)")
    parser.add_argument("--capacity", type=comma_list(_capacity), default=DEFAULTS["capacity"],
                        help=f"pool sizes in blocks, comma-separated, each at most {MAX_CAPACITY:,} (the block "
                             "manager's limit); 'inf' never evicts (default: %(default)s)")
    parser.add_argument("--policy", type=comma_list(_policy), default=DEFAULTS["policy"],
                        help=f"eviction policies among {', '.join(POLICIES)} (default: %(default)s)")
    parser.add_argument("--offload-capacity", type=comma_list(_offload_capacity), default=DEFAULTS["offload_capacity"],
                        help="CPU offload tier sizes in blocks behind each pool, comma-separated; 0 is no tier "
                             "(vLLM's kv_offloading_size; sequential mode; default: %(default)s)")
    parser.add_argument("--offload-policy", type=comma_list(_one_of("offload policy", list(OFFLOAD_POLICIES))),
                        default=DEFAULTS["offload_policy"],
                        help=f"the tier's replacement policies among {', '.join(OFFLOAD_POLICIES)} (default: "
                             "%(default)s)")
    parser.add_argument("--offload-admission", type=comma_list(_one_of("offload admission", OFFLOAD_ADMISSIONS)),
                        default=DEFAULTS["offload_admission"],
                        help="which evicted blocks the tier takes: 'always', or 'reused' (looked up twice, vLLM's "
                             "reuse filter); comma-separated (default: %(default)s)")
    parser.add_argument("--kv-cache-metrics-sample", metavar="RATE", default=None,
                        type=option(lambda t: check_number("kv cache metrics sample", float(t), 0, 1, min_open=True)),
                        help="sample this share of cached blocks for residency metrics (lifetime, idle before "
                             "eviction, reuse gap; vLLM's --kv-cache-metrics-sample; sequential mode; default: off)")
    parser.add_argument("--ttft-model", choices=list(MODELS), default=TTFT.model,
                        help="TTFT model: whose K/V bytes a tier hit moves (default: %(default)s)")
    parser.add_argument("--kv-cache-dtype", choices=list(KV_FORMATS), default=TTFT.kv_cache_dtype,
                        help="TTFT model: the cached K/V's format (default: %(default)s)")
    parser.add_argument("--prefill-tokens-per-s", type=option(positive_number("prefill tokens per s")),
                        default=TTFT.prefill_tokens_per_s,
                        help="TTFT model: prefill throughput, what recomputing costs (default: %(default)g)")
    parser.add_argument("--h2d-gb-per-s", type=option(positive_number("h2d GB per s")), default=TTFT.h2d_gb_per_s,
                        help="TTFT model: host-to-device bandwidth, what a tier hit's copy costs (default: "
                             "%(default)g)")
    parser.add_argument("--mode", choices=MODES, default=DEFAULTS["mode"],
                        help="one request at a time, or overlapping requests under continuous batching "
                             "(default: %(default)s)")
    parser.add_argument("--limit", type=option(count_of("limit")), default=None,
                        help="replay only the first N requests")
    parser.add_argument("--time-scale", type=option(positive_number("time scale")), default=1.0,
                        help="overlap mode: multiply arrival times (2 = half the request rate)")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "lpm"), default="fcfs",
                        help="overlap mode: admit waiting requests first come first served, or longest cached "
                             "prefix first (kvlab.engine.queue_order) (default: %(default)s)")
    parser.add_argument("--jobs", type=option(count_of("jobs")), default=None,
                        help="replays run in N processes (default: all cores; 1: in this process; with "
                             "--dask-scheduler: all the cluster's worker threads)")
    parser.add_argument("--dask-scheduler", metavar="ADDRESS", default=None,
                        help="run the replays on this Dask cluster (e.g. tcp://10.0.0.5:8786) instead of locally; "
                             "its workers need kvlab installed; 'local' starts one here, of --jobs single-threaded "
                             "worker processes")
    parser.add_argument("--dask-timeout", metavar="SECONDS", type=option(positive_number("dask timeout")), default=10.0,
                        help="give up on --dask-scheduler after this long without a connection, or as long again "
                             "without its answer (default: %(default)g)")
    parser.add_argument("--retries", type=option(retries), default=RETRIES,
                        help="try a failed replay again this many times (a dead worker's too) before reporting it "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=directory, default=DEFAULTS["out"],
                        help="directory for study.csv and study.png, and study_rows.jsonl: each replay's row as it "
                             "finishes; the same study run again replays only the rows it lacks (default: "
                             "%(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def format_table(table) -> str:
    tiered = "offload_capacity_blocks" in table and table["offload_capacity_blocks"].any()
    columns = SHOWN[:4] + SHOWN_TIER + SHOWN[4:] if tiered else SHOWN
    shown = table[columns].copy()
    for column in ("hit_rate_tokens", "hit_rate_blocks", "ceiling_hit_rate_tokens"):
        shown[column] = shown[column].map("{:.2%}".format)
    shown["capacity_blocks"] = shown["capacity_blocks"].map(lambda c: "inf" if c == math.inf else f"{int(c):,}")
    for column in ("ttft_mean_ms", "ttft_tier_gain_ms"):
        if column in shown:
            shown[column] = shown[column].map("{:.1f}".format)
    text = shown.to_string(index=False)
    if SHOWN_RESIDENCY[0] in table:
        text += "\n\nresidency (seconds on the trace's clock; gpu_/cpu_: the pool / the offload tier):\n"
        text += table[SHOWN[:4] + SHOWN_RESIDENCY].to_string(index=False, float_format="{:.1f}".format)
    return text


def main(argv=None) -> int:
    """Entry point of ``kvlab study`` / ``python -m kvlab study``. ``argv`` are the arguments after
    ``study`` (a leading ``study`` is accepted too, so a console script can point here directly)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["study"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)  # list options arrive parsed; string defaults go through type= too
    problem = check_out(args.out, OUTPUTS)
    if problem:
        parser.error(f"argument --out: {problem}")
    try:
        ttft = TTFTModel(args.ttft_model, args.kv_cache_dtype, args.prefill_tokens_per_s, args.h2d_gb_per_s)
        table = cache_hit_study(args.trace, block_sizes=args.block_size, capacities=args.capacity,
                                policies=args.policy, mode=args.mode, limit=args.limit,
                                engine=EngineModel(time_scale=args.time_scale,
                                                   scheduling_policy=args.scheduling_policy), progress=not args.quiet,
                                jobs=-1 if args.jobs is None else args.jobs, dask_scheduler=args.dask_scheduler,
                                dask_timeout=args.dask_timeout, offload_capacities=args.offload_capacity,
                                offload_policies=args.offload_policy, offload_admissions=args.offload_admission,
                                kv_cache_metrics_sample=args.kv_cache_metrics_sample, ttft=ttft,
                                rows_file=args.out / OUTPUTS[3], retries=args.retries)
    except KvlabError as e:
        print(f"kvlab study: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ReplayError) else 2  # a replay's failure, not bad input
    assumptions = ttft.describe(table["block_size"].unique().tolist())
    try:
        write_results(table, args.out, assumptions)
    except OSError as e:
        print(f"kvlab study: error: cannot write the results in {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(format_table(table))
    print()
    print(summary(table))
    print()
    print(assumptions)
    print(f"\nwrote {args.out / 'study.csv'}, {args.out / 'study.png'} and {args.out / 'ttft_model.txt'}")
    return 0


def write_results(table, out: Path, assumptions: str = "") -> None:
    # Whole numbers in the CSV ("inf" for the infinite pool), not the float column pandas keeps.
    whole = {c: table[c].map(lambda v: "inf" if v == math.inf else int(v))
             for c in ("capacity_blocks", "capacity_tokens")}
    out.mkdir(parents=True, exist_ok=True)
    table.assign(**whole).to_csv(out / "study.csv", index=False)
    (out / "ttft_model.txt").write_text(assumptions + "\n")  # the assumptions behind the CSV's ttft_ columns
    figure = plot_hit_rates(table)
    try:
        figure.savefig(out / "study.png", dpi=120)
    finally:
        plt.close(figure)
