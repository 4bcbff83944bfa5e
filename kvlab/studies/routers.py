"""Routers of a fleet: which replica serves a request, from what a real router can see.

A router sees no replica's pool, only a ``ReplicaView``: the set of block hashes the replica caches,
replayed from its KV events (``kvlab.blocks.events.CachedHashes``), and its queue (requests in flight:
running, waiting, or on their way; and the prompt tokens still waiting for prefill). It hashes the request's
prompt blocks the way the replicas do, so a prefix match is an exact count of the blocks the replica would
hit if nothing changed before admission.

    round_robin    replica after replica, blind to cache and load
    least_loaded   fewest requests in flight
    cache_aware    SGLang-style, event-fed: the least loaded replica when loads are imbalanced (max - min
                   in-flight requests above ``balance_abs_threshold`` and max above ``balance_rel_threshold`` x
                   min); otherwise the longest cached-prefix match if it covers more than ``cache_threshold`` of
                   the prompt's blocks, else the replica caching the fewest blocks. SGLang's cache-aware policy
                   has these rules, but matches against its own approximate tree of the text it routed to each
                   worker (its fallback is the smallest tree); this one reads the replicas' KV events, so its
                   fallback sees what each pool really caches (notebook 12 shows what that does to load)
    kv_cost        the least cost ``prefill_weight`` x uncached prompt tokens + ``queue_weight`` x prompt
                   tokens queued there: the prefill work this request would wait for and do. That is the
                   prefill term of Dynamo's KV router (``overlap_score_weight`` x prefill blocks, in tokens
                   here); Dynamo adds the blocks the worker's running requests hold (decode blocks), which
                   this router leaves out. Mooncake's Conductor estimates the same prefill and queueing time

Ties go to the fewest requests in flight, then to the replica after the last one chosen (so idle replicas
take turns instead of the first one taking everything).

Your own router: subclass ``Router`` (override ``choose``; ``pick`` breaks ties as above; set
``needs_hashes`` to be given the prompt's block hashes), or write a function ``choose(replicas, num_tokens,
hashes) -> int``; pass either where a router name goes (``replay_fleet(router=...)``, ``fleet_study``), or
add the class to ``ROUTERS`` to use it by name.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

from kvlab.blocks.events import CachedHashes
from kvlab.errors import InvalidArgumentError
from kvlab.validation import check_int, check_number


@dataclass(frozen=True)
class RouterSettings:
    """Knobs of ``cache_aware`` and ``kv_cost`` (both weights 1: a token is a token). ``cache_aware``'s defaults
    are SGLang's router's (``RouterArgs`` in sgl-model-gateway/bindings/python/src/sglang_router/router_args.py,
    as of sgl-project/sglang commit 6614f98; older releases had 0.5, 32 and 1.0001)."""
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    prefill_weight: float = 1.0
    queue_weight: float = 1.0

    def __post_init__(self):
        check_number("cache_threshold", self.cache_threshold, 0, 1)
        check_int("balance_abs_threshold", self.balance_abs_threshold, 0)
        check_number("balance_rel_threshold", self.balance_rel_threshold, 1)
        check_number("prefill_weight", self.prefill_weight, 0)
        check_number("queue_weight", self.queue_weight, 0)


class ReplicaView(Protocol):
    """All a router may read of a replica (``kvlab.studies.fleet.Replica`` implements it)."""
    cached: CachedHashes  # the block hashes its KV events say it caches

    def in_flight(self) -> int:
        """Requests routed there and not finished: running, waiting, or not yet at a step."""

    @property
    def waiting_tokens(self) -> int:
        """Prompt tokens routed there and not admitted yet."""


class Router:
    """``choose(replicas, num_tokens, hashes)``: the index of the replica (a ``ReplicaView``) for a request of
    ``num_tokens`` prompt tokens whose hittable blocks have the chained ``hashes`` (empty unless
    ``needs_hashes``). One router routes one replay, so it may keep state between requests."""
    needs_hashes = False

    def __init__(self, settings: RouterSettings, block_size: int):
        self.settings, self.block_size = settings, block_size
        self._turn = 0

    def choose(self, replicas: list[ReplicaView], num_tokens: int, hashes: list[int]) -> int:
        raise NotImplementedError

    def pick(self, keys: list) -> int:
        """The replica with the smallest key; among equals, the first one from the last choice on."""
        n, turn = len(keys), self._turn
        best = min(range(n), key=lambda i: (keys[i], (i - turn) % n))
        self._turn = best + 1
        return best


class RoundRobin(Router):
    def choose(self, replicas, num_tokens, hashes) -> int:
        return self.pick([0] * len(replicas))


class LeastLoaded(Router):
    def choose(self, replicas, num_tokens, hashes) -> int:
        return self.pick([r.in_flight() for r in replicas])


class CacheAware(Router):
    needs_hashes = True

    def choose(self, replicas, num_tokens, hashes) -> int:
        s, loads = self.settings, [r.in_flight() for r in replicas]
        high, low = max(loads), min(loads)
        if high - low > s.balance_abs_threshold and high > s.balance_rel_threshold * low:
            return self.pick(loads)
        matches = [r.cached.prefix_match(hashes, len(hashes)) for r in replicas]
        if hashes and max(matches) / len(hashes) > s.cache_threshold:
            return self.pick([(-match, load) for match, load in zip(matches, loads)])
        return self.pick([(len(r.cached.hashes), load) for r, load in zip(replicas, loads)])


class KVCost(Router):
    needs_hashes = True

    def choose(self, replicas, num_tokens, hashes) -> int:
        s, bs = self.settings, self.block_size
        return self.pick([(s.prefill_weight * (num_tokens - bs * r.cached.prefix_match(hashes, len(hashes)))
                           + s.queue_weight * r.waiting_tokens, r.in_flight()) for r in replicas])


class FunctionRouter(Router):
    """A function ``choose(replicas, num_tokens, hashes) -> int`` as a router; it is given the hashes."""
    needs_hashes = True

    def __init__(self, function: Callable, settings: RouterSettings, block_size: int):
        super().__init__(settings, block_size)
        self.function = function

    def choose(self, replicas, num_tokens, hashes) -> int:
        return self.function(replicas, num_tokens, hashes)


#: Routers by name, for ``replay_fleet(router=name)`` and ``kvlab fleet --router``; add your own class here.
ROUTERS: dict[str, type[Router]] = {"round_robin": RoundRobin, "least_loaded": LeastLoaded,
                                    "cache_aware": CacheAware, "kv_cost": KVCost}


def check_router(name) -> str:
    """A router name in ROUTERS (the CLI's ``--router``)."""
    if not isinstance(name, str) or name not in ROUTERS:
        raise InvalidArgumentError(f"unknown router {name!r}; known: {', '.join(ROUTERS)}")
    return name


def router_factory(router) -> tuple[str, Callable[[RouterSettings, int], Router]]:
    """``(label, factory)`` for a name in ROUTERS, a ``Router`` subclass or a ``choose`` function; the
    factory makes a fresh router per replay as ``factory(settings, block_size)``."""
    if isinstance(router, str):
        return router, ROUTERS[check_router(router)]
    if isinstance(router, type) and issubclass(router, Router):
        if router.choose is Router.choose:
            raise InvalidArgumentError(f"router {router.__name__} must override choose(replicas, num_tokens, hashes)")
        return next((name for name, cls in ROUTERS.items() if cls is router), router.__name__), router
    if callable(router) and not isinstance(router, type):
        return getattr(router, "__name__", type(router).__name__), functools.partial(FunctionRouter, router)
    raise InvalidArgumentError(f"router must be a name ({', '.join(ROUTERS)}), a Router subclass or a function "
                               f"choose(replicas, num_tokens, hashes) -> int, got {router!r}")


def make_router(router, settings: RouterSettings, block_size: int) -> Router:
    return router_factory(router)[1](settings, block_size)
