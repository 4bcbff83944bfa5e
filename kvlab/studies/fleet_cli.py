"""``kvlab fleet``: route a trace across replicas and report what each router does to hits, load and TTFT.

``kvlab fleet --trace T --block-size B --capacity C --replicas N[,N...] --router P[,P...] --out DIR`` replays
every combination (``kvlab.studies.fleet_study``), prints a table, and writes ``DIR/fleet.csv`` and
``DIR/fleet.png``. Options are checked (and ``--out`` tried) before anything is replayed.

``--tier none,local,shared --tier-capacity T`` adds a second tier of T blocks for the fleet (one per replica,
T split among them, or one shared: ``kvlab.studies.fleet_tier``) at the stated bandwidths; ``--scheduling-policy
fcfs,lpm`` sets the order each replica admits waiting requests in (``kvlab.engine.queue_order``).
"""

import argparse
import sys

import matplotlib.pyplot as plt
import numpy as np

from kvlab.errors import KvlabError, ReplayError
from kvlab.studies.cli_options import (block_size_number, check_out, comma_list, count_of, directory, option,
                                      positive_number, retries, whole_number)
from kvlab.studies.fleet import check_capacity, check_replicas
from kvlab.studies.fleet_study import fleet_study
from kvlab.studies.sweep import RETRIES
from kvlab.studies.fleet_tier import TIER_KINDS, TierSettings, check_tier_kind, tier_assumptions
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.routers import ROUTERS, RouterSettings, check_router
from kvlab.studies.synthetic import WORKLOADS
from kvlab.studies.traces import BUNDLED
from kvlab.validation import check_int, check_number

SHOWN = ["block_size", "replicas", "capacity_blocks", "router", "scheduling_policy", "tier", "hit_rate_tokens",
         "hit_rate_blocks", "tier_hit_rate_blocks", "load_imbalance", "ttft_p50_s", "ttft_p99_s", "preemptions"]
FILES = ("fleet.csv", "fleet.png", "fleet_rows.jsonl")


def _number(name: str, minimum: float, maximum: float | None = None):
    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
        return check_number(name, value, minimum, maximum)
    return number


def _scheduling_policy(text: str) -> str:
    if text not in ("fcfs", "lpm"):
        raise ValueError(f"expected fcfs or lpm, got {text!r}")
    return text


def tier_settings(args) -> list[TierSettings]:
    """One TierSettings per ``--tier`` kind (InvalidArgumentError when a tier has no ``--tier-capacity``)."""
    common = dict(policy=args.tier_policy, host_gbps=args.host_gbps, network_gbps=args.network_gbps)
    return [TierSettings(kind, 0 if kind == "none" else (args.tier_capacity or 0), **common) for kind in args.tier]


def build_parser() -> argparse.ArgumentParser:
    defaults, tier_defaults = RouterSettings(), TierSettings()
    parser = argparse.ArgumentParser(
        prog="kvlab fleet", description="Replay a trace across N replicas (each a block manager in the overlap "
                                        "replay's engine) behind a router that sees their KV events and queues.",
        epilog=f"Routers: {', '.join(ROUTERS)}. Traces: {', '.join(BUNDLED)} (bundled), {', '.join(WORKLOADS)} "
               "(synthetic), or a path to a .jsonl (Mooncake shape) or .csv (Azure shape) file.")
    parser.add_argument("--trace", default="mooncake_conversation", help="trace name or path (default: %(default)s)")
    parser.add_argument("--block-size", type=comma_list(block_size_number), default="512",
                        help="tokens per block, comma-separated (default: %(default)s)")
    parser.add_argument("--capacity", type=comma_list(lambda t: check_capacity(whole_number(t))), default="2000",
                        help="blocks per replica, comma-separated (default: %(default)s)")
    parser.add_argument("--replicas", type=comma_list(lambda t: check_replicas(whole_number(t))), default="1,8",
                        help="replica counts, comma-separated (default: %(default)s)")
    parser.add_argument("--router", type=comma_list(check_router), default=",".join(ROUTERS),
                        help="routers, comma-separated (default: %(default)s)")
    parser.add_argument("--cache-threshold", type=option(_number("cache threshold", 0, 1)),
                        default=defaults.cache_threshold,
                        help="cache_aware: follow the longest match above this share of the prompt's blocks "
                             "(default: %(default)s)")
    parser.add_argument("--balance-abs-threshold", type=option(lambda text: check_int("balance abs threshold",
                                                                                      whole_number(text), 0)),
                        default=defaults.balance_abs_threshold,
                        help="cache_aware: balance load when max - min in-flight requests exceed this "
                             "(default: %(default)s)")
    parser.add_argument("--balance-rel-threshold", type=option(_number("balance rel threshold", 1)),
                        default=defaults.balance_rel_threshold,
                        help="cache_aware: ... and max exceeds this times min (default: %(default)s)")
    parser.add_argument("--prefill-weight", type=option(_number("prefill weight", 0)), default=defaults.prefill_weight,
                        help="kv_cost: weight of the request's uncached prompt tokens (default: %(default)s)")
    parser.add_argument("--queue-weight", type=option(_number("queue weight", 0)), default=defaults.queue_weight,
                        help="kv_cost: weight of the prompt tokens queued at the replica (default: %(default)s)")
    parser.add_argument("--scheduling-policy", type=comma_list(_scheduling_policy), default="fcfs",
                        help="admission order of each replica's waiting requests: fcfs, lpm (longest cached prefix "
                             "first), comma-separated (default: %(default)s)")
    parser.add_argument("--tier", type=comma_list(check_tier_kind), default="none",
                        help=f"second tier behind the GPU pools, among {', '.join(TIER_KINDS)}, comma-separated "
                             "(default: %(default)s)")
    parser.add_argument("--tier-capacity", type=option(count_of("tier capacity")), default=None,
                        help="tier blocks of the whole fleet: split among the replicas (local) or one pool "
                             "(shared); needed with --tier local or shared")
    parser.add_argument("--tier-policy", choices=("lru", "arc"), default="lru",
                        help="the tier's replacement policy (default: %(default)s)")
    parser.add_argument("--host-gbps", type=option(_number("host gbps", 0)), default=tier_defaults.host_gbps,
                        help="GB/s from a replica's local tier to its GPU (default: %(default)s)")
    parser.add_argument("--network-gbps", type=option(_number("network gbps", 0)),
                        default=tier_defaults.network_gbps,
                        help="GB/s from the shared tier to a GPU (default: %(default)s)")
    parser.add_argument("--limit", type=option(count_of("limit")), default=None,
                        help="replay only the first N requests")
    parser.add_argument("--time-scale", type=option(positive_number("time scale")), default=1.0,
                        help="multiply arrival times (2 = half the request rate)")
    parser.add_argument("--jobs", type=option(count_of("jobs")), default=None,
                        help="replays run in N processes (default: all cores; 1: in this process)")
    parser.add_argument("--dask-scheduler", metavar="ADDRESS", default=None,
                        help="run the replays on this Dask cluster instead of locally ('local': one started here, "
                             "of --jobs single-threaded worker processes)")
    parser.add_argument("--retries", type=option(retries), default=RETRIES,
                        help="try a failed replay again this many times (a dead worker's too) before reporting it "
                             "(default: %(default)s)")
    parser.add_argument("--out", type=directory, default="results",
                        help="directory for fleet.csv and fleet.png, and fleet_rows.jsonl: each replay's row as it "
                             "finishes; the same sweep run again replays only the rows it lacks (default: "
                             "%(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def main(argv=None) -> int:
    """Entry point of ``kvlab fleet``; ``argv`` are the arguments after ``fleet``."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    problem = check_out(args.out, FILES)
    if problem:
        parser.error(f"argument --out: {problem}")
    try:
        settings = RouterSettings(args.cache_threshold, args.balance_abs_threshold, args.balance_rel_threshold,
                                  args.prefill_weight, args.queue_weight)
        table = fleet_study(args.trace, block_sizes=args.block_size, capacities=args.capacity,
                            replicas=args.replicas, routers=args.router, settings=settings,
                            engine=EngineModel(time_scale=args.time_scale), limit=args.limit,
                            progress=not args.quiet, jobs=-1 if args.jobs is None else args.jobs,
                            dask_scheduler=args.dask_scheduler, tiers=tier_settings(args),
                            scheduling_policies=args.scheduling_policy, rows_file=args.out / FILES[2],
                            retries=args.retries)
    except KvlabError as e:
        print(f"kvlab fleet: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, ReplayError) else 2  # a replay's failure, not bad input
    try:
        write_results(table, args.out)
    except OSError as e:
        print(f"kvlab fleet: error: cannot write the results in {args.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(format_table(table))
    if set(args.tier) != {"none"}:
        print("\n" + "\n".join(tier_assumptions(tier_settings(args)[-1], b, EngineModel()) for b in args.block_size))
    print(f"\nwrote {args.out / FILES[0]} and {args.out / FILES[1]}")
    return 0


def format_table(table) -> str:
    shown = table[SHOWN].copy()
    for column in ("hit_rate_tokens", "hit_rate_blocks", "tier_hit_rate_blocks"):
        shown[column] = shown[column].map("{:.2%}".format)
    for column in ("load_imbalance", "ttft_p50_s", "ttft_p99_s"):
        shown[column] = shown[column].map("{:.2f}".format)
    return shown.to_string(index=False)


def write_results(table, out) -> None:
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / FILES[0], index=False)
    figure = plot_fleet(table)
    try:
        figure.savefig(out / FILES[1], dpi=120)
    finally:
        plt.close(figure)


#: One colour per router in every fleet figure (notebook 12 uses them too); other routers take the next ones.
ROUTER_COLORS = {"round_robin": "C0", "least_loaded": "C1", "cache_aware": "C2", "kv_cost": "C3"}
_LINESTYLES = ["-", "--", ":", "-."]


def router_color(router: str, others: list) -> str:
    """``router``'s colour: ``ROUTER_COLORS``'s, else the next unused one of the cycle (``others``: the
    routers already given one, in order)."""
    if router in ROUTER_COLORS:
        return ROUTER_COLORS[router]
    spare = [f"C{i}" for i in range(len(ROUTER_COLORS), 10)]
    return spare[[r for r in others if r not in ROUTER_COLORS].index(router) % len(spare)]


def plot_fleet(table):
    """Token hit rate, load imbalance and p99 TTFT (log scale: an overloaded fleet's tail is minutes, a balanced
    one's seconds) versus replicas, a line per router (its colour in ``ROUTER_COLORS``; a line style per
    scheduling policy x tier); one row of panels per block size x capacity. Returns the figure."""
    groups = list(table.groupby(["block_size", "capacity_blocks"], sort=False))
    panels = [("hit_rate_tokens", "prompt tokens served from cache (%)", 100), ("load_imbalance",
              "load imbalance (max / mean prefill tokens)", 1), ("ttft_p99_s", "p99 time to first token (s)", 1)]
    routers = list(dict.fromkeys(table["router"]))
    variants = list(dict.fromkeys(zip(table["scheduling_policy"], table["tier"])))
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 4 * len(groups)), squeeze=False)
    for row, ((block_size, capacity), group) in zip(axes, groups):
        counts = np.unique(group["replicas"].to_numpy())
        for ax, (column, label, scale) in zip(row, panels):
            for (router, policy, tier), rows in group.groupby(["router", "scheduling_policy", "tier"], sort=False):
                rows = rows.sort_values("replicas")
                name = " ".join([router] + [policy] * (policy != "fcfs") + [f"{tier} tier"] * (tier != "none"))
                style = _LINESTYLES[variants.index((policy, tier)) % len(_LINESTYLES)]
                ax.plot(rows["replicas"], scale * rows[column], marker="o", ls=style, label=name,
                        color=router_color(router, routers))
            if len(counts) > 1:
                ax.set_xscale("log", base=2)
            ax.set_xticks(counts, [str(c) for c in counts])
            ax.minorticks_off()
            ax.set_xlabel("replicas")
            ax.set_ylabel(label)
            ax.set_title(f"block size {block_size}, {capacity:,} blocks per replica", fontsize=10)
            ax.grid(alpha=0.3)
        row[2].set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    return fig
