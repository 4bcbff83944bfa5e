"""A tiny continuous-batching serving engine on kvlab: Llama/Qwen3 models whose every KV byte lives in kvlab's
paged cache, managed by ``kvlab.BlockManager`` and read and written by kvlab's Triton kernels.

    from kvlab.engine import LLM, SamplingParams
    llm = LLM("path/to/hf_model_dir", block_size=16)
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))

``LLM`` is imported when first asked for (PEP 562 ``__getattr__``): it loads torch, and the scheduler, the step
and the rest of the engine's bookkeeping do not, so a study that replays the engine's scheduler under a cost
model (``kvlab.studies.overlap``) never imports torch.
"""

from kvlab.engine.decisions import SeqDecision, StepDecision
from kvlab.engine.errors import (ModelFileError, NoChatTemplateError, NoTokenizerError, PromptTooLongError,
                                 UnsupportedModelError, WeightsError)
from kvlab.engine.request import CompletionOutput, RequestMetrics, RequestOutput
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.step_record import StepRecord

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "StepRecord",
           "StepDecision", "SeqDecision", "UnsupportedModelError", "ModelFileError", "WeightsError",
           "PromptTooLongError", "NoTokenizerError", "NoChatTemplateError"]


def __getattr__(name: str):
    if name == "LLM":
        from kvlab.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvlab.engine' has no attribute {name!r}")
