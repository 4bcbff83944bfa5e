"""Speculative decoding (n-gram prompt lookup) against plain decoding. ``python -m kvlab.bench engine --suite
speculative [--model DIR]`` (default model: SmolLM2-135M-Instruct from ``kvlab.models.smollm2()``).

Two chat workloads, greedy: "copy" asks to repeat or lightly edit a given text or code, so the answer quotes
the prompt (where prompt lookup pays); "chat" asks short open questions (little to look up). Each runs at
batch 1 (``max_num_seqs=1``) and batch 8, with no speculation and with ``ngram`` at k = 2, 4, 8
(``prompt_lookup_min=2, prompt_lookup_max=4``), side by side in one process. Reported: generated tokens/s
and its ratio to no speculation, per-request inter-token latency (decode time over tokens after the first)
p50/p99, acceptance rate, mean accepted length, KV slots written for rejected drafts, steps. Writes
``<out-dir>/<device>.csv`` (default ``data/bench/speculative/``). Wall-clock numbers on a shared CPU are noisy.
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
CONFIGS = [None] + [{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
                    for k in (2, 4, 8)]


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    def encode(question):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    copy = [encode(ask + text) for ask, text in zip(COPY_ASKS * 2, COPY_TEXTS * 2)]
    return {"copy": copy, "chat": [encode(q) for q in CHAT]}


def run_speculative(model_dir, base: dict, *, max_tokens: int = 48, block_size: int = 16) -> pd.DataFrame:
    from kvlab.engine import LLM, SamplingParams

    rows = []
    for config in CONFIGS:
        for batch in (1, 8):
            llm = LLM(model_dir, block_size=block_size, num_blocks=256, max_num_seqs=batch,
                      speculative_config=config)
            llm.generate(["Hi"], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up, not measured
            for workload, prompts in workloads(llm.tokenizer).items():
                llm.block_manager.reset_prefix_cache()  # each workload starts cold
                steps = len(llm.step_dataframe())
                start = time.perf_counter()
                outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
                wall = time.perf_counter() - start
                rows.append(dict(base, workload=workload, batch=batch, **_summary(config, outs, wall),
                                 steps=len(llm.step_dataframe()) - steps))
    frame = pd.DataFrame(rows)
    plain = frame[frame["k"] == 0].set_index(["workload", "batch"])["tok_s"]
    frame["vs_plain"] = [row.tok_s / plain[(row.workload, row.batch)] for row in frame.itertuples()]
    return frame


def _summary(config, outs, wall: float) -> dict:
    metrics = [o.metrics for o in outs]
    generated = sum(m.num_generated_tokens for m in metrics)
    drafts, accepted = sum(m.num_draft_tokens for m in metrics), sum(m.num_accepted_tokens for m in metrics)
    verifications = sum(m.num_drafting_steps for m in metrics)
    itl = pd.Series([m.decode_time / (m.num_generated_tokens - 1) for m in metrics if m.num_generated_tokens > 1],
                    dtype=float) * 1e3
    return dict(method=config["method"] if config else "none", k=config["num_speculative_tokens"] if config else 0,
                requests=len(outs), generated_tokens=generated, wall_s=wall, tok_s=generated / wall,
                itl_ms_p50=itl.median(), itl_ms_p99=itl.quantile(0.99), drafts=drafts, accepted=accepted,
                acceptance_rate=accepted / drafts if drafts else float("nan"),
                mean_accepted_length=1 + accepted / verifications if verifications else float("nan"),
                rejected_draft_slots=drafts - accepted)


def show(frame: pd.DataFrame, out) -> None:
    shown = ["workload", "batch", "method", "k", "tok_s", "vs_plain", "itl_ms_p50", "itl_ms_p99", "acceptance_rate",
             "mean_accepted_length", "rejected_draft_slots", "steps", "wall_s"]
    print(frame[shown].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")
