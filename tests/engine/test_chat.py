"""``LLM.chat`` renders conversations with the tokenizer's chat template and serves them as ``generate`` serves
token ids; a template that writes its own BOS gets no second one; bad input changes nothing."""

import shutil

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from engine_helpers import VOCAB, assert_pool_clean, hf_greedy, make_llm
from kvlab.engine import NoChatTemplateError, NoTokenizerError, PromptTooLongError, SamplingParams
from kvlab.errors import InvalidArgumentError

BOS = 1
TEMPLATE_WORDS = {"<s>": BOS, "</s>": 2, "system": 3, "user": 4, "assistant": 5}
#: Ids 1-5 are the template's words; every other id i is the word "w<i>".
WORDS = {f"w{i}": i for i in range(VOCAB) if i not in TEMPLATE_WORDS.values()} | TEMPLATE_WORDS
#: Writes BOS itself, like SmolLM2's and Llama 3's templates, and refuses roles it does not know.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}"
            "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role') }}{% endif %}"
            "{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}assistant{% endif %}")
CONVERSATION = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w17 w40"}]
RENDERED_IDS = [BOS, 3, 9, 4, 17, 40, 5]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def save_tokenizer(path, chat_template):
    """A word-level tokenizer that, like Llama's, puts BOS before every text it encodes."""
    words = Tokenizer(models.WordLevel(WORDS, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    words.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", bos_token="<s>", eos_token="</s>",
                            chat_template=chat_template).save_pretrained(path)


@pytest.fixture
def chat_model(llama, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(llama[0], path)
    save_tokenizer(path, TEMPLATE)
    return path


def test_chat_is_generate_on_the_rendered_prompt(chat_model, llama):
    llm = make_llm(chat_model)
    out, = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    assert out.prompt == "<s>system w9 user w17 w40 assistant"
    assert out.prompt_token_ids == RENDERED_IDS
    reference, = make_llm(chat_model).generate([RENDERED_IDS], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids == hf_greedy(llama[1], RENDERED_IDS, 4)
    assert out.outputs[0].text == reference.outputs[0].text
    assert_pool_clean(llm)


def test_a_template_that_writes_bos_gets_no_second_one(chat_model):
    llm = make_llm(chat_model)
    out, = llm.chat(CONVERSATION, GREEDY, use_tqdm=False)
    # The trap chat avoids: encoding the rendered text the usual way puts the tokenizer's BOS before the
    # template's.
    assert llm.tokenizer.encode(out.prompt)[:2] == [BOS, BOS]
    assert out.prompt_token_ids[0] == BOS and out.prompt_token_ids.count(BOS) == 1


def test_a_list_of_conversations_gives_one_output_each_in_order(chat_model):
    llm = make_llm(chat_model)
    second = [{"role": "user", "content": "w60"}]
    outs = llm.chat([CONVERSATION, second], [GREEDY, SamplingParams(temperature=0.0, max_tokens=2)],
                    use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [RENDERED_IDS, [BOS, 4, 60, 5]]
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 2]
    alone, = make_llm(chat_model).chat(second, SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


MALFORMED = {  # messages -> what the error says
    "a string": ("hi", r"messages must be a non-empty list"),
    "nothing": ([], r"messages must be a non-empty list"),
    "an empty conversation": ([CONVERSATION, []], r"conversation 1 is empty"),
    "no content": ([{"role": "user"}], r"message 0 of the conversation is not a message"),
    "content not a string": ([{"role": "user", "content": 5}], r"message 0 of the conversation is not a message"),
    "a string among conversations": ([CONVERSATION, ["w5"]], r"message 0 of conversation 1 is not a message"),
    "a conversation among messages": ([CONVERSATION[0], CONVERSATION], r"message 1 of the conversation"),
    "a role the template refuses": ([CONVERSATION, [{"role": "tool", "content": "w7"}]],
                                    r"the chat template refuses conversation 1: .*unknown role"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_conversation_changes_nothing(chat_model, name):
    llm = make_llm(chat_model)
    messages, match = MALFORMED[name]
    with pytest.raises(InvalidArgumentError, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert llm.step() == []
    assert_pool_clean(llm)


def test_a_conversation_too_long_for_the_context_queues_none_of_the_batch(chat_model):
    llm = make_llm(chat_model, max_model_len=8)
    long = [{"role": "user", "content": " ".join(["w9"] * 8)}]
    with pytest.raises(PromptTooLongError, match="the prompt has 11 tokens"):
        llm.chat([CONVERSATION, long], GREEDY, use_tqdm=False)
    assert llm.step() == []
    assert_pool_clean(llm)


def test_a_model_that_cannot_chat_says_why(llama, chat_model, tmp_path):
    with pytest.raises(NoTokenizerError, match="has no tokenizer: chat needs one"):
        make_llm(llama[0]).chat(CONVERSATION, use_tqdm=False)
    plain = tmp_path / "plain"
    shutil.copytree(llama[0], plain)
    save_tokenizer(plain, chat_template=None)
    llm = make_llm(plain)
    with pytest.raises(NoChatTemplateError, match="the tokenizer has no chat template"):
        llm.chat(CONVERSATION, use_tqdm=False)
    assert_pool_clean(llm)
