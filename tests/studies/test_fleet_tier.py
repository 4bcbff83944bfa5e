"""kvlab fleet with a second tier (none, one per replica, one shared: Mooncake's global store) at equal total
memory, per-tier hits in the rows and the CSV, and each replica's admission order (fcfs / lpm)."""

import re

import pandas as pd
import pytest

from kvlab.blocks.eviction import LRUPolicy
from kvlab.errors import InvalidArgumentError
from kvlab.studies.engine_model import EngineModel
from kvlab.studies.fleet import replay_fleet
from kvlab.studies.fleet_cli import main as fleet_main
from kvlab.studies.fleet_tier import TierSettings, fleet_managers
from kvlab.studies.synthetic import multi_turn_chat

# Round robin sends a conversation's next turn to another replica: only a shared tier can serve its history
# from there once the GPU pool evicted it.
CHAT = multi_turn_chat(num_conversations=12, turns=6, rate_per_s=4.0, seed=1)
RUN = dict(block_size=16, capacity=200, replicas=3, router="round_robin")


@pytest.fixture(scope="module")
def rows():
    return {kind: replay_fleet(CHAT, **RUN, tier=TierSettings(kind, 0 if kind == "none" else 600))
            for kind in ("none", "local", "shared")}


def test_a_shared_tier_serves_what_other_replicas_offloaded(rows):
    none, local, shared = rows["none"], rows["local"], rows["shared"]
    assert none["tier_hit_blocks"] == 0 and none["hit_rate_blocks"] == none["gpu_hit_rate_blocks"]
    assert 0 < local["tier_hit_blocks"] < shared["tier_hit_blocks"]
    assert none["hit_rate_blocks"] < local["hit_rate_blocks"] < shared["hit_rate_blocks"]
    for row in rows.values():  # the split adds up; the GPU pools are the same, so are their hits
        assert row["gpu_hit_rate_blocks"] + row["tier_hit_rate_blocks"] == pytest.approx(row["hit_rate_blocks"])
        assert row["gpu_hit_rate_blocks"] == pytest.approx(none["gpu_hit_rate_blocks"])
        assert row["requests"] == len(CHAT)
    assert shared["tier_ms_per_block"] == 2 * local["tier_ms_per_block"] > 0 == none["tier_ms_per_block"]


def test_local_and_shared_tiers_hold_the_same_total_memory(rows):
    assert rows["local"]["tier_capacity_blocks"] == rows["shared"]["tier_capacity_blocks"] == 600
    assert rows["none"]["tier_capacity_blocks"] == 0
    local = fleet_managers(TierSettings("local", 10), 3, 50, 16, LRUPolicy)
    shared = fleet_managers(TierSettings("shared", 10), 3, 50, 16, LRUPolicy)
    assert [m.num_offload_blocks for m in local] == [4, 3, 3]
    assert [m.num_offload_blocks for m in shared] == [10] * 3 and len({id(m.tier_stats) for m in shared}) == 1
    assert [m.num_blocks for m in local + shared] == [50] * 6


def test_the_csv_carries_per_tier_hits_and_the_policies(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--trace", "mooncake_conversation", "--limit", "120", "--block-size", "512", "--capacity", "60",
            "--replicas", "2", "--router", "round_robin", "--tier", "none,local,shared", "--tier-capacity", "100",
            "--scheduling-policy", "fcfs,lpm", "--jobs", "1", "--quiet", "--out", str(out)]
    assert fleet_main(argv) == 0
    assert "recompute 10.24 ms" in capsys.readouterr().out  # the cost model is printed with the results
    table = pd.read_csv(out / "fleet.csv")
    assert sorted(zip(table["tier"], table["scheduling_policy"])) == sorted(
        (t, p) for t in ("none", "local", "shared") for p in ("fcfs", "lpm"))
    assert list(table["tier_capacity_blocks"]) == [0 if t == "none" else 100 for t in table["tier"]]
    split = table["gpu_hit_rate_blocks"] + table["tier_hit_rate_blocks"]
    assert (split - table["hit_rate_blocks"]).abs().max() < 1e-12
    assert (table.loc[table["tier"] == "none", "tier_hit_blocks"] == 0).all()


@pytest.mark.parametrize("argv, message", [
    (["--tier", "shared"], "a 'shared' tier needs a tier capacity of 1 block or more"),
    (["--tier", "global", "--tier-capacity", "5"], "argument --tier: .*tier must be one of"),
    (["--scheduling-policy", "sjf"], "argument --scheduling-policy: expected fcfs or lpm"),
    (["--tier", "local", "--tier-capacity", "5", "--network-gbps", "0"], "network_gbps must be a finite number > 0"),
])
def test_bad_tier_options_are_one_error_line(argv, message, tmp_path, capsys):
    try:
        status = fleet_main([*argv, "--limit", "5", "--out", str(tmp_path / "out"), "--quiet", "--jobs", "1"])
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert re.search(rf"^(kvlab fleet: error: |.*error: ){message}", err, re.MULTILINE), err


@pytest.mark.parametrize("settings, match", [
    (dict(kind="none", capacity=4), "a 'none' tier needs no capacity"),
    (dict(kind="local", capacity=0), "a 'local' tier needs a tier capacity"),
    (dict(kind="local", capacity=4, policy="fifo"), "offload_policy must be one of"),
    (dict(kind="shared", capacity=4, network_gbps=-1.0), "network_gbps"),
])
def test_bad_tier_settings_are_refused(settings, match):
    with pytest.raises(InvalidArgumentError, match=match):
        TierSettings(**settings)


def test_an_unknown_scheduling_policy_is_refused_by_the_engine_model():
    with pytest.raises(InvalidArgumentError, match=r"scheduling_policy must be one of \('fcfs', 'lpm'\)"):
        EngineModel(scheduling_policy="dfs-weight")
