"""A step's slots and tables are checked once, not once per layer: the tensor -> host reads of a step (each
one a GPU sync) do not grow with the number of layers, with either attention backend.
``KVLAB_CHECK_EVERY_LAYER=1`` brings the per-layer checks back. A decode step copies no sequence's whole token
list to take its newest token."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine_helpers import make_llm, save_tiny_model
from kvlab.blocks.sequence import Sequence
from kvlab.engine import SamplingParams
from kvlab.errors import InvalidArgumentError
from kvlab.kernels import torch_paged

#: The Tensor methods that read a tensor's values back to the host (a GPU sync each).
HOST_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy}
PROMPTS = ([5, 17, 99, 3, 64, 23, 8, 41, 77, 12], [7, 7, 1, 100])
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
LAYERS = 2  # the models have LAYERS and 2 * LAYERS layers


class CountHostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func in HOST_READS
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """{number of layers: a tiny Llama with that many layers}."""
    dirs = {}
    for layers in (LAYERS, 2 * LAYERS):
        dirs[layers] = tmp_path_factory.mktemp(f"llama_{layers}_layers")
        save_tiny_model("llama", dirs[layers], num_hidden_layers=layers)
    return dirs


def host_reads_per_step(path, backend="triton") -> dict:
    """{step kind: host reads} of the first two steps of PROMPTS: a prefill of both prompts, then a decode of
    both."""
    llm = make_llm(path, attention_backend=backend)
    for prompt in PROMPTS:
        llm.add_request(prompt, GREEDY)
    reads = {}
    for _ in range(2):
        with CountHostReads() as counter:
            llm.step()
        reads[llm.step_dataframe()["kind"].iloc[-1]] = counter.count
    assert list(reads) == ["prefill", "decode"]
    return reads


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_a_steps_host_reads_do_not_grow_with_the_layers(model_dirs, monkeypatch, backend):
    monkeypatch.delenv("KVLAB_CHECK_EVERY_LAYER", raising=False)
    assert host_reads_per_step(model_dirs[LAYERS], backend) == host_reads_per_step(model_dirs[2 * LAYERS], backend)


def test_the_torch_layers_do_not_check_the_cache_again(model_dirs, monkeypatch):
    """The torch backend checks the cache's layout when it plans the step, not again in every layer (Python
    checks of tens of microseconds, 30 times a SmolLM2 step)."""
    checks = []
    check_cache = torch_paged.check_cache
    monkeypatch.setattr(torch_paged, "check_cache", lambda *args, **kwargs: checks.append(1) or check_cache(*args,
                                                                                                         **kwargs))
    per_model = []
    for path in model_dirs.values():
        llm = make_llm(path, attention_backend="torch")
        for prompt in PROMPTS:
            llm.add_request(prompt, GREEDY)
        checks.clear()
        llm.step(), llm.step()  # a prefill, then a decode
        per_model.append(len(checks))
    assert per_model[0] == per_model[1] > 0


def test_the_debug_switch_checks_every_layer_again(model_dirs, monkeypatch):
    monkeypatch.setenv("KVLAB_CHECK_EVERY_LAYER", "1")
    few, many = host_reads_per_step(model_dirs[LAYERS]), host_reads_per_step(model_dirs[2 * LAYERS])
    assert many["prefill"] > few["prefill"] and many["decode"] > few["decode"]


def test_the_debug_switch_catches_metadata_spoilt_between_layers(model_dirs, monkeypatch):
    """Layer 1 gets a sequence length of 0 after the step's check passed: only a per-layer check sees it."""
    monkeypatch.setenv("KVLAB_CHECK_EVERY_LAYER", "1")
    llm = make_llm(model_dirs[LAYERS], attention_backend="triton")

    def spoil(layer, args):
        batch = args[3]
        batch.seq_lens[0] = 0

    llm.model.model.layers[1].register_forward_pre_hook(spoil)
    out, = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "abort"
    assert "seq_lens[0] = 0; every sequence length must be >= 1" in out.outputs[0].abort_reason


def test_the_debug_switch_leaves_the_output_as_it_is(model_dirs, monkeypatch):
    outputs = []
    for value in ("0", "1"):
        monkeypatch.setenv("KVLAB_CHECK_EVERY_LAYER", value)
        llm = make_llm(model_dirs[LAYERS], attention_backend="triton")
        outputs.append([o.outputs[0].token_ids for o in llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)])
    assert outputs[0] == outputs[1]


def test_a_bad_switch_value_is_refused(model_dirs, monkeypatch):
    monkeypatch.setenv("KVLAB_CHECK_EVERY_LAYER", "yes")
    with pytest.raises(InvalidArgumentError, match="KVLAB_CHECK_EVERY_LAYER must be 1 .* got 'yes'"):
        make_llm(model_dirs[LAYERS], attention_backend="triton")


def test_a_decode_step_copies_no_whole_token_list(model_dirs, monkeypatch):
    llm = make_llm(model_dirs[LAYERS])
    for prompt in PROMPTS:
        llm.add_request(prompt, GREEDY)
    llm.step()
    copies = []
    whole_list = Sequence.token_ids.fget
    monkeypatch.setattr(Sequence, "token_ids", property(lambda seq: copies.append(seq) or whole_list(seq)))
    llm.step()
    assert llm.step_dataframe()["kind"].iloc[-1] == "decode"
    assert copies == []
