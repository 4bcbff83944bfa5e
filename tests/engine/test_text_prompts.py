"""String prompts go through the model directory's tokenizer, and outputs carry decoded text."""

import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine_helpers import VOCAB, assert_pool_clean, make_llm
from kvlab.engine import SamplingParams
from kvlab.errors import InvalidArgumentError


@pytest.fixture
def text_model(llama, tmp_path):
    """The tiny Llama with a word-level tokenizer: token i is the word "w<i>"."""
    path = tmp_path / "model"
    shutil.copytree(llama[0], path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(path)
    return path


def test_text_in_text_out(text_model):
    llm = make_llm(text_model)
    out, = llm.generate("w5 w17 w99", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert out.prompt == "w5 w17 w99" and out.prompt_token_ids == [5, 17, 99]
    completion = out.outputs[0]
    assert completion.text == " ".join(f"w{t}" for t in completion.token_ids)
    assert_pool_clean(llm)


def test_text_the_tokenizer_cannot_handle_costs_only_its_own_output(text_model, monkeypatch):
    llm = make_llm(text_model)
    with pytest.raises(InvalidArgumentError, match=r"the tokenizer cannot encode this prompt \('w1 \\ud800'\)"):
        llm.add_request("w1 \ud800")  # a lone surrogate: the Rust tokenizer refuses it
    decode = llm.tokenizer.decode

    def flaky(ids, **kwargs):
        if len(ids) == 1:
            raise ValueError("injected decode failure")
        return decode(ids, **kwargs)

    monkeypatch.setattr(llm.tokenizer, "decode", flaky)
    bad, good = llm.generate(["w3", "w5 w17"], [SamplingParams(max_tokens=1), SamplingParams(max_tokens=3)],
                             use_tqdm=False)
    assert len(bad.outputs[0].token_ids) == 1 and bad.outputs[0].text is None
    assert bad.outputs[0].finish_reason == "abort"
    assert "detokenizing failed for this sample: ValueError('injected decode failure')" in bad.outputs[0].abort_reason
    assert good.outputs[0].finish_reason == "length"
    assert good.outputs[0].text == " ".join(f"w{t}" for t in good.outputs[0].token_ids)
    assert_pool_clean(llm)
