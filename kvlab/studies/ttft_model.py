"""A TTFT model that prices both sides of a tier hit: recomputing the block, or copying it from the CPU tier.

A replay counts where each prompt block came from (kvlab.studies.tiers: GPU hit, tier hit, miss). What that is
worth in time to first token depends on what moving a block costs against computing it, and a simulator that
leaves the copy unpriced shows a tier's hits as pure gain (inference-sim #1699: offloading raised the hit rate,
not the latency). So, with stated assumptions (``TTFTModel``, every one a ``kvlab study`` option):

    bytes per block     = the named model's K/V bytes per token (kvlab.sizing.KVLayout, in ``kv_cache_dtype``)
                          x block_size
    recompute per block = block_size / prefill_tokens_per_s
    transfer per block  = bytes per block / host-to-device bandwidth
    a GPU hit costs nothing, a miss token is recomputed, and a tier hit costs the *cheaper* of transfer and
    recompute: an engine that can recompute a block faster than it can load it would recompute it, so a tier
    whose copies are slower than prefill shows as no gain (``ttft_tier_gain_ms`` = 0), however many hits it has.

Columns, means over every request of the trace (skipped ones too, all computed): ``ttft_no_cache_ms`` (every
prompt token computed), ``ttft_mean_ms`` (with the cache and the tier, priced as above), ``ttft_tier_gain_ms``
(what the tier's hits save against recomputing them). Simplifications, printed with the results: prefill time
is linear in tokens (attention's quadratic part is left out), a copy does not overlap computation (no
layer-by-layer pipelining), and requests do not queue (the sequential replay: one request at a time).
"""

from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError
from kvlab.sizing import KVLayout
from kvlab.sizing.kv_dtypes import KV_FORMATS
from kvlab.validation import check_number

#: Named models' K/V shapes (from their Hugging Face config.json): layers, KV heads, head_dim.
MODELS = {
    "llama-3-8b": ("Llama-3-8B", 32, 8, 128),
    "llama-3-70b": ("Llama-3-70B", 80, 8, 128),
    "qwen2.5-7b": ("Qwen2.5-7B", 28, 4, 128),
}
TTFT_COLUMNS = ["ttft_no_cache_ms", "ttft_mean_ms", "ttft_tier_gain_ms"]


@dataclass(frozen=True)
class TTFTModel:
    """Defaults: Llama-3-8B in fp16; 50,000 prefill tokens/s (an 8B model on one H100-class GPU, as the overlap
    replay's ``EngineModel``: 0.02 ms per token); 25 GB/s host to device (PCIe 4.0 x16 with pinned memory, in
    practice; PCIe 5.0 about doubles it). Assumptions, not measurements: change them to match a setup."""
    model: str = "llama-3-8b"
    kv_cache_dtype: str = "fp16"
    prefill_tokens_per_s: float = 50_000.0
    h2d_gb_per_s: float = 25.0

    def __post_init__(self):
        if not isinstance(self.model, str) or self.model not in MODELS:
            raise InvalidArgumentError(f"unknown TTFT model {self.model!r}; known: {', '.join(MODELS)}")
        if not isinstance(self.kv_cache_dtype, str) or self.kv_cache_dtype not in KV_FORMATS:
            raise InvalidArgumentError(f"unknown KV cache dtype {self.kv_cache_dtype!r}; known: "
                                       f"{', '.join(KV_FORMATS)}")
        check_number("prefill_tokens_per_s", self.prefill_tokens_per_s, 0, min_open=True)
        check_number("h2d_gb_per_s", self.h2d_gb_per_s, 0, min_open=True)

    @property
    def layout(self) -> KVLayout:
        _, layers, kv_heads, head_dim = MODELS[self.model]
        return KVLayout(num_kv_heads=kv_heads, head_dim=head_dim, dtype=self.kv_cache_dtype,
                        layer_windows=(None,) * layers)

    def bytes_per_block(self, block_size: int) -> int:
        return self.layout.bytes_per_token * block_size

    def recompute_ms(self, block_size: int) -> float:
        return 1000.0 * block_size / self.prefill_tokens_per_s

    def transfer_ms(self, block_size: int) -> float:
        return 1000.0 * self.bytes_per_block(block_size) / (self.h2d_gb_per_s * 1e9)

    def tier_hit_ms(self, block_size: int) -> float:
        """What a tier hit costs: the cheaper of loading the block and recomputing it."""
        return min(self.transfer_ms(block_size), self.recompute_ms(block_size))

    def columns(self, row: dict) -> dict:
        """The TTFT columns of a study row (its ``block_size``, ``prompt_tokens``, ``miss_tokens``,
        ``tier_hit_blocks``, ``requests`` and ``requests_skipped``)."""
        bs = row["block_size"]
        requests = row["requests"] + row["requests_skipped"] + row.get("requests_dropped_mid_decode", 0)
        per_token_ms = 1000.0 / self.prefill_tokens_per_s
        tier_blocks = row["tier_hit_blocks"]
        return {"ttft_no_cache_ms": row["prompt_tokens"] * per_token_ms / requests,
                "ttft_mean_ms": (row["miss_tokens"] * per_token_ms + tier_blocks * self.tier_hit_ms(bs)) / requests,
                "ttft_tier_gain_ms": tier_blocks * (self.recompute_ms(bs) - self.tier_hit_ms(bs)) / requests}

    def describe(self, block_sizes) -> str:
        """The assumptions and the prices they give per block size, in words (printed and written with the CSV)."""
        name, layers, kv_heads, head_dim = MODELS[self.model]
        per_token = self.layout.bytes_per_token
        lines = [f"TTFT model: {name} ({layers} layers x {kv_heads} KV heads x {head_dim} head_dim, "
                 f"{self.kv_cache_dtype}): {per_token / 1024:,.0f} KiB of K/V per token; prefill "
                 f"{self.prefill_tokens_per_s:,.0f} tokens/s; host to device {self.h2d_gb_per_s:g} GB/s."]
        for bs in block_sizes:
            recompute, transfer = self.recompute_ms(bs), self.transfer_ms(bs)
            verdict = (f"a tier hit saves {recompute - transfer:.3g} ms" if transfer < recompute else
                       "a tier hit saves nothing (loading is slower than recomputing: such hits are recomputed)")
            lines.append(f"  block size {bs}: {self.bytes_per_block(bs) / 2**20:,.3g} MiB per block; recompute "
                         f"{recompute:.3g} ms, transfer {transfer:.3g} ms: {verdict}.")
        lines.append("  A GPU hit costs nothing, a missed token is recomputed, a tier hit costs the cheaper of its "
                     "transfer and its recompute. Prefill is linear in tokens (attention's quadratic part left "
                     "out), copies do not overlap computation, and requests do not queue (one at a time).")
        return "\n".join(lines)
