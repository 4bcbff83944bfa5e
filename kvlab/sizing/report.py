"""``kvlab size``'s text: a ``Sizing`` (``kvlab.sizing.plan``) with the arithmetic of every figure."""

from collections import Counter

from kvlab.sizing.groups import KERNEL_BLOCK_ALIGNMENT, aligned_block_size
from kvlab.sizing.plan import Pool, Sizing

ASSUMPTIONS = ("assumptions: the budget is gpu_memory_utilization of the GPU's memory; weights as stated above; "
               "activations are kvlab's engine's bound (2 x batched tokens x (3 hidden + (heads + 2 kv heads) x "
               "head_dim + 2 intermediate) x dtype bytes, plus fp32 logits x 3 per sequence); a sliding-window "
               "group holds cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1 blocks "
               "per request (vLLM's bound, chunked prefill included).")
HYBRID = ("hybrid model: kvlab's engine lays the cache out as vLLM V1 does: layers of one kind are cut into "
          "groups of group-size layers, and each of group-size cache tensors is shared by one layer of every "
          "group, so a block id costs a page in only group-size layers, a request takes blocks in every group, "
          "and the blocks a window group releases are memory every group can take. Every layer as full "
          "attention (vLLM's --disable-hybrid-kv-cache-manager) is shown for comparison.")
STATE = ("hybrid state model: each state layer keeps one fixed state per request (no prefix-cache hits are "
         "counted), in a page padded to the attention page, as vLLM lays it out; kvlab's engine does not serve "
         "these models, so these are vLLM V1's figures only.")

def _size(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (``2.00 MiB``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:,.0f} B"


def _bytes(n: int) -> str:
    return f"{n:,} B ({_size(n)})"


def _kind(spec) -> str:
    return "state" if spec.kind == "mamba" else "full" if spec.sliding_window is None else f"sliding {spec.window}"


def describe_layers(s: Sizing) -> str:
    layout, shape = s.layout, s.shape
    kinds = [f"{layout.full_layers} full attention"] if layout.full_layers else []
    kinds += [f"{count} sliding-window ({window} tokens)" for window, count in layout.windows.items()]
    if shape.state_layers:
        beside = ", beside the attention in the same layers" if shape.parallel_state else ""
        kinds.append(f"{len(shape.state_layers)} Mamba / linear attention (a fixed state per request{beside})")
    heads = (f"MLA: one latent of {layout.mla_latent_dim} per token for {shape.num_heads} heads"
             if layout.mla_latent_dim else f"{shape.num_heads} query heads share {shape.num_kv_heads} kv heads")
    architecture = f" ({shape.architecture})" if shape.architecture else ""
    return (f"{shape.name}: {shape.model_type}{architecture}, {shape.num_layers} layers: "
            f"{', '.join(kinds)}; {heads}")


def _token_lines(s: Sizing) -> list[str]:
    layout, per_layer, n = s.layout, s.layout.bytes_per_token_per_layer, s.max_model_len
    lines = [f"per token and layer: {layout.per_layer_formula()}",
             f"per token, model:    {per_layer:,} B x {layout.num_layers} layers = {_bytes(layout.bytes_per_token)}"
             + (" while every window still holds the token" if layout.windows else "")]
    if layout.windows:
        lines += [f"  past the windows:  {per_layer:,} B x {layout.full_layers} full-attention layers = "
                  f"{_bytes(layout.bytes_per_token_past_windows)}: a sliding-window layer keeps at most its window",
                  f"  one request of {n:,} tokens, token-exact: {_bytes(layout.bytes_for_tokens(n))}, against "
                  f"{_size(layout.bytes_per_token * n)} if every layer kept every token"]
    return lines


def _state_lines(s: Sizing) -> list[str]:
    if not s.state_bytes:
        return []
    page, b, token = s.layout.page_bytes(s.block_size), s.block_size, s.layout.bytes_per_token_per_layer
    n, layers = KERNEL_BLOCK_ALIGNMENT, len(s.shape.state_layers)
    needed = aligned_block_size(s.state_bytes, token, 1)
    return [f"state per request and state layer: {s.state_formula}",
            f"state per request, model: {s.state_bytes:,} B x {layers} state layers = "
            f"{_bytes(s.state_bytes * layers)}",
            f"attention block size: {b:,} tokens; a page must hold a state: {n} x cdiv({s.state_bytes:,} B, {n} x "
            f"{token:,} B) = {needed:,} tokens at least (vLLM's alignment), {s.requested_block_size:,} asked for; "
            f"a state page is padded from {s.state_bytes:,} B to {page:,} B"]


def _block_lines(s: Sizing) -> list[str]:
    page, b = s.layout.page_bytes(s.block_size), s.block_size
    lines = [*_state_lines(s), f"per page (one layer, one block of {b} tokens): "
             f"{s.layout.bytes_per_token_per_layer:,} B x {b} = {page:,} B"]
    for pool in s.pools:
        config = pool.config
        if len(config.groups) == 1:
            where = f"a page in each of the {config.group_size} layers"
        else:
            padding = (f" ({config.padding_layers} padding layer{'s' * (config.padding_layers != 1)})"
                       if config.padding_layers else "")
            where = (f"{len(config.groups)} groups of {config.group_size} layers{padding}, a page in each of "
                     f"the {config.group_size} tensors they share")
        lines.append(f"per block id, {pool.name}: {page:,} B x {config.group_size} = "
                     f"{_bytes(pool.bytes_per_block)}; {where}")
    return lines


def _memory_lines(s: Sizing) -> list[str]:
    lines = [f"memory: {_size(s.gpu_memory)} x {s.gpu_memory_utilization:g} gpu_memory_utilization = "
             f"{_size(s.gpu_memory * s.gpu_memory_utilization)}",
             f"  - weights      {_size(s.weights):>12}  ({s.weights_source})",
             f"  - activations  {_size(s.activations):>12}  (a bound for {s.max_num_batched_tokens:,} batched "
             f"tokens and {s.max_num_seqs} sequences)"]
    if s.window_bytes:
        lines.append(f"  - KIVI windows {_size(s.window_bytes):>12}  (the newest tokens in full precision beside the "
                     f"pages: {s.window_formula})")
    lines.append(f"  = KV cache     {_size(s.kv_memory):>12}")
    if s.kv_memory <= 0:
        lines.append("  no room for the KV cache: the weights and activations"
                     + (" and KIVI windows" if s.window_bytes else "") + " take the whole budget")
    return lines


def _per_request(pool: Pool, s: Sizing) -> str:
    """The blocks a request holds, group by group: ``8,192 (full) + 6 x 577 (sliding 1024)``."""
    counts = Counter(group.attention for group in pool.config.groups)
    blocks = {group.attention: group.blocks_per_request(s.max_model_len, s.max_num_batched_tokens)
              for group in pool.config.groups}
    return " + ".join(f"{'' if count == 1 else f'{count} x '}{blocks[spec]:,} ({_kind(spec)})"
                      for spec, count in counts.items())


def _pool_lines(s: Sizing) -> list[str]:
    lines, b = [], s.block_size
    for pool in s.pools:
        groups = len(pool.config.groups)
        logged = (f"; vLLM logs 'KV cache size: {pool.num_blocks // groups * b:,} tokens', the blocks over its "
                  f"{groups} groups" if groups > 1 else "")
        lines += [f"{pool.name}: {_size(max(s.kv_memory, 0))} / {pool.bytes_per_block:,} B = "
                  f"{pool.num_blocks:,} blocks of {b} tokens ({pool.num_blocks * b:,} token slots{logged})",
                  f"  a request of {s.max_model_len:,} tokens holds {_per_request(pool, s)} = "
                  f"{pool.blocks_per_request:,} blocks: Maximum concurrency for {s.max_model_len:,} tokens per "
                  f"request: {pool.max_concurrency:.2f}x"]
    return lines


def format_sizing(s: Sizing, kv_dtype_note: str = "") -> str:
    lines = [describe_layers(s), f"KV cache dtype: {s.layout.dtype}{kv_dtype_note}", "", *_token_lines(s),
             *_block_lines(s), "", *_memory_lines(s), *_pool_lines(s), "", ASSUMPTIONS]
    return "\n".join(lines + ([HYBRID] if len(s.pools) > 1 else []) + ([STATE] if s.state_bytes else []))
