"""Bad input gets kvlab's own error, naming the problem, before any work starts; the engine stays usable."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvlab.device
from engine_helpers import assert_pool_clean, make_llm, save_tiny_model
from kvlab.engine import LLM, NoTokenizerError, PromptTooLongError, SamplingParams, UnsupportedModelError, WeightsError
from kvlab.engine.random_model import save_random_model
from kvlab.errors import InvalidArgumentError, KvlabError


@pytest.fixture
def model_copy(llama, tmp_path):
    """A copy of the tiny Llama directory the test may break."""
    path = tmp_path / "model"
    shutil.copytree(llama[0], path)
    return path


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_unknown_architecture(model_copy):
    edit_config(model_copy, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, qwen3"):
        LLM(model_copy, num_blocks=8, block_size=8)


def test_missing_weight(model_copy):
    edit_weights(model_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightsError, match="1 weights missing: model.layers.1.mlp.up_proj.weight"):
        LLM(model_copy, num_blocks=8, block_size=8)


def test_unexpected_weight(model_copy):
    edit_weights(model_copy, lambda t: t.update({"model.layers.0.self_attn.q_norm.weight": torch.ones(32)}))
    with pytest.raises(WeightsError, match="does not have.*q_norm"):
        LLM(model_copy, num_blocks=8, block_size=8)


def test_weights_that_do_not_match_the_config(model_copy):
    edit_config(model_copy, intermediate_size=100)
    with pytest.raises(WeightsError, match=r"gate_proj.weight: \(96, 64\) in the file, \(100, 64\) from config.json"):
        LLM(model_copy, num_blocks=8, block_size=8)


def test_no_weights(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        LLM(model_copy, num_blocks=8, block_size=8)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_head_dim_the_kernels_do_not_support(tmp_path, backend):
    save_tiny_model("llama", tmp_path, head_dim=8)
    with pytest.raises(UnsupportedModelError, match=f"{backend} attention cannot serve .* head_dim 8"):
        LLM(tmp_path, num_blocks=8, block_size=8, attention_backend=backend)


@pytest.mark.skipif(kvlab.device.ON_GPU, reason="bf16 runs on GPUs that support it")
def test_dtype_the_kernels_do_not_support_here(llama):
    with pytest.raises(UnsupportedModelError, match="triton attention cannot serve .* bfloat16"):
        LLM(llama[0], num_blocks=8, block_size=8, dtype=torch.bfloat16, attention_backend="triton")
    # The Triton interpreter computes bf16 wrongly; torch does not, so the torch backend takes it.
    assert LLM(llama[0], num_blocks=8, block_size=8, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_attention_backend_default_and_choice(llama):
    default = "triton" if kvlab.device.ON_GPU else "torch"
    assert LLM(llama[0], num_blocks=8, block_size=8).attention_backend == default
    for backend in ("torch", "triton"):
        assert LLM(llama[0], num_blocks=8, block_size=8, attention_backend=backend).attention_backend == backend


@pytest.mark.parametrize("settings, match", [
    (dict(block_size=256), "block_size"),
    (dict(dtype="int8"), "dtype"),
    (dict(preemption_mode="evict"), "preemption_mode"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "max_num_batched_tokens"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(preemption_mode="swap", num_cpu_blocks=0), "num_cpu_blocks"),
    (dict(max_model_len=10_000), "max_model_len"),
    (dict(device="cpu" if kvlab.device.ON_GPU else "cuda"), "device"),
    (dict(attention_backend="flash"), "attention_backend must be None .* 'torch', 'triton', got 'flash'"),
    (dict(attention_backend=["torch"]), "attention_backend"),
    (dict(seed=2**64), r"seed must be an int in \[0, 18446744073709551615\]"),
    (dict(seed=2**70), "seed"),
    (dict(scheduling="v2"), r"scheduling must be one of \('v1', 'v0'\), got 'v2'"),
    (dict(scheduling=1), "scheduling"),
    (dict(offload_policy=["lru"]), r"offload_policy must be one of \['arc', 'lru'\], got \['lru'\]"),
    (dict(offload_policy={"lru": 1}), r"offload_policy must be one of \['arc', 'lru'\], got \{'lru': 1\}"),
])
def test_bad_engine_settings(llama, settings, match):
    with pytest.raises(KvlabError, match=match) as error:
        LLM(llama[0], **{"num_blocks": 8, "block_size": 8, **settings})
    assert isinstance(error.value, ValueError)


def test_bad_prompts_queue_nothing_and_the_engine_stays_usable(llama):
    llm = make_llm(llama[0], num_blocks=4, max_model_len=40, max_num_seqs=4, max_num_batched_tokens=30)
    good = [1, 2, 3]
    cases = [
        ([list(range(1, 41))], PromptTooLongError, "context is 40"),
        ([list(range(1, 34))], PromptTooLongError, "pool holds only 4 blocks"),
        ([good, [1, 500]], InvalidArgumentError, r"id in \[0, 128\)"),
        ([good, []], InvalidArgumentError, "at least one token"),
        (["hello"], NoTokenizerError, "token-id lists"),
        ([1, 2, 3], InvalidArgumentError, "list of strings or of token-id lists"),
        ([good, None], InvalidArgumentError, "NoneType"),
    ]
    for prompts, error, match in cases:
        with pytest.raises(error, match=match):
            llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        assert not llm.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="SamplingParams"):
        llm.generate([good], dict(max_tokens=1), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs is 4"):
        llm.generate([good], SamplingParams(n=5), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="2 sampling_params for 1 prompts"):
        llm.generate([good], [SamplingParams(), SamplingParams()], use_tqdm=False)
    llm.add_request(good, SamplingParams(max_tokens=1), request_id="a")
    with pytest.raises(InvalidArgumentError, match="request_id"):
        llm.add_request(good, request_id="a")
    llm.abort_request("a")
    assert llm.generate([good], SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].finish_reason == "length"
    aborted, = llm.step()
    assert aborted.request_id == "a" and aborted.outputs[0].finish_reason == "abort"
    assert_pool_clean(llm)


def test_only_v0_scheduling_refuses_a_prompt_longer_than_the_token_budget(llama):
    over = [[1] * 31]
    v0 = make_llm(llama[0], num_blocks=4, max_num_seqs=4, max_num_batched_tokens=30, scheduling="v0")
    with pytest.raises(PromptTooLongError, match="max_num_batched_tokens=30 .* scheduling='v1'"):
        v0.generate(over, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_pool_clean(v0)
    v1 = make_llm(llama[0], num_blocks=4, max_num_seqs=4, max_num_batched_tokens=30)
    out, = v1.generate(over, SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.outputs[0].finish_reason == "length" and list(v1.step_dataframe()["prefill_tokens"]) == [30, 1]


@pytest.mark.parametrize("where, error", [("begin_step", RuntimeError("device lost")),
                                          ("forward", KeyboardInterrupt("device lost"))])
def test_a_step_that_fails_aborts_everything_and_forgets_unwritten_blocks(llama, monkeypatch, where, error):
    """A failure no request can be blamed for: in the step's block moves, or an interrupt."""
    llm = make_llm(llama[0], max_num_seqs=4, max_num_batched_tokens=20)
    prompt = list(range(1, 20))
    ids = [llm.add_request(prompt, SamplingParams(max_tokens=2)), llm.add_request([1, 2, 3])]  # the 2nd waits

    def broken(*args):
        raise error

    monkeypatch.setattr(llm.runner, where, broken)
    with pytest.raises(type(error), match="device lost"):
        llm.step()  # scheduled: the prompt's blocks were allocated (and made hittable) but never written
    outs = llm.step()  # the aborted requests' outputs come with the next step
    assert [o.request_id for o in outs] == ids and {o.outputs[0].finish_reason for o in outs} == {"abort"}
    assert all("device lost" in o.outputs[0].abort_reason for o in outs)
    assert_pool_clean(llm)
    monkeypatch.undo()
    out = llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.metrics.num_cached_prompt_tokens == 0  # the unwritten blocks were not hit
    assert_pool_clean(llm)


@pytest.mark.parametrize("shape", [["tiny"], {"tiny": 1}])
def test_a_random_models_shape_is_a_name(tmp_path, shape):
    with pytest.raises(InvalidArgumentError, match=r"shape must be one of \['qwen3-0.6b', 'smollm2-135m', 'tiny'\]"):
        save_random_model(tmp_path, shape)
