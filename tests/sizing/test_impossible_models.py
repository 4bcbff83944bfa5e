"""``kvlab size`` refuses a model that cannot exist, one it does not support, and settings past what it can
hold: one ``kvlab size: error:`` line naming the file, the field and what is allowed, exit status 2, and no
figures. Each config is a published one (configs/) with one field changed."""

import json
import re
from pathlib import Path

import pytest

from kvlab.__main__ import main
from kvlab.errors import InvalidArgumentError
from kvlab.sizing import parse_memory
from kvlab.sizing.hf_config import read_model_shape
from kvlab.sizing.plan import size_model

CONFIGS = Path(__file__).parent / "configs"
GiB = 2**30


def published(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def kvlab_size(argv: list, capsys) -> tuple[int, str, list]:
    try:
        status = main(["size", *argv])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err.strip().splitlines()


def assert_refused(argv: list, capsys, *fragments) -> None:
    status, out, err = kvlab_size(argv, capsys)
    usage = err[:-1]  # argparse prints its usage above an option's error
    assert status == 2 and out == "" and err[-1].startswith("kvlab size: error:"), (status, out, err)
    assert all(line.startswith(("usage:", " ")) for line in usage), err
    for fragment in fragments:
        assert fragment in err[-1], err[-1]


# (published config, fields changed, what the error says); each case printed figures or crashed before.
BAD_CONFIGS = {
    "kv heads 0": ("Meta-Llama-3-8B", dict(num_key_value_heads=0),
                   "num_key_value_heads must be an int from 1 to 65,536 or null, got 0"),
    "kv heads not a divisor": ("Meta-Llama-3-8B", dict(num_key_value_heads=3),
                               "num_attention_heads (32) must be a multiple of num_key_value_heads (3)"),
    "more kv heads than heads": ("Meta-Llama-3-8B", dict(num_key_value_heads=64),
                                 "num_attention_heads (32) must be a multiple of num_key_value_heads (64)"),
    "kv heads huge": ("Meta-Llama-3-8B", dict(num_key_value_heads=10**30), "num_key_value_heads must be an int"),
    "head_dim 0": ("Meta-Llama-3-8B", dict(head_dim=0), "head_dim must be an int from 1 to 65,536 or null, got 0"),
    "head_dim huge": ("Meta-Llama-3-8B", dict(head_dim=10**9), "head_dim must be an int from 1 to 65,536"),
    "head_dim odd": ("Meta-Llama-3-8B", dict(head_dim=3), "head_dim must be even"),
    "vocab 0": ("Meta-Llama-3-8B", dict(vocab_size=0), "vocab_size must be an int from 1 to 16,777,216, got 0"),
    "vocab negative": ("Meta-Llama-3-8B", dict(vocab_size=-1), "vocab_size must be an int from 1"),
    "vocab huge": ("Meta-Llama-3-8B", dict(vocab_size=10**12), "vocab_size must be an int from 1"),
    "intermediate 0": ("Meta-Llama-3-8B", dict(intermediate_size=0), "intermediate_size must be an int from 1"),
    "intermediate negative": ("SmolLM2-135M", dict(intermediate_size=-1536), "intermediate_size must be an int"),
    "hidden huge": ("Meta-Llama-3-8B", dict(hidden_size=2**40), "hidden_size must be an int from 1 to 1,048,576"),
    "layers huge (MemoryError)": ("Meta-Llama-3-8B", dict(num_hidden_layers=10**12),
                                  "num_hidden_layers must be an int from 1 to 65,536, got 1000000000000"),
    "layers past an index (OverflowError)": ("Meta-Llama-3-8B", dict(num_hidden_layers=10**30),
                                             "num_hidden_layers must be an int"),
    "context 0 (ZeroDivisionError)": ("Meta-Llama-3-8B", dict(max_position_embeddings=0),
                                      "max_position_embeddings must be an int from 1 to 4,294,967,296, got 0"),
    "context negative (ZeroDivisionError)": ("Meta-Llama-3-8B", dict(max_position_embeddings=-1),
                                             "max_position_embeddings must be an int from 1"),
    "context huge": ("Meta-Llama-3-8B", dict(max_position_embeddings=10**12), "max_position_embeddings must be"),
    "MLA rank 0": ("DeepSeek-V3", dict(kv_lora_rank=0), "kv_lora_rank must be an int from 1 to 65,536 or null"),
    "MLA rank negative": ("DeepSeek-V3", dict(kv_lora_rank=-512), "kv_lora_rank must be an int from 1"),
    "MLA rope 0": ("DeepSeek-V3", dict(qk_rope_head_dim=0), "qk_rope_head_dim must be an int from 1 to 65,536, got 0"),
    "MLA rope negative": ("DeepSeek-V3", dict(qk_rope_head_dim=-64), "qk_rope_head_dim must be an int from 1"),
    "MLA nope 0": ("DeepSeek-V3", dict(qk_nope_head_dim=0), "qk_nope_head_dim must be an int from 1"),
    "MLA v_head_dim 0": ("DeepSeek-V3", dict(v_head_dim=0), "v_head_dim must be an int from 1"),
    "MLA v_head_dim null (TypeError)": ("DeepSeek-V3", dict(v_head_dim=None), "v_head_dim must be an int from 1"),
    "MLA q rank 0": ("DeepSeek-V3", dict(q_lora_rank=0), "q_lora_rank must be an int from 1 to 65,536 or null"),
    "no routed experts": ("DeepSeek-V3", dict(n_routed_experts=0), "n_routed_experts must be an int from 1"),
    "expert width 0": ("DeepSeek-V3", dict(moe_intermediate_size=0), "moe_intermediate_size must be an int from 1"),
    "shared experts negative": ("DeepSeek-V3", dict(n_shared_experts=-1), "n_shared_experts must be an int from 0"),
    "dense layers negative": ("DeepSeek-V3", dict(first_k_dense_replace=-3), "first_k_dense_replace must be an int"),
    "local experts 0": ("gpt-oss-20b", dict(num_local_experts=0), "num_local_experts must be an int from 1"),
    "window huge": ("gpt-oss-20b", dict(sliding_window=10**30), "sliding_window must be an int from 1 to"),
    "architectures a string": ("Meta-Llama-3-8B", dict(architectures="LlamaForCausalLM"),
                               "architectures must be a list of class names"),
    "architectures not names": ("Meta-Llama-3-8B", dict(architectures=[1]), "architectures must be a list"),
    "dtype not a name": ("Meta-Llama-3-8B", dict(torch_dtype=16), "torch_dtype must be a dtype name"),
    "quant_method not a name": ("Meta-Llama-3-8B", dict(quantization_config={"quant_method": 8}),
                                "quantization_config must be a JSON object whose quant_method is a name"),
    "qwen3-next value heads 0": ("Qwen3-Next-80B-A3B-Instruct", dict(linear_num_value_heads=0),
                                 "linear_num_value_heads must be an int from 1 to 65,536, got 0"),
    "qwen3-next no attention layer": ("Qwen3-Next-80B-A3B-Instruct", dict(layer_types=["linear_attention"] * 48),
                                      "at least one attention layer (full_attention, sliding_attention), got 48"),
    "gemma 3 text heads 0": ("gemma-3-4b-it", dict(text_config=dict(published("gemma-3-4b-it")["text_config"],
                                                                    num_key_value_heads=0)),
                             "num_key_value_heads must be an int from 1"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_a_config_that_cannot_exist_is_one_error_naming_the_field(case, tmp_path, capsys):
    name, changes, message = BAD_CONFIGS[case]
    (tmp_path / "config.json").write_text(json.dumps(published(name) | changes))
    assert_refused(["--model", str(tmp_path)], capsys, str(tmp_path / "config.json"), message)
    with pytest.raises(InvalidArgumentError, match="must be"):
        read_model_shape(tmp_path)


# Not a decoder of attention layers: transformers knows these, kvlab size cannot describe their cache.
UNSUPPORTED = {
    "recurrent_gemma": "its config has no max_position_embeddings",  # recurrent blocks (AttributeError before)
    "t5": "it is an encoder-decoder model",  # AttributeError before
    "bert": "its config has no num_key_value_heads",  # an encoder: figures were printed
    # a Mamba hybrid not sized yet (Qwen3-Next's, Jamba's and Falcon-H1's are): the message names the supported ones
    "bamba": "layer_types has linear_attention layers",
}


@pytest.mark.parametrize("model_type", UNSUPPORTED)
def test_an_architecture_sizing_cannot_describe_is_not_supported(model_type, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert_refused(["--model", str(tmp_path)], capsys, f"{model_type} is not supported: {UNSUPPORTED[model_type]}",
                   "kvlab size supports decoder-only transformers", "full or sliding-window attention",
                   "hybrid state models qwen3_next, jamba and falcon_h1")


@pytest.mark.parametrize("option, value, message", [
    ("--gpu-memory", "1e400", "the memory must be from one byte to 2**64 bytes"),  # OverflowError before
    ("--gpu-memory", "1e30", "the memory must be from one byte to 2**64 bytes"),
    ("--block-size", str(10**30), "block size must be an int in [1, 4294967296]"),
    ("--max-num-batched-tokens", str(10**30), "max num batched tokens must be an int in [1, 4294967296]"),
    ("--max-num-seqs", "1" + "0" * 400, "max num seqs must be an int in [1, 4294967296]"),  # OverflowError before
])
def test_an_option_past_what_sizing_holds_is_one_error(option, value, message, capsys):
    assert_refused(["--model", str(CONFIGS / "Meta-Llama-3-8B"), option, value], capsys, f"argument {option}",
                   message)


@pytest.mark.parametrize("options, message", [
    (dict(max_model_len=2**32 + 1), "max_model_len must be an int in [1, 4294967296]"),
    (dict(gpu_memory=2**64 + 1), "gpu_memory must be an int in [1, 18446744073709551616]"),
    (dict(max_num_seqs=2**32 + 1), "max_num_seqs must be an int in [1, 4294967296]"),
])
def test_size_model_refuses_settings_past_its_arithmetic(options, message):
    shape = read_model_shape(CONFIGS / "SmolLM2-135M")
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        size_model(shape, **{"gpu_memory": GiB, "gpu_memory_utilization": 0.9, **options})


def test_size_model_takes_a_model_shape():
    with pytest.raises(InvalidArgumentError, match="shape must be a ModelShape"):
        size_model("SmolLM2-135M", gpu_memory=GiB, gpu_memory_utilization=0.9)


def test_parse_memory_takes_text():
    with pytest.raises(InvalidArgumentError, match="expected an amount of memory"):
        parse_memory(80 * GiB)

