"""kvlab fleet: one replica is the overlap study; routers route as documented; bad input is one error line."""

import re
from types import SimpleNamespace

import pandas as pd
import pytest

from kvlab.blocks.events import CachedHashes
from kvlab.errors import InvalidArgumentError
from kvlab.studies.cli import main as study_main
from kvlab.studies.fleet import replay_fleet
from kvlab.studies.fleet_cli import ROUTER_COLORS, plot_fleet
from kvlab.studies.fleet_cli import main as fleet_main
from kvlab.studies.routers import ROUTERS, KVCost, Router, RouterSettings, make_router
from kvlab.studies.synthetic import multi_turn_chat
from kvlab.studies.traces import load_trace

SMALL = ["--trace", "mooncake_conversation", "--limit", "300", "--block-size", "512,128", "--capacity", "150",
         "--jobs", "1", "--quiet"]


def test_one_replica_hit_rates_equal_the_overlap_study(tmp_path, capsys):
    """The same settings through ``kvlab study --mode overlap`` and ``kvlab fleet --replicas 1``, CSV to CSV."""
    assert study_main([*SMALL, "--mode", "overlap", "--policy", "lru", "--out", str(tmp_path / "study")]) == 0
    assert fleet_main([*SMALL, "--replicas", "1", "--out", str(tmp_path / "fleet")]) == 0
    study = pd.read_csv(tmp_path / "study" / "study.csv")
    fleet = pd.read_csv(tmp_path / "fleet" / "fleet.csv")
    assert list(fleet["router"]) == [*ROUTERS, *ROUTERS] and (fleet["replicas"] == 1).all()
    for block_size, rows in fleet.groupby("block_size"):
        [expected] = study[study["block_size"] == block_size].to_dict("records")
        assert expected["hit_rate_tokens"] > 0 and expected["evictions"] > 0  # a test that can tell
        for row in rows.to_dict("records"):
            assert (row["hit_rate_tokens"], row["hit_rate_blocks"], row["evictions"], row["requests"]) == (
                expected["hit_rate_tokens"], expected["hit_rate_blocks"], expected["evictions"], expected["requests"])
            assert row["load_imbalance"] == 1.0
    assert "wrote" in capsys.readouterr().out


def test_cache_affinity_keeps_a_conversation_on_its_replica():
    """Multi-turn chats hit their previous turn only where it ran: round robin scatters the turns."""
    chat = multi_turn_chat(num_conversations=12, turns=6, rate_per_s=4.0, seed=1)
    rows = {router: replay_fleet(chat, block_size=16, capacity=4000, replicas=4, router=router)
            for router in ROUTERS}
    single = replay_fleet(chat, block_size=16, capacity=16000, replicas=1)
    for router in ("cache_aware", "kv_cost"):
        assert rows[router]["hit_rate_tokens"] > rows["round_robin"]["hit_rate_tokens"] + 0.2
        assert rows[router]["hit_rate_tokens"] == pytest.approx(single["hit_rate_tokens"], abs=0.02)
    assert all(row["requests"] == len(chat) for row in rows.values())
    assert rows["round_robin"]["load_imbalance"] >= 1.0


def replicas(*states):
    """Fake replicas as a router sees them: (cached hashes, requests in flight, queued prompt tokens)."""
    fakes = []
    for hashes, load, queued in states:
        cached = CachedHashes()
        cached.hashes.update(hashes)
        fakes.append(SimpleNamespace(cached=cached, in_flight=lambda load=load: load, waiting_tokens=queued))
    return fakes


def test_round_robin_and_least_loaded_take_turns_among_equals():
    fleet = replicas(((), 0, 0), ((), 0, 0), ((), 0, 0))
    robin, least = make_router("round_robin", RouterSettings(), 4), make_router("least_loaded", RouterSettings(), 4)
    assert [robin.choose(fleet, 10, []) for _ in range(4)] == [0, 1, 2, 0]
    assert [least.choose(fleet, 10, []) for _ in range(3)] == [0, 1, 2]
    assert least.choose(replicas(((), 3, 0), ((), 1, 0), ((), 2, 0)), 10, []) == 1


def test_cache_aware_follows_the_longest_match_until_loads_are_imbalanced():
    settings = RouterSettings(cache_threshold=0.5, balance_abs_threshold=4, balance_rel_threshold=1.5)
    router, prompt = make_router("cache_aware", settings, 4), [11, 12, 13, 14]
    fleet = replicas(({11, 12}, 2, 0), ({11, 12, 13}, 5, 0), ((), 3, 0))
    assert router.choose(fleet, 17, prompt) == 1              # 3 of 4 blocks cached there
    assert router.choose(fleet, 17, [99, 12]) == 2            # no match: the smallest cache
    assert router.choose(replicas(({11, 12}, 2, 0), ({11, 12, 13}, 7, 0), ((), 3, 0)), 17, prompt) == 0


def test_cache_aware_defaults_are_sglangs_current_router_args():
    """0.3 / 64 / 1.5 (sgl-model-gateway's RouterArgs): a 2-of-5-block match is followed, and a gap of 40
    requests (4x as many) is not yet imbalanced; the old 0.5 / 32 / 1.0001 did neither."""
    router, prompt = make_router("cache_aware", RouterSettings(), 4), [11, 12, 13, 14, 15]
    assert router.choose(replicas(({11, 12}, 3, 0), ((), 1, 0)), 20, prompt) == 0
    assert router.choose(replicas(({11, 12, 13}, 50, 0), ((), 10, 0)), 20, prompt) == 0


def test_kv_cost_weighs_uncached_prefill_against_queued_tokens():
    fleet, prompt = replicas(({11, 12, 13}, 1, 20), ((), 1, 0)), [11, 12, 13, 14]
    # Replica 0: 17 - 3 x 4 = 5 uncached tokens behind 20 queued; replica 1: all 17 uncached, nothing queued.
    assert make_router("kv_cost", RouterSettings(), 4).choose(fleet, 17, prompt) == 1                   # 25 > 17
    assert make_router("kv_cost", RouterSettings(queue_weight=0.1), 4).choose(fleet, 17, prompt) == 0   # 7 < 17
    assert make_router("kv_cost", RouterSettings(prefill_weight=0.1), 4).choose(fleet, 17, prompt) == 1  # 20.5 > 1.7


@pytest.mark.parametrize("argv, message", [
    (["--router", "random"], "argument --router: unknown router 'random'; known: round_robin, "),
    (["--replicas", "0"], "argument --replicas: replicas must be an int in \\[1, 1024\\], got 0"),
    (["--capacity", "inf"], "argument --capacity: expected a whole number, got 'inf'"),
    (["--cache-threshold", "1.5"], "argument --cache-threshold: cache threshold must be a finite number >= 0 and <= 1"),
    (["--balance-rel-threshold", "0.5"], "argument --balance-rel-threshold: balance rel threshold must be a finite"),
    (["--queue-weight", "x"], "argument --queue-weight: expected a number, got 'x'"),
    (["--trace", "no_such_trace"], "trace 'no_such_trace' is neither a trace name"),
])
def test_bad_input_is_one_error_line(argv, message, tmp_path, capsys):
    try:
        status = fleet_main([*argv, "--out", str(tmp_path / "out"), "--quiet", "--jobs", "1"])
    except SystemExit as exit_info:
        status = exit_info.code
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert len(re.findall(r"^kvlab fleet: error: ", err, re.MULTILINE)) == 1
    assert re.search(rf"^kvlab fleet: error: {message}", err, re.MULTILINE), err


def test_a_fleet_accounts_for_every_request():
    trace = load_trace("mooncake_conversation", limit=50)
    row = replay_fleet(trace, block_size=512, capacity=100, replicas=3, router="kv_cost")
    assert row["requests"] + row["requests_skipped"] + row["requests_dropped_mid_decode"] == 50
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and row["load_imbalance"] >= 1.0


class LongestPrefix(Router):
    """A learner's router: the longest cached-prefix match, then the fewest requests in flight."""
    needs_hashes = True

    def choose(self, replicas, num_tokens, hashes):
        return self.pick([(-r.cached.prefix_match(hashes, len(hashes)), r.in_flight()) for r in replicas])


def least_waiting(replicas, num_tokens, hashes):
    """A learner's router as a plain function: the fewest prompt tokens waiting."""
    return min(range(len(replicas)), key=lambda i: replicas[i].waiting_tokens)


def test_a_learners_router_plugs_in_as_a_class_a_function_or_a_registered_name(monkeypatch, tmp_path):
    chat = multi_turn_chat(num_conversations=12, turns=6, rate_per_s=4.0, seed=1)
    run = dict(block_size=16, capacity=4000, replicas=4)
    robin, mine = (replay_fleet(chat, router=r, **run) for r in ("round_robin", LongestPrefix))
    assert mine["router"] == "LongestPrefix" and mine["requests"] == len(chat)
    assert mine["hit_rate_tokens"] > robin["hit_rate_tokens"] + 0.2  # affinity: the turns find their prefix
    waiting = replay_fleet(chat, router=least_waiting, **run)
    assert waiting["router"] == "least_waiting" and waiting["requests"] == len(chat)
    by_class, by_name = replay_fleet(chat, router=KVCost, **run), replay_fleet(chat, router="kv_cost", **run)
    assert {**by_class, "wall_s": 0} == {**by_name, "wall_s": 0}
    monkeypatch.setitem(ROUTERS, "longest_prefix", LongestPrefix)  # the CLI's --router takes registered names
    assert fleet_main(["--trace", "mooncake_conversation", "--limit", "40", "--replicas", "2", "--router",
                       "longest_prefix,round_robin", "--jobs", "1", "--quiet", "--out", str(tmp_path)]) == 0
    assert list(pd.read_csv(tmp_path / "fleet.csv")["router"]) == ["longest_prefix", "round_robin"]


def test_a_router_sees_only_the_replica_view():
    seen = []

    def look(replicas, num_tokens, hashes):
        seen.append({name for name in dir(replicas[0]) if not name.startswith("_")})
        assert isinstance(replicas[0].cached, CachedHashes) and replicas[0].in_flight() >= 0
        return 0

    replay_fleet(load_trace("mooncake_conversation", limit=5), block_size=512, capacity=100, replicas=2, router=look)
    assert seen and all(names == {"cached", "in_flight", "waiting_tokens"} for names in seen)


@pytest.mark.parametrize("router, match", [
    (lambda replicas, num_tokens, hashes: len(replicas), r"router '<lambda>' chose 3: .* an int in \[0, 3\)"),
    (lambda replicas, num_tokens, hashes: None, "router '<lambda>' chose None"),
    (Router, "router Router must override choose"),
    ("random", "unknown router 'random'; known: round_robin, "),
    (RouterSettings, "router must be a name"),
    (3, "router must be a name"),
])
def test_a_bad_router_is_refused_with_a_clear_error(router, match):
    trace = load_trace("mooncake_conversation", limit=5)
    with pytest.raises(InvalidArgumentError, match=match):
        replay_fleet(trace, block_size=512, capacity=100, replicas=3, router=router)


def test_plot_fleet_gives_each_router_its_colour_and_the_tail_a_log_axis():
    """Whatever order the rows come in, a router has ROUTER_COLORS' colour in every panel (notebook 12's bars
    use the same), and the p99 panel is logarithmic (minutes overloaded, seconds balanced)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    rows = [dict(block_size=512, capacity_blocks=100, replicas=n, router=router, scheduling_policy="fcfs",
                 tier="none", hit_rate_tokens=0.1, load_imbalance=1.0, ttft_p99_s=1000.0 / n)
            for router in ["kv_cost", "my_router", "round_robin"] for n in (1, 8)]
    figure = plot_fleet(pd.DataFrame(rows))
    for ax in figure.axes:
        colours = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()}
        assert colours == {"kv_cost": to_hex(ROUTER_COLORS["kv_cost"]), "my_router": to_hex("C4"),
                           "round_robin": to_hex(ROUTER_COLORS["round_robin"])}
    assert [ax.get_yscale() for ax in figure.axes] == ["linear", "linear", "log"]
    plt.close(figure)
