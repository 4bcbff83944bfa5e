"""The one place that decides whether kvlab's Triton kernels run compiled on a GPU or interpreted on CPU.

Without CUDA, Triton can still run every kernel through its interpreter, but only if
``TRITON_INTERPRET=1`` is in the environment *before* the first ``@triton.jit`` decorator runs. Every
kernel module imports this module first, so importing kvlab is enough; nothing here touches the Triton
driver (which fails without a GPU) or prints anything.
"""

import os
import platform

import torch

from kvlab._version import __version__

# A user who sets TRITON_INTERPRET=1 on a GPU machine asks for the interpreter (handy for debugging a
# kernel with print statements); we respect it.
ON_GPU: bool = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"

#: Where kvlab puts tensors by default: the GPU when there is one, else the CPU (interpreter mode).
DEVICE: torch.device = torch.device("cuda" if ON_GPU else "cpu")


def mode() -> str:
    """``"gpu"`` when kernels are compiled for CUDA, ``"interpreter"`` when they run on CPU."""
    return "gpu" if ON_GPU else "interpreter"


def default_attention_backend(device: torch.device = DEVICE) -> str:
    """The attention backend ``kvlab.engine.LLM`` runs on ``device`` unless told otherwise: ``"triton"`` (the
    compiled kernels) on CUDA; elsewhere ``"torch"``, since the Triton interpreter runs one program per tile in
    Python (a decode step of a 135M model over 5 sequences of 230 tokens: ~20 s interpreted)."""
    return "triton" if device.type == "cuda" else "torch"


def summary(kernels: bool = True) -> str:
    """One line saying what really runs here: the kernels' mode (``kernels=False``: for a notebook that runs no
    kernel of its own, only where it runs) and the engine's default attention backend (printed by every
    notebook's setup cell)."""
    if not kernels and not ON_GPU:
        return (f"kvlab {__version__}: no GPU: everything runs on the CPU (small sizes); the engine's attention "
                f"backend: {default_attention_backend()}")
    if ON_GPU:
        kernels = f"Triton kernels compiled for {torch.cuda.get_device_name()}"
    elif torch.cuda.is_available():
        kernels = "Triton kernels in the interpreter on CPU (TRITON_INTERPRET=1 was set, so the GPU is not used)"
    else:
        kernels = "no GPU: Triton kernels in the interpreter on CPU (slow, so notebooks use small sizes)"
    return f"kvlab {__version__}: {kernels}; the engine's attention backend: {default_attention_backend()}"


def report() -> str:
    """A few lines saying which mode is active and with which versions (``python -m kvlab info``)."""
    import triton  # imported here so that `import kvlab.device` stays cheap

    how_kernels_run = ("compiled Triton kernels on " + torch.cuda.get_device_name() if ON_GPU
                       else "TRITON_INTERPRET=1, kernels run on CPU")
    lines = [
        f"kvlab {__version__}",
        f"mode: {mode()} ({how_kernels_run})",
        f"engine attention backend: {default_attention_backend()} (LLM(attention_backend=None))",
        f"python {platform.python_version()}, torch {torch.__version__}, triton {triton.__version__}",
    ]
    if ON_GPU:
        major, minor = torch.cuda.get_device_capability()
        lines.append(f"cuda {torch.version.cuda}, compute capability {major}.{minor}, "
                     f"native bf16 {'yes' if torch.cuda.is_bf16_supported(including_emulation=False) else 'no'}")
    return "\n".join(lines)
