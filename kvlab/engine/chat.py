"""``LLM.chat``'s input side: conversations rendered by the tokenizer's chat template into prompts.

As vLLM's ``LLM.chat`` does for Hugging Face tokenizers, the template is rendered to text with the generation
prompt (``apply_chat_template(..., tokenize=False, add_generation_prompt=True)``) and that text is encoded
with ``add_special_tokens=False``: a template writes its own special tokens, BOS included where the model
wants one, so letting the tokenizer add them again would start the prompt with a second BOS.
"""

from kvlab.engine.errors import NoChatTemplateError, NoTokenizerError
from kvlab.errors import InvalidArgumentError

MESSAGE_FORM = 'a message is a dict with a "role" and a "content" string, e.g. {"role": "user", "content": "Hi"}'


def as_conversations(messages) -> list[list[dict]]:
    """One conversation (a list of messages) or a list of them (vLLM's rule: a list whose items are all lists
    is a batch), as a list of conversations, each checked."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgumentError(f"messages must be a non-empty list of messages, or a list of such lists; "
                                   f"{MESSAGE_FORM}; got {messages!r:.80}")
    batch = all(isinstance(m, (list, tuple)) for m in messages)
    conversations = list(messages) if batch else [messages]
    for i, conversation in enumerate(conversations):
        where = f"conversation {i}" if batch else "the conversation"
        if not conversation:
            raise InvalidArgumentError(f"{where} is empty: it needs at least one message")
        for j, message in enumerate(conversation):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise InvalidArgumentError(f"message {j} of {where} is not a message: {MESSAGE_FORM}; got "
                                           f"{message!r:.80}")
    return conversations


def render(tokenizer, path, messages) -> list[tuple[str, list[int]]]:
    """(rendered text, its token ids) for each conversation in ``messages``; raises before returning any if
    the model cannot chat or one conversation is malformed or refused by the template."""
    if tokenizer is None:
        raise NoTokenizerError(f"{path} has no tokenizer: chat needs one, with a chat template")
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(f"{path}: the tokenizer has no chat template (chat_template in "
                                  "tokenizer_config.json, or chat_template.jinja): format the prompt yourself and "
                                  "call generate")
    prompts = []
    for i, conversation in enumerate(as_conversations(messages)):
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - templates raise their own errors (e.g. roles must alternate)
            raise InvalidArgumentError(f"the chat template refuses conversation {i}: {type(e).__name__}: {e}") from None
        try:
            token_ids = tokenizer.encode(text, add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate, which the Rust tokenizers refuse
            raise InvalidArgumentError(f"the tokenizer cannot encode conversation {i} ({text[:40]!r}): "
                                       f"{type(e).__name__}: {e}") from None
        prompts.append((text, token_ids))
    return prompts
