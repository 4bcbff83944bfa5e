"""Request intake: what ``LLM`` checks before it queues anything (kvlab.engine.llm).

A prompt must be token ids of the model's vocabulary (a string is encoded by the model's tokenizer), leave
room in the context to generate, and fit the pool and the scheduler's first step; sampling parameters must
be servable by this model and engine. Every check raises before anything is queued, with kvlab's own errors
(kvlab.errors, kvlab.engine.errors) saying what was wrong and what is allowed.
"""

from kvlab.engine.config import ModelConfig
from kvlab.engine.errors import ModelFileError, NoTokenizerError, PromptTooLongError
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import too_long_for_the_pool
from kvlab.errors import InvalidArgumentError
from kvlab.validation import is_int

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def load_tokenizer(path):
    """The model directory's tokenizer, None if it has none; ModelFileError if its files cannot be loaded."""
    present = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not present:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - tokenizer backends raise many types; each means unusable files
        raise ModelFileError(f"{path}: cannot load the tokenizer from {', '.join(present)}: "
                             f"{type(e).__name__}: {e}") from None


def prompt_token_ids(tokenizer, config: ModelConfig, prompt, max_len: int | None = None) -> list[int]:
    """A prompt's token ids, each checked to be in the vocabulary (and, given ``max_len``, at most that many)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise NoTokenizerError(f"{config.path} has no tokenizer: pass prompts as token-id lists")
        try:
            token_ids = tokenizer.encode(prompt)
        except Exception as e:  # noqa: BLE001 - e.g. a lone surrogate, which the Rust tokenizers refuse
            raise InvalidArgumentError(f"the tokenizer cannot encode this prompt ({prompt[:40]!r}): "
                                       f"{type(e).__name__}: {e}") from None
    elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
        token_ids = [int(t) for t in prompt]
    else:
        raise InvalidArgumentError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    vocab = config.vocab_size
    if not token_ids or not all(0 <= t < vocab for t in token_ids):
        raise InvalidArgumentError(f"a prompt needs at least one token, each an id in [0, {vocab}); got "
                                   f"{token_ids[:8]}{'...' if len(token_ids) > 8 else ''}")
    if max_len is not None and len(token_ids) > max_len:
        raise PromptTooLongError(f"the prompt has {len(token_ids)} tokens, more than {max_len}")
    return token_ids


class RequestIntake:
    """The checks of one engine's requests: its model (``config``, ``tokenizer``), context (``max_model_len``),
    scheduler (its family, ``max_num_seqs`` and token budget) and block manager (what an idle pool holds)."""

    def __init__(self, config: ModelConfig, tokenizer, max_model_len: int, scheduler, max_num_batched_tokens: int):
        self.config, self.tokenizer, self.max_model_len = config, tokenizer, max_model_len
        self.scheduler, self.max_num_batched_tokens = scheduler, max_num_batched_tokens

    def default_params(self) -> SamplingParams:
        """The model's ``generation_config.json`` sampling defaults (``LLM.default_sampling_params``)."""
        return SamplingParams(**self.config.sampling_defaults)

    def params_for(self, sampling_params, count: int) -> list[SamplingParams]:
        """One checked SamplingParams per prompt: ``sampling_params`` is one for all (None: the defaults) or a
        list of ``count``."""
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != count:
                raise InvalidArgumentError(f"{len(sampling_params)} sampling_params for {count} prompts")
            return [self.params(p) for p in sampling_params]
        return [self.params(sampling_params)] * count

    def params(self, params) -> SamplingParams:
        """``params`` checked against the model and the engine (None: the defaults)."""
        if params is None:
            return self.default_params()
        if not isinstance(params, SamplingParams):
            raise InvalidArgumentError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if params.n > self.scheduler.max_num_seqs:
            raise InvalidArgumentError(f"n={params.n} samples can never run together: max_num_seqs is "
                                       f"{self.scheduler.max_num_seqs}")
        vocab = self.config.vocab_size
        if params.top_k > vocab:
            raise InvalidArgumentError(f"top_k={params.top_k} is more than the model's {vocab} tokens: use 1 to "
                                       f"{vocab}, or 0 or -1 for no cut")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidArgumentError(f"stop_token_ids must be token ids in [0, {vocab}), got "
                                       f"{[t for t in params.stop_token_ids if t >= vocab][:8]} among them")
        return params

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids, checked to leave room to generate and to fit an idle pool's first step."""
        token_ids = prompt_token_ids(self.tokenizer, self.config, prompt)
        n, scheduling = len(token_ids), self.scheduler.scheduling
        if n >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens; the model's context is {self.max_model_len}, "
                                     "and at least one position must be left to generate")
        # What the scheduler would abort at admission even in an idle pool: V0 prefills the whole prompt in one
        # step, V1 as much as its token budget takes.
        first_step = None if scheduling == "v0" else min(n, self.max_num_batched_tokens)
        too_long = too_long_for_the_pool(self.scheduler.manager, n, first_step)
        if too_long:
            raise PromptTooLongError(too_long)
        if scheduling == "v0" and n > self.max_num_batched_tokens:
            raise PromptTooLongError(f"the prompt has {n} tokens, more than max_num_batched_tokens="
                                     f"{self.max_num_batched_tokens} (V0 scheduling does not chunk prefill): raise it "
                                     "or use scheduling='v1'")
        return token_ids
