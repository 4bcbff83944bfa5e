"""``python -m kvlab.bench blocks`` on a few requests: a line per pool, then one per offload tier with its ratio to
the single tier of the same run (their runs take turns)."""

import re

import pytest

from kvlab.bench import blocks


def test_each_tier_is_printed_against_the_single_tier_of_the_same_pool(capsys, monkeypatch):
    replays = []
    replay = blocks.replay_kvlab
    # Each replay first collects the garbage: in a whole test session's heap that is ~0.5 s, twenty times here.
    monkeypatch.setattr(blocks.gc, "collect", lambda: 0)
    monkeypatch.setattr(blocks, "replay_kvlab", lambda *args, **tier: replays.append(
        tier.get("offload_policy")) or replay(*args, **tier))
    blocks.main(["--limit", "4", "--pools", "3000,5000", "--repeat", "2", "--offload-blocks", "32"])
    lines = capsys.readouterr().out.splitlines()[2:]  # after the two header lines: a pool, its four tiers, ...
    assert [line.split()[0] for line in lines[::5]] == ["3,000", "5,000"]
    for pool, tier_lines in ((lines[0], lines[1:5]), (lines[5], lines[6:10])):
        single = float(pool.split()[2])
        found = [re.search(r"tier (\w+/\w+) +([\d.]+) us/block: ([\d.]+)x the single tier", line)
                 for line in tier_lines]
        assert [tier.group(1) for tier in found] == ["lru/always", "lru/reused", "arc/always", "arc/reused"]
        assert all(float(tier.group(3)) == pytest.approx(float(tier.group(2)) / single, abs=0.01) for tier in found)
    # each repeat runs the single tier, then every tier: alternated, not one configuration's runs in a row
    assert replays[:10] == [None, "lru", "lru", "arc", "arc"] * 2


def test_vs_nano_refuses_a_folder_without_nano_vllm(tmp_path):
    with pytest.raises(SystemExit, match="not a nano-vllm checkout"):
        blocks.main(["--limit", "2", "--pools", "64", "--repeat", "1", "--vs-nano", str(tmp_path)])


def test_a_pool_no_request_fits_is_refused_with_what_to_change():
    with pytest.raises(SystemExit, match="no request of the 2 replayed fits a pool of 64 blocks"):
        blocks.main(["--limit", "2", "--pools", "64", "--repeat", "1"])
