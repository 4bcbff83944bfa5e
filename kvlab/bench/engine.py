"""kvlab.engine against Hugging Face ``generate``. ``python -m kvlab.bench engine [--suite S] [--model DIR]``.

--suite serving (the default without a GPU): a handful of prompts, kvlab's attention backends (--backends)
side by side with HF one prompt at a time, and the time of one decode step; see ``kvlab.bench.serving``.
Without --model: a random model of SmolLM2-135M's shape (Qwen3-0.6B's on a GPU). Writes
``data/bench/serving/<device>.csv``.

--suite throughput (the default on a GPU): offline throughput against HF ``generate`` in static batches (no
paging) on the same requests, with the device's default attention backend.

--suite scheduling: V0 against V1 scheduling (throughput, TTFT and inter-token latency percentiles) on
nano-vllm's workload, scaled down on CPU, HF as the peer; see ``kvlab.bench.scheduling``.

--suite decode: the plain decode step of 8 SmolLM2 chat prompts (or --model) against its floor (streaming the
weights once, a GEMM of the step's FLOPs) measured beside it, and kvlab against HF's padded batch and HF one
prompt at a time on that workload; see ``kvlab.bench.decode``.

--suite chat: end to end on the decode suite's workload (8 SmolLM2 chat prompts sharing a system prompt, 32
new tokens each): kvlab's one batch against HF's padded batch and HF one prompt at a time, with each one's peak
KV memory; writes ``data/bench/engine/<device>.csv`` and ``<device>.json`` (machine, date, command, load
average), which notebook 09 plots; see ``kvlab.bench.chat``.

--suite speculative: n-gram speculative decoding (k = 2, 4, 8), with the acceptance rule, and suffix decoding
against none on a copy-heavy and a plain chat workload, at batch 1 and 8, on SmolLM2-135M-Instruct (or
--model); see ``kvlab.bench.speculative``.

Workloads (random token ids from ``--seed``, every request runs to its own output length, EOS ignored):
  random         nano-vllm's benchmark: many requests, prompt and output lengths uniform at random;
  shared-prefix  every prompt starts with the same long system prompt, then a short random suffix.
The engine runs each with prefix caching on and off; HF generate runs each once, in batches of
``--hf-batch-size`` requests padded to the batch's longest prompt and output. Reported per run: generated
tokens/s, total (prompt + generated) tokens/s, the engine's time to first token and inter-token latency,
peak KV memory (engine: blocks in use at the fullest step; HF: the largest batch's padded cache) and the
prefix hit rate.

On a GPU: ``--model DIR`` (a local Llama/Qwen3 directory, e.g. Qwen3-0.6B downloaded with huggingface_hub)
or, without it, a random model of Qwen3-0.6B's shape in bf16; 256 requests, prompts 100-1024 tokens,
outputs 100-1024. Without a GPU: a tiny random model (2 layers, hidden 64) and 16 short requests, served
with the torch backend (the Triton interpreter would take minutes). Writes ``<out-dir>/<device>.csv``
(default ``data/bench/throughput/``).
"""

import argparse
import platform
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

from kvlab.bench.hf_static import run_hf
from kvlab.bench.timing import release_device_memory, sync
from kvlab.device import ON_GPU

CPU_WORKLOAD = dict(requests=16, input_len=(8, 48), output_len=(4, 16), prefix_len=64, suffix_len=(4, 16))
GPU_WORKLOAD = dict(requests=256, input_len=(100, 1024), output_len=(100, 1024), prefix_len=1024,
                    suffix_len=(32, 256))


def device_name() -> str:
    """File-name-safe name of the machine the numbers come from: the GPU, else the CPU model."""
    if ON_GPU:
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.is_file():
            models = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text())
            name = f"cpu {models[0]}" if models else name
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def make_workloads(vocab: int, seed: int, spec: dict) -> dict:
    """name -> (prompts, output lengths)."""
    rng = random.Random(seed)
    n = spec["requests"]

    def tokens(k):
        return [rng.randrange(vocab) for _ in range(k)]

    random_prompts = [tokens(rng.randint(*spec["input_len"])) for _ in range(n)]
    random_outputs = [rng.randint(*spec["output_len"]) for _ in range(n)]
    system = tokens(spec["prefix_len"])
    shared_prompts = [system + tokens(rng.randint(*spec["suffix_len"])) for _ in range(n)]
    shared_outputs = [rng.randint(*spec["output_len"]) for _ in range(n)]
    return {"random": (random_prompts, random_outputs), "shared-prefix": (shared_prompts, shared_outputs)}


def run_engine(model_dir, prompts, outputs, *, prefix_caching: bool, block_size: int, max_num_seqs: int,
               scheduling: str = "v1") -> dict:
    from kvlab.engine import LLM, SamplingParams

    max_len = max(len(p) + o for p, o in zip(prompts, outputs))
    llm = LLM(model_dir, block_size=block_size, enable_prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max(8192, max_len), scheduling=scheduling)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o) for o in outputs]
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up (compiles on a GPU)
    llm.block_manager.reset_prefix_cache()
    first_step = len(llm.step_records)
    sync()
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=True)
    sync()
    wall = time.perf_counter() - start
    steps = llm.step_dataframe().iloc[first_step:]
    return dict(wall_s=wall, **latency_stats([r.metrics for r in results]),
                peak_kv_mib=steps["blocks_used"].max() * llm.kv_cache.bytes_per_block / 2**20,
                kv_pool_mib=llm.block_manager.num_blocks * llm.kv_cache.bytes_per_block / 2**20,
                prefix_hit_rate=llm.block_manager.stats.hit_rate, preemptions=int(steps["preempted"].sum()),
                steps=len(steps), dtype=str(llm.dtype).replace("torch.", ""), attention_backend=llm.attention_backend)


def latency_stats(metrics) -> dict:
    """Median and p99 time to first token, median inter-token latency (a request's decode time over its
    tokens after the first), in ms. Every request arrives at the start, so TTFT includes queueing."""
    ttft = pd.Series([m.time_to_first_token for m in metrics], dtype=float) * 1e3
    itl = pd.Series([m.decode_time / (m.num_generated_tokens - 1) for m in metrics if m.num_generated_tokens > 1],
                    dtype=float) * 1e3
    return dict(ttft_ms_median=ttft.median(), ttft_ms_p99=ttft.quantile(0.99), itl_ms_median=itl.median())


def main(argv=None) -> int:
    intro, details = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(prog="python -m kvlab.bench engine", description=intro, epilog=details,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=("serving", "throughput", "scheduling", "speculative", "decode", "chat"),
                        help="default: throughput on a GPU, serving without one")
    parser.add_argument("--model", help="local HF model directory; default: a random model (see above)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", help="where to write <device>.csv (default: data/bench/<suite>/, "
                        "data/bench/engine/ for chat)")
    parser.add_argument("--threads", type=int, help="torch CPU threads for the run (decode, speculative, chat; "
                        "default: torch's). On a shared CPU whose load exceeds its cores, 1 thread was 18x "
                        "faster than 2")
    parser.add_argument("--requests", type=int, help="number of requests per workload (throughput, scheduling)")
    serving = parser.add_argument_group("serving and decode suites")
    serving.add_argument("--backends", default="torch,triton", help="comma-separated attention backends (serving)")
    serving.add_argument("--repeats", type=int, default=3, help="runs per measurement (medians reported; also chat)")
    serving.add_argument("--decode-steps", type=int, help="decode steps timed (default: 5 per backend for serving, "
                         "24 rounds beside the floor for decode)")
    serving.add_argument("--interpreter-end-to-end", action="store_true",
                         help="also run the end-to-end measurement in the Triton interpreter (many minutes)")
    serving.add_argument("--profile", action="store_true", help="print where a torch-backend step spends its time")
    throughput = parser.add_argument_group("throughput suite")
    throughput.add_argument("--quick", action="store_true", help="a quarter of the requests")
    throughput.add_argument("--block-size", type=int, default=16)
    throughput.add_argument("--max-num-seqs", type=int, help="default: 256 (scheduling: 64 on a GPU, 4 on CPU)")
    throughput.add_argument("--hf-batch-size", type=int, default=None, help="default: 64 on a GPU, 16 on CPU")
    speculative = parser.add_argument_group("speculative suite (also --requests: prompts per workload, default 8; "
                                            "--profile: also where the time goes, under cProfile)")
    speculative.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    speculative.add_argument("--profile-only", action="store_true", help="only the profile (writes "
                             "<device>-profile.csv)")
    scheduling = parser.add_argument_group("scheduling suite")
    scheduling.add_argument("--scale", type=float, help="workload lengths x this (default: 1 on a GPU, 1/16 on CPU)")
    scheduling.add_argument("--max-num-batched-tokens", type=int, help="token budget per step (default: 2048 x "
                            "scale, raised to the longest prompt)")
    args = parser.parse_args(argv)
    suite = args.suite or ("throughput" if ON_GPU else "serving")
    from kvlab.engine.random_model import save_random_model

    if suite == "speculative":
        return _speculative(args)
    if suite == "decode":
        return _decode(args)
    if suite == "chat":
        return _chat(args, argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, model_name = Path(args.model), Path(args.model).name
        else:
            shape = "qwen3-0.6b" if ON_GPU else ("smollm2-135m" if suite == "serving" else "tiny")
            model_dir = save_random_model(Path(tmp) / shape, shape, dtype=torch.bfloat16 if ON_GPU else torch.float32)
            model_name = f"random {shape}"
        base = dict(device=device_name(), params_m=round(sum(p.numel() for p in _param_shapes(model_dir)) / 1e6, 1))
        if suite == "serving":
            from kvlab.bench.serving import run_serving, write_and_show

            frame = run_serving(model_dir, model_name, backends=args.backends.split(","), repeats=args.repeats,
                                decode_steps=args.decode_steps or 5, seed=args.seed,
                                interpreter_end_to_end=args.interpreter_end_to_end, profile=args.profile, base=base)
            write_and_show(frame, args.out_dir or "data/bench/serving", device_name())
            return 0
        if suite == "scheduling":
            return _scheduling(model_dir, dict(base, model=model_name), args)
        frame = run_throughput(model_dir, dict(base, model=model_name), args)
    out = Path(args.out_dir or "data/bench/throughput") / f"{device_name()}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.round(4).to_csv(out, index=False)
    shown = ["workload", "system", "prefix_caching", "generated_tok_s", "total_tok_s", "vs_hf", "peak_kv_mib",
             "prefix_hit_rate", "preemptions", "wall_s"]
    print(f"\n{model_name} ({base['params_m']}M parameters) on {device_name()}, engine: {frame['kernels'].iloc[0]}")
    print(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")
    return 0


def _speculative(args) -> int:
    from kvlab.bench.speculative import profile_speculative, run_speculative, show
    from kvlab.models import smollm2

    model_dir = Path(args.model) if args.model else smollm2()
    if args.threads:
        torch.set_num_threads(args.threads)
    base = dict(device=device_name(), model=model_dir.name, threads=torch.get_num_threads())
    sizes = dict(requests=args.requests or 8, max_tokens=args.max_tokens)
    out = Path(args.out_dir or "data/bench/speculative") / f"{device_name()}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    if not args.profile_only:
        frame = run_speculative(model_dir, base, **sizes)
        frame.round(4).to_csv(out, index=False)
        show(frame, out)
    if args.profile or args.profile_only:
        profile = profile_speculative(model_dir, base, **sizes)
        profile_out = out.with_name(f"{out.stem}-profile.csv")
        profile.round(4).to_csv(profile_out, index=False)
        print(profile.pivot_table(index=["workload", "config"], columns="part", values="share", sort=False)
              .to_string(float_format=lambda v: f"{v:.2f}"))
        print(f"wrote {profile_out}")
    return 0


def _decode(args) -> int:
    from kvlab.bench.decode import run_decode, show
    from kvlab.models import smollm2

    model_dir = Path(args.model) if args.model else smollm2()
    frame = run_decode(model_dir, dict(device=device_name(), model=model_dir.name), repeats=args.repeats,
                       decode_steps=args.decode_steps or 24, threads=args.threads)
    out = Path(args.out_dir or "data/bench/decode") / f"{device_name()}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.round(4).to_csv(out, index=False)
    show(frame, out)
    return 0


def _chat(args, argv) -> int:
    from kvlab.bench.chat import time_chat
    from kvlab.models import smollm2

    model_dir = Path(args.model) if args.model else smollm2()
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out_dir or "data/bench/engine") / f"{device_name()}.csv"
    time_chat(model_dir, dict(device=device_name(), model=model_dir.name), repeats=args.repeats, out=out,
              argv=sys.argv[1:] if argv is None else list(argv))
    return 0


def _scheduling(model_dir, base: dict, args) -> int:
    from kvlab.bench.scheduling import CPU_SCALE, run_scheduling, show

    scale = args.scale or (1.0 if ON_GPU else CPU_SCALE)
    frame = run_scheduling(model_dir, base, seed=args.seed, scale=scale, requests=args.requests,
                           max_num_seqs=args.max_num_seqs or (64 if ON_GPU else 4),
                           max_num_batched_tokens=args.max_num_batched_tokens or round(2048 * scale),
                           block_size=args.block_size, hf_batch_size=args.hf_batch_size or (64 if ON_GPU else 16))
    out = Path(args.out_dir or "data/bench/scheduling") / f"{device_name()}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.round(4).to_csv(out, index=False)
    show(frame, out)
    return 0


def run_throughput(model_dir, base: dict, args) -> pd.DataFrame:
    """Both workloads: the engine with prefix caching on and off, then HF in static batches."""
    from kvlab.engine.config import load_model_config

    spec = dict(GPU_WORKLOAD if ON_GPU else CPU_WORKLOAD)
    spec["requests"] = args.requests or (spec["requests"] // 4 if args.quick else spec["requests"])
    hf_batch = args.hf_batch_size or (64 if ON_GPU else 16)
    config = load_model_config(model_dir)
    rows = []
    for workload, (prompts, outputs) in make_workloads(config.vocab_size, args.seed, spec).items():
        run_base = dict(base, workload=workload, requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                        generated_tokens=sum(outputs))
        for caching in (True, False):
            print(f"{workload}: kvlab engine, prefix caching {'on' if caching else 'off'}")
            result = run_engine(model_dir, prompts, outputs, prefix_caching=caching, block_size=args.block_size,
                                max_num_seqs=args.max_num_seqs or 256)
            release_device_memory()
            rows.append({**run_base, "system": "kvlab.engine", "prefix_caching": caching,
                         "max_batch": args.max_num_seqs or 256, **result})
        print(f"{workload}: HF generate, batches of {hf_batch}")
        dtype = getattr(torch, rows[-1]["dtype"])
        rows.append({**run_base, "system": "hf-generate", "prefix_caching": False, "max_batch": hf_batch,
                     "dtype": rows[-1]["dtype"], **run_hf(model_dir, prompts, outputs, batch_size=hf_batch,
                                                          dtype=dtype)})
        release_device_memory()
    frame = pd.DataFrame(rows)
    frame["generated_tok_s"] = frame["generated_tokens"] / frame["wall_s"]
    frame["total_tok_s"] = (frame["generated_tokens"] + frame["prompt_tokens"]) / frame["wall_s"]
    hf = frame[frame["system"] == "hf-generate"].set_index("workload")["generated_tok_s"]
    frame["vs_hf"] = frame["generated_tok_s"] / frame["workload"].map(hf)
    backend = frame["attention_backend"].dropna().iloc[0]
    engine = f"kvlab, {backend}" + ("" if backend == "torch" else (" (compiled)" if ON_GPU else " (interpreter)"))
    frame["kernels"] = [engine if s == "kvlab.engine" else "torch" for s in frame["system"]]
    return frame.drop(columns="attention_backend")


def _param_shapes(model_dir):
    """Every weight tensor's shape, read from the safetensors headers (nothing loaded)."""
    from safetensors import safe_open

    from kvlab.engine.weights import weight_files

    for file in weight_files(Path(model_dir)):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield torch.Size(f.get_slice(name).get_shape())
