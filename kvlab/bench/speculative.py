"""Speculative decoding against plain decoding. ``python -m kvlab.bench engine --suite speculative [--model DIR]
[--requests N] [--max-tokens T] [--threads 1] [--profile]`` (default model: SmolLM2-135M-Instruct from
``kvlab.models.smollm2()``).

Two chat workloads, greedy: "copy" asks to repeat or lightly edit a given text or code, so the answer quotes
the prompt (where prompt lookup pays); "chat" asks short open questions (little to look up). Each runs at
batch 1 (``max_num_seqs=1``) and batch 8 with every config of ``CONFIGS``: no speculation; ``ngram`` at k = 2,
4, 8 (``prompt_lookup_min=2, prompt_lookup_max=4``); ngram k = 8 with the acceptance rule
(``draft_acceptance_floor``, ``kvlab.engine.draft_control``); ``suffix`` k = 8 without and with the rule.
Reported: generated tokens/s and its ratio to no speculation on the same workload and batch (``vs_plain``),
per-request inter-token latency (decode time over tokens after the first) p50/p99 and the p50's ratio,
acceptance rate, mean accepted length, KV slots written for rejected drafts, steps. Writes
``<out-dir>/<device>.csv`` (default ``data/bench/speculative/``); ``--profile`` adds ``<device>-profile.csv``,
where a batch-8 step's time goes (``profile_speculative``). Wall-clock numbers on a shared CPU are noisy:
compare the ratios, which come from runs minutes apart.
"""

import time

import pandas as pd

COPY_TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonaci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree while the fox runs "
    "across the green field towards the river.",
    "for i in range(10):\n    total = total + values[i] * weights[i]\nprint('total:', totl)\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of Spain. "
    "Rome is the capital of Italy.",
]
COPY_ASKS = ["Fix the typo and write out the whole corrected code:\n", "Repeat this text exactly:\n",
             "Fix the bug and write out the whole corrected code:\n", "Repeat this text exactly:\n"]
CHAT = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
        "Give me a tip for learning Python.", "What does a compiler do?", "How many legs does a spider have?",
        "What is photosynthesis?", "Suggest a name for a cat."]
NGRAM = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
#: The rule's floor in the suite: a draft must have a 30% chance of being kept (kvlab.engine.draft_control).
FLOOR = 0.3
CONFIGS = [None] + [{**NGRAM, "num_speculative_tokens": k} for k in (2, 4, 8)] + [
    {**NGRAM, "num_speculative_tokens": 8, "draft_acceptance_floor": FLOOR},
    {"method": "suffix", "num_speculative_tokens": 8},
    {"method": "suffix", "num_speculative_tokens": 8, "draft_acceptance_floor": FLOOR}]


def workloads(tokenizer, requests: int = 8) -> dict[str, list[list[int]]]:
    """``requests`` prompts per workload (the lists repeat past their length)."""
    def encode(question):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    copy = [encode(COPY_ASKS[i % len(COPY_ASKS)] + COPY_TEXTS[i % len(COPY_TEXTS)]) for i in range(requests)]
    return {"copy": copy, "chat": [encode(CHAT[i % len(CHAT)]) for i in range(requests)]}


def run_speculative(model_dir, base: dict, *, requests: int = 8, max_tokens: int = 48,
                    block_size: int = 16) -> pd.DataFrame:
    """Every config on every workload at batch 1 and 8. The configs of one workload and batch run back to back
    (an engine each, built and warmed up before), so the ratios compare runs minutes apart at most on a
    machine whose load drifts."""
    from kvlab.engine import LLM, SamplingParams

    rows = []
    for batch in (1, 8):
        llms = []
        for config in CONFIGS:
            llm = LLM(model_dir, block_size=block_size, num_blocks=256, max_num_seqs=batch,
                      speculative_config=config)
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, not measured
            llms.append(llm)
        for workload, prompts in workloads(llms[0].tokenizer, requests).items():
            for config, llm in zip(CONFIGS, llms):
                print(f"batch {batch}, {workload}: {_label(config)}", flush=True)
                llm.block_manager.reset_prefix_cache()  # each workload starts cold
                steps = len(llm.step_dataframe())
                start = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
                wall = time.perf_counter() - start
                rows.append(dict(base, workload=workload, batch=batch, **_summary(config, outs, wall),
                                 steps=len(llm.step_dataframe()) - steps))
        del llms
    frame = pd.DataFrame(rows)
    plain = frame[frame["config"] == "none"].set_index(["workload", "batch"])
    key = list(zip(frame["workload"], frame["batch"]))
    frame["vs_plain"] = frame["tok_s"].to_numpy() / plain.loc[key, "tok_s"].to_numpy()
    frame["itl_p50_vs_plain"] = frame["itl_ms_p50"].to_numpy() / plain.loc[key, "itl_ms_p50"].to_numpy()
    return frame


def _label(config) -> str:
    if config is None:
        return "none"
    floor = config.get("draft_acceptance_floor")
    return f"{config['method']} k={config['num_speculative_tokens']}" + (f" floor={floor}" if floor else "")


def _summary(config, outs, wall: float) -> dict:
    metrics = [o.metrics for o in outs]
    generated = sum(m.num_generated_tokens for m in metrics)
    drafts, accepted = sum(m.num_draft_tokens for m in metrics), sum(m.num_accepted_tokens for m in metrics)
    verifications = sum(m.num_drafting_steps for m in metrics)
    itl = pd.Series([m.decode_time / (m.num_generated_tokens - 1) for m in metrics if m.num_generated_tokens > 1],
                    dtype=float) * 1e3
    return dict(config=_label(config), method=config["method"] if config else "none",
                k=config["num_speculative_tokens"] if config else 0,
                draft_acceptance_floor=(config or {}).get("draft_acceptance_floor", float("nan")),
                requests=len(outs), generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
                itl_ms_p50=itl.median(), itl_ms_p99=itl.quantile(0.99), drafts=drafts, accepted=accepted,
                acceptance_rate=accepted / drafts if drafts else float("nan"),
                mean_accepted_length=1 + accepted / verifications if verifications else float("nan"),
                rejected_draft_slots=drafts - accepted)


def show(frame: pd.DataFrame, out) -> None:
    shown = ["workload", "batch", "config", "tok_s", "vs_plain", "itl_ms_p50", "itl_ms_p99", "acceptance_rate",
             "mean_accepted_length", "rejected_draft_slots", "steps", "wall_s"]
    print(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")


#: Where a step's time goes, by the functions cProfile times (cumulative seconds): (label, file suffix, name).
PROFILED = [("step (all)", "engine/step_loop.py", "step"), ("schedule", "engine/scheduler_v1.py", "schedule"),
            ("propose", "engine/speculative.py", "drafts"), ("forward (verify)", "engine/runner.py", "forward"),
            ("accept", "engine/speculative.py", "accept"), ("verify bookkeeping", "engine/step_loop.py", "_verify")]


def profile_speculative(model_dir, base: dict, *, requests: int = 8, max_tokens: int = 48,
                        block_size: int = 16) -> pd.DataFrame:
    """One batch-8 run per workload and config (none, ngram k=4, suffix k=8) under cProfile: seconds in each
    of ``PROFILED`` (cumulative: propose is inside schedule, accept inside verify bookkeeping) and their share
    of the steps' time. cProfile slows Python code more than the forward's kernels: shares, not speeds."""
    import cProfile
    import pstats

    from kvlab.engine import LLM, SamplingParams

    rows = []
    for config in (CONFIGS[0], CONFIGS[2], CONFIGS[5]):
        llm = LLM(model_dir, block_size=block_size, num_blocks=256, max_num_seqs=8, speculative_config=config)
        llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)
        for workload, prompts in workloads(llm.tokenizer, requests).items():
            llm.block_manager.reset_prefix_cache()
            profiler = cProfile.Profile()
            profiler.runcall(llm.generate, prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                             use_tqdm=False)
            stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, ..., total, cumulative, ...)
            seconds = {label: sum(v[3] for (file, _, name), v in stats.items()
                                  if file.endswith(suffix) and name == function)
                       for label, suffix, function in PROFILED}
            total = seconds["step (all)"]
            rows += [dict(base, workload=workload, batch=8, config=_label(config), part=label, seconds=value,
                          share=value / total) for label, value in seconds.items()]
    return pd.DataFrame(rows)
