# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
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
# Setup. In a checkout (or CI) this uses the checkout's kvlab. On Colab it clones the repository (code and
# bundled traces) and installs kvlab's missing dependencies; Colab's torch and Triton are kept as they are.
import importlib.util
import subprocess
import sys
from pathlib import Path

KVLAB_REPO = "https://github.com/kvlab/kvlab"  # the repository this notebook comes from
if importlib.util.find_spec("kvlab") is None:
    checkout = Path.cwd().parent
    if not (checkout / "kvlab" / "__init__.py").is_file():  # not run from notebooks/ in a checkout
        checkout = Path.cwd() / "kvlab-repo"
        if not checkout.is_dir():
            subprocess.check_call(["git", "clone", "-q", "--depth", "1", KVLAB_REPO, str(checkout)])
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "-e", str(checkout)])
    sys.path.insert(0, str(checkout))

# %%
import matplotlib.pyplot as plt
import numpy as np

from kvlab import AllocStatus, BlockManager, Sequence, viz

rng = np.random.default_rng(0)
BLOCK_SIZE = 4  # tiny, so that every slot fits in a picture; servers use 16 or more

# %% [markdown]
# ## 1. A sequence and its logical blocks
#
# A `Sequence` is a list of token ids. Logical block `i` holds positions `[i * block_size, (i + 1) *
# block_size)`; only the last block can be partial.

# %%
prompt = Sequence([17, 4, 99, 23, 8, 61, 5, 42, 11, 70], block_size=BLOCK_SIZE)
viz.draw_tokens(prompt, names=["prompt"], title="a 10-token prompt in logical blocks of 4 (dashed: empty slots)")
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
manager = BlockManager(num_blocks=12, block_size=BLOCK_SIZE, record_events=True)
print("can_allocate:", manager.can_allocate(prompt).name)
manager.allocate(prompt)
viz.draw_block_tables(manager, [prompt], title="after allocate(prompt)")
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
assert slot == table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE

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
chat = Sequence(rng.integers(100, 200, size=5), BLOCK_SIZE)
manager.allocate(chat)
steps = [viz.snapshot(manager, [prompt, chat], "prompt and chat allocated")]
seal_events_before = sum(e.kind == "seal" for e in manager.events)
num_steps = 9
for step in range(num_steps):
    blocks_before = manager.num_free_blocks
    for seq in (prompt, chat):
        seq.append_token(int(rng.integers(200, 300)))
        copies = manager.append_slots(seq)
        assert copies == []  # nothing is shared here, so nothing is copied on write
    if manager.num_free_blocks < blocks_before:
        steps.append(viz.snapshot(manager, [prompt, chat], f"decode step {step + 1}: took a new block"))
steps.append(viz.snapshot(manager, [prompt, chat], f"after {num_steps} decode steps"))
viz.show_steps(steps, ncols=2)
plt.show()

# %%
new_blocks = sum(e.kind == "append" for e in manager.events)
sealed = sum(e.kind == "seal" for e in manager.events) - seal_events_before
empty_slots = sum(len(s.block_table) * BLOCK_SIZE - s.num_tokens for s in (prompt, chat))
print(f"In {num_steps} steps the two sequences generated {2 * num_steps} tokens and took only {new_blocks} new "
      f"blocks; {sealed} blocks filled up and were sealed on the way.")
print(f"Right now {empty_slots} slots are allocated but empty: at most block_size - 1 = {BLOCK_SIZE - 1} per "
      "sequence, in its last block.")
print(f"prompt's table: {prompt.block_table}; chat's table: {chat.block_table} (interleaved in the pool).")

# %% [markdown]
# A sealed block is immutable and *cached*: a prefix lookup could hit it from now on (the gold dot). The
# last, partial block of each sequence is not.

# %%
viz.draw_pool(manager, title="the pool after decoding (gold dot: sealed and cached)")
plt.show()
sealed_blocks = [b for b in prompt.block_table + chat.block_table if manager.is_cached(b)]
print(f"{len(sealed_blocks)} of the {len(prompt.block_table) + len(chat.block_table)} blocks in use are sealed "
      f"and hittable; the two partial tail blocks, {prompt.block_table[-1]} and {chat.block_table[-1]}, are not.")
assert not manager.is_cached(prompt.block_table[-1]) and not manager.is_cached(chat.block_table[-1])

# %% [markdown]
# ## 4. Admission: OK, LATER, NEVER
#
# Before allocating, a scheduler asks `can_allocate`. A request that fits the free blocks is `OK`; one
# that fits the pool but not the free blocks must wait for others to finish (`LATER`); one bigger than the
# whole pool can never run (`NEVER`).

# %%
free_now = manager.num_free_blocks
fits = Sequence(range(1000, 1000 + free_now * BLOCK_SIZE), BLOCK_SIZE)
waits = Sequence(range(2000, 2000 + (free_now + 1) * BLOCK_SIZE), BLOCK_SIZE)
never = Sequence(range(3000, 3000 + (manager.num_blocks + 1) * BLOCK_SIZE), BLOCK_SIZE)
for name, seq in (("fits", fits), ("waits", waits), ("never", never)):
    print(f"a {seq.num_tokens}-token request needs {seq.num_blocks} blocks with {free_now} free of "
          f"{manager.num_blocks}: {manager.can_allocate(seq).name}")
assert [manager.can_allocate(s) for s in (fits, waits, never)] == [AllocStatus.OK, AllocStatus.LATER,
                                                                    AllocStatus.NEVER]

# %% [markdown]
# ## 5. Freeing
#
# When `chat` finishes, `free(chat)` drops its references. Its blocks return to the free list, but the
# sealed ones keep their content and stay hittable (**warm**, amber) until the pool reuses them: never-cached
# blocks are reused first, then warm ones, least recently freed first.

# %%
chat_blocks = list(chat.block_table)
manager.free(chat)
viz.draw_pool(manager, title="after free(chat): its sealed blocks are warm")
plt.show()
warm = [b for b in chat_blocks if manager.is_cached(b)]
order = manager.free_block_ids()
print(f"chat's {len(chat_blocks)} blocks are free again; {len(warm)} of them ({warm}) stay cached. "
      f"Reuse order starts with {order[:3]}... and the warm ones come last: positions "
      f"{[order.index(b) for b in warm]} of {len(order)}.")
assert chat.status.name == "FINISHED" and set(order[-len(warm):]) == set(warm)

# %% [markdown]
# ## 6. The whole story as a timeline
#
# With `record_events=True` the manager logs every step: `miss` (a new block for a prompt), `seal`,
# `allocate`, `append` (a new block during decode), `release` (a block's ref count reached 0), `free`.

# %%
viz.draw_timeline(manager, title="events of this notebook's manager")
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
sigma = 0.8
lengths = np.minimum(MAX_LEN, np.maximum(1, rng.lognormal(np.log(500) - sigma**2 / 2, sigma, 500).astype(int)))


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
waste = {"contiguous, reserve 2048": 1 - tokens / (MAX_LEN * len(lengths)), **waste}
fig, ax = plt.subplots(figsize=(8, 3.2))
bars = ax.barh(list(waste), [100 * w for w in waste.values()], color=["#d1495b"] + ["#4e79a7"] * len(block_sizes))
ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
ax.invert_yaxis()
ax.set_xlabel("reserved KV slots holding no token (%)")
ax.set_title(f"{len(lengths)} requests, mean length {lengths.mean():.0f} tokens")
plt.show()
print(f"Reserving {MAX_LEN} slots per request leaves {100 * waste['contiguous, reserve 2048']:.0f}% of them empty; "
      f"paging with 16-token blocks leaves {100 * waste['paged, block 16']:.1f}% empty (only the last, partial "
      f"block of each request), and even 256-token blocks leave {100 * waste['paged, block 256']:.0f}%.")

# %% [markdown]
# ## Takeaways
#
# * A block table maps a sequence's logical blocks to physical blocks anywhere in the pool; the kernel sees
#   it as slots, `block * block_size + offset`.
# * A sequence takes a new block only when its last block is full, so at most `block_size - 1` slots per
#   sequence are empty, instead of everything up to the maximum length.
# * Full blocks are sealed and stay cached after `free`: that is the starting point of prefix caching
#   (notebook 02) and of sharing between forks (notebook 03).
