"""Memory-waste accounting: exact shares on hand-built workloads, shares summing to 100%, the allocator."""

import numpy as np
import pandas as pd
import pytest

from kvlab.errors import InvalidArgumentError
from kvlab.studies.memory_waste import PAPER_TOKEN_STATES, SHARES, _FirstFit, memory_waste, reservation, simulate


def requests(prompts, outputs) -> pd.DataFrame:
    return pd.DataFrame({"input_length": prompts, "output_length": outputs})


# Six identical requests (prompt 10, output 10: final length 20), budget 50, max_len 40. Every admitted
# request holds 10 + j tokens after step j, j = 1..10: 15.5 on average. Max reserves 40 and Pow2 10 + 16 (the
# output rounded up to a power of two), so one runs at a time; Oracle reserves 20, so two; blocks of 10 give a
# request exactly 20 slots at admission.
HAND = {
    "Max": dict(token_states=15.5 / 50, reservation=4.5 / 50, internal_fragmentation=20 / 50,
                external_fragmentation=10 / 50, concurrent_requests=1),
    "Pow2": dict(token_states=15.5 / 50, reservation=4.5 / 50, internal_fragmentation=6 / 50,
                 external_fragmentation=24 / 50, concurrent_requests=1),
    "Oracle": dict(token_states=31 / 50, reservation=9 / 50, internal_fragmentation=0,
                   external_fragmentation=10 / 50, concurrent_requests=2),
    "Paged 10": dict(token_states=31 / 50, reservation=9 / 50, internal_fragmentation=0,
                     external_fragmentation=10 / 50, concurrent_requests=2),
}


@pytest.mark.parametrize("scheme", HAND)
def test_shares_by_hand(scheme):
    result = simulate(np.full(6, 10), np.full(6, 20), scheme, budget_tokens=50, max_len=40)
    assert {k: result[k] for k in HAND[scheme]} == pytest.approx(HAND[scheme])


def test_pow2_rounds_the_output_up_to_a_power_of_two_as_in_the_paper():
    # Kwon et al. section 6.1: "if the true output length is 25, it reserves 32 positions for outputs".
    prompt, final = np.array([100, 3, 10, 7]), np.array([125, 8, 11, 7 + 1000])
    assert reservation("Pow2", final, 1024, prompt).tolist() == [132, 11, 11, 1024]  # capped at max_len
    assert reservation("Oracle", final, 1024, prompt).tolist() == final.tolist()
    assert reservation("Max", final, 1024, prompt).tolist() == [1024] * 4


def test_the_study_table_on_a_hand_workload():
    table = memory_waste(requests([10] * 6, [10] * 6), budget_tokens=50, max_len=40, block_sizes=(10, 5))
    assert table["scheme"].tolist() == ["Max", "Pow2", "Oracle", "Paged 10", "Paged 5"]
    assert table.loc[2, "token_states"] == pytest.approx(0.62)
    assert (table["requests"] == 6).all() and (table["requests_excluded"] == 0).all()


@pytest.mark.parametrize("seed", range(4))
def test_shares_sum_to_one_on_random_workloads(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(50, 300))
    frame = requests(rng.integers(1, 700, size=n), rng.integers(0, 400, size=n))
    table = memory_waste(frame, budget_tokens=int(rng.integers(1100, 5000)), max_len=1024, block_sizes=(1, 7, 16))
    assert np.allclose(table[SHARES].sum(axis=1), 1.0)
    assert ((table[SHARES] >= -1e-12) & (table[SHARES] <= 1 + 1e-12)).all().all()
    assert (table["concurrent_requests"] >= 1).all()
    oracle, paged = table.set_index("scheme").loc["Oracle"], table.set_index("scheme").loc["Paged 1"]
    assert oracle["internal_fragmentation"] == pytest.approx(0)          # reserves exactly the final length
    assert paged["internal_fragmentation"] == paged["reservation"] == 0  # one-token blocks waste nothing


def test_on_azure_every_request_under_max_reserves_the_same_and_paging_wins():
    table = memory_waste("azure_code", limit=400).set_index("scheme")
    assert np.allclose(table[SHARES].sum(axis=1), 1.0)
    assert table.loc["Max", "concurrent_requests"] == 48_000 // 8192  # whole max-length slots, always full
    tokens = table["token_states"]
    assert tokens["Paged 16"] > tokens["Oracle"] > tokens["Max"]
    assert table.loc["Paged 16", "paper_token_states"] == PAPER_TOKEN_STATES["Paged 16"] == 0.963
    assert table.loc["Max", "paper_token_states"] == 0.204 and np.isnan(table.loc["Paged 8", "paper_token_states"])


def test_requests_longer_than_max_len_are_excluded_and_counted():
    table = memory_waste(requests([10, 30, 10], [5, 20, 5]), budget_tokens=100, max_len=32, block_sizes=(8,))
    assert (table["requests_excluded"] == 1).all() and (table["requests"] == 2).all()


@pytest.mark.parametrize("kwargs", [dict(max_len=0), dict(max_len=60_000), dict(block_sizes=(0,)),
                                    dict(budget_tokens=10_000, max_len=9_000, block_sizes=(4096,)),
                                    dict(max_len=True), dict(budget_tokens=48_000.0), dict(block_sizes=(True,)),
                                    dict(limit=0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(InvalidArgumentError):
        memory_waste(requests([10], [5]), **kwargs)


@pytest.mark.parametrize("prompts, outputs", [([10, np.nan], [5, 5]), ([10, 20], [5, -1]), ([10.5, 20], [5, 5])])
def test_bad_lengths_in_a_frame_are_refused(prompts, outputs):
    with pytest.raises(InvalidArgumentError, match="trace column"):
        memory_waste(requests(prompts, outputs))


def test_first_fit_takes_the_lowest_hole_and_merges_freed_neighbours():
    space = _FirstFit(100)
    assert [space.allocate(n) for n in (10, 20, 5)] == [0, 10, 30]
    space.free(10, 20)
    assert space.allocate(25) == 35          # the 20-slot hole at 10 is too small
    space.free(0, 10)                        # merges with the hole at 10: [0, 30)
    assert space.allocate(30) == 0 and space.allocate(41) is None
