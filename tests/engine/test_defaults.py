"""What a user gets without asking: ``generation_config.json``'s sampling settings when no SamplingParams is
given, and on CPU a KV pool of a fixed 256 MiB, stated in one log line. (Bad values in generation_config.json
are among test_model_files' broken directories.)"""

import json
import logging
import shutil

import pytest

import kvlab.device
from engine_helpers import hf_greedy, make_llm
from kvlab.engine import LLM, SamplingParams

PROMPT = [5, 17, 99, 3, 64]


@pytest.fixture
def with_generation_config(llama, tmp_path):
    """Copy the tiny Llama and return a function that writes its generation_config.json."""
    path = tmp_path / "model"
    shutil.copytree(llama[0], path)

    def write(**fields):
        (path / "generation_config.json").write_text(json.dumps(fields))
        return path
    return write


def test_generation_config_sets_the_defaults(with_generation_config):
    path = with_generation_config(do_sample=True, temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=5)
    llm = make_llm(path)
    same = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=5)
    assert llm.default_sampling_params() == same
    out, = llm.generate([PROMPT], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5
    # Sampled with the file's settings: the same draws as those settings passed explicitly (same engine seed).
    explicit, = make_llm(path).generate([PROMPT], same, use_tqdm=False)
    assert out.outputs[0].token_ids == explicit.outputs[0].token_ids
    llm.add_request(PROMPT)  # the step-level API takes the same defaults
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [len(o.outputs[0].token_ids) for o in outputs] == [5]


def test_explicit_sampling_params_win_entirely(with_generation_config, llama):
    llm = make_llm(with_generation_config(do_sample=True, temperature=0.7, top_k=20, max_new_tokens=5))
    out, = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(llama[1], PROMPT, 3)
    # Fields the explicit params leave unset take SamplingParams' defaults, not the file's.
    out, = llm.generate([PROMPT], SamplingParams(temperature=0.0), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == SamplingParams().max_tokens == 16


def test_do_sample_false_is_greedy_whatever_the_temperature(with_generation_config, llama):
    llm = make_llm(with_generation_config(do_sample=False, temperature=0.7, top_p=0.5, max_new_tokens=4))
    assert llm.default_sampling_params() == SamplingParams(temperature=0.0, top_p=0.5, max_tokens=4)
    out, = llm.generate([PROMPT], use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(llama[1], PROMPT, 4)


def test_a_generation_config_without_sampling_fields_leaves_sampling_params_defaults(with_generation_config):
    llm = make_llm(with_generation_config(eos_token_id=None, max_length=20, temperature=None))
    assert llm.default_sampling_params() == SamplingParams()


@pytest.mark.skipif(kvlab.device.ON_GPU, reason="the CPU default; on a GPU the pool is what memory leaves")
def test_the_cpu_default_pool_is_256_mib_and_logged(qwen3, tmp_path, caplog):
    path = tmp_path / "model"
    shutil.copytree(qwen3[0], path)
    config = json.loads((path / "config.json").read_text())
    # A long context, so that the budget and not max_num_seqs * max_model_len limits the pool.
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2**20}))
    with caplog.at_level(logging.INFO, logger="kvlab.engine"):
        llm = LLM(path, block_size=8)
    per_block = llm.kv_cache.bytes_per_block  # 2 layers x K and V x 8 tokens x 2 kv heads x 32 dims x 4 bytes
    assert per_block == 8192 and llm.block_manager.num_blocks * per_block == 256 * 2**20
    # A token: K and V x 2 kv heads x 32 dims x 4 bytes = 512 bytes a layer, in 2 layers.
    assert caplog.messages == ["KV cache: 32768 blocks of 8 tokens (262144 tokens, 256.0 MiB; 1,024 bytes per "
                               "token = 512 x 2 layers) on cpu (num_blocks=None: the CPU budget, 256 MiB)"]


def test_the_log_line_states_a_given_pool_and_its_swap_space(llama, caplog):
    with caplog.at_level(logging.INFO, logger="kvlab.engine"):
        make_llm(llama[0], num_blocks=64, preemption_mode="swap", num_cpu_blocks=128)
    device = kvlab.device.DEVICE.type + (":0" if kvlab.device.ON_GPU else "")
    assert caplog.messages == [f"KV cache: 64 blocks of 8 tokens (512 tokens, 0.5 MiB; 1,024 bytes per token = "
                               f"512 x 2 layers) on {device}, plus 128 CPU blocks for swapping (1.0 MiB) "
                               "(num_blocks=64)"]
