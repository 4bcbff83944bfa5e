"""A broken model directory gets a kvlab error naming the file, the field and what is allowed, before any
memory is taken; repaired, the same directory loads."""

import json
import shutil

import pytest

from engine_helpers import hf_greedy, make_llm
from kvlab.engine import LLM, ModelFileError, SamplingParams, UnsupportedModelError, WeightsError
from kvlab.errors import InvalidArgumentError


def write_json(file, value):
    file.write_text(json.dumps(value))


def set_field(file, **changes):
    write_json(file, {**json.loads(file.read_text()), **changes})


def make_dir_instead(file):
    file.unlink()
    file.mkdir()


CASES = {  # name: (break the copy, error, match)
    "config is a list": (lambda p: write_json(p / "config.json", [1, 2]), ModelFileError,
                         r"config.json must hold a JSON object.*got a list"),
    "config is a string": (lambda p: write_json(p / "config.json", "llama"), ModelFileError,
                           r"config.json must hold a JSON object.*got a str"),
    "config is not UTF-8": (lambda p: (p / "config.json").write_bytes(b"\xff{"), ModelFileError,
                            r"cannot read .*config.json.*utf-8"),
    "model_type is a list": (lambda p: set_field(p / "config.json", model_type=["llama"]), UnsupportedModelError,
                             r"config.json: model_type \['llama'\].*runs deepseek_v3, llama, qwen3"),
    "eos is a string": (lambda p: set_field(p / "generation_config.json", eos_token_id="abc"), ModelFileError,
                        r"generation_config.json: eos_token_id must be a token id.*got 'abc'"),
    "eos list holds null": (lambda p: set_field(p / "generation_config.json", eos_token_id=[1, None]),
                            ModelFileError, r"generation_config.json: eos_token_id.*got \[1, None\]"),
    "eos is negative": (lambda p: set_field(p / "config.json", eos_token_id=-1), ModelFileError,
                        r"config.json: eos_token_id.*int >= 0.*got -1"),
    "generation config is a list": (lambda p: write_json(p / "generation_config.json", [1]), ModelFileError,
                                    r"generation_config.json must hold a JSON object"),
    "temperature is a string": (lambda p: set_field(p / "generation_config.json", temperature="hot"),
                                ModelFileError, r"generation_config.json: temperature must be a finite number >= 0 "
                                r"or absent, got 'hot'"),
    "negative temperature": (lambda p: set_field(p / "generation_config.json", temperature=-0.5), ModelFileError,
                             r"generation_config.json: temperature must be a finite number >= 0.*got -0.5"),
    "temperature is NaN": (lambda p: set_field(p / "generation_config.json", temperature=float("nan")),
                           ModelFileError, r"generation_config.json: temperature must be a finite number.*got nan"),
    "top_p is 0": (lambda p: set_field(p / "generation_config.json", top_p=0), ModelFileError,
                   r"generation_config.json: top_p must be a number in \(0, 1\] or absent, got 0"),
    "top_p above 1": (lambda p: set_field(p / "generation_config.json", top_p=1.5), ModelFileError,
                      r"generation_config.json: top_p must be a number in \(0, 1\].*got 1.5"),
    "top_k beyond the vocabulary": (lambda p: set_field(p / "generation_config.json", top_k=1000), ModelFileError,
                                    r"generation_config.json: top_k must be an int from -1 to the vocabulary size "
                                    r"128.*got 1000"),
    "top_k is a float": (lambda p: set_field(p / "generation_config.json", top_k=5.5), ModelFileError,
                         r"generation_config.json: top_k must be an int.*got 5.5"),
    "max_new_tokens is 0": (lambda p: set_field(p / "generation_config.json", max_new_tokens=0), ModelFileError,
                            r"generation_config.json: max_new_tokens must be an int >= 1 or absent, got 0"),
    "do_sample is a string": (lambda p: set_field(p / "generation_config.json", do_sample="yes"), ModelFileError,
                              r"generation_config.json: do_sample must be true, false or absent, got 'yes'"),
    "odd head_dim": (lambda p: set_field(p / "config.json", head_dim=17), ModelFileError,
                     r"config.json: head_dim must be even.*got 17"),
    "vocab_size is a string": (lambda p: set_field(p / "config.json", vocab_size="abc"), ModelFileError,
                               r"config.json: vocab_size must be an int >= 1, got 'abc'"),
    "no attention heads": (lambda p: set_field(p / "config.json", num_attention_heads=0), ModelFileError,
                           r"config.json: num_attention_heads must be an int >= 1, got 0"),
    "no kv heads": (lambda p: set_field(p / "config.json", num_key_value_heads=0), ModelFileError,
                    r"config.json: num_key_value_heads must be an int >= 1, got 0"),
    "no layers": (lambda p: set_field(p / "config.json", num_hidden_layers=0), ModelFileError,
                  r"config.json: num_hidden_layers must be an int >= 1, got 0"),
    "negative vocab_size": (lambda p: set_field(p / "config.json", vocab_size=-5), ModelFileError,
                            r"config.json: vocab_size must be an int >= 1, got -5"),
    "no context": (lambda p: set_field(p / "config.json", max_position_embeddings=0), ModelFileError,
                   r"config.json: max_position_embeddings must be an int >= 2, got 0"),
    "negative rms_norm_eps": (lambda p: set_field(p / "config.json", rms_norm_eps=-1.0), ModelFileError,
                              r"config.json: rms_norm_eps must be a finite number > 0, got -1.0"),
    "rope_theta is a string": (lambda p: set_field(p / "config.json", rope_parameters=dict(
        rope_type="default", rope_theta="abc"), rope_scaling=None, rope_theta=None), ModelFileError,
        r"config.json: rope_theta must be a finite number > 0, got 'abc'"),
    "layer_types is a number": (lambda p: set_field(p / "config.json", layer_types=5), ModelFileError,
                                r"config.json: layer_types must be a list.*got 5"),
    "dtype is a list": (lambda p: set_field(p / "config.json", dtype=["float32"]), ModelFileError,
                        r"config.json: dtype must be a dtype name.*got \['float32'\]"),
    "weights file is a directory": (lambda p: make_dir_instead(p / "model.safetensors"), WeightsError,
                                    r"\['model.safetensors'\] are not files"),
    "shard index is a list": (lambda p: write_json(p / "model.safetensors.index.json", [1, 2]), WeightsError,
                              r"index.json must hold a JSON object whose weight_map.*got list"),
    "shard index names a number": (lambda p: write_json(p / "model.safetensors.index.json",
                                                        {"weight_map": {"lm_head.weight": 1}}), WeightsError,
                                   r"weight_map values must be shard file names.*got 1"),
    "shard index leaves the directory": (lambda p: write_json(p / "model.safetensors.index.json", {
        "weight_map": {"lm_head.weight": "../other/model.safetensors"}}), WeightsError,
        r"weight_map values must be shard file names.*'\.\./other/model.safetensors'"),
    "corrupted tokenizer.json": (lambda p: (p / "tokenizer.json").write_text("{not json"), ModelFileError,
                                 r"cannot load the tokenizer from tokenizer.json"),
    "vocab.json is a list": (lambda p: write_json(p / "vocab.json", []), ModelFileError,
                             r"cannot load the tokenizer from vocab.json"),
    "no config.json": (lambda p: (p / "config.json").unlink(), ModelFileError, r"it has no config.json"),
    "no directory": (lambda p: shutil.rmtree(p), ModelFileError, r"model directory .* does not exist"),
    "a file, not a directory": (lambda p: None, ModelFileError, r"config.json is not a directory"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_broken_model_directory_names_the_file_and_the_field(name, llama, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(llama[0], broken)
    edit, error, match = CASES[name]
    edit(broken)
    target = broken / "config.json" if name == "a file, not a directory" else broken
    with pytest.raises(error, match=match):
        LLM(target, num_blocks=8, block_size=8)
    shutil.rmtree(broken, ignore_errors=True)  # repaired, the same directory loads
    shutil.copytree(llama[0], broken)
    LLM(broken, num_blocks=8, block_size=8)


def test_the_model_must_be_a_path(llama):
    for model in (None, 123, [str(llama[0])]):
        with pytest.raises(InvalidArgumentError, match="model must be the path of a Hugging Face model directory"):
            LLM(model, num_blocks=8, block_size=8)


def test_a_huge_context_costs_no_memory_until_used(qwen3, tmp_path):
    """Rotary cos/sin are computed per step, not tabled for max_position_embeddings positions."""
    path = tmp_path / "model"
    shutil.copytree(qwen3[0], path)
    set_field(path / "config.json", max_position_embeddings=2**40)
    llm = make_llm(path)
    assert llm.max_model_len == 2**40
    prompt = [5, 17, 99, 3, 64, 23, 8, 41, 77, 12, 90, 31, 6]
    out, = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(qwen3[1], prompt, 4)
