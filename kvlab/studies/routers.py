"""Routers of a fleet: which replica serves a request, from what a real router can see.

A router sees no replica's pool. It sees each replica's KV events, replayed into the set of block hashes
that replica caches (``kvlab.blocks.kv_events.CachedHashes``), and its queue: requests in flight (running,
waiting, or on their way) and the prompt tokens still waiting for prefill. It hashes the request's prompt
blocks the way the replicas do, so a prefix match is an exact count of the blocks the replica would hit if
nothing changed before admission.

    round_robin    replica after replica, blind to cache and load
    least_loaded   fewest requests in flight
    cache_aware    SGLang's router: the least loaded replica when loads are imbalanced (max - min in-flight
                   requests above ``balance_abs_threshold`` and max above ``balance_rel_threshold`` x min);
                   otherwise the longest cached-prefix match if it covers more than ``cache_threshold`` of
                   the prompt's blocks, else the replica caching the fewest blocks (SGLang's smallest tree)
    kv_cost        the least cost ``prefill_weight`` x uncached prompt tokens + ``queue_weight`` x prompt
                   tokens queued there: the prefill work this request would wait for and do, the quantity
                   Dynamo's KV router and Mooncake's Conductor estimate

Ties go to the fewest requests in flight, then to the replica after the last one chosen (so idle replicas
take turns instead of the first one taking everything).
"""

from dataclasses import dataclass

from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number

ROUTERS = ("round_robin", "least_loaded", "cache_aware", "kv_cost")


@dataclass(frozen=True)
class RouterSettings:
    """Knobs of ``cache_aware`` (SGLang's defaults) and ``kv_cost`` (both weights 1: a token is a token)."""
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.0001
    prefill_weight: float = 1.0
    queue_weight: float = 1.0

    def __post_init__(self):
        check_number("cache_threshold", self.cache_threshold, 0, 1)
        check_int("balance_abs_threshold", self.balance_abs_threshold, 0)
        check_number("balance_rel_threshold", self.balance_rel_threshold, 1)
        check_number("prefill_weight", self.prefill_weight, 0)
        check_number("queue_weight", self.queue_weight, 0)


def check_router(name) -> str:
    if name not in ROUTERS:
        raise InvalidArgumentError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    return name


class Router:
    """``choose(replicas, num_tokens, hashes)``: the index of the replica for a request of ``num_tokens``
    prompt tokens whose hittable blocks have the chained ``hashes`` (empty unless ``needs_hashes``). Each
    replica offers ``cached`` (a CachedHashes), ``in_flight()`` and ``waiting_tokens``."""

    def __init__(self, name: str, settings: RouterSettings, block_size: int):
        self.name, self.settings, self.block_size = check_router(name), settings, block_size
        self.needs_hashes = name in ("cache_aware", "kv_cost")
        self._choose = getattr(self, f"_{name}")
        self._turn = 0

    def choose(self, replicas, num_tokens: int, hashes: list[int]) -> int:
        return self._choose(replicas, num_tokens, hashes)

    def _pick(self, keys: list) -> int:
        """The replica with the smallest key; among equals, the first one from the last choice on."""
        n, turn = len(keys), self._turn
        best = min(range(n), key=lambda i: (keys[i], (i - turn) % n))
        self._turn = best + 1
        return best

    def _round_robin(self, replicas, num_tokens, hashes) -> int:
        return self._pick([0] * len(replicas))

    def _least_loaded(self, replicas, num_tokens, hashes) -> int:
        return self._pick([r.in_flight() for r in replicas])

    def _cache_aware(self, replicas, num_tokens, hashes) -> int:
        s, loads = self.settings, [r.in_flight() for r in replicas]
        high, low = max(loads), min(loads)
        if high - low > s.balance_abs_threshold and high > s.balance_rel_threshold * low:
            return self._pick(loads)
        matches = [r.cached.prefix_match(hashes, len(hashes)) for r in replicas]
        if hashes and max(matches) / len(hashes) > s.cache_threshold:
            return self._pick([(-match, load) for match, load in zip(matches, loads)])
        return self._pick([(len(r.cached.hashes), load) for r, load in zip(replicas, loads)])

    def _kv_cost(self, replicas, num_tokens, hashes) -> int:
        s, bs = self.settings, self.block_size
        return self._pick([(s.prefill_weight * (num_tokens - bs * r.cached.prefix_match(hashes, len(hashes)))
                            + s.queue_weight * r.waiting_tokens, r.in_flight()) for r in replicas])
