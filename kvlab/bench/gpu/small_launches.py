"""One small launch of each kernel (decode with and without split-K, prefill, reshape_and_cache, copy_blocks,
swap out and in), for compute-sanitizer: ``compute-sanitizer --tool memcheck python -m
kvlab.bench.gpu.small_launches``. Run it with PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is its
own allocation and an out-of-bounds access cannot land unseen in a neighbour inside torch's pooled memory."""

import sys

import torch

from kvlab.bench.gpu.kernel_checks import GPU_CHECKS, kernel_and_twin, shrink
from kvlab.device import DEVICE, ON_GPU


def small_checks():
    """The first GPU check of each kernel and of split-K decode (which adds the reduce kernel), shrunk."""
    first = {}
    for check in GPU_CHECKS:
        first.setdefault((check.kernel, check.split_k), check)
    return [shrink(c) for c in first.values()]


def main() -> int:
    torch.manual_seed(0)
    for check in small_checks():
        kernel, _ = kernel_and_twin(check, DEVICE)
        kernel()
        if ON_GPU:
            torch.cuda.synchronize()  # an asynchronous fault surfaces here, named after its launch
        print(f"launched {check.name}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
