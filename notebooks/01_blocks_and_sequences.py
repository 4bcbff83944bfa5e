# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 01 · Blocks and sequences
#
# For every token a model has seen, each layer keeps a key and a value vector: the **KV cache**. A server
# does not know in advance how long an answer will be, so reserving one contiguous slab per request means
# reserving for the longest possible answer. **Paging** (vLLM's PagedAttention) cuts the cache into
# fixed-size **blocks** of `block_size` token slots, hands them out one at a time as a sequence grows, and
# keeps a per-sequence **block table** from *logical* blocks (positions `0..block_size-1`,
# `block_size..2*block_size-1`, ...) to *physical* blocks anywhere in a shared pool.
#
# This notebook follows sequences through their life in kvlab's `BlockManager`: a prompt is split into
# logical blocks, allocated, grows during decoding (`append_token` + `append_slots`), fills and seals blocks,
# and is freed. The last section measures what paging saves over contiguous reservation.

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

from kvlab import AllocStatus, BlockManager, Sequence, viz

# Knobs: change them and run the notebook again (Run All). The checks below explain what your change did.
BLOCK_SIZE = 4     # token slots per block: tiny so every slot fits in a picture; servers use 16 or more
NUM_BLOCKS = 12    # blocks in the pool: both sequences must fit (BLOCK_SIZE = 1 needs about 40)
DECODE_STEPS = 9   # tokens each sequence generates in section 3
SEED = 0           # the random tokens

DEFAULTS = (BLOCK_SIZE, NUM_BLOCKS, DECODE_STEPS, SEED) == (4, 12, 9, 0)  # the setting CI checks exactly
rng = np.random.default_rng(SEED)

# %% [markdown]
# ## 1. A sequence and its logical blocks
#
# A `Sequence` is a list of token ids. Logical block `i` holds positions `[i * block_size, (i + 1) *
# block_size)`; only the last block can be partial.

# %%
prompt = Sequence([17, 4, 99, 23, 8, 61, 5, 42, 11, 70], block_size=BLOCK_SIZE)
viz.draw_tokens(prompt, names=["prompt"],
                title=f"a 10-token prompt in logical blocks of {BLOCK_SIZE} (dashed: empty slots)")
plt.show()
last_fill = prompt.num_tokens - (prompt.num_blocks - 1) * BLOCK_SIZE
print(f"The prompt has {prompt.num_tokens} tokens, so it spans {prompt.num_blocks} logical blocks of "
      f"{BLOCK_SIZE}: {prompt.num_blocks - 1} full ones and a last one holding {last_fill} of {BLOCK_SIZE} slots.")

# %% [markdown]
# ## 2. Allocating the prompt: the block table
#
# `allocate(seq)` gives every logical block a physical block from the pool. The picture shows the block
# table as a row of cells (each filled in proportion to the tokens it holds, labelled with the physical
# block id) with arrows into the pool below. Free blocks show their place in the reuse order (`#0` is
# handed out next).

# %%
manager = BlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, record_events=True)
phases = [(len(manager.events), "allocate(prompt)")]  # for the timeline in section 6: which call logged what
print("can_allocate:", manager.can_allocate(prompt).name)
manager.allocate(prompt)
viz.draw_block_tables(manager, [prompt], names=["prompt"], title="after allocate(prompt)")
plt.show()
print(f"allocate gave logical blocks 0..{prompt.num_blocks - 1} the physical blocks {manager.get_block_table(prompt)}; "
      f"{manager.num_free_blocks} of {manager.num_blocks} blocks are still free.")

# %% [markdown]
# The kernel never sees the block table directly for writes; it gets a **slot** per token:
# `slot = physical_block * block_size + offset`. `slot_mapping(seq, start, end)` computes them.

# %%
p = prompt.num_tokens - 1
table = manager.get_block_table(prompt)
slot = manager.slot_mapping(prompt, p, p + 1)[0]
print(f"The last prompt token (position {p}) sits in logical block {p // BLOCK_SIZE} -> physical block "
      f"{table[p // BLOCK_SIZE]}, offset {p % BLOCK_SIZE}: slot {table[p // BLOCK_SIZE]} * {BLOCK_SIZE} + "
      f"{p % BLOCK_SIZE} = {slot}.")
assert slot == table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE  # the formula, whatever the knobs

# %% [markdown]
# ## 3. Growing during decode
#
# Each decode step adds one token per sequence: `seq.append_token(t)` records the token, then
# `manager.append_slots(seq)` makes sure it has a slot. A new block is taken only when the last one is full.
# When a block fills up, the manager **seals** it: it records a hash of its contents so that a later
# request with the same prefix can reuse it (notebook 02).
#
# A second request, `chat`, arrives and decodes in the same batch, so the two sequences' new blocks
# interleave in the pool: physical placement no longer matters once there is a block table. We record a
# snapshot whenever a step takes a new block.

# %%
NAMES = ["prompt", "chat"]
chat = Sequence(rng.integers(100, 200, size=5), BLOCK_SIZE)
phases.append((len(manager.events), "allocate(chat)"))
manager.allocate(chat)
steps = [viz.snapshot(manager, [prompt, chat], "prompt and chat allocated", names=NAMES)]
seal_events_before = sum(e.kind == "seal" for e in manager.events)
phases.append((len(manager.events), f"{DECODE_STEPS} decode steps"))
for step in range(DECODE_STEPS):
    blocks_before = manager.num_free_blocks
    for seq in (prompt, chat):
        seq.append_token(int(rng.integers(200, 300)))
        copies = manager.append_slots(seq)
        assert copies == []  # nothing is shared here, so nothing is copied on write
    if manager.num_free_blocks < blocks_before:
        steps.append(viz.snapshot(manager, [prompt, chat], f"decode step {step + 1} took a new block", names=NAMES))
steps.append(viz.snapshot(manager, [prompt, chat], f"after {DECODE_STEPS} decode steps", names=NAMES))
viz.show_steps(steps, ncols=2)  # a slider in Jupyter or Colab; every snapshot side by side elsewhere
plt.show()

# %%
new_blocks = sum(e.kind == "append" for e in manager.events)
sealed = sum(e.kind == "seal" for e in manager.events) - seal_events_before
empty_slots = sum(len(s.block_table) * BLOCK_SIZE - s.num_tokens for s in (prompt, chat))
print(f"In {DECODE_STEPS} steps the two sequences generated {2 * DECODE_STEPS} tokens and took only {new_blocks} "
      f"new blocks; {sealed} blocks filled up and were sealed on the way.")
print(f"Right now {empty_slots} slots are allocated but empty: at most block_size - 1 = {BLOCK_SIZE - 1} per "
      "sequence, in its last block.")
print(f"prompt's table: {prompt.block_table}; chat's table: {chat.block_table} (interleaved in the pool).")
assert empty_slots <= 2 * (BLOCK_SIZE - 1)  # paging's promise, whatever the knobs
viz.check(max(prompt.block_table) > min(chat.block_table),
          f"the tables do not interleave: prompt took no new block after chat's first ({prompt.block_table}, "
          f"{chat.block_table}); with DECODE_STEPS={DECODE_STEPS} prompt never outgrew its last block",
          defaults=DEFAULTS)

# %% [markdown]
# **Exercise.** Predict for blocks of 8 instead of 4 (same 10- and 5-token prompts, nine decode steps
# each): how many new blocks do the decode steps take, and how many allocated slots are empty at the end?
# Fewer, longer blocks mean fewer `append` steps but more empty slots in each sequence's last block. Edit
# the two values and run the cell: it replays the story on a fresh pool and checks them.

# %%
from kvlab.course import answer

PREDICTED_NEW_BLOCKS = None    # blocks the nine decode steps take, both sequences together
PREDICTED_EMPTY_SLOTS = None   # allocated slots holding no token at the end


def decode_story(block_size, prompt_lens=(10, 5), steps=9):
    """Allocate the prompts, decode ``steps`` tokens each; return (new blocks taken, empty slots at the end)."""
    pool = BlockManager(64, block_size, enable_prefix_caching=False)
    seqs = [Sequence(range(n), block_size) for n in prompt_lens]
    for seq in seqs:
        pool.allocate(seq)
    free_before = pool.num_free_blocks
    for _ in range(steps):
        for seq in seqs:
            seq.append_token(0)
            pool.append_slots(seq)
    return free_before - pool.num_free_blocks, sum(len(s.block_table) * block_size - s.num_tokens for s in seqs)


new_blocks_8, empty_slots_8 = decode_story(8)
answer(PREDICTED_NEW_BLOCKS, new_blocks_8, "prompt grows from 10 to 19 tokens (2 -> 3 blocks of 8), chat from 5 "
       "to 14 (1 -> 2): one new block each.")
answer(PREDICTED_EMPTY_SLOTS, empty_slots_8, "3 x 8 - 19 = 5 empty slots in prompt's last block, 2 x 8 - 14 = 2 "
       "in chat's.")
# The answer below, asserted (fixed arguments, so whatever the knobs): blocks of 8 take fewer new blocks than
# blocks of 4 but leave more slots empty; blocks of 1 take a block per token and leave none empty.
new_blocks_4, empty_slots_4 = decode_story(4)
new_blocks_1, empty_slots_1 = decode_story(1)
viz.check((new_blocks_8, empty_slots_8, new_blocks_4, empty_slots_4, new_blocks_1, empty_slots_1)
          == (2, 7, 4, 3, 18, 0),
          f"decode_story: blocks of 8 gave {(new_blocks_8, empty_slots_8)}, of 4 {(new_blocks_4, empty_slots_4)}, "
          f"of 1 {(new_blocks_1, empty_slots_1)}; the answer says (2, 7), (4, 3), (18, 0)", defaults=True)
one_token_pool = BlockManager(12, 1)
one_token_pool.allocate(Sequence(range(10), 1))
viz.check(10 + 5 + new_blocks_1 <= 40 and one_token_pool.can_allocate(Sequence(range(100, 105), 1)) != AllocStatus.OK,
          "blocks of one token: the story needs more than about 40 blocks, or 12 blocks hold both prompts",
          defaults=True)

# %% [markdown]
# **Answer.** 2 new blocks and 7 empty slots (blocks of 4 took 4 new blocks and left 3 empty: check with
# `decode_story(4)`). `decode_story(1)` takes 18 blocks and leaves none empty: every token fills, and
# seals, a block of its own, which is why the pool would need about 40 one-token blocks. (With 12 blocks
# of one token, `allocate(chat)` raises `OutOfBlocksError`: the pool is full, and `can_allocate` would
# have said so.)

# %% [markdown]
# A sealed block is immutable and *cached*: a prefix lookup could hit it from now on (the gold dot). The
# last, partial block of each sequence is not.

# %%
viz.draw_pool(manager, title="the pool after decoding (gold dot: sealed and cached)")
plt.show()
in_use = prompt.block_table + chat.block_table
sealed_blocks = [b for b in in_use if manager.is_cached(b)]
tails = {name: seq.block_table[-1] for name, seq in zip(NAMES, (prompt, chat))}
print(f"{len(sealed_blocks)} of the {len(in_use)} blocks in use are sealed and hittable; the two tail blocks "
      f"{list(tails.values())} are partial, so not sealed.")
viz.check(not any(manager.is_cached(b) for b in tails.values()),
          f"a tail block is sealed: {[n for n, b in tails.items() if manager.is_cached(b)]} ended exactly on a "
          f"block boundary (its length is a multiple of BLOCK_SIZE={BLOCK_SIZE}), so its last block is full",
          defaults=DEFAULTS)

# %% [markdown]
# ## 4. Admission: OK, LATER, NEVER
#
# Before allocating, a scheduler asks `can_allocate`. A request that fits the free blocks is `OK`; one
# that fits the pool but not the free blocks must wait for others to finish (`LATER`); one bigger than the
# whole pool can never run (`NEVER`). (Notebook 10a adds the *watermark*, a reserve of free blocks kept for
# running sequences to grow into.)

# %%
free_now = manager.num_free_blocks
requests = {"fits": max(1, free_now), "waits": free_now + 1, "never": manager.num_blocks + 1}  # in blocks
answers = {}
for k, (name, blocks) in enumerate(requests.items()):
    seq = Sequence(range(1000 * (k + 1), 1000 * (k + 1) + blocks * BLOCK_SIZE), BLOCK_SIZE)
    answers[name] = manager.can_allocate(seq)
    print(f"a {seq.num_tokens}-token request needs {seq.num_blocks} blocks with {free_now} free of "
          f"{manager.num_blocks}: {answers[name].name}")
viz.check(list(answers.values()) == [AllocStatus.OK, AllocStatus.LATER, AllocStatus.NEVER],
          f"no free block was left (free: {free_now}), so even a one-block request must wait" if free_now == 0
          else f"unexpected answers {[a.name for a in answers.values()]}", defaults=DEFAULTS)

# %% [markdown]
# ## 5. Freeing
#
# When `chat` finishes, `free(chat)` drops its references. Its blocks return to the free list, but the
# sealed ones keep their content and stay hittable (**warm**, amber) until the pool reuses them:
# never-cached blocks are reused first, then warm ones, least recently freed first.

# %%
chat_blocks = list(chat.block_table)
phases.append((len(manager.events), "free(chat)"))
manager.free(chat)
viz.draw_pool(manager, title="after free(chat): its sealed blocks are warm")
plt.show()
warm = [b for b in chat_blocks if manager.is_cached(b)]
order = manager.free_block_ids()
print(f"chat's {len(chat_blocks)} blocks are free again; {len(warm)} of them ({warm}) stay cached. "
      f"Reuse order starts with {order[:3]}... and the warm ones come last: positions "
      f"{[order.index(b) for b in warm]} of {len(order)}.")
assert chat.status.name == "FINISHED" and set(order[len(order) - len(warm):]) == set(warm)  # any knobs

# %% [markdown]
# > **In vLLM.** This reuse order is a blend of vLLM's two engines. **V0** (the original engine, removed in
# > 2025; read it at a tag such as `v0.8.5`) hands out never-cached free blocks first and only then evicts a
# > cached one, least recently *accessed* first (`vllm/core/block/prefix_caching_block.py`,
# > `vllm/core/evictor.py`). **V1** (today's engine) keeps a single free queue: a finished request appends its
# > blocks tail first, and allocation pops from the head, so a never-cached block freed recently is reused
# > *after* older cached ones (`FreeKVCacheBlockQueue` in `vllm/v1/core/kv_cache_utils.py`, `BlockPool` in
# > `vllm/v1/core/block_pool.py`; the design doc is docs.vllm.ai, *Automatic Prefix Caching*). Notebook 02
# > shows why the order matters.

# %% [markdown]
# ## 6. The whole story as a timeline
#
# With `record_events=True` the manager logs every step of its work. Each row is one kind of event, each
# square one event, in the order they happened; the shaded bands group the events by the call that caused
# them. A square's label is the physical block it concerns, or the sequence for `allocate` and `free`:
#
# * `miss`: a prompt block that was not in the cache, so it got a fresh block (`hit` would reuse one);
# * `seal`: a block became full, was hashed and is now hittable;
# * `allocate`: a prompt has all its blocks (logged after its misses);
# * `append`: a decode step needed a new block;
# * `release`: a block's reference count dropped to zero (it is free, maybe still warm);
# * `free`: a sequence gave back all its blocks (logged after its releases, tail first).

# %%
viz.draw_timeline(manager, names={prompt.seq_id: "prompt", chat.seq_id: "chat"}, phases=phases,
                  title="everything this notebook's manager did")
plt.show()

# %% [markdown]
# ## 7. What paging saves
#
# A contiguous allocator must reserve each request's maximum length up front; a paged one holds
# `ceil(tokens / block_size)` blocks. We draw 500 requests whose total length (prompt + output) is
# log-normal with mean about 500 tokens (our choice, roughly ShareGPT-sized: 161 + 338 tokens on average in
# the PagedAttention paper), capped at a 2048-token context, and let a real `BlockManager` allocate each
# one at its final length to count blocks.

# %%
MAX_LEN = 2048
SIGMA = 0.8        # spread of the log-normal lengths: try 0.3 (similar lengths) or 1.5 (a long tail)
lengths = np.minimum(MAX_LEN, np.maximum(1, rng.lognormal(np.log(500) - SIGMA**2 / 2, SIGMA, 500).astype(int)))


def paged_slots(block_size: int) -> int:
    """Slots a paged allocator holds for all requests at their final length (one request at a time)."""
    pool = BlockManager(MAX_LEN // block_size + 1, block_size, enable_prefix_caching=False)
    total = 0
    for n in lengths:
        seq = Sequence(np.arange(n), block_size)
        pool.allocate(seq)
        total += len(seq.block_table) * block_size
        pool.free(seq)
    return total


tokens = int(lengths.sum())
block_sizes = [1, 8, 16, 32, 64, 128, 256]
waste = {f"paged, block {bs}": 1 - tokens / paged_slots(bs) for bs in block_sizes}
waste = {f"contiguous, reserve {MAX_LEN}": 1 - tokens / (MAX_LEN * len(lengths)), **waste}
fig, ax = plt.subplots(figsize=(8, 3.2))
bars = ax.barh(list(waste), [100 * w for w in waste.values()], color=["#d1495b"] + ["#4e79a7"] * len(block_sizes))
ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("reserved KV slots holding no token (%)")
ax.set_title(f"{len(lengths)} requests, mean length {lengths.mean():.0f} tokens: the share of reserved memory "
             "left empty", fontsize=10)
plt.show()
contiguous_waste = waste[f"contiguous, reserve {MAX_LEN}"]
# Laws behind the Try-it below, whatever SIGMA: a paged request wastes at most one partial block, and the
# contiguous bar is 1 - mean / MAX_LEN.
viz.check(all(paged_slots(bs) - tokens <= len(lengths) * (bs - 1) for bs in block_sizes)
          and abs(contiguous_waste - (1 - lengths.mean() / MAX_LEN)) < 1e-9,
          "a paged request wasted more than one partial block, or the contiguous bar is not 1 - mean / MAX_LEN",
          defaults=True)
viz.check(contiguous_waste > max(w for name, w in waste.items() if name.startswith("paged")),
          f"a paged bar ({max(waste.values()):.0%}) is not below the contiguous one ({contiguous_waste:.0%}): "
          f"SIGMA={SIGMA} makes requests so long that whole {MAX_LEN}-token reservations are nearly full",
          defaults=DEFAULTS and SIGMA == 0.8)
print(f"Reserving {MAX_LEN} slots per request leaves {100 * waste[f'contiguous, reserve {MAX_LEN}']:.0f}% of them "
      f"empty; paging with 16-token blocks leaves {100 * waste['paged, block 16']:.1f}% empty (only the last, "
      f"partial block of each request), and even 256-token blocks leave {100 * waste['paged, block 256']:.0f}%.")

# %% [markdown]
# **Try it.** Predict first, then change `SIGMA` above to 0.3 and to 1.5 and rerun this section: which bars
# move, and which hardly do? A paged request wastes at most one partial block, whatever its length, so the
# paged bars depend on the block size and barely on the spread; the contiguous bar is `1 - mean / 2048`, so
# it moves only with the mean length. (Notebook 07 runs the same comparison on real request lengths.)

# %% [markdown]
# ## Takeaways
#
# * A block table maps a sequence's logical blocks to physical blocks anywhere in the pool; the kernel sees
#   it as slots, `block * block_size + offset`.
# * A sequence takes a new block only when its last block is full, so at most `block_size - 1` slots per
#   sequence are empty, instead of everything up to the maximum length.
# * Full blocks are sealed and stay cached after `free`: that is the starting point of prefix caching
#   (notebook 02) and of sharing between forks (notebook 03a).
