"""The exceptions of ``kvlab.models``. Each derives from ``kvlab.KvlabError`` and from the builtin a caller
would catch, and its message says what failed and how to get the model another way."""

from kvlab.errors import KvlabError


class ModelFolderError(KvlabError, ValueError):
    """A folder given as the model (``path=`` or an environment variable) is not a Hugging Face model folder."""


class ModelFetchError(KvlabError, RuntimeError):
    """The model could not be fetched or converted (no index, a corrupted download, a full disk, a missing
    package...). Nothing half-written is left in the cache."""
