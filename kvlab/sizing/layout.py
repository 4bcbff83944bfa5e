"""What one token's K and V cost: per layer, for the whole model, per block.

A standard attention layer keeps, for every token, a key and a value vector for each of its **KV heads**:
``2 x num_kv_heads x head_dim`` elements. With grouped-query attention (GQA) several query heads share one
KV head, so the query heads do not count (forgetting that is vLLM #22291's mismatch). An MLA layer
(DeepSeek-V2/V3) keeps one compressed latent from which both K and V are projected, plus the key's rotary
part: ``kv_lora_rank + qk_rope_head_dim`` elements, with no factor 2. A sliding-window layer keeps the same
per token, but only for the last ``window`` tokens: past the window a token costs it nothing more.

``KVLayout`` holds these numbers; every figure kvlab prints or sizes a pool with comes from it, through the
KV cache config that lays its pages out in cache tensors (``kvlab.sizing.groups``: ``kvlab size``, the
engine's ``blocks_for_memory`` and its cache's ``bytes_per_block``).
"""

from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError
from kvlab.sizing.kv_dtypes import (CODEC_BITS, KV_FORMATS, check_kivi_rows, check_kv_format, kivi_settings,
                                    row_bytes)
from kvlab.validation import check_int, is_int

#: Float dtype names (vLLM's ``--kv-cache-dtype`` spellings and torch's) -> bytes per element. fp8 caches
#: also keep scales per layer and KV head for K and V (vLLM's k_scale / v_scale), a few bytes in all, outside
#: the pool. Every cache format, integer ones included, is in ``kvlab.sizing.kv_dtypes.KV_FORMATS``.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2, "bf16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}


@dataclass(frozen=True)
class KVLayout:
    """One model's KV cache shape. ``layer_windows[i]``: layer i's sliding window in tokens, None for full
    attention. ``mla_latent_dim`` set (MLA): every layer keeps that many elements per token, and
    ``num_kv_heads`` / ``head_dim`` are not used for the cache."""

    num_kv_heads: int
    head_dim: int
    dtype: str                 # a cache format: a KV_FORMATS name
    layer_windows: tuple
    mla_latent_dim: int | None = None

    def __post_init__(self):
        check_kv_format(self.dtype)
        check_int("num_kv_heads", self.num_kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        if self.mla_latent_dim is not None:
            check_int("mla_latent_dim", self.mla_latent_dim, 1)
        if kivi_settings(self.dtype) is not None:
            check_kivi_rows(self.dtype, self.row_elements)
        elif self.row_elements % 2 and any(CODEC_BITS[codec] == 4 for codec in self.codecs):
            raise InvalidArgumentError(f"the {self.dtype} cache packs two 4-bit codes a byte, so rows need an even "
                                       f"number of elements; got {self.row_elements}")
        if not isinstance(self.layer_windows, tuple) or not self.layer_windows or not all(
                window is None or (is_int(window) and window >= 1) for window in self.layer_windows):
            raise InvalidArgumentError(f"layer_windows must be a non-empty tuple with each layer's window (an int "
                                       f">= 1) or None for full attention, got {self.layer_windows!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layer_windows)

    @property
    def codecs(self) -> tuple:
        """(K codec, V codec) of the format (``kvlab.sizing.kv_dtypes``)."""
        return KV_FORMATS[self.dtype]

    @property
    def row_elements(self) -> int:
        """Elements of one stored row: a KV head's K or V, or MLA's one latent."""
        return self.head_dim if self.mla_latent_dim is None else self.mla_latent_dim

    @property
    def element_bytes(self) -> float:
        """Bytes per element where K and V share one codec without scales in the rows, else the average."""
        return self.bytes_per_token_per_layer / self.elements_per_token_per_layer

    @property
    def full_layers(self) -> int:
        return sum(window is None for window in self.layer_windows)

    @property
    def windows(self) -> dict:
        """Sliding window -> how many layers use it (empty for a model of full-attention layers)."""
        counts = {}
        for window in self.layer_windows:
            if window is not None:
                counts[window] = counts.get(window, 0) + 1
        return dict(sorted(counts.items()))

    @property
    def is_hybrid(self) -> bool:
        """Layers of more than one kind (full and windowed, or several windows)."""
        return len(self.windows) + (self.full_layers > 0) > 1

    @property
    def elements_per_token_per_layer(self) -> int:
        if self.mla_latent_dim is not None:
            return self.mla_latent_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V rows of every KV head in their codecs; MLA: one latent row in the K codec."""
        key, value = self.codecs
        if self.mla_latent_dim is not None:
            return row_bytes(key, self.mla_latent_dim)
        return self.num_kv_heads * (row_bytes(key, self.head_dim) + row_bytes(value, self.head_dim))

    def per_layer_formula(self) -> str:
        """The arithmetic of ``bytes_per_token_per_layer``, e.g. ``2 (K and V) x 8 kv heads x 128 head_dim x 2
        bytes (bfloat16) = 4,096 B``; a format whose K and V rows differ or hold scales shows each row's bytes."""
        key, value = self.codecs
        uniform = key == value and key != "int4_token"
        element = f"{CODEC_BITS[key] / 8:g} bytes ({self.dtype})"
        if self.mla_latent_dim is not None:
            terms = f"{self.mla_latent_dim} latent (kv_lora_rank + qk_rope_head_dim, one for K and V) x {element}"
        elif uniform:
            terms = f"2 (K and V) x {self.num_kv_heads} kv heads x {self.head_dim} head_dim x {element}"
        else:
            terms = (f"{self.num_kv_heads} kv heads x (K {row_bytes(key, self.head_dim)} B ({key}) + V "
                     f"{row_bytes(value, self.head_dim)} B ({value}) per {self.head_dim}-element row)")
        return f"{terms} = {self.bytes_per_token_per_layer:,} B"

    @property
    def bytes_per_token(self) -> int:
        """A token in every layer: what a full-attention model pays per token of context."""
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def bytes_per_token_past_windows(self) -> int:
        """What one more token costs once every window is full: only the full-attention layers keep it."""
        return self.bytes_per_token_per_layer * self.full_layers

    def bytes_for_tokens(self, num_tokens: int) -> int:
        """K and V of one sequence of ``num_tokens`` tokens, token-exact (no block rounding): every
        full-attention layer keeps them all, a windowed layer at most its window."""
        return self.bytes_per_token_per_layer * sum(
            num_tokens if window is None else min(num_tokens, window) for window in self.layer_windows)

    def page_bytes(self, block_size: int) -> int:
        """One block of one layer: ``block_size`` tokens' K and V (the unit vLLM's pages come in)."""
        check_int("block_size", block_size, 1)
        return self.bytes_per_token_per_layer * block_size
