"""The per-step record as a DataFrame, and the timeline drawn from it."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from engine_helpers import assert_pool_clean, make_llm  # noqa: E402
from kvlab.engine import SamplingParams, StepRecord  # noqa: E402
from kvlab.errors import InvalidArgumentError  # noqa: E402
from kvlab.viz import draw_engine_timeline  # noqa: E402


def test_records_and_timeline(llama):
    llm = make_llm(llama[0], num_blocks=6)
    prompt = list(range(1, 12))
    outs = llm.generate([prompt, prompt + [3, 4, 5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0),
                        use_tqdm=False)
    frame = llm.step_dataframe()
    assert list(frame.columns) == list(StepRecord.__dataclass_fields__)
    assert list(frame["kind"]) == ["prefill", "decode", "decode"]
    assert list(frame["step"]) == [0, 1, 2] and (frame["wall_s"] > 0).all()
    first = frame.iloc[0]
    assert (first.num_seqs, first.num_tokens, first.cached_tokens) == (2, 11 + 16 - 8, 8)
    assert (frame["blocks_used"] + frame["blocks_free"] == 6).all()
    # 2 + 2 blocks, one of them shared; hittable: that shared full block and the second prompt's full block 1
    assert first.blocks_used == 3 and first.blocks_cached == 2
    assert frame["finished"].sum() == 2 and frame["running"].iloc[-1] == 0
    assert outs[1].metrics.num_cached_prompt_tokens == 8 and outs[1].metrics.time_to_first_token > 0
    axes = draw_engine_timeline(llm)
    assert len(axes) == 4 and axes[0].figure is axes[3].figure
    assert len([p for p in axes[0].patches if p.get_gid() == "tokens-cached"]) == 3
    # the legends name only what ran: no mixed steps, no preemption, swap or copy-on-write in this run
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == [
        "prefill: computed", "decode: one per sequence", "prefix hit: read,\nnot computed"]
    assert axes[2].get_legend() is None
    draw_engine_timeline(frame, x="step")
    with pytest.raises(InvalidArgumentError, match="x must be"):
        draw_engine_timeline(frame, x="tokens")
    with pytest.raises(InvalidArgumentError, match="missing columns"):
        draw_engine_timeline(frame.drop(columns=["cow_copies"]))
    plt.close("all")
    assert_pool_clean(llm)
