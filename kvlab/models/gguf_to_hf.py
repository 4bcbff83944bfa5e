"""Turn a GGUF file into a Hugging Face folder (config.json, fp32 *.safetensors, tokenizer, generation config).

transformers reads GGUF (with the ``gguf`` package; ``accelerate`` for the loading) and dequantizes the
weights. It then keeps a GGUF "quantizer" on the model, and ``save_pretrained`` refuses a quantized model,
so the quantizer is detached first: the dequantized weights are plain tensors, and they are the model.
"""

import importlib.util
from pathlib import Path

from kvlab.models.errors import ModelFetchError

NEEDED = ("gguf", "accelerate")


def convert(gguf_file: Path, out: Path) -> None:
    """Write the model in ``gguf_file`` into the existing folder ``out`` as a Hugging Face folder."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelFetchError(f"reading a GGUF file needs the package(s) {', '.join(missing)}: "
                              f"pip install {' '.join(missing)} (kvlab's setup installs them)")
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    except Exception as e:  # whatever transformers' GGUF reader raises, the file could not be read
        raise ModelFetchError(f"transformers {transformers.__version__} could not read {gguf_file.name}: "
                              f"{type(e).__name__}: {e}") from None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    packed = [name for name, t in model.state_dict().items() if not t.is_floating_point()]
    if packed:  # a transformers that keeps GGUF blocks (e.g. with the `kernels` package) instead of unpacking
        raise ModelFetchError(f"transformers {transformers.__version__} kept {gguf_file.name}'s weights packed "
                              f"({packed[0]}, ...); kvlab needs plain weights (transformers unpacks them when the "
                              "`kernels` package is absent)")
    model.float().save_pretrained(out)  # safetensors, and generation_config.json
    tokenizer.save_pretrained(out)
