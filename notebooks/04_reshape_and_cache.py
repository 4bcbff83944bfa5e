# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 04 · From slot mapping to cache: `reshape_and_cache`
#
# The block manager decides *where* each token's keys and values live: a **slot** in the shared pool of
# KV-cache blocks, `slot = block_id * block_size + offset`. The `reshape_and_cache` kernel then scatters
# the K/V vectors a model layer just computed into those slots. This notebook follows one batch from the
# manager's bookkeeping to the bytes in the cache, and checks the kernel against a plain-torch reference.
#
# On a CPU the kernel runs in the Triton interpreter with small sizes; on a GPU it runs compiled with
# realistic ones.

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
from kvlab.kernels.reference import reshape_and_cache_ref
from kvlab.kernels.reshape_and_cache import reshape_and_cache

# Knobs: change them and run the notebook again (on a GPU, the realistic sizes below replace the first four).
BLOCK_SIZE = 8                    # slots per block: try 4 or 16 (token labels are drawn up to 8)
NUM_BLOCKS = 10                   # the pool: A, B and C hold 6 blocks of 8; give smaller blocks more
PROMPT_LENS = {"A": 20, "C": 11}  # B is A's full blocks plus BLOCK_SIZE - 1 tokens of its own
NUM_KV_HEADS, HEAD_DIM = 2, 64
NUM_PADDING = 3                   # padding tokens at the end of the batch (slot -1)
SHARE_PREFIX = True               # B starts with A's full blocks (a shared system prompt); False: it does not
SEED = 0
if ON_GPU:   # realistic head shapes, a pool of a few dozen blocks
    BLOCK_SIZE, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM = 16, 24, 8, 128
    PROMPT_LENS = {"A": 150, "C": 90}
DEFAULTS = not ON_GPU and (BLOCK_SIZE, NUM_BLOCKS, PROMPT_LENS, NUM_KV_HEADS, HEAD_DIM, NUM_PADDING, SHARE_PREFIX,
                           SEED) == (8, 10, {"A": 20, "C": 11}, 2, 64, 3, True, 0)  # the CPU setting CI checks
DTYPE = torch.float16
torch.manual_seed(SEED)
print(f"kernels run in {mode()} mode on {DEVICE}; block_size={BLOCK_SIZE}, {NUM_BLOCKS} blocks, "
      f"{NUM_KV_HEADS} kv heads x head_dim {HEAD_DIM}")

# %% [markdown]
# ## 1. The block manager hands out blocks
#
# Three prompts arrive. `B` starts with the same full blocks as `A` (think: a shared system prompt), so
# with prefix caching the manager gives `B` *A's* blocks for that prefix and fresh blocks only for the rest.

# %%
vocab = 1000
prompt_a = torch.randint(vocab, (PROMPT_LENS["A"],)).tolist()
shared = (PROMPT_LENS["A"] // BLOCK_SIZE) * BLOCK_SIZE if SHARE_PREFIX else 0  # A's full blocks
prompts = {"A": prompt_a,
           "B": prompt_a[:shared] + torch.randint(vocab, (BLOCK_SIZE - 1,)).tolist(),
           "C": torch.randint(vocab, (PROMPT_LENS["C"],)).tolist()}

manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
seqs = {name: Sequence(tokens, block_size=BLOCK_SIZE) for name, tokens in prompts.items()}
for name, seq in seqs.items():
    manager.allocate(seq)
    print(f"{name}: {len(seq):>3} tokens, block table {manager.get_block_table(seq)}, "
          f"{seq.num_cached_tokens} tokens already cached")
shared_blocks = shared // BLOCK_SIZE
viz.check(seqs["B"].block_table[:shared_blocks] == seqs["A"].block_table[:shared_blocks]
          and not set(seqs["B"].block_table[shared_blocks:]) & set(seqs["A"].block_table + seqs["C"].block_table),
          "B did not get A's blocks for the shared prefix and fresh blocks for the rest", defaults=True)
viz.check(manager.num_blocks - manager.num_free_blocks == 6,
          f"A, B and C hold {manager.num_blocks - manager.num_free_blocks} blocks, not the 6 the knobs' comment says",
          defaults=DEFAULTS)

# %% [markdown]
# Token position `p` of a sequence lives in logical block `p // block_size` at offset `p % block_size`;
# the block table turns the logical block into a physical one. Here is that arithmetic for one token,
# next to what `manager.slot_mapping` returns:

# %%
seq, p = seqs["B"], len(seqs["B"]) - 1
block = manager.get_block_table(seq)[p // BLOCK_SIZE]
print(f"B's token {p}: logical block {p // BLOCK_SIZE} -> physical block {block}, offset {p % BLOCK_SIZE}, "
      f"slot {block} * {BLOCK_SIZE} + {p % BLOCK_SIZE} = {block * BLOCK_SIZE + p % BLOCK_SIZE}")
print("manager.slot_mapping(B, p, p + 1) =", manager.slot_mapping(seq, p, p + 1))

# %% [markdown]
# ## 2. A picture of the pool
#
# Each row is a physical block, each cell a slot. A cell is coloured by the sequence whose token sits
# there (labelled with the token's position); blocks that two sequences share get their own colour.


# %%
def pool_picture(ax, owners, title):
    """owners: dict (block, offset) -> list of (sequence name, position)."""
    names = list(seqs)
    grid = np.full((NUM_BLOCKS, BLOCK_SIZE), -1)
    for (block, offset), tokens in owners.items():
        grid[block, offset] = len(names) if len({n for n, _ in tokens}) > 1 else names.index(tokens[0][0])
    colors = ["#f0f0f0", "#4c72b0", "#dd8452", "#55a868", "#c44e52"]  # empty, A, B, C, shared
    ax.imshow(grid + 1, cmap=ListedColormap(colors), vmin=0, vmax=len(colors) - 1, aspect="auto")
    if BLOCK_SIZE <= 8:
        for (block, offset), tokens in owners.items():
            label = "/".join(f"{n}{p}" for n, p in tokens)
            ax.text(offset, block, label, ha="center", va="center", fontsize=7, color="white")
    ax.set(title=title, xlabel="offset in block", ylabel="physical block",
           xticks=range(0, BLOCK_SIZE, max(1, BLOCK_SIZE // 8)), yticks=range(0, NUM_BLOCKS, max(1, NUM_BLOCKS // 12)))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors[1:]]
    ax.legend(handles, names + ["shared"], loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    ax.set_xticks(np.arange(-0.5, BLOCK_SIZE), minor=True)  # white lines between slots and between blocks
    ax.set_yticks(np.arange(-0.5, NUM_BLOCKS), minor=True)
    ax.grid(which="minor", color="white", linewidth=1)
    ax.tick_params(which="minor", length=0)


def planned_owners(positions):
    """Where the manager put every token in ``positions`` (name -> range): (block, offset) -> [(name, p)]."""
    owners = {}
    for name, rng in positions.items():
        for p, slot in zip(rng, manager.slot_mapping(seqs[name], rng.start, rng.stop)):
            owners.setdefault(divmod(slot, BLOCK_SIZE), []).append((name, p))
    return owners


fig, ax = plt.subplots(figsize=(7, 4))
pool_picture(ax, planned_owners({n: range(len(s)) for n, s in seqs.items()}), "every token's slot, per the manager")
plt.show()

# %% [markdown]
# ## 3. The batch's slot mapping
#
# The engine runs all three prompts through the model as one batch of tokens. Only tokens whose K/V is
# *not* in the cache yet must be written: for `B`, that skips the prefix it shares with `A`. The batch's
# `slot_mapping` is the concatenation of each sequence's `manager.slot_mapping(seq, num_cached_tokens,
# len(seq))`. Engines pad a batch to a fixed size (for CUDA graphs); a padding token gets slot `-1` and
# the kernel skips it.

# %%
to_write = {name: range(seq.num_cached_tokens, len(seq)) for name, seq in seqs.items()}
slot_mapping = [slot for name, rng in to_write.items()
                for slot in manager.slot_mapping(seqs[name], rng.start, rng.stop)]
slot_mapping = torch.tensor(slot_mapping + [-1] * NUM_PADDING, dtype=torch.int64, device=DEVICE)
num_tokens = len(slot_mapping)
print(f"{num_tokens} tokens in the batch ({NUM_PADDING} of them padding); "
      f"B skips {seqs['B'].num_cached_tokens} cached tokens")
print("slot_mapping:", slot_mapping.tolist())
viz.check(seqs["B"].num_cached_tokens == shared, f"B skips {seqs['B'].num_cached_tokens} tokens, not the "
          f"{shared} it shares with A (with BLOCK_SIZE = 1, B is A's prompt and may not hit its last token)",
          defaults=BLOCK_SIZE > 1)

# %% [markdown]
# ## 4. Run the kernel
#
# The model layer produced `key` and `value`, each `[num_tokens, num_kv_heads, head_dim]`. The cache is
# one tensor `[num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim]`. We fill it with NaN first: any
# slot the kernel should not touch must still be NaN afterwards.

# %%
def written_slots(cache):
    """[num_blocks, block_size] bool: slots whose K or V no longer holds the NaN poison."""
    return ~cache.isnan().flatten(3).all(dim=-1).all(dim=1)


kv_cache = torch.full((NUM_BLOCKS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE, device=DEVICE)
expected = kv_cache.clone()
key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)
value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE)

reshape_and_cache(key, value, kv_cache, slot_mapping)
reshape_and_cache_ref(key, value, expected, slot_mapping)
same = torch.equal(kv_cache.view(torch.int16), expected.view(torch.int16))  # bitwise, so NaN == NaN
written = written_slots(kv_cache)
print(f"kernel == reference, bit for bit: {same}; slots written: {int(written.sum())} "
      f"(non-padding tokens: {int((slot_mapping >= 0).sum())})")
assert same and int(written.sum()) == int((slot_mapping >= 0).sum())  # whatever the knobs

# %% [markdown]
# **Exercise.** Predict, for this notebook's CPU prompts (A of 20 tokens, C of 11, B = A's full blocks plus 7
# tokens of its own, blocks of 8): if B's prompt shared *no* full block with A (`SHARE_PREFIX = False`: B is
# then just its 7 own tokens), how many tokens would the batch write, and how many blocks would the three
# prompts hold? Edit the values and run the cell: it replays the allocation on a fresh pool.

# %%
PREDICTED_WRITES_UNSHARED = None   # tokens the batch writes (padding excluded) without the shared prefix
PREDICTED_BLOCKS_UNSHARED = None   # blocks in use (coloured rows of the pool picture)


def batch_plan(share_prefix, block_size=8, len_a=20, len_c=11):
    """Allocate A, B and C on a fresh pool: tokens to write, blocks in use, tokens B finds in the cache."""
    a = list(range(len_a))
    shared_tokens = len_a // block_size * block_size if share_prefix else 0
    plan = [a, a[:shared_tokens] + list(range(1000, 1000 + block_size - 1)), list(range(2000, 2000 + len_c))]
    pool = BlockManager(64, block_size)
    batch = [Sequence(tokens, block_size) for tokens in plan]
    for seq in batch:
        pool.allocate(seq)
    return dict(writes=sum(len(s) - s.num_cached_tokens for s in batch),
                blocks=pool.num_blocks - pool.num_free_blocks, b_cached=batch[1].num_cached_tokens)


unshared, shared_plan = batch_plan(False), batch_plan(True)
answer(PREDICTED_WRITES_UNSHARED, unshared["writes"], f"A writes 20, B its 7 own tokens, C 11; with the shared "
       f"prefix B also writes only its 7 own tokens ({shared_plan['writes']} either way).")
answer(PREDICTED_BLOCKS_UNSHARED, unshared["blocks"], f"A 3 blocks, B 1, C 2; with the shared prefix B's 2 "
       f"prefix blocks are A's, so {shared_plan['blocks']} either way.")
viz.check((unshared["writes"], unshared["blocks"], shared_plan["writes"], shared_plan["blocks"]) == (38, 6, 38, 6),
          f"batch_plan gave {unshared} without and {shared_plan} with the shared prefix; the answer below says 38 "
          "tokens and 6 blocks either way", defaults=True)

# %% [markdown]
# **Answer.** 38 tokens and 6 blocks, exactly as with the shared prefix: a prefix hit costs the batch
# nothing, neither a write nor a block, so taking the shared prefix away only takes tokens away from B.
# `NUM_PADDING = 0` changes only the slot mapping's length (3 fewer `-1` entries): the kernel skips padding,
# so "slots written" does not move.

# %% [markdown]
# The right-hand picture is read back from the cache itself: a cell is coloured when its slot no longer
# holds NaN. It matches the manager's plan, including B's shared prefix (written once, by A) and the
# skipped padding tokens.

# %%
written_cells = {cell: owners for cell, owners in planned_owners({n: range(len(s)) for n, s in seqs.items()}).items()
                 if bool(written[cell])}
fig, (left, right) = plt.subplots(1, 2, figsize=(14, 4))
pool_picture(left, planned_owners(to_write), "tokens this batch writes (manager)")
pool_picture(right, written_cells, "slots holding data after the kernel (cache)")
plt.tight_layout()
plt.show()
viz.check(set(written_cells) == set(planned_owners({n: range(len(s)) for n, s in seqs.items()})),
          "the slots holding data differ from the manager's plan", defaults=True)

# %% [markdown]
# ## 5. A decode step
#
# While generating, every sequence adds one token per step. `append_slots` gives it a slot (a new block
# when the last one is full), and the batch's slot mapping has exactly one slot per sequence.

# %%
for seq in seqs.values():
    seq.append_token(int(torch.randint(vocab, ())))
    assert manager.append_slots(seq) == []  # no shared partial block here, so no copy-on-write
decode_slots = torch.tensor([manager.slot_mapping(s, len(s) - 1, len(s))[0] for s in seqs.values()], device=DEVICE)
new_key, new_value = (torch.randn(len(seqs), NUM_KV_HEADS, HEAD_DIM, device=DEVICE).to(DTYPE) for _ in range(2))
reshape_and_cache(new_key, new_value, kv_cache, decode_slots)
reshape_and_cache_ref(new_key, new_value, expected, decode_slots)
print("decode slots:", dict(zip(seqs, decode_slots.tolist())))
decode_same = torch.equal(kv_cache.view(torch.int16), expected.view(torch.int16))
print("kernel == reference after the decode step:", decode_same)
assert decode_same  # whatever the knobs

# %%
written = written_slots(kv_cache)
owners_now = planned_owners({n: range(len(s)) for n, s in seqs.items()})
fig, ax = plt.subplots(figsize=(7, 4))
pool_picture(ax, {cell: o for cell, o in owners_now.items() if bool(written[cell])}, "cache after one decode step")
plt.show()

# %% [markdown]
# **Exercise.** Predict: with blocks of 4 instead of 8 (same CPU prompts), how many of B's tokens come from
# A's cache, and how many tokens does the batch write? Edit and run; `batch_plan` from the exercise above
# replays it.

# %%
PREDICTED_B_CACHED_4 = None   # B's tokens found in the cache, blocks of 4
PREDICTED_WRITES_4 = None     # tokens the batch writes, blocks of 4

small = batch_plan(True, block_size=4)
answer(PREDICTED_B_CACHED_4, small["b_cached"], "A's 20 tokens are 5 full blocks of 4, and B is those 20 tokens "
       "plus 3 of its own: all 20 shared tokens hit (with blocks of 8 only 16 did: A's third block was partial).")
answer(PREDICTED_WRITES_4, small["writes"], "A 20 + B 3 + C 11: smaller blocks let B share more and write less.")
viz.check((small["b_cached"], small["writes"], shared_plan["b_cached"], shared_plan["writes"]) == (20, 34, 16, 38),
          f"batch_plan gave {small} with blocks of 4 and {shared_plan} with blocks of 8; the answer below says B "
          "finds 20 and the batch writes 34, against 16 and 38", defaults=True)

# %% [markdown]
# **Answer.** B finds 20 tokens in the cache and the batch writes 34 (against 16 and 38 with blocks of 8).
# Only *full* blocks are shared, so the smaller the block, the more of a shared prefix is reusable. To see
# it in the pictures, set `BLOCK_SIZE = 4` and `NUM_BLOCKS = 16` in the knobs cell: the pool picture then
# has 16 rows.
#
# > **In vLLM.** The same kernel exists under the same name, with another cache layout. vLLM's **V0**
# > PagedAttention kernels used two tensors per layer, keys as `[num_blocks, num_kv_heads, head_size / x,
# > block_size, x]` (x elements = 16 bytes, so a thread loads 16 bytes at a time) and values as `[num_blocks,
# > num_kv_heads, head_size, block_size]` (`reshape_and_cache` in `csrc/cache_kernels.cu`). **V1**'s
# > FlashAttention backend uses one tensor `[2, num_blocks, block_size, num_kv_heads, head_size]` written by
# > `reshape_and_cache_flash` (`vllm/v1/attention/backends/flash_attn.py`, `get_kv_cache_shape`); nano-vllm
# > keeps `k_cache` and `v_cache` as `[num_blocks, block_size, num_kv_heads, head_dim]` and writes them with a
# > Triton kernel (`store_kvcache` in `nanovllm/layers/attention.py`). kvlab keeps a block's K and V next to
# > each other (`[num_blocks, 2, block_size, ...]`), so copying or swapping a block is one contiguous move. All
# > of them skip a slot of `-1` (vLLM calls it `PAD_SLOT_ID`).

# %% [markdown]
# ## Takeaways
#
# * The block manager never touches tensors: it only hands out integers, and `slot_mapping` is the whole
#   interface between its bookkeeping and the kernel.
# * Prefix-cached tokens are simply not in the slot mapping, and padding is `-1`: the kernel writes exactly
#   the slots it is given, each by one token (the launcher rejects duplicates, which would race).
# * Checking against NaN-poisoned memory shows both halves of correctness: the right values in the right
#   slots, and nothing anywhere else.
