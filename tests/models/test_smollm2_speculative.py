"""Speculative decoding (n-gram prompt lookup; suffix decoding with the acceptance rule) on the real
SmolLM2-135M-Instruct: greedy tokens equal HF transformers' and plain decoding's on a copy-heavy chat prompt
(the answer quotes the prompt), where drafts are accepted, with a second prompt hitting the first one's cached
system-prompt blocks."""

import pytest
import torch

from kvlab.engine import LLM, SamplingParams
from kvlab.models import smollm2

pytestmark = pytest.mark.slow

QUESTIONS = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "Name a primary colour."]
MAX_TOKENS = 20
BLOCK_SIZE = 16


def test_speculative_greedy_matches_hf_on_smollm2():
    from transformers import AutoModelForCausalLM

    path = smollm2()
    runs = {}
    for config in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                          "prompt_lookup_max": 4},
                   {"method": "suffix", "num_speculative_tokens": 8, "draft_acceptance_floor": 0.3}):
        llm = LLM(path, block_size=BLOCK_SIZE, num_blocks=64, speculative_config=config)
        texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                   tokenize=False) for q in QUESTIONS]
        prompts = [llm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
        runs[config and config["method"]] = outs
    hf = AutoModelForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(p):].tolist()
                    for p in prompts]
    for outs in runs.values():
        assert [o.outputs[0].token_ids for o in outs] == expected
    plain = runs[None]
    for speculative in (runs["ngram"], runs["suffix"]):
        assert speculative[0].metrics.num_accepted_tokens > 0
        assert [o.metrics.num_cached_prompt_tokens for o in speculative] == [o.metrics.num_cached_prompt_tokens
                                                                            for o in plain]
        assert speculative[1].metrics.num_cached_prompt_tokens > 0
