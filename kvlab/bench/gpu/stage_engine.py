"""Stage engine: nano-vllm's benchmark workload (random prompts and output lengths, EOS ignored) through
kvlab.engine and, in the same process on the same requests, Hugging Face's continuous batching (paged
attention, ``init_continuous_batching``) and static ``generate``, into ``engine-<device slug>.csv`` with
the columns of ``python -m kvlab.bench engine --suite throughput`` plus TTFT and inter-token latency.

kvlab.engine runs twice, with V1 scheduling (one token budget per step, chunked prefill, mixed steps) and with
V0's (a step is all prefill or all decode). What it does not run, and says so in the summary: CUDA-graph
decode (not in kvlab.engine). On a GPU: Qwen3-0.6B's
shape with random bf16 weights (or ``--model``), 256 requests, lengths in [100, 1024]; the dry run: the
tiny random model, a few short requests, the engine's CPU default (torch attention; the path, not a figure)."""

import functools
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from kvlab.bench.engine import GPU_WORKLOAD, make_workloads, run_engine
from kvlab.bench.gpu.report import ENGINE_PREFIX, device_slug
from kvlab.bench.hf_static import run_hf
from kvlab.bench.timing import release_device_memory, sync

DRY_RUN_WORKLOAD = dict(requests=3, input_len=(8, 24), output_len=(2, 5), prefix_len=16, suffix_len=(4, 8))
#: Requests per static HF batch, as ``python -m kvlab.bench engine`` uses on a GPU.
HF_BATCH = 64


def hf_continuous(model_dir, prompts, outputs, *, dtype, device, dry_run):
    """HF's continuous batching (it picks its paged attention), each request with its own max_new_tokens and
    no EOS, token timestamps recorded for TTFT and inter-token latency. Its API has moved between
    transformers releases: a failure here is this peer's alone. No inference_mode: HF's background thread
    updates tensors made outside it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.update(eos_token_id=None, pad_token_id=0, do_sample=False)
    options = dict(block=True, timeout=30)
    if dry_run:  # on CPU, HF sizes its pool by host memory and takes a minute to start: a small one, no warm-up
        from transformers import ContinuousBatchingConfig

        options.update(warmup=False, continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=4 * len(prompts), page_size=16, max_batch_tokens=128))
    with model.continuous_batching_context_manager(**options) as manager:  # warm-up (CUDA graphs) happens here
        sync()
        start = time.perf_counter()
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
               for p, n in zip(prompts, outputs)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError(f"HF's generation thread stopped with {len(results)} of {len(ids)} done")
        sync()
        wall = time.perf_counter() - start
    failed = [r.error for r in results.values() if r.error is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(ids)} requests failed in HF's continuous batching: {failed[0]}")
    generated = [len(r.generated_tokens) for r in results.values()]  # counted, not assumed: HF may stop early
    ttft = pd.Series([r.timestamps[0] - r.created_time for r in results.values()], dtype=float) * 1e3
    itl = pd.Series([(r.timestamps[-1] - r.timestamps[0]) / (len(r.timestamps) - 1)
                     for r in results.values() if len(r.timestamps) > 1], dtype=float) * 1e3
    return dict(wall_s=wall, generated_tokens=sum(generated), ttft_ms_median=ttft.median(),
                ttft_ms_p99=ttft.quantile(0.99), itl_ms_median=itl.median())


def model_and_workload(stage, tmp):
    """(model directory, its name, prompts, output lengths, dtype, device)."""
    from kvlab.engine.config import load_model_config
    from kvlab.engine.random_model import save_random_model

    on_gpu = not stage.dry_run
    dtype, device = (torch.bfloat16, "cuda") if on_gpu else (torch.float32, "cpu")
    if stage.model:
        model_dir, name = Path(stage.model), Path(stage.model).name
    else:
        shape = "qwen3-0.6b" if on_gpu else "tiny"
        model_dir, name = save_random_model(Path(tmp) / shape, shape, dtype=dtype), f"random {shape}"
    vocab = load_model_config(model_dir).vocab_size
    prompts, outputs = make_workloads(vocab, 0, GPU_WORKLOAD if on_gpu else DRY_RUN_WORKLOAD)["random"]
    return model_dir, name, prompts, outputs, dtype, device


def run(stage):
    stage.record("CUDA-graph decode", "skipped", "not in kvlab.engine: every decode step launches its kernels")
    path = stage.out / f"{ENGINE_PREFIX}{device_slug(stage.dry_run)}.csv"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, name, prompts, outputs, dtype, device = model_and_workload(stage, tmp)
        base = dict(device=device_slug(stage.dry_run), model=name, workload="random", requests=len(prompts),
                    prompt_tokens=sum(map(len, prompts)), generated_tokens=sum(outputs),
                    dtype=str(dtype).replace("torch.", ""), prefix_caching=False)
        systems = {
            **{f"kvlab.engine ({scheduling})": functools.partial(
                run_engine, model_dir, prompts, outputs, prefix_caching=False, block_size=16, max_num_seqs=256,
                scheduling=scheduling) for scheduling in ("v1", "v0")},
            "hf-continuous-batching": lambda: hf_continuous(model_dir, prompts, outputs, dtype=dtype, device=device,
                                                         dry_run=stage.dry_run),
            "hf-generate": lambda: run_hf(model_dir, prompts, outputs, batch_size=HF_BATCH, dtype=dtype),
        }
        rows = []
        for system, measure in systems.items():
            if stage.time_left() <= 0:
                stage.record(system, "timed out", "not started: the stage's time is spent")
                continue
            with stage.check(system) as detail:
                row = {**base, "system": system, "max_batch": HF_BATCH if system == "hf-generate" else 256,
                       "kernels": ("kvlab, torch attention" if stage.dry_run else "kvlab, compiled")
                       if system.startswith("kvlab.engine") else "torch", **measure()}
                rows.append(row)
                write_frame(rows, path)  # after each system: a stage killed later keeps the rows it has
                detail["text"] = (f"{row['generated_tokens'] / row['wall_s']:.1f} generated tok/s, "
                                  f"TTFT median {row.get('ttft_ms_median', float('nan')):.0f} ms, "
                                  f"ITL median {row.get('itl_ms_median', float('nan')):.1f} ms")
            release_device_memory()


def write_frame(rows, path):
    """The engine benchmark's derived columns; ``vs_hf``: against HF's continuous batching, the stronger peer."""
    frame = pd.DataFrame(rows)
    frame["generated_tok_s"] = frame["generated_tokens"] / frame["wall_s"]
    frame["total_tok_s"] = (frame["generated_tokens"] + frame["prompt_tokens"]) / frame["wall_s"]
    peer = frame.loc[frame["system"] == "hf-continuous-batching", "generated_tok_s"]
    frame["vs_hf"] = frame["generated_tok_s"] / peer.iloc[0] if len(peer) else float("nan")
    frame.round(4).to_csv(path, index=False)
