"""String prompts go through the model directory's tokenizer, and outputs carry decoded text."""

import shutil

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from engine_helpers import VOCAB, assert_pool_clean, make_llm
from kvlab.engine import SamplingParams


def test_text_in_text_out(llama, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(llama[0], path)
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0").save_pretrained(path)
    llm = make_llm(path)
    out, = llm.generate("w5 w17 w99", SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert out.prompt == "w5 w17 w99" and out.prompt_token_ids == [5, 17, 99]
    completion = out.outputs[0]
    assert completion.text == " ".join(f"w{t}" for t in completion.token_ids)
    assert_pool_clean(llm)
