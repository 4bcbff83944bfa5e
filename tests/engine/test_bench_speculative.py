"""The speculative suite's summary row and configs (the suite itself runs SmolLM2: a benchmark, not a test)."""

import math
from types import SimpleNamespace

from kvlab.bench.speculative import CONFIGS, _label, _summary
from kvlab.engine.request import RequestMetrics
from kvlab.engine.speculative import resolve_speculative_config


def test_a_row_sums_drafts_over_requests_as_vllm_reports_them():
    metrics = []
    for drafts, accepted, steps in ((8, 6, 2), (4, 0, 1)):
        m = RequestMetrics(arrival_time=0.0, num_prompt_tokens=5, first_token_time=1.0, finished_time=2.0,
                           num_generated_tokens=11, num_draft_tokens=drafts, num_accepted_tokens=accepted,
                           num_drafting_steps=steps)
        metrics.append(SimpleNamespace(metrics=m))
    row = _summary(CONFIGS[2], metrics, wall=2.0)
    assert (row["method"], row["k"], row["generated_tokens"], row["tok_s"]) == ("ngram", 4, 22, 11.0)
    assert (row["drafts"], row["accepted"], row["rejected_draft_slots"]) == (12, 6, 6)
    assert row["acceptance_rate"] == 0.5 and row["mean_accepted_length"] == 1 + 6 / 3
    assert row["itl_ms_p50"] == 100.0  # 1 s of decode over 10 gaps
    assert _summary(None, metrics, wall=2.0)["k"] == 0
    assert (math.isnan(row["draft_acceptance_floor"])
            and _summary(CONFIGS[4], metrics, 2.0)["draft_acceptance_floor"] == 0.3)


def test_the_suite_runs_every_config_the_issue_asks_for_each_valid():
    assert [_label(c) for c in CONFIGS] == ["none", "ngram k=2", "ngram k=4", "ngram k=8", "ngram k=8 floor=0.3",
                                            "suffix k=8", "suffix k=8 floor=0.3"]
    for config in CONFIGS[1:]:
        resolve_speculative_config(config)
