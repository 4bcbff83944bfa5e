# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: -jupytext.text_representation,-kernelspec
# ---

# %% [markdown]
# # 13 · Speculative decoding on a paged cache
#
# A decode step computes one token per sequence, and on a GPU it is bound by reading the weights, not by
# arithmetic: checking five tokens costs about what producing one does. **Speculative decoding** uses that. A
# cheap *proposer* guesses the next k tokens (the *drafts*), one forward pass of the target model computes all
# of them at once, and the sequence keeps the longest run of drafts the target agrees with, plus one token of
# the target's own. With greedy decoding the text is exactly what plain decoding produces; only the number of
# steps changes.
#
# The paged cache is where it gets delicate. Drafts need KV slots before anyone knows whether they are right,
# the forward pass writes their K/V, and then some of those slots hold K/V of tokens the sequence never had.
# Prefix caching must never hand such a block to another request. This notebook shows where drafts live in a
# block table, the wrong prefix hit that an unverified block would cause, what speculation costs and buys on
# the real SmolLM2-135M-Instruct, and why vLLM's EAGLE drafters give up one block of every prefix hit.
#
# **Objectives.** After this notebook you can:
# 1. draw a block table during a speculative step: drafts in slots after the last token, then after
#    verification the accepted drafts' K/V kept, the rejected slots left to be overwritten, and the target's own
#    token waiting for its slot (the *recovered* token in a rejected draft's place, or the *bonus* token after a
#    run whose every draft was accepted);
# 2. explain why a block holding an unverified token must never be hashed, with the wrong hit it would cause;
# 3. measure acceptance against k and against the workload (text the answer copies vs plain chat), and weigh
#    what speculation costs in KV slots written for rejected drafts against what it saves in decode steps;
# 4. say why vLLM drops the last matched block of a prefix hit under EAGLE/MTP, and why a model-free proposer
#    does not have to.

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
KVLAB_EXTRAS = "engine"  # pyproject.toml's extras this notebook uses ("": kvlab's core only)
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
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import torch
from IPython.display import display
from matplotlib.patches import Patch
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from kvlab import BlockManager, Sequence
from kvlab.course import answer
from kvlab.device import DEVICE, ON_GPU
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.chat import render
from kvlab.engine.proposers import PROPOSERS, NgramProposer
from kvlab.engine.random_model import save_random_model
from kvlab.engine.speculative import accept
from kvlab.models import ModelFetchError, ModelFolderError, smollm2
from kvlab.viz import check, draw_tokens, snapshot, snapshot_grid

# Knobs: change them and run the notebook again. Checks that hold only for the defaults say what changed.
BS = 4              # block size of the pictures in sections 1-2 (small, so every slot shows)
K_PICTURE = 6       # drafts in the picture
K = 4               # num_speculative_tokens of the engine runs in section 3
KS = range(1, 9)    # the k swept in section 3
BLOCK_SIZE = 16     # the engine's block size
# New tokens per request (every CPU decode step runs all 30 layers): chat answers are cut shorter, they only
# need to show that prompt lookup finds little to propose there.
MAX_TOKENS = {"copy-heavy": 128, "chat": 128} if ON_GPU else {"copy-heavy": 32, "chat": 16}
# Options of the proposers that have any (the others run with their defaults). vLLM's default n is 5 for both
# bounds; these short prompts match better with n from 4 down to 2.
PROPOSER_OPTIONS = {"ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}}
DEFAULTS = (BS, K_PICTURE, K, BLOCK_SIZE) == (4, 6, 4, 16)
print(f"the engine runs on {DEVICE} (torch attention on a CPU); proposers: {sorted(PROPOSERS)}")

# %% [markdown]
# ## 1. Drafts in the block table, before and after verification
#
# A toy first, so that every slot fits on the screen: words for tokens, blocks of `BS = 4`. Sequence A's prompt
# is *"the cat sat on the mat . the cat"*; its prefill computed those 9 tokens and sampled *"sat"*. Now a
# speculative step. The n-gram proposer (prompt lookup, vLLM's `method="ngram"`) finds the context's last
# words *"the cat sat"* earlier in the context and proposes what followed them there: *"on the mat . the cat"*.
# `append_slots(seq, num_draft_tokens=6)` gives the sampled token and the six drafts slots (positions 9 to 15),
# and the forward pass writes K/V into all of them.
#
# We keep a **fake KV store** beside the manager: a dict from slot to the token whose K/V that slot holds.
# `forward` writes it the way the real pass writes K/V, through the manager's slot mapping.

# %%
WORDS = "the cat sat on mat . rug end".split()
ID = {word: i + 1 for i, word in enumerate(WORDS)}   # token ids 1..8
WORD = {i: word for word, i in ID.items()}


def ids(text):
    return [ID[word] for word in text.split()]


manager = BlockManager(num_blocks=10, block_size=BS)
kv = {}   # the fake KV store: slot -> the token whose K/V the slot holds


def forward(seq, start, tokens):
    """What a forward pass does to the cache: position start + i gets the K/V of tokens[i]."""
    for slot, token in zip(manager.slot_mapping(seq, start, start + len(tokens)), tokens):
        kv[slot] = token


seq = Sequence(ids("the cat sat on the mat . the cat"), BS)
manager.allocate(seq)
forward(seq, 0, seq.token_ids)            # the prefill: K/V of the 9 prompt tokens
seq.append_token(ID["sat"])               # ...and the token it sampled (no K/V yet)

drafts = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=3).propose(seq.token_ids, K_PICTURE)
first = seq.num_computed_tokens           # 9: the sampled token's position
manager.append_slots(seq, num_draft_tokens=len(drafts))
scheduled = seq.token_ids + drafts        # what this step computes: the token and its drafts
forward(seq, first, scheduled[first:])
table = list(seq.block_table)
before = snapshot(manager, [seq], "before verification", names=["A"])
hashed_before = [manager.is_cached(block) for block in table]
print("drafts:", " ".join(WORD[t] for t in drafts), f"| positions with slots: {seq.num_computed_tokens}, "
      f"of which drafts: {seq.num_draft_tokens} | hashed blocks: {hashed_before}")
check(hashed_before == [True, True, False, False],
      "before verification only the two prompt blocks are hashed: blocks 2 and 3 hold drafts", defaults=DEFAULTS)

# %% [markdown]
# **Verification.** Logit row i of the pass is the target's distribution for the token after the context and
# the first i drafts, so row i checks draft i + 1 (`kvlab.engine.speculative.accept`). Say the target's greedy
# choices are *"on the rug"*: drafts *"on"* and *"the"* are accepted, *"mat"* is rejected, and the target's own
# token for that row, *"rug"*, is kept instead (vLLM calls it the **recovered** token; after a run whose every
# draft is accepted the target's next token is the **bonus** token): one more token than drafts accepted, every
# step. Rows past the first rejection were computed after a wrong
# draft and are ignored. The engine then appends the kept tokens and calls `accept_drafts(seq, 2)`.

# %%
TARGET = ids("on the rug . the end .")   # row i's argmax (rows 3.. follow a rejected draft: never read)
logits = torch.full((len(drafts) + 1, len(WORDS) + 1), -10.0)
logits[torch.arange(len(drafts) + 1), torch.tensor(TARGET)] = 10.0
kept = accept(logits, tuple(drafts), SamplingParams(temperature=0), None)
num_accepted = len(kept) - 1
for token in kept[:num_accepted]:
    seq.append_token(token)
manager.accept_drafts(seq, num_accepted)    # K/V of accepted drafts stays; the counter rolls back past the rest
seq.append_token(kept[-1])                  # the target's own token: its K/V is written by the next step
after = snapshot(manager, [seq], "after verification", names=["A"])
hashed_after = [manager.is_cached(block) for block in seq.block_table]
print("kept:", " ".join(WORD[t] for t in kept), f"| verified positions: {seq.num_computed_tokens} | hashed: "
      f"{hashed_after}")
check(seq.block_table == tuple(table) and hashed_after == [True, True, True, False] and num_accepted == 2,
      "verification takes no block and copies no K/V: block 2 (now verified) is hashed, block 3 is not",
      defaults=DEFAULTS)
slot_12 = manager.slot_mapping(seq, 12, 13)[0]
check(seq.num_computed_tokens == 12 and WORD[seq.token_ids[12]] == "rug" and WORD[kv[slot_12]] == "mat",
      "the text below says: num_computed_tokens rolled back to 12, and position 12 is 'rug' while its slot still "
      "holds 'mat''s K/V", defaults=DEFAULTS)
manager.check_invariants()

# %% [markdown]
# The picture: one row per moment, one cell per slot, the words in them being what the **cache** holds there
# (the fake store). Above each block, its physical id and whether the prefix cache can hit it. Below, the same
# two moments as block tables over the pool (`kvlab.viz.snapshot_grid`): verification changed no table entry
# and took no block.

# %%
LOOK = {"verified": "#4e79a7", "this step": "#a0cbe8", "draft": "#f2b447", "accepted": "#59a14f",
        "rejected": "#e15759", "target's token": "#b07aa1", "empty": "white"}


def slot_rows(tokens, looks, stored, label):
    """One draw_tokens row: a proxy sequence of ``tokens`` (its block structure) with each slot's colour and
    text replaced by its look and what the cache holds there (``stored`` per position, None: nothing yet)."""
    return dict(seq=Sequence(tokens, BS), looks=looks, stored=stored, label=label)


def draw_rows(rows, tables, hashed, title):
    fig, ax = plt.subplots(figsize=(10, 1.4 * len(rows) + 0.8))
    proxies = [row["seq"] for row in rows]
    captions = {r: [f"block {b}: " + ("hashed" if hashed[r][i] else "not hashed")
                    for i, b in enumerate(tables[r])] for r in range(len(rows))}
    draw_tokens(proxies, ax, captions=captions, names=[row["label"] for row in rows], title=title)
    for patch in ax.patches:   # draw_tokens names each slot "slot-<row>-<position>"
        _, r, p = patch.get_gid().split("-")
        patch.set_facecolor(LOOK[rows[int(r)]["looks"][int(p)]])
    for text in ax.texts:
        if (gid := text.get_gid() or "").startswith("token-"):
            _, r, p = gid.split("-")
            stored = rows[int(r)]["stored"][int(p)]
            text.set_text("·" if stored is None else WORD[stored])
            text.set_fontsize(6.5)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#444444", label=k) for k, c in LOOK.items() if k != "empty"],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    return ax


slots = [table[p // BS] * BS + p % BS for p in range(len(scheduled))]
stored = [kv.get(slot) for slot in slots]
looks_before = ["verified"] * first + ["this step"] + ["draft"] * len(drafts)
looks_after = (["verified"] * first + ["verified"] + ["accepted"] * num_accepted + ["target's token"]
               + ["rejected"] * (len(drafts) - num_accepted - 1))
picture = [slot_rows(scheduled, looks_before, stored, "before"), slot_rows(scheduled, looks_after, stored, "after")]
draw_rows(picture, [table, table], [hashed_before, hashed_after], "A's slots: what the cache holds (purple: 'rug' is kept, its slot still holds "
          "'mat' until the next step writes it)")
plt.show()
snapshot_grid([before, after], ncols=2)
plt.show()

# %% [markdown]
# Read it: before verification the drafts occupy slots 10-15 and blocks 2 and 3 are *not hashed*, although
# block 2's and block 3's slots are all written. After it, positions 10-11 are ordinary tokens whose K/V the
# verification pass already wrote (reused, never recomputed), so block 2 is complete and verified and is hashed
# at once. Position 12 is *"rug"* now, but its slot still holds *"mat"*'s K/V: the next step starts there
# (`num_computed_tokens` rolled back to 12) and overwrites it, and slots 13-15 later on. Nothing is freed: the
# table never shrinks, the rejected slots are simply reused.
#
# > **In vLLM.** V1 has no separate draft slots either: the scheduler schedules a request's drafts as new
# > tokens and `KVCacheManager.allocate_slots` (`vllm/v1/core/kv_cache_manager.py`) gives them slots, then caches
# > blocks only up to `min(num_computed + num_new_tokens, request.num_tokens)`: the comment there says it must
# > exclude "non-committable" tokens such as draft tokens that could be rejected, and drafts are not in
# > `request.num_tokens`. After the pass, `Scheduler.update_from_output` (`vllm/v1/core/sched/scheduler.py`)
# > subtracts the rejected drafts from `request.num_computed_tokens`, the roll-back shown here. kvlab does the
# > same with explicit calls, `append_slots(seq, num_draft_tokens=k)` and `accept_drafts(seq, num_accepted)`
# > (the docstring of `kvlab/blocks/group_manager.py` compares the two step by step).

# %% [markdown]
# ## 2. Why an unverified block must not be hashed: the wrong hit
#
# Suppose a manager hashed a block as soon as all its positions were scheduled, drafts included (as if drafts
# were tokens). At the speculative step above, block 3's positions held *"mat . the cat"*, so it would have
# published block 3 under the chain *"the cat sat on | the mat . the | cat sat on the | mat . the cat"*. At that
# instant the claim is even true: the pass just wrote those K/V. It turns false when the next steps overwrite
# the rejected slots. Let A decode four more plain steps (*"rug . the end"*), then send request B, whose prompt
# happens to be exactly what the drafts guessed.

# %%
naive_index = {tuple(scheduled[:(i + 1) * BS]): table[i] for i in range(len(scheduled) // BS)}  # chain -> block

for token in ids(". the end ."):          # four plain decode steps of A
    start = seq.num_computed_tokens
    manager.append_slots(seq)
    forward(seq, start, seq.token_ids[start:])
    seq.append_token(token)

b_prompt = ids("the cat sat on the mat . the cat sat on the mat . the cat sat")
naive_hits = []
for i in range(len(b_prompt) // BS):
    block = naive_index.get(tuple(b_prompt[:(i + 1) * BS]))
    if block is None:
        break
    naive_hits.append(block)
wrong = [(i, [WORD[kv[block * BS + j]] for j in range(BS)], [WORD[t] for t in b_prompt[i * BS:(i + 1) * BS]])
         for i, block in enumerate(naive_hits) if [kv[block * BS + j] for j in range(BS)] != b_prompt[i * BS:(i + 1) * BS]]
for i, holds, wants in wrong:
    print(f"naive manager: B's block {i} hits physical block {naive_hits[i]}, whose slots hold the K/V of "
          f"{' '.join(holds)!r}; B's prompt there says {' '.join(wants)!r}")

seq_b = Sequence(b_prompt, BS)
hit_tokens = manager.get_num_cached_tokens(seq_b)
manager.allocate(seq_b)                   # kvlab: share what the prefix cache can vouch for, compute the rest
kvlab_hits = list(seq_b.block_table[:hit_tokens // BS])
kvlab_wrong = [block for i, block in enumerate(kvlab_hits)
               if [kv[block * BS + j] for j in range(BS)] != b_prompt[i * BS:(i + 1) * BS]]
print(f"kvlab: B hits {hit_tokens} tokens (blocks {kvlab_hits}), every one holding B's own tokens; "
      f"it computes the other {len(b_prompt) - hit_tokens}")
check(len(naive_hits) == 4 and len(wrong) == 1 and hit_tokens == 12 and not kvlab_wrong,
      "the naive manager hits 4 blocks, one of them holding the wrong K/V; kvlab hits the 3 verified ones",
      defaults=DEFAULTS)
manager.check_invariants()

# %% [markdown]
# B would attend to keys and values of *"rug . the end"* at the positions of *"mat . the cat"*: no error, no
# crash, just a wrong answer, in somebody else's request. (A KV event published for that block would also
# have sent a router, notebook 12, after a block that never existed.) kvlab's manager never seals a block
# that holds an unverified position: block 3 was sealed only once all four of its tokens were A's real ones,
# under their real hash, so B's lookup for *"mat . the cat"* misses it and B computes those tokens itself.

# %%
def hit_looks(prompt, hits, holds_right):
    """Per logical block of ``prompt``: green = a right hit, red = a wrong hit, grey = computed."""
    n = -(-len(prompt) // BS)
    return [("#59a14f" if holds_right[i] else "#e15759") if i < len(hits) else "#dddddd" for i in range(n)]


right = {i: i not in {w[0] for w in wrong} for i in range(len(naive_hits))}
fig, ax = plt.subplots(figsize=(10, 2.6))
proxy = Sequence(b_prompt, BS)
draw_tokens([proxy, proxy], ax, names=["naive manager", "kvlab"],
            block_colors={0: hit_looks(b_prompt, naive_hits, right),
                          1: hit_looks(b_prompt, kvlab_hits, {i: True for i in range(len(kvlab_hits))})},
            captions={0: [f"hit block {b}" + ("" if right[i] else ": WRONG K/V") for i, b in enumerate(naive_hits)]
                      + ["computed"] * (proxy.num_blocks - len(naive_hits)),
                      1: [f"hit block {b}" for b in kvlab_hits] + ["computed"] * (proxy.num_blocks - len(kvlab_hits))},
            title="Request B's prompt: what each manager lets it reuse")
for text in ax.texts:
    if (gid := text.get_gid() or "").startswith("token-"):
        text.set_text(WORD[b_prompt[int(gid.split("-")[2])]])
        text.set_fontsize(6.5)
plt.show()

# %% [markdown]
# ## 3. Acceptance against k and against the workload, on a real model
#
# Now SmolLM2-135M-Instruct (`kvlab.models.smollm2()`, converted once from a PyPI wheel; without it a tiny
# random model, whose noise no proposer can guess) on two workloads of four prompts each:
#
# * **copy-heavy**: the answer repeats text from the prompt (correct a sentence, repeat one): prompt lookup's
#   home ground;
# * **chat**: open questions, whose answers quote nothing.

# %%
MODEL_DIR = None
try:
    MODEL_DIR = smollm2()
except (ModelFetchError, ModelFolderError) as e:
    print(f"SmolLM2 could not be had, so this run uses a tiny RANDOM model: its output is noise, and no proposer "
          f"guesses noise (acceptance near 0):\n{e}")
    MODEL_DIR = save_random_model(Path(tempfile.mkdtemp()) / "tiny", "tiny")
tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR) if (Path(MODEL_DIR) / "tokenizer_config.json").is_file() else None
CHAT = bool(getattr(tokenizer, "chat_template", None))
REAL = CHAT and DEFAULTS   # the checks below that depend on what SmolLM2 writes


def prompt_ids(text):
    if not CHAT:   # the random model has no tokenizer: bytes as token ids, behind a shared "system prompt"
        return list(range(100, 120)) + list(text.encode()[:40])
    return render(tokenizer, MODEL_DIR, [{"role": "user", "content": text}])[0][1]


WORKLOADS = {
    "copy-heavy": ["Correct the spelling in this sentence and write it out again: The quick brown fox jumpd over "
                   "the lazy dog and then the fox ran into the forrest to find its friends.",
                   "Repeat this sentence word for word: Paged attention stores the keys and values of every token "
                   "in fixed-size blocks, so memory is allocated on demand.",
                   "Copy this list exactly as it is: apples, bananas, cherries, dates, elderberries, figs, grapes, "
                   "kiwis, lemons, mangoes.",
                   "Fix the capital letters in this sentence and write it out again: the block manager keeps a "
                   "table of blocks for every sequence in the batch."],
    "chat": ["Why is the sky blue?", "Give me three tips for sleeping well.", "How do plants make their food?",
             "What should I pack for a weekend of hiking?"],
}
requests = [(workload, prompt_ids(text)) for workload, texts in WORKLOADS.items() for text in texts]
PROMPTS = [ids_ for _, ids_ in requests]
GREEDY = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[workload], ignore_eos=not CHAT)
          for workload, _ in requests]


def serve(speculative_config=None):
    """One engine on every prompt at once (greedy); returns the engine and its outputs."""
    llm = LLM(MODEL_DIR, block_size=BLOCK_SIZE, max_num_seqs=len(PROMPTS), speculative_config=speculative_config)
    return llm, llm.generate(PROMPTS, GREEDY, use_tqdm=False)


plain_llm, plain = serve()
outputs = [out.outputs[0].token_ids for out in plain]
for (workload, _), tokens in zip(requests, outputs):
    print(f"{workload:>10}: {tokenizer.decode(tokens)[:110]!r}" if CHAT else f"{workload:>10}: {tokens[:16]}")

# %% [markdown]
# **Greedy acceptance needs no second run.** Speculation never changes greedy output (the engine's tests check
# it token for token against plain decoding and HF transformers for every k from 1 to 8), so the output above
# *is* what every speculative run produces. Which drafts a model-free proposer makes at each step depends only
# on that text, and a draft is accepted exactly when it equals the next token of the output. So the whole run
# can be replayed without the model, for any k: `replay` does what the engine's scheduler and `accept` do,
# step by step. Below, the engine itself checks the replay.

# %%
def replay(prompt, output, proposer, k, max_tokens):
    """Greedy speculative decoding of ``output`` replayed without the model: (drafts proposed, drafts accepted,
    decode steps, steps that had drafts). As the engine: the first token comes from the prefill; each step asks
    for min(k, tokens left - 1) drafts, keeps the run that matches the output and one token more."""
    made, proposed, accepted, steps, drafting = list(output[:1]), 0, 0, 0, 0
    while len(made) < len(output):
        room = min(k, max_tokens - len(made) - 1)
        guess = proposer.propose(prompt + made, room)[:room] if room > 0 else []
        target = output[len(made):]
        n = 0
        while n < len(guess) and n < len(target) and guess[n] == target[n]:
            n += 1
        proposed, accepted, steps, drafting = proposed + len(guess), accepted + n, steps + 1, drafting + bool(guess)
        made += target[:n + 1]
    return proposed, accepted, steps, drafting


ngram = NgramProposer(**PROPOSER_OPTIONS["ngram"])
sweep = pd.DataFrame([dict(workload=workload, request=r, k=k, generated=len(outputs[r]),
                           plain_steps=len(outputs[r]) - 1,
                           **dict(zip(("proposed", "accepted", "steps", "drafting_steps"),
                                      replay(requests[r][1], outputs[r], ngram, k, MAX_TOKENS[workload]))))
                      for k in tqdm(KS, desc="replaying k") for r, (workload, _) in enumerate(requests)])
by_k = sweep.groupby(["workload", "k"])[["generated", "plain_steps", "proposed", "accepted", "steps"]].sum()
by_k["acceptance_rate"] = by_k.accepted / by_k.proposed.where(by_k.proposed > 0)
by_k["steps_saved"] = 1 - by_k.steps / by_k.plain_steps
by_k["rejected_slots_per_token"] = (by_k.proposed - by_k.accepted) / by_k.generated
display(by_k[["proposed", "accepted", "acceptance_rate", "steps", "steps_saved", "rejected_slots_per_token"]]
        .round(2))  # narrow enough for a laptop screen

# %% [markdown]
# The engine, once per proposer in `kvlab.engine.proposers.PROPOSERS` at `K` drafts: the same tokens as plain
# decoding, and the per-request metrics vLLM reports (drafts proposed and accepted, acceptance rate, mean
# accepted length, here also KV slots written for rejected drafts). For the n-gram proposer, the replay above
# must give the same counts, with one exception: when the output ends at the end-of-turn token in the middle of
# an accepted run, the engine still counts the drafts the target accepted after it (the stop ends the request
# there, `kvlab/engine/step_loop.py`), and the replay cannot see past the end of the text.

# %%
rows, engines = [], {}
for name in tqdm(sorted(PROPOSERS), desc="proposers"):
    config = {"method": name, "num_speculative_tokens": K, **PROPOSER_OPTIONS.get(name, {})}
    engines[name], outs = serve(config)
    same = [out.outputs[0].token_ids for out in outs] == outputs
    check(same, f"speculation with {name!r} changed greedy output: it must not", defaults=True)
    for r, ((workload, _), out) in enumerate(zip(requests, outs)):
        m = out.metrics
        rows.append(dict(proposer=name, workload=workload, request=r, proposed=m.num_draft_tokens,
                         accepted=m.num_accepted_tokens, drafting_steps=m.num_drafting_steps,
                         rejected_slots=m.num_rejected_draft_slots, mean_accepted_length=m.mean_accepted_length,
                         cached_prompt_tokens=m.num_cached_prompt_tokens))
engine_metrics = pd.DataFrame(rows)
per_workload = engine_metrics.groupby(["proposer", "workload"])[["proposed", "accepted", "rejected_slots"]].sum()
per_workload["acceptance_rate"] = per_workload.accepted / per_workload.proposed.where(per_workload.proposed > 0)
display(per_workload.round(2))

replayed = sweep[sweep.k == K].set_index("request")
measured = engine_metrics[engine_metrics.proposer == "ngram"].set_index("request")
stopped = pd.Series([out.outputs[0].finish_reason == "stop" for out in plain])
past_the_end = measured.accepted - replayed.accepted
check((replayed[["proposed", "drafting_steps"]] == measured[["proposed", "drafting_steps"]]).all().all()
      and (past_the_end >= 0).all() and (past_the_end[~stopped] == 0).all() and (past_the_end <= K).all(),
      "the replay must count exactly the drafts the engine proposed, and accepted up to the end of the text",
      defaults=True)

# %% [markdown]
# What each k buys and costs, per workload: the acceptance rate (accepted drafts over proposed ones, drawn only
# where at least `MIN_DRAFTS` drafts were proposed: a rate from a handful says little; each point is labelled
# with its count), the decode
# steps saved against plain decoding (one token per step), and the KV slots written for drafts that were
# rejected, per generated token. Those slots are the memory price: they are written and read by the
# verification pass and then overwritten; they never hold anything another request can hit.

# %%
MIN_DRAFTS = 20  # fewer proposed drafts than this: no acceptance rate drawn
fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
for workload, frame in by_k.groupby(level="workload"):
    ks = frame.index.get_level_values("k")
    enough = frame.proposed >= MIN_DRAFTS
    line, = axes[0].plot(ks[enough], frame.acceptance_rate[enough], "o-",
                         label=f"{workload} ({int(frame.proposed.sum())} drafts in all)")
    for k, rate, n in zip(ks[enough], frame.acceptance_rate[enough], frame.proposed[enough]):
        axes[0].annotate(f"{n}", (k, rate), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6.5,
                         color=line.get_color())
    axes[1].plot(ks, 100 * frame.steps_saved, "o-", label=workload)
    axes[2].plot(ks, frame.rejected_slots_per_token, "o-", label=workload)
for ax, ylabel, title in zip(axes, ["accepted / proposed", "% of plain decode steps", "slots per generated token"],
                             ["acceptance rate", "decode steps saved", "KV slots written for rejected drafts"]):
    ax.set(xlabel="k (num_speculative_tokens)", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
axes[0].set_ylim(0, 1.08)
axes[0].legend(fontsize=7, loc="lower left", title=f"n = drafts proposed (rates from >= {MIN_DRAFTS})",
               title_fontsize=7)
fig.suptitle(f"n-gram prompt lookup on {'SmolLM2-135M-Instruct' if CHAT else 'a tiny random model'}, "
             "greedy, replayed", fontsize=10)
plt.tight_layout()
plt.show()

copy, chat = by_k.loc["copy-heavy"], by_k.loc["chat"]
drafts_per_token = by_k.proposed / by_k.generated
check(copy.loc[K, "acceptance_rate"] > 0.5 and drafts_per_token["chat", K] < drafts_per_token["copy-heavy", K] / 2,
      "prompt lookup proposes far more, and is mostly right, where the answer copies the prompt", defaults=REAL)
check(copy.steps_saved.is_monotonic_increasing and copy.loc[KS[-1], "steps"] < copy.loc[1, "steps"]
      and chat.loc[K, "steps_saved"] < 0.1,
      "a longer k saves more steps on the copy-heavy prompts, and chat saves almost none", defaults=REAL)
check(copy.loc[KS[-1], "acceptance_rate"] < copy.loc[1, "acceptance_rate"]
      and (chat.proposed < MIN_DRAFTS).all() and chat.rejected_slots_per_token.mean()
      > 0.5 * copy.rejected_slots_per_token.mean(),
      "the copy-heavy rate falls with k; chat proposes too little to draw, yet wastes slots per token as "
      "copy-heavy does", defaults=REAL)

# %% [markdown]
# Read the three panels together. On the copy-heavy prompts most drafts are right, and each verification
# yields several tokens; the acceptance *rate* falls as k grows (the copied run ends somewhere, and the drafts
# after its end are wrong), while the steps saved keep growing slowly. On chat the proposer rarely finds a
# match at all: it proposes so little that its acceptance rate is left out (fewer than `MIN_DRAFTS` drafts at
# every k), and it saves almost no step; the slots its few wrong drafts write still cost about as much per
# generated token as the copy-heavy prompts'. The cost that the plot cannot
# show is time: a step that verifies k drafts computes k + 1 query rows per sequence. On a GPU in the
# memory-bound decode regime the extra rows cost little; on this notebook's CPU each row costs real arithmetic, which is
# why `python -m kvlab.bench engine --suite speculative` measures tokens per second rather than steps.
#
# **Per step**, the n-gram engine run's step records (`llm.step_dataframe()`): drafts verified in each step, how
# many were accepted, and the slots written for rejected ones.

# %%
records = engines["ngram"].step_dataframe()
steps = records[records.draft_tokens > 0]
fig, ax = plt.subplots(figsize=(10, 3))
ax.bar(steps.step, steps.accepted_tokens, color=LOOK["accepted"], label="accepted drafts")
ax.bar(steps.step, steps.rejected_draft_slots, bottom=steps.accepted_tokens, color=LOOK["rejected"],
       label="slots written for rejected drafts")
ax.set(xlabel="engine step", ylabel="draft tokens", title=f"Drafts per step, all {len(PROMPTS)} requests (n-gram, k={K})")
ax.legend()
ax.grid(alpha=0.3, axis="y")
plt.show()
plain_steps, spec_steps = len(plain_llm.step_records), len(engines["ngram"].step_records)
print(f"engine steps: {plain_steps} plain, {spec_steps} with n-gram k={K} (a batch runs until its slowest "
      f"request is done); peak blocks in use: {plain_llm.step_dataframe().blocks_used.max()} plain, "
      f"{records.blocks_used.max()} with speculation")

# %% [markdown]
# ## 4. Prefix hits under speculation, and vLLM's EAGLE last-block drop
#
# All the prompts start with the chat template's default system prompt, so a request can hit the blocks
# another one sealed (the table counts each request's prompt tokens read from the prefix cache). Speculation
# leaves those hits alone in kvlab: a prefix hit depends only on verified tokens, and a model-free proposer
# needs nothing from the hit blocks but their tokens.

# %%
hits = pd.DataFrame({"plain": [out.metrics.num_cached_prompt_tokens for out in plain]}
                    | {name: engine_metrics[engine_metrics.proposer == name].cached_prompt_tokens.tolist()
                       for name in sorted(PROPOSERS)},
                    index=[f"{workload} {r}" for r, (workload, _) in enumerate(requests)])
# What vLLM's rule for EAGLE-style drafters would leave: one block less of every hit.
hits["eagle rule"] = (hits.plain - BLOCK_SIZE).clip(lower=0)
display(hits)
check(all((hits[name] == hits.plain).all() for name in PROPOSERS),
      "speculation must not change a single prefix hit", defaults=True)

# %% [markdown]
# > **In vLLM: EAGLE and MTP give up the last matched block.** EAGLE-style drafters (EAGLE, EAGLE-3, MTP heads)
# > are small networks that take the **target's hidden states** as input, and a prefix hit skips exactly the
# > forward pass that would have produced them. So when a drafter of that family is on, vLLM's prefix lookup
# > drops the last matched block and recomputes it: in `vllm/v1/core/single_type_kv_cache_manager.py`,
# > `FullAttentionManager.find_longest_cache_hit` pops the last hit block when `use_eagle` is set ("Need to drop
# > the last matched block if eagle is enabled"; the base class's docstring: "drop the last matched block to
# > force recompute the last block to get the required hidden states for eagle drafting head"), and
# > `SlidingWindowManager` asks for one more contiguous block than the window needs, then drops it. It came
# > with PR #17137 ("Make eagle compatible with prefix caching"); later versions pass the flag from
# > `vllm/v1/core/kv_cache_coordinator.py` as `drop_eagle_block`.
# >
# > The price is one block per hit, and with small blocks nobody notices. Hybrid models are different: to
# > give every layer type the same page size, vLLM enlarges the attention block size, and one block becomes
# > thousands of tokens. vLLM #38182 (Qwen3.5-35B-A3B with MTP: "why does enabling MTP speculative decoding
# > actually reduce the prefix cache hit rate?"; PR #51769 quotes it as 92% -> 71%, confirmed by a maintainer
# > as expected behaviour) and #53670 (a hybrid Qwen3.8 layout with 1,648-token blocks: 97.5% -> 86.9-91.7%
# > hit rate with any EAGLE-family `speculative_config`, about 30-40% batch throughput lost to the recompute)
# > are this rule at work. The "eagle rule" column above is what it would leave of kvlab's hits; kvlab's
# > proposers are model-free (they read tokens only), so they need no hidden state and drop nothing.

# %% [markdown]
# ## 5. Exercise: what one verification keeps
#
# Back to section 1's toy: the proposer drafted *"on the mat . the cat"* after *"... the cat sat"*. Predict
# with greedy decoding: (a) if the target's choices were *"on the mat . the end ."*, how many drafts are
# accepted? (b) if the target agreed with all six drafts, how many tokens would the step add to the
# sequence? Edit the values and run the cell: it asks `kvlab.engine.speculative.accept`, the engine's own
# verification, with logits that make those choices.

# %%
PREDICTED_ACCEPTED = None    # (a) drafts accepted
PREDICTED_ALL_KEPT = None    # (b) tokens added when every draft is right


def verify(target_text):
    """The tokens one greedy verification keeps when the target's argmax after context + drafts[:i] is the
    i-th word of ``target_text``."""
    choices = (ids(target_text) + [ID["end"]] * len(drafts))[:len(drafts) + 1]  # one choice per logit row
    one_hot = torch.full((len(drafts) + 1, len(WORDS) + 1), -10.0)
    one_hot[torch.arange(len(drafts) + 1), torch.tensor(choices)] = 10.0
    return accept(one_hot, tuple(drafts), SamplingParams(temperature=0), None)


print("drafts:", " ".join(WORD[t] for t in drafts))
answer(PREDICTED_ACCEPTED, len(verify("on the mat . the end .")) - 1, "drafts are accepted up to the first "
       "disagreement: 'on the mat . the' agree, 'cat' against 'end' does not; 'end' is kept in its place.")
answer(PREDICTED_ALL_KEPT, len(verify("on the mat . the cat sat")), "six accepted drafts plus the target's own "
       "token after them (the bonus token, which exists only when every draft is accepted).")
check([WORD[t] for t in verify("on the mat . the end .")] == "on the mat . the end".split()
      and len(verify("on the mat . the cat sat")) == 7, "the answer below says: 5 drafts accepted and 'end' kept "
      "(6 tokens), and 7 tokens when all six drafts are right", defaults=DEFAULTS)

# %% [markdown]
# **Answer.** (a) 5 drafts accepted, and the step keeps 6 tokens (the 5 and the target's *"end"*); only one
# slot, the sixth draft's, held a rejected draft's K/V, and the next step overwrites it. (b) 7 tokens: every
# verification keeps its accepted drafts plus one token of the target's own, so a step with k drafts adds
# between 1 and k + 1 tokens. Going further: set `K = 8` in the knobs cell and compare the engine runs, or
# add a proposer of your own to `PROPOSERS` (a subclass of `kvlab.engine.proposers.Proposer` with a
# `propose(tokens, max_tokens)` method) and rerun section 3: the engine cell and its checks pick it up by
# name.

# %% [markdown]
# ## What you learned
#
# * Drafts get ordinary slots after the last token (`append_slots(seq, num_draft_tokens=k)`); verification
#   takes no block and copies no K/V: accepted drafts keep the K/V the verification pass wrote, rejected
#   slots are simply overwritten by the next step (`accept_drafts` rolls `num_computed_tokens` back).
# * A block that holds an unverified token is never hashed: a later request could otherwise hit K/V of
#   tokens the sequence never had (section 2's wrong hit).
# * One verification keeps the accepted drafts plus the target's own token, so greedy speculation writes
#   exactly the text of plain decoding in fewer steps. Prompt lookup pays off where the answer copies the
#   prompt, and costs KV slots written for rejected drafts, per generated token, where it guesses wrong.
# * vLLM's EAGLE/MTP drafters need the target's hidden states, so vLLM drops the last block of every prefix
#   hit to recompute them; a model-free proposer like kvlab's needs only tokens and drops nothing.
