"""What every engine benchmark does around a timed run: wait for the device's queued work before reading
the clock (``sync``), and hand a finished run's GPU memory back before the next one (``release_device_memory``)."""

import gc

import torch

from kvlab.device import ON_GPU


def sync():
    if ON_GPU:
        torch.cuda.synchronize()


def release_device_memory():
    """After a run: its model and KV cache are garbage now; hand their GPU memory back for the next run."""
    gc.collect()
    if ON_GPU:
        torch.cuda.empty_cache()
