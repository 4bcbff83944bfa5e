"""V0 against V1 scheduling on nano-vllm's workload shape. ``python -m kvlab.bench engine --suite scheduling``.

nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in [100, 1024], random token ids, all
arriving at once. On a GPU that shape as is; without one every length is scaled by ``--scale`` (default 1/16,
printed with the results) and 16 requests go through a tiny random model. The same requests run with
``scheduling="v0"`` (a step is all prefill or all decode) and ``"v1"`` (one token budget shared by decodes and
prefill chunks), and through HF ``generate`` in static batches (throughput only: it has no per-token clock).
The engine admits at most ``--max-num-seqs`` sequences, so later requests are prefilled while earlier ones
decode: the moment V0 stalls every running decode for a prefill step and V1 does not. Reported: generated
and total tokens/s, TTFT and inter-token latency percentiles (every gap between two tokens of a request, so
a stall shows in the tail). Writes ``<out-dir>/<device>.csv`` (default ``data/bench/scheduling/``).
"""

import random
import time

import pandas as pd

from kvlab.bench.hf_static import run_hf
from kvlab.bench.timing import release_device_memory, sync
from kvlab.device import ON_GPU

NANO_VLLM = dict(requests=256, input_len=(100, 1024), output_len=(100, 1024))
CPU_REQUESTS = 16
CPU_SCALE = 1 / 16
PERCENTILES = (50, 90, 99)


def workload(vocab: int, seed: int, scale: float, requests: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's requests with every length bound scaled by ``scale`` (at least 1 token)."""
    rng = random.Random(seed)
    low, high = (max(1, round(n * scale)) for n in NANO_VLLM["input_len"])
    out_low, out_high = (max(1, round(n * scale)) for n in NANO_VLLM["output_len"])
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(requests)]
    return prompts, [rng.randint(out_low, out_high) for _ in range(requests)]


def token_times(llm, prompts, outputs) -> list[list[float]]:
    """Serve every request, all queued at once; for each, the clock after each step that gave it a token.
    ``generate`` only reports first and last token times, and a stall hides between them. ``llm`` records
    its decisions (``record_decisions=True``): a step gives a request a token where it computes its last
    position."""
    from kvlab.engine import SamplingParams

    ids = [llm.add_request(p, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o))
           for p, o in zip(prompts, outputs)]
    index, times = {request_id: k for k, request_id in enumerate(ids)}, [[] for _ in ids]
    seen = len(llm.decisions)
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        sync()
        now = time.perf_counter() - start
        for decision in llm.decisions[seen:]:
            for seq in decision.ran:
                if seq.samples and seq.request_id in index:
                    times[index[seq.request_id]].append(now)
        seen = len(llm.decisions)
    return times


def latency_row(times, wall: float) -> dict:
    """TTFT (every request arrives at 0) and inter-token gap percentiles, in ms."""
    ttft = pd.Series([t[0] for t in times]) * 1e3
    gaps = pd.Series([b - a for t in times for a, b in zip(t, t[1:])], dtype=float) * 1e3
    row = dict(wall_s=wall, itl_ms_max=gaps.max())
    for p in PERCENTILES:
        row[f"ttft_ms_p{p}"] = ttft.quantile(p / 100)
        row[f"itl_ms_p{p}"] = gaps.quantile(p / 100)
    return row


def run_scheduling(model_dir, base: dict, *, seed: int, scale: float | None, requests: int | None,
                   max_num_seqs: int, max_num_batched_tokens: int, block_size: int, hf_batch_size: int):
    """One row per system: kvlab V0, kvlab V1, HF generate."""
    from kvlab.engine import LLM, SamplingParams
    from kvlab.engine.config import load_model_config

    scale = scale or (1.0 if ON_GPU else CPU_SCALE)
    requests = requests or (NANO_VLLM["requests"] if ON_GPU else CPU_REQUESTS)
    prompts, outputs = workload(load_model_config(model_dir).vocab_size, seed, scale, requests)
    base = dict(base, workload=f"nano-vllm random x{scale:g}", scale=scale, requests=requests,
                prompt_tokens=sum(map(len, prompts)), generated_tokens=sum(outputs))
    # V0 refuses a prompt longer than the budget; V1 would chunk it, but the comparison needs both to serve it
    budget = max(max_num_batched_tokens, max(map(len, prompts)))
    rows = []
    for scheduling in ("v0", "v1"):
        print(f"kvlab {scheduling}: {requests} requests, budget {budget} tokens, {max_num_seqs} sequences", flush=True)
        llm = LLM(model_dir, block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  max_model_len=max(len(p) + o for p, o in zip(prompts, outputs)), scheduling=scheduling,
                  record_decisions=True)  # token_times reads them
        llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up (compiles on a GPU)
        first_step = len(llm.step_records)
        start = time.perf_counter()
        times = token_times(llm, prompts, outputs)
        steps = llm.step_dataframe().iloc[first_step:]
        rows.append(dict(base, system=f"kvlab {scheduling}", max_batch=max_num_seqs, budget_tokens=budget,
                         steps=len(steps), mixed_steps=int((steps["kind"] == "mixed").sum()),
                         preemptions=int(steps["preempted"].sum()), dtype=str(llm.dtype).replace("torch.", ""),
                         **latency_row(times, time.perf_counter() - start)))
        dtype = llm.dtype
        del llm
        release_device_memory()
    print(f"HF generate, static batches of {hf_batch_size}", flush=True)
    hf = run_hf(model_dir, prompts, outputs, batch_size=hf_batch_size, dtype=dtype)
    rows.append(dict(base, system="hf-generate", max_batch=hf_batch_size, wall_s=hf["wall_s"], steps=hf["steps"],
                     dtype=rows[-1]["dtype"]))
    frame = pd.DataFrame(rows)
    frame["generated_tok_s"] = frame["generated_tokens"] / frame["wall_s"]
    frame["total_tok_s"] = (frame["generated_tokens"] + frame["prompt_tokens"]) / frame["wall_s"]
    return frame


def show(frame: pd.DataFrame, out) -> None:
    row = frame.iloc[0]
    print(f"\n{row['model']} on {row['device']}: {row['workload']} (lengths scaled by {row['scale']:g} from "
          f"nano-vllm's [100, 1024]), {row['requests']} requests, {row['prompt_tokens']} prompt and "
          f"{row['generated_tokens']} generated tokens; latencies in ms, HF has none (static batches)")
    shown = ["system", "steps", "mixed_steps", "generated_tok_s", "total_tok_s"] + [
        f"{m}_ms_p{p}" for m in ("ttft", "itl") for p in PERCENTILES] + ["itl_ms_max"]
    print(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")
