"""The plain decode step against its floor, and kvlab against HF on the same chat workload. ``python -m kvlab.bench
engine --suite decode [--model DIR] [--repeats N] [--decode-steps N]`` (default model: SmolLM2-135M-Instruct
from ``kvlab.models.smollm2()``).

Workload (issue 24 §3): 8 chat prompts of ~110 tokens sharing one system prompt, 32 new tokens each, greedy.

The floor of a decode step, measured in the same run, interleaved round by round with the steps it is the floor
of (the machine is shared, so a step is compared with the floor measured beside it, never with one from
another run):
  stream  reading every weight the step reads once (every layer's, the final norm's and the output matrix's;
          an untied embedding matrix is only indexed): one ``sum`` per tensor, the same sizes as the model's.
  gemm    one square GEMM in the model's dtype of as many FLOPs as the step does (2 per weight per token, plus
          attention's 4 * context * heads * head_dim per token and layer), at the rate a large GEMM reaches.
  floor   the larger of the two (a step cannot beat either); ``x_floor`` = decode step / floor, per round.
End to end: kvlab's ``generate`` of the 8 prompts as one batch, HF ``generate`` on the padded batch
(``kvlab.bench.hf_static``) and HF one prompt at a time (``kvlab.bench.serving``). Medians of the repeats.
Writes ``<out-dir>/<device>.csv`` (default ``data/bench/decode/``).
"""

import statistics
import time

import pandas as pd
import torch

SYSTEM = ("You are a helpful, patient assistant for a small software team. Answer in plain English and keep "
          "answers short: two or three sentences unless asked for more. Use an example when it helps, say so "
          "when you are unsure, prefer the standard library to new dependencies, explain trade-offs briefly, "
          "and never invent functions or options that do not exist. If a question is ambiguous, answer the most "
          "likely reading and say which one you chose.")
QUESTIONS = ["What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Give me a tip for learning Python.", "What does a compiler do?", "How many legs does a spider have?",
             "What is photosynthesis?", "Suggest a name for a cat."]
NEW_TOKENS = 32


def chat_prompts(tokenizer) -> list[list[int]]:
    """The workload's token ids: the system prompt, then one question each, through the chat template."""
    def encode(question):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return [encode(q) for q in QUESTIONS]


def greedy(max_tokens: int):
    from kvlab.engine import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


def streamed_weights(model) -> list[torch.Tensor]:
    """The tensors a decode step reads in full, each once: the layers', the final norm's, the output matrix
    (tied or not). The embedding matrix is only indexed, so it counts only where it is the output matrix."""
    tensors = list(model.model.layers.parameters()) + list(model.model.norm.parameters()) + [model.lm_head.weight]
    return list({t.data_ptr(): t for t in tensors}.values())


def step_flops(model, num_seqs: int, context: int) -> float:
    """FLOPs of one decode step of ``num_seqs`` sequences of ~``context`` tokens: 2 per matrix weight per
    token, plus QK^T and PV (2 * 2 * context * head_dim per query head, token and layer)."""
    config = model.config
    matrices = sum(t.numel() for t in streamed_weights(model) if t.dim() == 2)
    attention = 4 * context * config.num_heads * config.head_dim * config.num_layers
    return float(num_seqs * (2 * matrices + attention))


class Floor:
    """Times the two floors; each call measures once (the caller interleaves them with the steps)."""

    def __init__(self, model, flops: float):
        self.weights = streamed_weights(model)
        self.bytes = sum(t.numel() * t.element_size() for t in self.weights)
        side = round((flops / 2) ** (1 / 3))  # a square GEMM of the step's FLOPs
        dtype, device = self.weights[0].dtype, self.weights[0].device
        self.a, self.b = (torch.randn(side, side, dtype=dtype, device=device) for _ in range(2))
        self.flops = flops

    def stream_s(self) -> float:
        start = time.perf_counter()
        for t in self.weights:
            t.sum()
        return time.perf_counter() - start

    def gemm_s(self) -> float:
        start = time.perf_counter()
        self.a @ self.b
        return (time.perf_counter() - start) * self.flops / (2 * self.a.shape[0] ** 3)


def decode_rounds(llm, prompts, steps: int) -> pd.DataFrame:
    """Prefill ``prompts``, then ``steps`` rounds of (stream, gemm, one decode step), the order rotated each
    round; one row per round (seconds)."""
    ids = [llm.add_request(p, greedy(steps + 2)) for p in prompts]
    llm.step()  # the prefill
    llm.step()  # warm-up
    context = round(statistics.mean(map(len, prompts))) + 2
    floor = Floor(llm.model, step_flops(llm.model, len(prompts), context))
    floor.stream_s(), floor.gemm_s()  # warm-up

    def step():
        llm.step()
        return llm.step_records[-1].wall_s

    parts = {"stream_s": floor.stream_s, "gemm_s": floor.gemm_s, "step_s": step}
    rows = []
    for i in range(steps):
        order = list(parts)[i % 3:] + list(parts)[:i % 3]
        rows.append({name: parts[name]() for name in order})
    for request_id in ids:
        llm.abort_request(request_id)
    frame = pd.DataFrame(rows)
    frame["floor_s"] = frame[["stream_s", "gemm_s"]].max(axis=1)
    frame["x_floor"] = frame["step_s"] / frame["floor_s"]
    frame.attrs.update(weight_mb=floor.bytes / 1e6, step_gflop=floor.flops / 1e9)
    return frame


def engine_end_to_end(llm, prompts, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        llm.block_manager.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(prompts, greedy(NEW_TOKENS), use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times


def run_decode(model_dir, base: dict, *, repeats: int, decode_steps: int, threads: int | None = None) -> pd.DataFrame:
    """Every measurement, one row each: the decode step beside its floor, then end to end. ``threads``: torch's
    intra-op threads for the whole run (None: torch's default); on a CPU shared with other busy processes, one
    thread each avoids waiting at every op for a second thread that is not scheduled."""
    from kvlab.bench.hf_static import run_hf
    from kvlab.bench.serving import hf_end_to_end
    from kvlab.engine import LLM

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(model_dir, block_size=16, max_num_seqs=8)
    prompts = chat_prompts(llm.tokenizer)
    base = dict(base, dtype=str(llm.dtype).replace("torch.", ""), threads=torch.get_num_threads(),
                prompt_tokens=round(statistics.mean(map(len, prompts))), new_tokens=NEW_TOKENS)
    print(f"decode step: {len(prompts)} sequences, {decode_steps} rounds beside the floor ...", flush=True)
    rounds = decode_rounds(llm, prompts, decode_steps)
    step = dict(base, measurement=f"decode step of {len(prompts)} sequences", repeats=len(rounds),
                weight_mb=rounds.attrs["weight_mb"], step_gflop=rounds.attrs["step_gflop"],
                **{f"{c}_ms": rounds[c].median() * 1e3 for c in ("step_s", "stream_s", "gemm_s", "floor_s")},
                x_floor=rounds["x_floor"].median())
    e2e = f"end-to-end: {len(prompts)} prompts, {NEW_TOKENS} new tokens each"
    runs = {}
    print(f"{e2e}: kvlab ...", flush=True)
    runs["kvlab (one batch)"] = engine_end_to_end(llm, prompts, repeats)
    dtype = llm.dtype
    del llm
    print(f"{e2e}: HF generate, padded batch ...", flush=True)
    runs["HF generate, padded batch"] = [run_hf(model_dir, prompts, [NEW_TOKENS] * len(prompts),
                                                batch_size=len(prompts), dtype=dtype)["wall_s"] for _ in range(repeats)]
    print(f"{e2e}: HF generate, one prompt at a time ...", flush=True)
    runs["HF generate, one prompt at a time"] = hf_end_to_end(model_dir, prompts, dtype, repeats,
                                                              new_tokens=NEW_TOKENS)
    kvlab = statistics.median(runs["kvlab (one batch)"])
    rows = [dict(base, measurement=e2e, system=system, repeats=len(times), wall_s=statistics.median(times),
                 min_s=min(times), kvlab_speedup=statistics.median(times) / kvlab) for system, times in runs.items()]
    return pd.DataFrame([dict(step, system="kvlab")] + rows)


def show(frame: pd.DataFrame, out) -> None:
    step, e2e = frame.iloc[0], frame.iloc[1:]
    print(f"\n{step['model']} ({step['dtype']}, {step['threads']} torch threads) on {step['device']}; "
          f"{len(e2e) and e2e['measurement'].iloc[0]}, prompts of ~{step['prompt_tokens']} tokens; medians")
    print(f"decode step of 8 sequences: {step['step_s_ms']:.1f} ms over {step['repeats']} rounds; floor "
          f"{step['floor_s_ms']:.1f} ms = max(stream {step['weight_mb']:.0f} MB of weights "
          f"{step['stream_s_ms']:.1f} ms, {step['step_gflop']:.2f} GFLOP of square GEMM {step['gemm_s_ms']:.1f} ms); "
          f"step = {step['x_floor']:.2f}x the floor measured beside it")
    print(e2e[["system", "repeats", "wall_s", "min_s", "kvlab_speedup"]].to_string(
        index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"wrote {out}")
