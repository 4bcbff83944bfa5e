"""Trained models as local Hugging Face folders, for ``kvlab.engine.LLM``, with nothing fetched at run time
from a model hub that the machine cannot reach: ``LLM(smollm2())``."""

from kvlab.models.catalog import SMOLLM2, smollm2
from kvlab.models.errors import ModelFetchError, ModelFolderError

__all__ = ["SMOLLM2", "ModelFetchError", "ModelFolderError", "smollm2"]
