"""The engine's own exception types. Each derives from ``kvlab.KvlabError`` and from the builtin a caller
would catch (``ValueError``: the input is what is wrong), and is raised before any work starts, so a failed
call leaves the engine as it was. Bad arguments (sampling parameters, engine settings) raise kvlab's
``InvalidArgumentError``.
"""

from kvlab.errors import KvlabError


class UnsupportedModelError(KvlabError, ValueError):
    """The model directory holds an architecture or a feature the engine or kvlab's kernels cannot run
    (unknown ``model_type``, a head dim or dtype the kernels do not support, sliding windows outside qwen3...)."""


class ModelFileError(KvlabError, ValueError):
    """The model directory is missing, or one of its files other than the weights (``config.json``,
    ``generation_config.json``, the tokenizer's files) cannot be read or holds a value the engine cannot use;
    the message names the file, the field and what is allowed."""


class WeightsError(KvlabError, ValueError):
    """The ``*.safetensors`` files (or their shard index) cannot be read or do not match the model's config:
    missing, unexpected or misshapen tensors."""


class PromptTooLongError(KvlabError, ValueError):
    """A prompt longer than the model's context, than the whole KV pool, or than one step's token budget."""


class NoTokenizerError(KvlabError, ValueError):
    """A text prompt was given but the model directory has no tokenizer (pass token ids instead)."""


class NoChatTemplateError(KvlabError, ValueError):
    """``LLM.chat`` was called but the model's tokenizer has no chat template (format the prompt yourself and
    call ``generate``)."""
