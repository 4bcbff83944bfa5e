"""How to pick the next token and when to stop: one ``SamplingParams`` per request (vLLM's names)."""

from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number, check_optional_int, is_int

MAX_SEED = 2**64 - 1  # a seed is 64 bits (torch.Generator.manual_seed)


@dataclass(frozen=True)
class SamplingParams:
    """``n`` samples per prompt (they share the prompt's KV blocks through ``fork``).

    ``temperature=0`` is greedy (argmax); otherwise logits are divided by the temperature, cut to the
    ``top_k`` most likely tokens (0 or -1: no cut) and to the smallest set whose probability reaches
    ``top_p`` (1.0: no cut), then sampled. Any finite temperature > 0 is safe: a tiny one (even 1e-300)
    picks the most likely token, a huge one samples near-uniformly; the most likely token survives any
    ``top_p``, so a tiny ``top_p`` keeps it alone. A request stops after ``max_tokens`` generated tokens, at
    the model's end-of-sequence token unless ``ignore_eos``, or at any of ``stop_token_ids`` (the stopping
    token is kept in the output). ``seed`` (0 to 2**64 - 1) makes a request's samples reproducible whatever
    else is in the batch; without one, the engine's own generator is used. ``top_k`` and
    ``stop_token_ids`` are checked against the model's vocabulary when the request is added to an ``LLM``.
    """
    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple = ()
    seed: int | None = None

    def __post_init__(self):
        # A frozen dataclass: normalised values are written with object.__setattr__.
        set_ = object.__setattr__
        set_(self, "n", check_int("n", self.n, minimum=1))
        set_(self, "temperature", check_number("temperature", self.temperature, minimum=0.0))
        set_(self, "top_k", check_int("top_k", self.top_k, minimum=-1))
        set_(self, "top_p", check_number("top_p", self.top_p, minimum=0.0, maximum=1.0, min_open=True))
        set_(self, "max_tokens", check_int("max_tokens", self.max_tokens, minimum=1))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidArgumentError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        stop = self.stop_token_ids
        if isinstance(stop, (str, bytes)) or not hasattr(stop, "__iter__"):
            raise InvalidArgumentError(f"stop_token_ids must be a list of token ids, got {stop!r}")
        stop = tuple(stop)
        if not all(is_int(t) and t >= 0 for t in stop):
            raise InvalidArgumentError(f"stop_token_ids must hold non-negative ints, got {list(stop)!r}")
        set_(self, "stop_token_ids", tuple(int(t) for t in stop))
        set_(self, "seed", check_optional_int("seed", self.seed, minimum=0, maximum=MAX_SEED))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
