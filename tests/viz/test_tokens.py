"""kvlab.viz.draw_tokens: every token in its slot, the partial block's empty slots dashed, captions per block."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from kvlab import InvalidArgumentError, Sequence  # noqa: E402
from kvlab.viz import draw_tokens  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def test_tokens_fill_slots_block_by_block():
    seq = Sequence([31, 7, 12, 5, 9, 40, 2], 3)  # blocks [31 7 12] [5 9 40] [2 _ _]
    ax = draw_tokens(seq, block_colors={0: ["red", "green", "blue"]}, captions={0: ["x", "y", "z"]})
    slots = {p.get_gid(): p for p in ax.patches}
    texts = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    assert [texts[f"token-0-{p}"] for p in range(7)] == ["31", "7", "12", "5", "9", "40", "2"]
    assert len(slots) == 9
    empty = [g for g, p in slots.items() if p.get_linestyle() == "--"]
    assert empty == ["slot-0-7", "slot-0-8"]
    assert slots["slot-0-4"].get_facecolor() == to_rgba("green")
    assert slots["slot-0-6"].get_facecolor() == to_rgba("blue")
    assert slots["slot-0-3"].get_x() - slots["slot-0-2"].get_x() > 1  # a gap between logical blocks
    assert [texts[f"caption-0-{i}"] for i in range(3)] == ["x", "y", "z"]


def test_bad_input():
    seq = Sequence(range(5), 4)
    with pytest.raises(InvalidArgumentError, match="Sequence"):
        draw_tokens([])
    with pytest.raises(InvalidArgumentError, match="one entry per logical block"):
        draw_tokens(seq, captions={0: ["only one"]})
    with pytest.raises(InvalidArgumentError, match="names"):
        draw_tokens([seq], names=["a", "b"])
