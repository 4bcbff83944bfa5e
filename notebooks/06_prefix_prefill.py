# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 06 · Prefix hits skip compute: `paged_prefill`
#
# Many requests start with the same tokens: a system prompt, a few-shot preamble, the earlier turns of a
# chat. With prefix caching the block manager hands a new request the blocks that already hold that
# prefix's keys and values, and reports how many tokens are cached (`num_cached_tokens`). The engine then
# runs the model only over the *new* tokens; their attention still has to see the whole context, which is
# what `paged_prefill` does: queries for the new tokens, keys and values for every token, read through the
# block table.
#
# This notebook runs that path end to end with the real `kvlab.BlockManager`, checks that the result equals
# a full prefill over every token, and counts what the hit saves.

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
KVLAB_KERNELS = True  # whether this notebook runs kvlab's Triton kernels itself (it imports kvlab.kernels)
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
import torch
from matplotlib.colors import ListedColormap

from kvlab import BlockManager, Sequence, viz
from kvlab.course import answer
from kvlab.device import DEVICE, ON_GPU, mode
from kvlab.kernels.paged_prefill import paged_prefill
from kvlab.kernels.reference import attention_ref
from kvlab.kernels.reshape_and_cache import reshape_and_cache

# Knobs: change them and run the notebook again (on a GPU, the realistic sizes below replace them).
BLOCK_SIZE, NUM_BLOCKS = 8, 24            # the pool must hold A, B and C: 13 blocks of 8 here
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 64
SYSTEM_LEN = 37                           # the shared system prompt: 4 full blocks of 8 and 5 tokens more
USER_LENS = {"A": 13, "B": 6, "C": 21}    # each request's own message after it
SEED = 0
DTYPE = torch.float32
if ON_GPU:   # a Llama-3-8B-like attention layer, a 2000-token system prompt
    BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 512, 32, 8, 128
    SYSTEM_LEN, USER_LENS = 2000, {"A": 300, "B": 170, "C": 45}
    DTYPE = torch.float16
DEFAULTS = not ON_GPU and (BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SYSTEM_LEN, USER_LENS, SEED) == (
    8, 24, 4, 2, 64, 37, {"A": 13, "B": 6, "C": 21}, 0)  # the CPU setting CI checks exactly
torch.manual_seed(SEED)
VOCAB = 1000
print(f"kernels run in {mode()} mode on {DEVICE}; block_size={BLOCK_SIZE}, {NUM_HEADS} query / "
      f"{NUM_KV_HEADS} kv heads, head_dim {HEAD_DIM}, system prompt of {SYSTEM_LEN} tokens")


def max_error(a, b):
    return (a.float() - b.float()).abs().max().item()


# %% [markdown]
# ## 1. A toy layer
#
# A real layer's K/V for a token depend on the tokens before it, never after: that is why a cached prefix
# can be reused. Our stand-in keeps that property in its simplest form: Q, K and V of a token are fixed
# random functions of (token id, position).

# %%
MAX_POS = SYSTEM_LEN + max(USER_LENS.values())
embed = {name: torch.randn(VOCAB, heads, HEAD_DIM, device=DEVICE) / 2
         for name, heads in [("q", NUM_HEADS), ("k", NUM_KV_HEADS), ("v", NUM_KV_HEADS)]}
position = {name: torch.randn(MAX_POS, t.shape[1], HEAD_DIM, device=DEVICE) / 2 for name, t in embed.items()}


def project(name, tokens, start):
    """``name`` in q/k/v for ``tokens`` at positions start, start+1, ...: ``[len(tokens), heads, head_dim]``."""
    ids = torch.tensor(tokens, device=DEVICE)
    return (embed[name][ids] + position[name][start:start + len(tokens)]).to(DTYPE)


# %% [markdown]
# ## 2. Request A fills the cache
#
# Three requests share a system prompt and differ in the user's message. A arrives first: nothing is
# cached, so the block manager gives it fresh blocks, the engine writes all of A's K/V
# (`reshape_and_cache`) and runs `paged_prefill` with every token as a query.

# %%
system = torch.randint(VOCAB, (SYSTEM_LEN,)).tolist()
prompts = {name: system + torch.randint(VOCAB, (n,)).tolist() for name, n in USER_LENS.items()}
manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
seqs = {name: Sequence(tokens, block_size=BLOCK_SIZE) for name, tokens in prompts.items()}
kv_cache = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=DEVICE)


def block_tables_of(names):
    """int32 [len(names), width] block tables, padded with -1."""
    rows = [manager.get_block_table(seqs[n]) for n in names]
    width = max(map(len, rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32, device=DEVICE)


def prefill(names):
    """One engine step for newly allocated sequences: write the new tokens' K/V, then attend. Returns
    {name: output rows of its new tokens}."""
    new = {n: range(seqs[n].num_cached_tokens, len(seqs[n])) for n in names}
    tokens = {n: prompts[n][r.start:] for n, r in new.items()}
    slots = torch.tensor([s for n, r in new.items() for s in manager.slot_mapping(seqs[n], r.start, r.stop)],
                         device=DEVICE)
    key = torch.cat([project("k", tokens[n], r.start) for n, r in new.items()])
    value = torch.cat([project("v", tokens[n], r.start) for n, r in new.items()])
    reshape_and_cache(key, value, kv_cache, slots)
    query = torch.cat([project("q", tokens[n], r.start) for n, r in new.items()])
    cu_query_lens = torch.tensor([0] + [len(r) for r in new.values()], device=DEVICE).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([len(seqs[n]) for n in names], dtype=torch.int32, device=DEVICE)
    out = paged_prefill(query, kv_cache, block_tables_of(names), seq_lens, cu_query_lens)
    return {n: out[cu_query_lens[i]:cu_query_lens[i + 1]] for i, n in enumerate(names)}


manager.allocate(seqs["A"])
print(f"A: {len(seqs['A'])} tokens, {seqs['A'].num_cached_tokens} cached, blocks {manager.get_block_table(seqs['A'])}")
outputs = prefill(["A"])

# %% [markdown]
# ## 3. B and C hit the prefix
#
# The manager recognises the system prompt's *full* blocks (their content hashes match A's) and shares
# them. B and C are then prefilled together in one launch: each has a different number of new tokens and a
# different context length, described by `cu_query_lens` and `seq_lens`.

# %%
for name in ("B", "C"):
    manager.allocate(seqs[name])
    seq = seqs[name]
    print(f"{name}: {len(seq)} tokens, {seq.num_cached_tokens} cached "
          f"({seq.num_cached_tokens / len(seq):.0%}), blocks {manager.get_block_table(seq)}")
outputs.update(prefill(["B", "C"]))
print(f"prefix cache hit rate so far: {manager.stats.hit_rate:.0%} of queried tokens")
system_blocks = SYSTEM_LEN // BLOCK_SIZE
viz.check(all(seqs[n].block_table[:system_blocks] == seqs["A"].block_table[:system_blocks]
              and seqs[n].num_cached_tokens >= system_blocks * BLOCK_SIZE for n in ("B", "C")),
          "B or C does not share the system prompt's full blocks with A", defaults=True)
viz.check(manager.num_blocks - manager.num_free_blocks == 13 and seqs["B"].num_cached_tokens == 32,
          f"A, B and C hold {manager.num_blocks - manager.num_free_blocks} blocks (the knobs' comment: 13) and B "
          f"found {seqs['B'].num_cached_tokens} tokens cached (4 full blocks of 8: 32)", defaults=DEFAULTS)

# %%
names = list(seqs)
tables = [manager.get_block_table(seqs[n]) for n in names]
width = max(map(len, tables))
grid = np.zeros((len(names), width))
for i, table in enumerate(tables):
    for j, block in enumerate(table):
        shared = sum(block in other for other in tables) > 1
        grid[i, j] = 2 if shared else 1
fig, ax = plt.subplots(figsize=(max(7, min(14, 1 + 0.35 * width)), 2.2))
ax.imshow(grid, cmap=ListedColormap(["white", "#dd8452", "#4c72b0"]), vmin=0, vmax=2, aspect="auto")
if width <= 40:
    for (i, j), kind in np.ndenumerate(grid):
        if kind:
            ax.text(j, i, tables[i][j], ha="center", va="center", fontsize=7, color="white")
ax.set(yticks=range(len(names)), yticklabels=names, xlabel="logical block (numbers: physical block ids)",
       title="block tables: blue = shared prefix blocks (computed once, by A)\norange = the request's own blocks")
plt.show()

# %% [markdown]
# ## 4. Same answer as computing everything
#
# The check: recompute each request from scratch, every token a query over every token (no cache, no
# paging: `attention_ref` on freshly projected Q/K/V), and compare its new tokens' rows with what the
# prefix-hit path produced.

# %%
for name, seq in seqs.items():
    tokens, n, cached = prompts[name], len(seqs[name]), seqs[name].num_cached_tokens
    full = attention_ref(project("q", tokens, 0), project("k", tokens, 0), project("v", tokens, 0),
                         torch.arange(n, device=DEVICE))
    err = max_error(outputs[name], full[cached:])
    print(f"{name}: computed {n - cached:>4} of {n:>4} query tokens; max |error| vs full prefill = {err:.1e}")
    assert err < (1e-4 if DTYPE == torch.float32 else 2e-2)

# %% [markdown]
# ## 5. What a hit saves
#
# Prefilling `q` new tokens of an `n`-token sequence costs, per layer, the projections and MLP for `q` tokens
# (about 2 FLOPs per weight per token) plus attention: new token `i` scores and mixes `i + 1` keys, 4
# FLOPs per key per head dimension per head. A hit ratio `h` removes a fraction `h` of the first part and
# about `h²` of the second (the skipped tokens are the early ones, which attend to few keys). Below for a
# Llama-3-8B-shaped layer: on the left the three parts for an 8192-token prompt; on the right the whole
# layer for prompts of several lengths, with this notebook's requests as dots on the curve of their own
# length.

# %%
MODEL = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336)


def prefill_flops(n, q, model=MODEL):
    """(linear, attention) FLOPs of one layer prefilling the last q of n tokens."""
    d, hd = model["hidden"], model["head_dim"]
    weights = d * hd * (2 * model["heads"] + 2 * model["kv_heads"]) + 3 * d * model["intermediate"]
    keys_seen = sum(range(n - q + 1, n + 1))  # new token at position i sees i + 1 keys
    return 2 * weights * q, 4 * model["heads"] * hd * keys_seen


def skipped_fraction(n, cached):
    full_linear, full_attention = prefill_flops(n, n)
    linear, attention = prefill_flops(n, n - cached)
    return 1 - linear / full_linear, 1 - attention / full_attention, 1 - (linear + attention) / (full_linear + full_attention)


prompt_len = 8192
ratios = np.linspace(0, 1, 65)


def curve(n):
    """skipped_fraction over hit ratios for an n-token prompt (hits in whole tokens)."""
    return np.array([skipped_fraction(n, int(h * n)) for h in ratios])


curves = curve(prompt_len)
fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
for k, label in enumerate(["projections + MLP", "attention", "all of the layer"]):
    left.plot(ratios, curves[:, k], label=label)
left.set(xlabel="prefix hit ratio (cached tokens / prompt tokens)", ylabel="fraction of prefill FLOPs skipped",
         title=f"the parts of one layer, {prompt_len}-token prompt")
left.legend(fontsize=8)
for n, color in ((512, "C0"), (8192, "C2"), (32768, "C3"), (131072, "C4")):
    right.plot(ratios, curve(n)[:, 2], color=color, label=f"{n:,}-token prompt")
for name, seq in seqs.items():  # each request on the curve of its own length
    n, h = len(seq), seq.num_cached_tokens / len(seq)
    right.plot(ratios, curve(n)[:, 2], color="0.6", lw=0.8, ls=":")
    right.plot(h, skipped_fraction(n, seq.num_cached_tokens)[2], "o", color="k")
    right.annotate(f"{name} ({n} tokens)", (h, skipped_fraction(n, seq.num_cached_tokens)[2]),
                   textcoords="offset points", xytext=(6, -12), fontsize=8)
right.plot([], [], color="0.6", lw=0.8, ls=":", label="this notebook's requests, at their length")
right.set(xlabel="prefix hit ratio", title="all of the layer: longer prompts save less than their hit ratio")
right.legend(fontsize=8)
fig.suptitle("what a prefix hit skips (one layer, Llama-3-8B shape)", fontsize=11)
plt.tight_layout()
plt.show()
half = skipped_fraction(prompt_len, prompt_len // 2)
print(f"at a 50% hit ratio on a {prompt_len}-token prompt: {half[0]:.0%} of projection/MLP FLOPs, "
      f"{half[1]:.0%} of attention FLOPs, {half[2]:.0%} of the layer's FLOPs are skipped")
by_length = {n: curve(n)[:, 2] for n in (512, 8192, 32768, 131072)}
interior = slice(1, -1)  # at 0% and 100% every prompt saves exactly the hit ratio
viz.check(np.allclose(curves[:, 0], ratios) and np.all(np.abs(curves[:, 1] - ratios**2) < 0.01)
          and all(np.all(c <= ratios + 1e-12) for c in by_length.values())
          and all(np.all(longer[interior] < shorter[interior])
                  for shorter, longer in zip(list(by_length.values()), list(by_length.values())[1:])),
          "projections and MLP do not save exactly the hit ratio, attention not about its square, or a longer "
          "prompt does not save less than a shorter one at the same hit ratio", defaults=True)

# %% [markdown]
# **Exercise.** Predict, for this notebook's CPU sizes (blocks of 8; user messages of 13, 6 and 21 tokens
# after the system prompt; A first): how many tokens does B find in the cache with a 7-token system prompt
# (less than one block), and with a 40-token one (exactly five blocks)? Only full blocks are shared, and a
# hit never covers a prompt's last token. Edit the values and run the cell: it replays A, B and C on a
# fresh pool. (To see the dots move in the figure, set `SYSTEM_LEN` in the knobs cell.)

# %%
PREDICTED_B_HITS_7 = None    # B's cached tokens, system prompt of 7
PREDICTED_B_HITS_40 = None   # B's cached tokens, system prompt of 40


def cached_tokens(system_len, block_size=8, user_lens=(13, 6, 21)):
    """A, B and C (the system prompt, then their own messages) on a fresh pool: each one's cached tokens."""
    pool = BlockManager(64, block_size)
    cached = []
    for k, n in enumerate(user_lens):
        seq = Sequence(list(range(system_len)) + list(range(1000 * (k + 1), 1000 * (k + 1) + n)), block_size)
        pool.allocate(seq)
        cached.append(seq.num_cached_tokens)
    return cached


answer(PREDICTED_B_HITS_7, cached_tokens(7)[1], "7 tokens never fill a block of 8, and B's first block also holds "
       "its own message: nothing is shared.")
viz.check(cached_tokens(7)[1:] == [0, 0] and cached_tokens(40)[1] == 40 and cached_tokens(37)[1:] == [32, 32],
          f"cached tokens: {cached_tokens(7)} with a 7-token system prompt, {cached_tokens(40)} with 40, "
          f"{cached_tokens(37)} with 37; the answer below says B and C 0, B 40, and 32 each", defaults=True)
answer(PREDICTED_B_HITS_40, cached_tokens(40)[1], "the system prompt is exactly 5 full blocks, and B's last token lies "
       "in its sixth block: all 40 tokens hit.")

# %% [markdown]
# **Answer.** 0 and 40. With 7 system tokens the first block mixes the system prompt with each request's own
# message, so no block is the same; B and C compute everything, and their dots sit at a hit ratio of 0. With
# 40, B hits all 40 (40 of its 46 tokens), because the block boundary falls exactly at the end of the system
# prompt. The default 37 tokens share only 4 full blocks: 32 tokens, the last 5 recomputed by everyone.
#
# > **In vLLM.** vLLM's **V0** had a dedicated Triton kernel for this path, `context_attention_fwd` in
# > `vllm/attention/ops/prefix_prefill.py` (new tokens' queries against a paged cached prefix plus
# > themselves), used when prefix caching or chunked prefill gave a prompt a cached part. **V1** does not
# > distinguish: every step calls one varlen attention kernel with a block table and per-sequence query and
# > context lengths (`vllm/v1/attention/backends/flash_attn.py`), and with chunked prefill a long prompt's
# > later chunks take exactly this path, their earlier chunks playing the cached prefix.

# %% [markdown]
# ## 6. Time to first token on a GPU
#
# On a GPU we time one Llama-3-8B-shaped layer's prefill at several hit ratios: the projections and MLP as
# torch matmuls over the new tokens, attention as `paged_prefill` over the whole context, times 32 layers,
# as a proxy for time to first token (no embedding, norms or sampling).

# %%
def time_ms(fn, reps=10):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def layer_ms(n, cached, num_layers=32, block_size=16):
    """Median time of num_layers layers prefilling tokens cached..n-1 of an n-token prompt."""
    m, q = MODEL, n - cached
    d, hd, h, kvh = m["hidden"], m["head_dim"], m["heads"], m["kv_heads"]
    w_qkv = torch.randn(d, (h + 2 * kvh) * hd, device="cuda", dtype=torch.float16) / d ** 0.5
    w_o = torch.randn(h * hd, d, device="cuda", dtype=torch.float16) / d ** 0.5
    w_up = torch.randn(d, 2 * m["intermediate"], device="cuda", dtype=torch.float16) / d ** 0.5
    w_down = torch.randn(m["intermediate"], d, device="cuda", dtype=torch.float16) / d ** 0.5
    blocks = -(-n // block_size)
    cache = torch.randn(blocks, 2, block_size, kvh, hd, device="cuda", dtype=torch.float16)
    tables = torch.randperm(blocks, device="cuda").to(torch.int32)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, q], dtype=torch.int32, device="cuda")
    x = torch.randn(q, d, device="cuda", dtype=torch.float16)

    def layer():
        qkv = x @ w_qkv
        attn = paged_prefill(qkv[:, :h * hd].view(q, h, hd), cache, tables, seq_lens, cu)
        y = x + attn.view(q, h * hd) @ w_o
        gate, up = (y @ w_up).chunk(2, dim=-1)
        return y + (torch.nn.functional.silu(gate) * up) @ w_down

    return num_layers * time_ms(layer)


if ON_GPU:
    ttft_len = 8192
    hit_ratios = [0.0, 0.25, 0.5, 0.75, 0.9, 0.97]
    cached_tokens = [int(h * ttft_len) // 16 * 16 for h in hit_ratios]  # prefix hits come in whole blocks
    ttft = [layer_ms(ttft_len, c) for c in cached_tokens]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([c / ttft_len for c in cached_tokens], ttft, "o-", label="measured (32 layers)")
    ax.plot(ratios, ttft[0] * (1 - curve(ttft_len)[:, 2]), "--", color="0.5",
            label="FLOP model, scaled to the 0% point")
    ax.set(xlabel="prefix hit ratio", ylabel="time to first token (ms)",
           title=f"{ttft_len}-token prompt on {torch.cuda.get_device_name()}")
    ax.legend(fontsize=8)
    plt.show()
    print(f"TTFT proxy: {ttft[0]:.1f} ms with no hit, {ttft[-1]:.1f} ms with a {cached_tokens[-1] / ttft_len:.0%} hit")
else:
    print("No GPU here: time to first token is only measured on a GPU (in the interpreter, timings mean "
          "nothing). The FLOP count above is what that measurement tracks.")

# %% [markdown]
# ## Takeaways
#
# * A prefix hit is pure bookkeeping for the block manager (shared block ids, `num_cached_tokens`) and a
#   shorter query for the kernel: `paged_prefill` takes only the new tokens as queries and reads every
#   token's K/V through the block table, with the causal mask aligned to the end of the context.
# * The output equals a full prefill's rows for those tokens: skipping the prefix changes cost, not results.
# * Projections and MLP save exactly the hit ratio; attention saves only about its square, because the
#   skipped prefix tokens are the early ones, which attend to few keys. The longer the prompt, the larger
#   attention's share of the work, and the further the total saving falls below the hit ratio.
