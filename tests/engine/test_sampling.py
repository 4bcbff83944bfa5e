"""Sampling: parameter checks, the sampler's distributions on a tiny vocabulary (a statistical check with
fixed seeds, so deterministic), and seeded requests reproducible through the engine whatever the batch."""

import numpy as np
import pytest
import torch

from engine_helpers import assert_pool_clean, make_llm
from kvlab.engine import SamplingParams
from kvlab.engine.request import Request
from kvlab.engine.sampler import Sampler, probabilities, sample_generator
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


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None])
def test_a_greedy_batch_reads_its_logits_once_and_still_refuses_unusable_rows(bad):
    """The check (NaN, +inf, all -inf) and the argmax are one pass over ``[B, V]``, not one pass each."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    logits[1, 7] = logits[1].max() + 1  # row 1's argmax, ahead of a -inf
    logits[1, 9] = float("-inf")
    params, sampler = [SamplingParams(temperature=0.0)] * 4, Sampler(0, "cpu")
    with CountCalls() as calls:
        tokens = sampler(logits, params, [None] * 4)
    assert tokens == logits.argmax(-1).tolist() and tokens[1] == 7 and calls.on_logits(logits) == 1
    if bad is None:
        logits[2] = float("-inf")
    else:
        logits[2, 3] = bad
    with pytest.raises(FloatingPointError, match=r"rows \[2\]"):
        sampler(logits, params, [None] * 4)


class CountCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch functions called with a given tensor as their first argument."""

    def __init__(self):
        super().__init__()
        self.first_args = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args:
            self.first_args.append(args[0])
        return func(*args, **(kwargs or {}))

    def on_logits(self, logits) -> int:
        return sum(arg is logits for arg in self.first_args)


def test_a_seeded_row_draws_the_same_token_whatever_the_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=7)] * 6
    alone = [Sampler(0, "cpu")(logits[i:i + 1], params[:1], [sample_generator(7, i, "cpu")])[0] for i in range(6)]
    batched = Sampler(5, "cpu")(logits, params, [sample_generator(7, i, "cpu") for i in range(6)])
    assert alone == batched


@pytest.mark.parametrize("temperature", [1e-37, 1e-40, 1e-300, 5e-324])
def test_a_tiny_temperature_picks_the_most_likely_token(temperature):
    """Dividing fp32 logits by it would overflow to inf, and inf - inf is NaN."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0], [-3.0, 5.0, 4.9999, 0.0], [0.0, -1e30, 1e30, float("-inf")]])
    params = [SamplingParams(temperature=temperature)] * 3
    probs = probabilities(logits, params)
    assert not probs.isnan().any() and probs.equal(torch.eye(4)[[0, 1, 2]])
    assert Sampler(0, "cpu")(logits, params, [None] * 3) == [0, 1, 2]


def test_a_huge_temperature_samples_evenly_and_keeps_masked_tokens_out():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, 30.0]])
    probs = probabilities(logits, [SamplingParams(temperature=1e300)])  # inf in fp32: -inf / inf would be NaN
    torch.testing.assert_close(probs, torch.tensor([[1 / 3, 0.0, 1 / 3, 1 / 3]]))


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-8])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    probs = probabilities(LOGITS[None], [SamplingParams(top_p=top_p)])  # 1e-300 rounds to 0 in fp32
    assert probs.equal(torch.eye(len(LOGITS))[[0]])
    assert frequencies(SamplingParams(top_p=top_p, top_k=3))[0] == 1.0


@pytest.mark.parametrize("bad", [dict(n=0), dict(temperature=-0.5), dict(temperature=float("nan")),
                                 dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_p=float("nan")), dict(top_k=-2), dict(top_k=True), dict(top_k=2.0),
                                 dict(max_tokens=0), dict(max_tokens=True), dict(stop_token_ids="eos"),
                                 dict(stop_token_ids=[-1]), dict(stop_token_ids=[True]), dict(stop_token_ids=5),
                                 dict(seed=-1), dict(seed=2**64), dict(seed=2**70), dict(seed=1.0),
                                 dict(ignore_eos=1), dict(n=True)])
def test_bad_sampling_params_are_rejected(bad):
    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_numpy_numbers_are_accepted_as_python_numbers():
    params = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=np.int32(5), top_p=np.float64(0.5),
                            max_tokens=np.uint8(3), stop_token_ids=np.array([1, 2]), seed=np.uint64(2**64 - 1))
    assert params == SamplingParams(n=2, temperature=0.5, top_k=5, top_p=0.5, max_tokens=3, stop_token_ids=(1, 2),
                                    seed=2**64 - 1)
    assert all(type(v) in (int, float, bool, tuple) for v in params.__dict__.values())
    assert Request.create("r", None, [1], params, 8, "cpu").generators[1] is not None


def test_parameters_beyond_the_vocabulary_are_refused_when_added_and_cost_no_one_anything(llama):
    """Before, top_k=2**64 was queued and the next step raised (int64 overflow), aborting every request."""
    llm = make_llm(llama[0])
    running = llm.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3))
    llm.step()
    for bad, match in [(dict(top_k=2**64), r"top_k=18446744073709551616 is more than the model's 128 tokens"),
                       (dict(top_k=129), r"top_k=129 .*use 1 to 128, or 0 or -1"),
                       (dict(stop_token_ids=[5, 128, 2**70]), r"stop_token_ids must be token ids in \[0, 128\)")]:
        with pytest.raises(InvalidArgumentError, match=match):
            llm.add_request([4, 5], SamplingParams(**bad))
    llm.add_request([4, 5], SamplingParams(top_k=128, stop_token_ids=[127], max_tokens=2))  # the whole vocabulary
    outs = {}
    while llm.has_unfinished_requests():
        outs.update((o.request_id, o) for o in llm.step())
    assert outs[running].outputs[0].finish_reason == "length" and len(outs) == 2
    assert_pool_clean(llm)


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
