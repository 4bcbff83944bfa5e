# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 03b · Beam search, swapping and the memory sharing saves
#
# Notebook 03a forked one prompt into parallel samples: `fork` shares every block, and the first write into
# a shared partial block is copied on write. **Beam search** keeps the `k` most likely continuations, and
# its beams branch *and* die, so they share long stretches of output, not only the prompt. Under memory
# pressure a scheduler can **swap** such a forked group to CPU memory and back. This notebook runs both on
# the tiny fork engine of 03a (`kvlab.course.forks`), then measures the memory that sharing saves on request
# lengths like those of the PagedAttention paper, and explains where and why it differs.
#
# **Objectives.** After this notebook you can:
# 1. follow beam search through the block manager (fork a chosen beam, free a dead one) and read its
#    blocks-in-use curve against the blocks the beams would hold without sharing;
# 2. predict how many block copies a forked group's swap-out takes (one per *distinct* block) and say why
#    the group shares its blocks again after swapping in;
# 3. compare the memory saved by sharing with the paper's Fig. 15, and name what moves it (prompt length
#    against the block size, samples outliving each other, how far back beams share an ancestor);
# 4. say what vLLM V1 kept of all this (prefix caching instead of forks, recompute instead of swapping).

# %%
# Setup (generated from scripts/sync_notebooks.py: edit it there, then `make notebooks`). In a checkout, or in
# CI, this uses the checkout's kvlab. On Colab it clones the repository (code and bundled traces) and installs
# kvlab with the optional dependencies this notebook needs (KVLAB_EXTRAS); Colab's torch and Triton are kept as
# they are. `%matplotlib inline` keeps figures in the notebook however it runs (Jupyter, Colab, nbconvert).
# %matplotlib inline
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

# The repository to clone when kvlab is not installed: for a fork, change it here or set $KVLAB_REPO.
KVLAB_REPO = os.environ.get("KVLAB_REPO", "https://github.com/kvlab/kvlab")
KVLAB_EXTRAS = ""  # pyproject.toml's extras this notebook uses ("": kvlab's core only)
KVLAB_KERNELS = False  # whether this notebook runs kvlab's Triton kernels itself (it imports kvlab.kernels)
if importlib.util.find_spec("kvlab") is None:
    checkout = Path.cwd().parent
    if not (checkout / "kvlab" / "__init__.py").is_file():  # not run from notebooks/ in a checkout
        checkout = Path.cwd() / "kvlab-repo"
        if not checkout.is_dir():
            clone = subprocess.run(["git", "clone", "-q", "--depth", "1", KVLAB_REPO, str(checkout)],
                                   capture_output=True, text=True)
            if clone.returncode != 0:
                raise RuntimeError(
                    f"Could not clone kvlab from {KVLAB_REPO}: {clone.stderr.strip() or 'git failed'}\n"
                    "If your copy of kvlab lives elsewhere, set KVLAB_REPO in this cell to its address (or the "
                    "KVLAB_REPO environment variable), then run the cell again.") from None
        target = f"{checkout}[{KVLAB_EXTRAS}]" if KVLAB_EXTRAS else str(checkout)
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", target])
    sys.path.insert(0, str(checkout))
import kvlab.device

print(kvlab.device.summary(kernels=KVLAB_KERNELS))
if kvlab.device.mode() != "gpu":
    print("For real sizes" + (" and compiled kernels" if KVLAB_KERNELS else "") + ", use a GPU: on Colab, "
          "Runtime > Change runtime type > a GPU, then run the notebook again.")

# %%
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from kvlab import AllocStatus, Sequence, viz
from kvlab.course import answer
from kvlab.course.forks import Blocks, TinyEngine
from kvlab.device import DEVICE, mode

# Knobs: change them and run the notebook again. Checks that hold only for the defaults explain what changed.
BS = 8             # block size of sections 1-2
BEAM_WIDTH = 4     # section 1's beams
SEED = 0

DEFAULTS = (BS, BEAM_WIDTH, SEED) == (8, 4, 0)
rng = np.random.default_rng(SEED)
torch.manual_seed(SEED)
print(f"block copies and swaps use kvlab's Triton kernels ({mode()} mode); cache tensors live on {DEVICE}")

# %% [markdown]
# ## 1. Beam search: beams fork and die
#
# Beam search keeps the `k` highest-scoring sequences (`BEAM_WIDTH` = 4 here). Each step, every beam proposes
# continuations; the best `k` of all of them survive. A beam chosen several times is **forked**; a beam not chosen at all is
# **freed**. We use a stochastic stand-in for a model (our choice, not a real LLM): each beam's next-token
# distribution over a 32-token vocabulary is drawn from a Dirichlet(0.3), so some continuations are far more
# likely than others, as with a real model. Scores are summed log-probabilities.

# %%
VOCAB = 32


def beam_search(blocks, prompt_len, output_len, width, gen, alpha=0.3, on_step=None, vocab=VOCAB):
    """Run beam search on ``blocks`` (Blocks or TinyEngine) with random generator ``gen``; returns (sum over
    steps of blocks in use, sum over steps of blocks the beams would hold without sharing)."""
    beams = [Sequence(gen.integers(0, 30000, size=prompt_len), blocks.manager.block_size)]
    blocks.prefill(beams[0])
    scores = np.zeros(1)
    used = unshared = 0
    for t in range(output_len):
        logp = np.log(gen.dirichlet(np.full(vocab, alpha), size=len(beams)) + 1e-12)
        candidates = scores[:, None] + logp                          # [beams, vocab]
        best = np.argsort(candidates, axis=None)[::-1][:width]
        parents, tokens = np.unravel_index(best, candidates.shape)
        chosen = {}
        for p, tok in zip(parents.tolist(), tokens.tolist()):
            chosen.setdefault(p, []).append(tok)
        new_beams, new_scores, step = [], [], {}
        for p, toks in chosen.items():                               # fork before anyone appends
            for i, tok in enumerate(toks):
                beam = beams[p] if i == 0 else blocks.fork(beams[p])
                new_beams.append(beam)
                new_scores.append(candidates[p, tok])
                step[beam] = tok
        for p, beam in enumerate(beams):                             # beams nobody chose die
            if p not in chosen:
                blocks.free(beam)
        blocks.step(step)
        beams, scores = new_beams, np.array(new_scores)
        used += blocks.blocks_in_use()
        unshared += sum(b.num_blocks for b in beams)
        if on_step:
            on_step(t, beams)
    for beam in beams:
        blocks.free(beam)
    return used, unshared


beam_engine = TinyEngine(num_blocks=10 * BEAM_WIDTH + 10, block_size=BS)
beam_steps, history, beam_names = [], [], {}


def watch(t, beams):
    history.append((beam_engine.blocks_in_use(), sum(b.num_blocks for b in beams), len(beams)))
    assert beam_engine.wrong_reads(beams) == []  # every beam reads its own history through shared blocks
    for beam in beams:  # name beams in order of birth: the root is beam 0
        beam_names.setdefault(beam.seq_id, f"beam {len(beam_names)}")
    if t in (0, 5, 11, 23):
        beam_steps.append(viz.snapshot(beam_engine.manager, beams, f"after decode step {t + 1}", names=beam_names))


beam_search(beam_engine, prompt_len=12, output_len=24, width=BEAM_WIDTH, gen=rng, on_step=watch)
viz.show_steps(beam_steps, ncols=2)
plt.show()

# %%
used_curve, unshared_curve, beam_counts = np.array(history).T
counts = {k: sum(e.kind == k for e in beam_engine.manager.events) for k in ("fork", "cow", "free")}
deaths = counts["free"] - beam_counts[-1]  # every beam is freed once: the dead ones, then the survivors at the end
fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(np.arange(1, len(history) + 1), unshared_curve, label="without sharing (sum of the beams' tables)")
ax.plot(np.arange(1, len(history) + 1), used_curve, label="with sharing (blocks in use)")
ax.set_xlabel("decode step")
ax.set_ylabel("blocks")
ax.legend(fontsize=8)
ax.set_title(f"{BEAM_WIDTH} beams, prompt of 12 tokens, block size {BS}: blocks in use per decode step",
             fontsize=10)
plt.show()
print(f"Over {len(history)} steps the beams forked {counts['fork']} times, died {deaths} times and triggered "
      f"{counts['cow']} copy-on-writes. At the end they held {used_curve[-1]} blocks instead of "
      f"{unshared_curve[-1]}; averaged over the steps, sharing saved {100 * (1 - used_curve.sum() / unshared_curve.sum()):.0f}% "
      f"of the blocks. Every beam read back exactly its own K/V at every step.")
viz.check(np.all(used_curve <= unshared_curve), "sharing held more blocks than the beams' tables", defaults=True)
viz.check(used_curve.sum() < unshared_curve.sum() and counts["fork"] > 0 and deaths > 0,
          f"with BEAM_WIDTH={BEAM_WIDTH} the beams never forked, never died or shared nothing", defaults=DEFAULTS)

# %% [markdown]
# ## 2. Swapping a forked group out and back in
#
# Under memory pressure a scheduler can **swap out** running sequences: copy their blocks to CPU memory,
# free the GPU blocks, and bring them back later. A forked group shares blocks, and the manager keeps it
# that way: when the first sequence of the group swaps out, each of its blocks is copied once; the next ones
# copy only the blocks they do not share with a sequence already swapped out. Swapping in works the same
# way in reverse, and the group shares its GPU blocks again.
#
# Three samples of a 20-token prompt have decoded 6 tokens each. Then a long request, `big`, arrives that
# does not fit.

# %%
swap_engine = TinyEngine(num_blocks=16, block_size=BS, num_cpu_blocks=16)
root = Sequence(rng.integers(0, 1000, size=20), BS)
swap_engine.prefill(root)
group = [root] + [swap_engine.fork(root) for _ in range(2)]
group_names = {s.seq_id: f"sample {k}" for k, s in enumerate(group)}
for _ in range(6):
    swap_engine.step({s: rng.integers(1000, 2000) for s in group})
manager = swap_engine.manager
big = Sequence(rng.integers(5000, 6000, size=12 * BS), BS)
entries = sum(len(s.block_table) for s in group)
print(f"The group holds {swap_engine.blocks_in_use()} blocks for {entries} table entries; {manager.num_free_blocks} "
      f"of {manager.num_blocks} are free. big needs {big.num_blocks}: can_allocate says "
      f"{manager.can_allocate(big).name}.")
viz.check(manager.can_allocate(big) is AllocStatus.LATER,
          f"can_allocate(big) is {manager.can_allocate(big).name}: with BS={BS} the group and big fit differently",
          defaults=DEFAULTS)

# %%
gpu_tables = {s.seq_id: list(s.block_table) for s in group}
swap_out_maps = {s.seq_id: swap_engine.swap_out(s) for s in group}
for seq_id, mapping in swap_out_maps.items():
    print(f"swap_out({group_names[seq_id]}): GPU table {gpu_tables[seq_id]} -> copies (gpu, cpu) {mapping}")
copied = sum(map(len, swap_out_maps.values()))
print(f"{copied} block copies for {entries} table entries: each shared block moved once.")
assert copied == len({b for t in gpu_tables.values() for b in t})  # a law: one copy per distinct block
viz.draw_block_tables(manager, group, names=group_names, title="the group swapped out: tables now point at CPU blocks")
plt.show()

# %% [markdown]
# The long request now runs. It overwrites GPU blocks the group used to hold, which is fine: the group's
# K/V are safe in CPU memory. When it finishes, the group swaps back in.

# %%
print(f"can_allocate(big) after the swap: {manager.can_allocate(big).name}")
swap_engine.prefill(big)
overwritten = set(big.block_table) & {b for t in gpu_tables.values() for b in t}
viz.check(len(overwritten) > 0, "big used none of the group's old GPU blocks", defaults=DEFAULTS)
swap_engine.free(big)
swap_in_maps = {s.seq_id: swap_engine.swap_in(s) for s in group}
for seq in group:
    print(f"swap_in({group_names[seq.seq_id]}): copies (cpu, gpu) {swap_in_maps[seq.seq_id]} -> GPU table "
          f"{list(seq.block_table)}")
print(f"big overwrote {len(overwritten)} of the group's old GPU blocks; after swapping in, sequences reading "
      f"wrong K/V: {swap_engine.wrong_reads(group)} (none), and the shared prompt blocks have ref count "
      f"{manager.ref_count(root.block_table[0])} again.")
assert swap_engine.wrong_reads(group) == [] and manager.ref_count(root.block_table[0]) == len(group)
manager.check_invariants()
viz.draw_block_tables(manager, group, names=group_names, title="swapped back in: shared again, in new GPU blocks")
plt.show()

# %% [markdown]
# On the kernel side, each list of pairs is exactly the `block_mapping` argument of `swap_blocks(src, dst,
# mapping)`: `(gpu, cpu)` pairs from the GPU cache into pinned CPU memory on swap-out, `(cpu, gpu)` pairs back on
# swap-in, for every layer. The copies cross PCIe, so their number is the cost. The swap-in copies must
# finish before the sequences' next forward pass reads those blocks (same CUDA stream, or an event).

# %%
kv_bytes_per_token = 2 * 32 * 4096 * 2  # K and V, 32 layers, 4096 wide, fp16: a Llama-2-7B-sized model
block_mib = 16 * kv_bytes_per_token / 2**20
print(f"With 16-token blocks of a Llama-2-7B-sized model ({block_mib:.0f} MiB per block), swapping this group out "
      f"moves {copied * block_mib:.0f} MiB instead of {entries * block_mib:.0f} MiB without sharing-aware swapping "
      f"({100 * (1 - copied / entries):.0f}% less), and the same again to bring it back.")

# %% [markdown]
# ### Exercise: predict a swap's cost
#
# Four samples (instead of three) of a 20-token prompt, block size 8, have decoded 6 tokens each. Predict
# how many block copies swapping out the whole group takes, then run the cell: it builds that group on a
# fresh `TinyEngine` and swaps it out.

# %%
PREDICTED_SWAP_COPIES = None   # (gpu, cpu) copies for swapping out all four samples


def swap_out_copies(num_samples, prompt_len=20, decoded=6, block_size=8):
    """Fork, decode ``decoded`` tokens per sample, swap the whole group out; return (copies, table entries)."""
    engine = TinyEngine(num_blocks=32, block_size=block_size, num_cpu_blocks=32)
    first = Sequence(range(prompt_len), block_size)
    engine.prefill(first)
    samples = [first] + [engine.fork(first) for _ in range(num_samples - 1)]
    for t in range(decoded):
        engine.step({s: 1000 + 10 * t + k for k, s in enumerate(samples)})
    entries = sum(len(s.block_table) for s in samples)
    copies = sum(len(engine.swap_out(s)) for s in samples)
    return copies, entries


swap_copies, swap_entries = swap_out_copies(4)
answer(PREDICTED_SWAP_COPIES, swap_copies, f"One copy per distinct block, not per table entry ({swap_entries}): "
       "the 2 full prompt blocks are shared by all four, and each sample owns 2 blocks (its copied partial "
       "block and the one its sixth token opened).")
viz.check((swap_copies, swap_entries) == (10, 16),
          f"swap_out_copies(4) gave {(swap_copies, swap_entries)}; the answer below says 10 copies for 16 entries",
          defaults=True)

# %% [markdown]
# **Answer.** 10 copies for 16 table entries: 26 tokens are 4 blocks per sample; blocks 0-1 (the full
# prompt blocks) are shared and move once, blocks 2 and 3 are private (block 2 was copied on write by the
# first token), so 2 + 4 x 2 = 10. Sharing-aware swapping moves 10 blocks across PCIe instead of 16.

# %% [markdown]
# > **In vLLM.** Beams forking and dying, and swapping a forked group to CPU memory, are the PagedAttention
# > paper's design and vLLM's **V0** engine (removed in 2025; read it at a tag such as `v0.8.5`):
# > `vllm/core/block_manager.py` (`fork`, `swap_out`, `swap_in`) and `vllm/core/scheduler.py`, which
# > preempted a multi-sequence group by swapping and a single sequence by recomputing. **V1** has neither
# > forks nor swapping: it preempts by **recompute** only (`vllm/v1/core/sched/scheduler.py`: the preempted
# > request's blocks are freed and it is prefilled again later, hitting its own cached prefix), and beam
# > search became a loop outside the engine (`LLM.beam_search` in `vllm/entrypoints/llm.py`) that submits
# > each step's beams as new requests, sharing through the prefix cache. kvlab's engine (notebook 09) offers
# > both preemption modes; notebook 10a compares them.

# %% [markdown]
# ## 3. How much memory does sharing save? Against the PagedAttention paper
#
# Kwon et al., *Efficient Memory Management for Large Language Model Serving with PagedAttention*
# (SOSP'23), §6.3 and Fig. 15, report the memory saved by sharing (blocks saved / blocks needed without
# sharing) for parallel sampling and beam search with 2, 4 and 6 sequences, on the Alpaca and ShareGPT
# traces. Those published numbers are the constants below. Everything else is computed here with the block
# manager, on request lengths we draw ourselves:
#
# * prompt and output lengths are **log-normal** (our choice; σ = 1, long-tailed like the paper's Fig. 11
#   histograms) with the paper's mean lengths: Alpaca 19.31 input / 58.45 output tokens, ShareGPT
#   161.31 / 337.99, rounded and clipped to [1, 2048];
# * parallel sampling: every sample draws its own output length and is freed when it ends; beam search
#   runs all beams for the request's output length (the model above);
# * block size 16 (vLLM's default); the saving is averaged over every decode step of every request,
#   one request at a time.

# %%
PAPER = {  # Kwon et al., SOSP'23, Fig. 15 / §6.3: memory saved by sharing, in %
    ("Alpaca", "parallel sampling"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("Alpaca", "beam search"): {2: 37.56, 4: 53.13, 6: 55.16},
    ("ShareGPT", "parallel sampling"): (16.2, 30.5),  # a range over n = 2..6 in the text
    ("ShareGPT", "beam search"): (44.3, 66.3),
}
MEANS = {"Alpaca": (19.31, 58.45), "ShareGPT": (161.31, 337.99)}
NUM_REQUESTS = {"Alpaca": 200, "ShareGPT": 20}  # requests per configuration: enough for a stable average
STUDY_BS, SIGMA = 16, 1.0


def lognormal_lengths(gen, mean, size, sigma=SIGMA):
    """Log-normal lengths with the given mean (mu = ln(mean) - sigma^2 / 2), rounded and clipped to [1, 2048]."""
    return np.clip(np.rint(gen.lognormal(np.log(mean) - sigma**2 / 2, sigma, size)), 1, 2048).astype(int)


def parallel_sampling(blocks, prompt_len, output_lens, gen):
    """n samples of one prompt, each ending after its own output length; returns (used, unshared) step sums."""
    parent = Sequence(gen.integers(0, 30000, size=prompt_len), blocks.manager.block_size)
    blocks.prefill(parent)
    live = {parent: output_lens[0], **{blocks.fork(parent): n for n in output_lens[1:]}}
    used = unshared = t = 0
    while live:
        t += 1
        blocks.step({seq: gen.integers(30000, 60000) for seq in live})
        used += blocks.blocks_in_use()
        unshared += sum(seq.num_blocks for seq in live)
        for seq in [s for s, n in live.items() if n <= t]:
            blocks.free(seq)
            del live[seq]
    return used, unshared


def tail_depth(beams, depths):
    """Record how many trailing tokens the beams do not all share (their common ancestor is that far back)."""
    tokens = [b.token_ids for b in beams]
    common = next((i for i, column in enumerate(zip(*tokens)) if len(set(column)) > 1), len(tokens[0]))
    depths.append(len(tokens[0]) - common)


def saving(dataset, method, n, sigma=SIGMA, alpha=0.3, seed=0, same_length=False, depths=None, vocab=VOCAB):
    """Memory saved by sharing (%), over NUM_REQUESTS[dataset] requests drawn with a fixed seed (every
    configuration sees the same prompt lengths, so differences come from the configuration).
    ``same_length``: every parallel sample runs as long as the first. ``depths``: a list to which beam
    search appends, every step, how many trailing tokens its beams do not share."""
    gen = np.random.default_rng(seed)
    mean_in, mean_out = MEANS[dataset]
    blocks = Blocks(2 * 2048 * 6 // STUDY_BS, STUDY_BS)  # room for 6 sequences of 2 x 2048 tokens
    used = unshared = 0
    for prompt_len in lognormal_lengths(gen, mean_in, NUM_REQUESTS[dataset], sigma):
        if method == "parallel sampling":
            lengths = lognormal_lengths(gen, mean_out, n, sigma)
            u, s = parallel_sampling(blocks, int(prompt_len), lengths[:1].repeat(n) if same_length else lengths, gen)
        else:
            output_len = int(lognormal_lengths(gen, mean_out, 1, sigma)[0])
            watch = (lambda t, beams: tail_depth(beams, depths)) if depths is not None else None
            u, s = beam_search(blocks, int(prompt_len), output_len, n, gen, alpha, on_step=watch, vocab=vocab)
        used, unshared = used + u, unshared + s
    assert blocks.blocks_in_use() == 0
    return 100 * (1 - used / unshared)


runs = [(d, m, n) for d in MEANS for m in ("parallel sampling", "beam search") for n in (2, 4, 6)]
depth_log = {run: [] for run in runs if run[1] == "beam search"}
ours = {run: saving(*run, depths=depth_log.get(run)) for run in tqdm(runs, desc="sharing study")}

# %%
# What the text below says of these runs (fixed seeds and sizes: whatever the knobs above).
GROUP_SIZES = (2, 4, 6)  # sequences per request in the study


def paper_at(d, m, n, end=0):
    """The paper's figure for n, or the low (end=0) or high (end=1) end of its range over n = 2..6."""
    return PAPER[d, m][n] if isinstance(PAPER[d, m], dict) else PAPER[d, m][end]


sampling_below = all(ours[d, "parallel sampling", n] < paper_at(d, "parallel sampling", n)
                     for d in MEANS for n in GROUP_SIZES)
beams_above = (all(ours[d, "beam search", n] > paper_at(d, "beam search", n) for d in MEANS for n in GROUP_SIZES)
               and sum(ours["ShareGPT", "beam search", n] > paper_at("ShareGPT", "beam search", n, end=1)
                       for n in GROUP_SIZES) >= 2)
viz.check(sampling_below and beams_above, "parallel sampling is not below the paper everywhere, or beam search "
          "not above it (Alpaca: every n; ShareGPT: above the range's low end, above its top for most n)",
          defaults=True)
beams_beat_sampling = all(min(ours[d, "beam search", n] for n in GROUP_SIZES)
                          > max(ours[d, "parallel sampling", n] for n in GROUP_SIZES) for d in MEANS)
viz.check(beams_beat_sampling, "beam search does not save more than parallel sampling", defaults=True)
table = pd.DataFrame([{"dataset": d, "method": m, "n": n, "kvlab (%)": round(ours[d, m, n], 1),
                       "paper (%)": PAPER[d, m][n] if isinstance(PAPER[d, m], dict) else
                       f"{PAPER[d, m][0]}-{PAPER[d, m][1]} (n=2..6)"} for d, m, n in runs])
fig, axes = plt.subplots(1, 4, figsize=(14, 3.8), sharey=True, layout="constrained")
x = np.arange(3)
for ax, (d, m) in zip(axes, PAPER):
    paper = PAPER[d, m]
    ranged = not isinstance(paper, dict)
    # Side by side where the paper gives one number per n; centred on the paper's shaded range otherwise.
    ax.bar(x if ranged else x - 0.2, [ours[d, m, n] for n in (2, 4, 6)], 0.5 if ranged else 0.4,
           label="kvlab (computed)", color="#4e79a7")
    if ranged:
        ax.axhspan(*paper, color="#bab0ac", alpha=0.5, zorder=0, label="paper, range over n = 2..6 (§6.3)")
    else:
        ax.bar(x + 0.2, [paper[n] for n in (2, 4, 6)], 0.4, label="paper (Fig. 15)", color="#bab0ac")
    if m == "beam search":  # at best all beams share everything: one copy of n
        ax.scatter(x, [100 * (n - 1) / n for n in (2, 4, 6)], marker="_", s=600, color="k", zorder=3,
                   label="most possible: (n - 1) / n")
    ax.set_xticks(x, [f"n={n}" for n in (2, 4, 6)])
    ax.set_title(f"{d}, {m}", fontsize=10)
axes[0].set_ylabel("memory saved by sharing (%)")
handles, labels = [], []
for ax in axes:
    for h, label in zip(*ax.get_legend_handles_labels()):
        if label not in labels:
            handles.append(h)
            labels.append(label)
fig.legend(handles, labels, loc="outside lower center", ncol=4, fontsize=8)  # the title keeps the top
fig.suptitle("memory saved by sharing: kvlab's block manager on drawn lengths vs the PagedAttention paper",
             fontsize=11)
plt.show()
table

# %% [markdown]
# ### Parallel sampling lands below the paper
#
# In parallel sampling only the prompt is shared, and only its *full* blocks once the samples write (the
# partial block is copied on the first step), so the saving is bounded by the share of a request's blocks
# that are full prompt blocks. Two things in our model push it below the paper, and the cell below measures
# both. **Alpaca's prompts are short**: with our log-normal lengths many do not fill a single 16-token block,
# so how much is shared hinges on the spread σ. **ShareGPT's outputs are twice its prompts, and each of our
# samples ends on its own log-normal length**: the longest sample of a request runs on alone for many steps,
# sharing nothing, and those steps weigh in the average. Giving every sample the same output length (the
# first sample's) removes that tail.

# %%
spreads = {s: saving("Alpaca", "parallel sampling", 4, sigma=s) for s in (0.5, 1.5)}
spreads[SIGMA] = ours["Alpaca", "parallel sampling", 4]
same = {n: saving("ShareGPT", "parallel sampling", n, same_length=True) for n in (2, 4, 6)}
short = (lognormal_lengths(np.random.default_rng(0), MEANS["Alpaca"][0], 10_000) < STUDY_BS).mean()
own = {n: ours["ShareGPT", "parallel sampling", n] for n in (2, 4, 6)}
print(f"{100 * short:.0f}% of our Alpaca prompts (σ = {SIGMA}) are shorter than one {STUDY_BS}-token block. On "
      f"ShareGPT, equal output lengths move the saving from {', '.join(f'{v:.0f}%' for v in own.values())} to "
      f"{', '.join(f'{v:.0f}%' for v in same.values())} for n = 2, 4, 6 (the paper: 16.2-30.5%).")
pd.concat({"Alpaca, n = 4, lengths spread by σ": pd.Series({f"σ = {k}": v for k, v in sorted(spreads.items())}),
           "ShareGPT, each sample its own length": pd.Series({f"n = {n}": v for n, v in own.items()}),
           "ShareGPT, every sample the same length": pd.Series({f"n = {n}": v for n, v in same.items()})},
          names=["experiment", "setting"]).round(1).rename("saved (%)").to_frame()
viz.check(short > 0.25 and max(spreads.values()) - min(spreads.values()) >= 3 and all(same[n] > own[n] for n in own),
          f"{short:.0%} of Alpaca prompts are under one block, σ moves the saving by "
          f"{max(spreads.values()) - min(spreads.values()):.1f} points, equal lengths give {same} against {own}: "
          "the text says many, several points, and higher", defaults=True)

# %% [markdown]
# Reading: on Alpaca the saving moves by several points with σ alone, because it hinges on how many prompts
# fill a block; the paper shows its lengths only as histograms, so matching it needs the real distribution.
# On ShareGPT, equal output lengths move the saving towards the paper's range: part of the gap is how long
# samples outlive each other, a property of the model and the prompt that our independent draws exaggerate.
# (With 20 requests per configuration the averages are noisy by a few points.)
#
# ### Beam search lands above the paper
#
# Beam search shares output as well as prompt. At best every beam shares everything but its last block, so
# the saving can approach `(n - 1) / n` of the blocks (the black marks): 50%, 75%, 83%. How close a run
# gets depends on how far back the beams' most recent common ancestor lies. Our stand-in model picks the top
# `n` of `n × 32` candidates from peaked Dirichlet distributions, and the winners nearly always descend from
# the same recent beam, so its beams coalesce within a few tokens:

# %%
depths = {run: np.mean(d) for run, d in depth_log.items()}
peaks = {a: saving("Alpaca", "beam search", 4, alpha=a) for a in (0.1, 1.0)}
peaks[0.3] = ours["Alpaca", "beam search", 4]
pd.DataFrame([{"dataset": d, "beams": n, "tokens back to the common ancestor (mean)": round(depths[d, m, n], 1),
               "saved (%)": round(ours[d, m, n], 1), "most possible (%)": round(100 * (n - 1) / n, 1)}
              for d, m, n in depth_log])
bound = {n: 100 * (n - 1) / n for n in (2, 4, 6)}
viz.check(max(depths.values()) < 10
          and all(ours[d, "beam search", n] < bound[n] for d in MEANS for n in (2, 4, 6))
          and all(bound[n] - ours["ShareGPT", "beam search", n] < bound[n] - ours["Alpaca", "beam search", n]
                  for n in (2, 4, 6)),
          f"the beams' common ancestor lies up to {max(depths.values()):.1f} tokens back, a saving passed "
          "(n - 1) / n, or ShareGPT is not closer to that bound than Alpaca", defaults=True)

# %% [markdown]
# A common ancestor a handful of tokens back means the beams differ only in their last block or two: about
# one private block per beam, everything else shared. The longer the sequences, the smaller that private
# part, so ShareGPT's long outputs come closer to the `(n - 1) / n` bound than Alpaca's short ones, and both
# land mostly above the paper's figures (55% at most on Alpaca, 44-66% on ShareGPT). A real LLM's beams on
# open-ended text keep distinct histories for longer, and end at different lengths (an end-of-sequence
# token), which our beams never do. The Dirichlet α, our only knob for how peaked the model is, moves the
# saving by a few points only (below): what the paper measured is a property of its model, not of paging.
# Our figures are a model of the mechanism, not a reproduction: they also average one request at a time,
# where the paper measures a running server's batch.

# %%
print("Beam search on Alpaca with 4 beams saves " + ", ".join(f"{peaks[a]:.1f}% at α = {a}" for a in sorted(peaks))
      + f" (the paper, with a real model: {PAPER['Alpaca', 'beam search'][4]}%).")
viz.check(max(peaks.values()) - min(peaks.values()) <= 6,
          f"α moves the saving by {max(peaks.values()) - min(peaks.values()):.1f} points, not a few", defaults=True)

# %% [markdown]
# ### Exercise: a larger vocabulary
#
# Predict first: if the stand-in model's vocabulary (`VOCAB`, 32 tokens) had 256 tokens, would 4 beams on
# Alpaca save **more** or **less** memory by sharing? Write `"more"` or `"less"`, then run the cell: it
# reruns that configuration of the study with `vocab=256` (a few seconds).

# %%
PREDICTED_SHARING = None   # "more" or "less"

wide_depths = []
wide = saving("Alpaca", "beam search", 4, vocab=256, depths=wide_depths)
narrow = ours["Alpaca", "beam search", 4]
print(f"4 beams on Alpaca: {narrow:.1f}% saved with VOCAB = {VOCAB} (common ancestor "
      f"{depths['Alpaca', 'beam search', 4]:.1f} tokens back), {wide:.1f}% with 256 ({np.mean(wide_depths):.1f} back).")
answer(PREDICTED_SHARING, "more" if wide > narrow else "less", "A Dirichlet(0.3) over more tokens is more "
       "peaked, so the best beam's few likely tokens win the top k even more often: the beams' common ancestor "
       "is more recent and they share more.")
viz.check(wide > narrow > PAPER["Alpaca", "beam search"][4]
          and (round(wide), round(narrow), round(depths["Alpaca", "beam search", 4]), round(np.mean(wide_depths)))
          == (62, 59, 5, 4),
          f"{wide:.1f}% with 256 tokens against {narrow:.1f}% ({np.mean(wide_depths):.1f} against "
          f"{depths['Alpaca', 'beam search', 4]:.1f} tokens back); the answer below says about 62% against 59%, "
          "4 against 5", defaults=True)

# %% [markdown]
# **Answer.** More (about 62% against 59%, and the common ancestor moves from about 5 to about 4 tokens
# back), so the saving moves *away* from the paper's 53%. With α = 0.3 most of a draw's mass falls on a
# handful of tokens, and the more tokens there are, the more lopsided it gets: the top `k` candidates come
# from one beam even more often. A larger vocabulary alone does not make the stand-in behave like a real
# LLM, whose beams keep distinct histories for longer.

# %% [markdown]
# ## Takeaways
#
# * Beam search forks the beams chosen several times and frees the ones nobody chose; shared blocks are
#   copied on write like parallel samples' (notebook 03a), and every beam reads back its own K/V.
# * A shared block is swapped once each way, so a forked group's swap costs one copy per distinct block,
#   not per table entry, and the group shares its blocks again after swapping in.
# * Parallel sampling shares the prompt's full blocks only, so it saves little on short prompts; beam
#   search shares output too and saves far more, up to `(n - 1) / n` when beams share a recent ancestor.
#   Our numbers model the mechanism, not the paper's model: they land below it for sampling, above for beams.
# * vLLM V1 dropped forks and swapping: samples and beams share through the prefix cache, and preemption
#   always recomputes.
