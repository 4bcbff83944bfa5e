"""The engine benchmarks' Hugging Face peer: ``generate`` in static batches (no paging), each batch padded to
its longest prompt and run to its longest output."""

import time

import torch

from kvlab.bench.timing import sync
from kvlab.device import ON_GPU


@torch.inference_mode()
def run_hf(model_dir, prompts, outputs, *, batch_size: int, dtype) -> dict:
    """HF generate in static batches of ``batch_size`` (arrival order), left-padded, each batch running to its
    longest output; only each request's own tokens count as generated."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if ON_GPU else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # run every batch to its max_new_tokens
    model.generation_config.pad_token_id = 0
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
                          * torch.empty((), dtype=dtype).element_size())

    def batch(ps, n):
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
        return len(ps) * (width + n) * kv_bytes_per_token

    batch([prompts[0][:16]], 2)  # warm-up
    sync()
    start, peak = time.perf_counter(), 0
    for i in range(0, len(prompts), batch_size):
        peak = max(peak, batch(prompts[i:i + batch_size], max(outputs[i:i + batch_size])))
    sync()
    wall = time.perf_counter() - start
    return dict(wall_s=wall, peak_kv_mib=peak / 2**20, steps=sum(max(outputs[i:i + batch_size])
                                                                    for i in range(0, len(prompts), batch_size)))
