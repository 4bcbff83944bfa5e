"""The decode suite's floor: which weights a decode step streams, its FLOPs, and rounds that compare each step
with the floor measured beside it (the suite itself runs SmolLM2: a benchmark, not a test)."""

import pytest

from engine_helpers import make_llm
from kvlab.bench.decode import decode_rounds, step_flops, streamed_weights


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # untied and tied output matrices
def test_a_step_streams_every_layer_and_the_output_matrix_once(request, arch):
    path, _ = request.getfixturevalue(arch)
    model = make_llm(path).model
    streamed = {t.data_ptr() for t in streamed_weights(model)}
    layers = {p.data_ptr() for p in model.model.layers.parameters()}
    assert layers < streamed and model.lm_head.weight.data_ptr() in streamed
    assert len(streamed) == len(streamed_weights(model))  # each once, the tied matrix included
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == (arch == "qwen3") and (model.model.embed_tokens.weight.data_ptr() in streamed) == tied


def test_step_flops_count_two_per_weight_and_token_plus_attention(llama):
    model = make_llm(llama[0]).model
    config = model.config
    matrices = sum(t.numel() for t in streamed_weights(model) if t.dim() == 2)
    attention = 4 * 10 * config.num_heads * config.head_dim * config.num_layers
    assert step_flops(model, 3, context=10) == 3 * (2 * matrices + attention)


def test_each_round_compares_a_step_with_the_floor_beside_it(llama):
    llm = make_llm(llama[0])
    rounds = decode_rounds(llm, [[5, 17, 99, 3], [7, 7, 1]], steps=3)
    assert len(rounds) == 3 and (rounds[["stream_s", "gemm_s", "step_s"]] > 0).all().all()
    assert (rounds["floor_s"] == rounds[["stream_s", "gemm_s"]].max(axis=1)).all()
    assert (rounds["x_floor"] == rounds["step_s"] / rounds["floor_s"]).all()
    assert not llm.has_unfinished_requests()  # the rounds' requests are aborted, the engine is free again
