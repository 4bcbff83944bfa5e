"""Sampling: parameter checks, the sampler's distributions on a tiny vocabulary (a statistical check with
fixed seeds, so deterministic), and seeded requests reproducible through the engine whatever the batch."""

import pytest
import torch

from engine_helpers import assert_pool_clean, make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.request import Request
from kvlab.engine.sampler import Sampler, sample_generator
from kvlab.errors import InvalidArgumentError

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
ROWS = 40_000
TOLERANCE = 0.012  # > 4 standard deviations of a frequency estimated from 40k draws


def frequencies(params: SamplingParams, seed=0) -> torch.Tensor:
    tokens = Sampler(seed, "cpu")(LOGITS.expand(ROWS, -1).clone(), [params] * ROWS, [None] * ROWS)
    return torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).float() / ROWS


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_the_softmax(temperature):
    expected = (LOGITS / temperature).softmax(-1)
    assert (frequencies(SamplingParams(temperature=temperature)) - expected).abs().max() < TOLERANCE


def test_top_k_and_top_p_keep_the_right_tokens():
    top2 = LOGITS[:2].softmax(-1)
    freq = frequencies(SamplingParams(top_k=2))
    assert (freq[:2] - top2).abs().max() < TOLERANCE and freq[2:].sum() == 0
    # softmax(LOGITS) = [.55, .20, .12, .07, ...]: the smallest set reaching 0.8 is the first three tokens.
    probs = LOGITS.softmax(-1)
    freq = frequencies(SamplingParams(top_p=0.8))
    assert (freq[:3] - probs[:3] / probs[:3].sum()).abs().max() < TOLERANCE and freq[3:].sum() == 0
    assert frequencies(SamplingParams(top_p=0.5))[0] == 1.0  # the top token alone reaches 0.5


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 4
    tokens = Sampler(0, "cpu")(logits, params, [None] * 8)
    assert tokens[::2] == logits[::2].argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_token_whatever_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7)] * 6
    alone = [Sampler(0, "cpu")(logits[i:i + 1], params[:1], [sample_generator(7, i, "cpu")])[0] for i in range(6)]
    batched = Sampler(5, "cpu")(logits, params, [sample_generator(7, i, "cpu") for i in range(6)])
    assert alone == batched


@pytest.mark.parametrize("bad", [dict(n=0), dict(temperature=-0.5), dict(temperature=float("nan")),
                                 dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(max_tokens=0),
                                 dict(stop_token_ids="eos"), dict(stop_token_ids=[-1]), dict(seed=-1),
                                 dict(ignore_eos=1), dict(n=True)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_stop_conditions():
    request = Request.create("r", None, [1, 2, 3], SamplingParams(max_tokens=3, stop_token_ids=[9]), 8, "cpu")
    seq = request.seqs[0]
    seq.append_token(5)
    assert request.stop_check(seq, eos_token_ids={7}, max_model_len=100) is None
    seq.append_token(7)
    assert request.stop_check(seq, {7}, 100).reason == "stop" and request.stop_check(seq, {7}, 100).stop_reason == 7
    assert request.stop_check(seq, {8}, 100) is None
    assert request.stop_check(seq, {8}, 5).reason == "length"  # the model's context is full
    seq.append_token(9)
    assert request.stop_check(seq, set(), 100).stop_reason == 9
    ignoring = Request.create("s", None, [1], SamplingParams(ignore_eos=True, max_tokens=2), 8, "cpu")
    ignoring.seqs[0].append_token(7)
    assert ignoring.stop_check(ignoring.seqs[0], {7}, 100) is None
    ignoring.seqs[0].append_token(7)
    assert ignoring.stop_check(ignoring.seqs[0], {7}, 100).reason == "length"


def test_seeded_requests_are_reproducible_through_the_engine(llama):
    path, _ = llama
    llm = make_llm(path)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    params = SamplingParams(n=2, temperature=0.8, top_k=50, top_p=0.95, seed=123, max_tokens=4, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    batched = llm.generate([[7, 7, 7], prompt, [100, 2]], [others, params, others], use_tqdm=False)[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batched.outputs]
    reseeded = llm.generate([prompt], SamplingParams(**{**params.__dict__, "seed": 124}), use_tqdm=False)[0]
    assert [c.token_ids for c in reseeded.outputs] != [c.token_ids for c in alone.outputs]
    assert_pool_clean(llm)
