"""kvlab against Hugging Face ``generate`` on a chat workload, end to end: ``python -m kvlab.bench engine --suite
chat [--model DIR] [--repeats N] [--threads N]`` (default model: SmolLM2-135M-Instruct from
``kvlab.models.smollm2()``). Notebook 09 plots what it writes.

Workload (``kvlab.bench.decode``'s): 8 chat prompts of ~108 tokens sharing one system prompt, 32 new tokens each,
greedy, EOS ignored. Three ways to serve it, each timed ``--repeats`` times (medians reported):
  kvlab (one batch)                  ``LLM.generate`` of the 8 prompts (default scheduling; the prefix cache
                                     is reset before each run, so the system prompt is computed once per run);
  HF generate, padded batch          one ``generate`` call on the 8 prompts, left-padded to the longest;
  HF generate, one prompt at a time  8 ``generate`` calls, one after another.
Also per system: the KV memory it holds at its fullest (kvlab: blocks in use at the fullest step; HF: the
batch's padded cache, or the longest single prompt's) and, for kvlab, the prompt tokens read from the prefix
cache. Writes ``<out-dir>/<device>.csv`` (default ``data/bench/engine/``) and, beside it, ``<device>.json``:
the machine, the date, the exact command and the load average before and after, so the numbers say where they
come from.
"""

import json
import os
import platform
import shlex
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from kvlab.bench.decode import NEW_TOKENS, chat_prompts, engine_end_to_end, greedy
from kvlab.bench.timing import release_device_memory
from kvlab.device import ON_GPU

KVLAB = "kvlab (one batch)"
HF_PADDED = "HF generate, padded batch"
HF_SEQUENTIAL = "HF generate, one prompt at a time"


def machine() -> dict:
    """What the numbers ran on: the accelerator (or none), the CPU, its cores and torch's threads."""
    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                    if line.startswith("model name")), cpu)
    return dict(gpu=torch.cuda.get_device_name() if ON_GPU else None, cpu=cpu, cpu_cores=os.cpu_count(),
                torch_threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version())


def load_average() -> list[float] | None:
    """The 1-, 5- and 15-minute load averages (None where the OS has none): a shared machine's other work."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def kv_bytes_per_token(config, dtype) -> int:
    """K and V of one token in every layer: what an unpaged cache reserves per position."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def run_chat(model_dir, base: dict, *, repeats: int) -> pd.DataFrame:
    """One row per system: median, min and max wall seconds over ``repeats``, generated tokens per second, peak
    KV memory (MiB) and prompt tokens read from the prefix cache (kvlab only)."""
    from kvlab.bench.hf_static import run_hf
    from kvlab.bench.serving import hf_end_to_end
    from kvlab.engine import LLM

    llm = LLM(model_dir, block_size=16, max_num_seqs=8)
    prompts = chat_prompts(llm.tokenizer)
    dtype, per_token = llm.dtype, kv_bytes_per_token(llm.model_config, llm.dtype)
    base = dict(base, dtype=str(dtype).replace("torch.", ""), attention_backend=llm.attention_backend,
                requests=len(prompts), prompt_tokens=sum(map(len, prompts)), new_tokens=NEW_TOKENS)
    print(f"{len(prompts)} chat prompts, {NEW_TOKENS} new tokens each, {repeats} runs per system", flush=True)
    print(f"{KVLAB} ...", flush=True)
    llm.generate([prompts[0][:8]], greedy(2), use_tqdm=False)  # warm-up (compiles on a GPU)
    times = {KVLAB: []}
    for _ in range(repeats):
        first_step = len(llm.step_records)
        times[KVLAB] += engine_end_to_end(llm, prompts, 1)  # resets the prefix cache first
    last_run = llm.step_dataframe().iloc[first_step:]
    extra = {KVLAB: dict(peak_kv_mib=last_run["blocks_used"].max() * llm.kv_cache.bytes_per_block / 2**20,
                         cached_prompt_tokens=int(last_run["cached_tokens"].sum()))}
    del llm
    release_device_memory()
    print(f"{HF_PADDED} ...", flush=True)
    padded = [run_hf(model_dir, prompts, [NEW_TOKENS] * len(prompts), batch_size=len(prompts), dtype=dtype)
              for _ in range(repeats)]
    times[HF_PADDED] = [run["wall_s"] for run in padded]
    extra[HF_PADDED] = dict(peak_kv_mib=padded[0]["peak_kv_mib"], cached_prompt_tokens=0)
    release_device_memory()
    print(f"{HF_SEQUENTIAL} ...", flush=True)
    times[HF_SEQUENTIAL] = hf_end_to_end(model_dir, prompts, dtype, repeats, new_tokens=NEW_TOKENS)
    extra[HF_SEQUENTIAL] = dict(peak_kv_mib=(max(map(len, prompts)) + NEW_TOKENS) * per_token / 2**20,
                                cached_prompt_tokens=0)
    generated = len(prompts) * NEW_TOKENS
    kvlab = statistics.median(times[KVLAB])
    return pd.DataFrame([dict(base, system=system, repeats=len(runs), wall_s=statistics.median(runs),
                              min_s=min(runs), max_s=max(runs), generated_tok_s=generated / statistics.median(runs),
                              x_kvlab_time=statistics.median(runs) / kvlab, **extra[system])
                         for system, runs in times.items()])


def write(frame: pd.DataFrame, out: Path, provenance: dict) -> None:
    """The CSV and, beside it, where and how it was measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    frame.round(4).to_csv(out, index=False)
    out.with_suffix(".json").write_text(json.dumps(provenance, indent=2) + "\n")


def provenance(argv: list[str], started: datetime, load_before, load_after) -> dict:
    """``argv``: the engine command's arguments, as ``kvlab.bench.engine.main`` got them."""
    return dict(command=shlex.join(["python", "-m", "kvlab.bench", "engine", *argv]),
                date=started.isoformat(timespec="seconds"),
                machine=machine(), load_average_before=load_before, load_average_after=load_after)


def show(frame: pd.DataFrame, out: Path, provenance: dict) -> None:
    row = frame.iloc[0]
    print(f"\n{row['model']} ({row['dtype']}, attention: {row['attention_backend']}) on {row['device']}, "
          f"{provenance['date']}; load average {provenance['load_average_before']} before, "
          f"{provenance['load_average_after']} after")
    print(frame[["system", "repeats", "wall_s", "min_s", "max_s", "generated_tok_s", "x_kvlab_time", "peak_kv_mib",
                 "cached_prompt_tokens"]].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out} and {out.with_suffix('.json').name}")


def time_chat(model_dir, base: dict, *, repeats: int, out: Path, argv: list[str]) -> pd.DataFrame:
    """Measure, then write the CSV and its provenance and print both."""
    started, load_before = datetime.now(timezone.utc), load_average()
    frame = run_chat(model_dir, base, repeats=repeats)
    record = provenance(argv, started, load_before, load_average())
    write(frame, out, record)
    show(frame, out, record)
    return frame
