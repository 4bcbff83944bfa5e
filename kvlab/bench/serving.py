"""Serving a handful of prompts: kvlab's attention backends side by side with Hugging Face ``generate``, one
prompt at a time. ``python -m kvlab.bench engine --suite serving`` (the default without a GPU).

Two measurements, each repeated ``--repeats`` times (medians reported: shared machines are noisy):
  end-to-end   greedy, 20 new tokens for each of 5 prompts of 5 to 230 tokens: kvlab serves them as one
               batch, HF ``generate`` one after another (what a single-user script does).
  decode step  one engine step over 5 sequences of ~230 tokens (scheduling, the forward pass, sampling).
In the Triton interpreter a decode step of a 135M model takes tens of seconds and a prefill minutes, so on
CPU the "triton" backend gets the decode step only, once, after a prefill by the torch backend into the same
paged cache (pass ``--interpreter-end-to-end`` for the rest). ``--profile`` prints where a torch-backend
decode step and prefill spend their time (torch.profiler, by op).
Writes ``<out-dir>/<device>.csv`` (default ``data/bench/serving/``).
"""

import random
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from kvlab.bench.timing import sync
from kvlab.device import ON_GPU

PROMPT_LENS = (5, 61, 118, 174, 230)
NEW_TOKENS = 20
DECODE_PROMPT_LENS = (226, 227, 228, 229, 230)
HF = "HF generate, one prompt at a time"


def _prompts(vocab: int, lens, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


def _llm(model_dir, backend: str):
    from kvlab.engine import LLM

    return LLM(model_dir, block_size=16, max_num_seqs=8, max_model_len=1024, attention_backend=backend)


def _greedy(max_tokens: int):
    from kvlab.engine import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def engine_end_to_end(model_dir, backend: str, prompts, repeats: int) -> list[float]:
    """Seconds per ``generate`` of every prompt as one batch (prefix cache reset before each run)."""
    llm = _llm(model_dir, backend)
    llm.generate([prompts[0][:8]], _greedy(2), use_tqdm=False)  # warm-up (compiles on a GPU)
    times = []
    for _ in range(repeats):
        llm.block_manager.reset_prefix_cache()
        sync()
        start = time.perf_counter()
        llm.generate(prompts, _greedy(NEW_TOKENS), use_tqdm=False)
        sync()
        times.append(time.perf_counter() - start)
    return times


def engine_decode_steps(model_dir, backend: str, prompts, steps: int) -> list[float]:
    """Wall seconds of ``steps`` decode steps over ``prompts``, each as the engine records it. The prefill runs
    with the torch backend: both write and read the same cache, tables and slots, so the decode steps are
    the backend's own whichever prefilled."""
    llm = _llm(model_dir, "torch")
    ids = [llm.add_request(prompt, _greedy(steps + 2)) for prompt in prompts]
    llm.step()  # every prompt's prefill
    llm.runner.attention_backend = backend
    llm.step()  # warm-up (compiles on a GPU)
    for _ in range(steps):
        llm.step()
    for request_id in ids:
        llm.abort_request(request_id)
    return [r.wall_s for r in llm.step_records[-steps:]]


@torch.inference_mode()
def hf_end_to_end(model_dir, prompts, dtype, repeats: int, new_tokens: int = NEW_TOKENS) -> list[float]:
    """Seconds to ``generate`` ``new_tokens`` for every prompt, one after another (no padding, no batching)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if ON_GPU else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # every prompt gets exactly new_tokens
    model.generation_config.pad_token_id = 0

    def run(prompt, n):
        model.generate(torch.tensor([prompt], device=device), max_new_tokens=n, do_sample=False)

    run(prompts[0][:8], 2)  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for prompt in prompts:
            run(prompt, new_tokens)
        sync()
        times.append(time.perf_counter() - start)
    return times


def profile_torch_backend(model_dir, vocab: int, seed: int, rows: int = 15) -> None:
    """Print torch.profiler's op table for one torch-backend prefill of the decode prompts and one decode step."""
    from torch.profiler import ProfilerActivity, profile

    llm = _llm(model_dir, "torch")
    for prompt in _prompts(vocab, DECODE_PROMPT_LENS, seed):
        llm.add_request(prompt, _greedy(4))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ON_GPU else [])
    for what in ("prefill", "decode step", "decode step"):  # the first decode step warms up
        with profile(activities=activities) as prof:
            llm.step()
        print(f"\n== torch backend, {what} over {len(DECODE_PROMPT_LENS)} sequences: "
              f"{llm.step_records[-1].wall_s * 1e3:.0f} ms (profiled) ==")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    while llm.has_unfinished_requests():
        llm.step()


def _row(base, measurement, system, times, generated):
    median = statistics.median(times)
    return dict(base, measurement=measurement, system=system, repeats=len(times), median_s=median,
                min_s=min(times), max_s=max(times), generated_tokens=generated, generated_tok_s=generated / median)


def run_serving(model_dir, model_name: str, *, backends, repeats: int, decode_steps: int, seed: int,
                interpreter_end_to_end: bool, profile: bool, base: dict) -> pd.DataFrame:
    """Every measurement for every backend, and HF; one row each (times in seconds)."""
    from kvlab.engine.config import load_model_config
    from kvlab.engine.settings import resolve_dtype

    config = load_model_config(model_dir)
    dtype = resolve_dtype(None, config, torch.device("cuda" if ON_GPU else "cpu"))
    base = dict(base, model=model_name, dtype=str(dtype).replace("torch.", ""), threads=torch.get_num_threads())
    prompts = _prompts(config.vocab_size, PROMPT_LENS, seed)
    e2e = f"end-to-end: {len(prompts)} prompts of {min(PROMPT_LENS)}-{max(PROMPT_LENS)} tokens, {NEW_TOKENS} new each"
    step = f"decode step: {len(DECODE_PROMPT_LENS)} sequences of ~{max(DECODE_PROMPT_LENS)} tokens"
    generated = len(prompts) * NEW_TOKENS
    rows = []
    for backend in backends:
        slow = backend == "triton" and not ON_GPU  # the interpreter
        label = f"kvlab {backend}" + (" (interpreter)" if slow else "")
        if not slow or interpreter_end_to_end:
            print(f"{e2e}: {label} ...", flush=True)
            rows.append(_row(base, e2e, label, engine_end_to_end(model_dir, backend, prompts, 1 if slow else repeats),
                             generated))
        print(f"{step}: {label} ...", flush=True)
        decode_prompts = _prompts(config.vocab_size, DECODE_PROMPT_LENS, seed + 1)
        times = engine_decode_steps(model_dir, backend, decode_prompts, 1 if slow else decode_steps)
        rows.append(_row(base, step, label, times, len(decode_prompts) * len(times)))
    print(f"{e2e}: {HF} ...", flush=True)
    rows.append(_row(base, e2e, HF, hf_end_to_end(model_dir, prompts, dtype, repeats), generated))
    frame = pd.DataFrame(rows)
    hf = frame.loc[frame["system"] == HF, "median_s"].iloc[0]
    frame["speedup_vs_hf"] = [hf / m if e == e2e else float("nan") for m, e in zip(frame["median_s"],
                                                                                      frame["measurement"])]
    if profile:
        profile_torch_backend(model_dir, config.vocab_size, seed + 1)
    return frame


def write_and_show(frame: pd.DataFrame, out_dir, device: str) -> Path:
    out = Path(out_dir) / f"{device}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.round(4).to_csv(out, index=False)
    row = frame.iloc[0]
    print(f"\n{row['model']} ({row['params_m']}M parameters, {row['dtype']}) on {device}, "
          f"{row['threads']} torch threads; medians of the repeats")
    shown = ["measurement", "system", "repeats", "median_s", "min_s", "max_s", "generated_tok_s", "speedup_vs_hf"]
    print(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")
    return out
