"""Puzzle: a router, least prefill work first (kvlab's ``kv_cost``). Read first: notebook 12 (§1 and §3).

**Spec.** A fleet's router sends each request to one replica, seeing of each only a ``ReplicaView``
(``kvlab.studies.routers``): ``replica.cached.prefix_match(hashes, len(hashes))``, how many of the request's
leading blocks it caches (from its KV events); ``replica.waiting_tokens``, the prompt tokens queued there and
not admitted yet; ``replica.in_flight()``, its requests not finished. Write ``choose`` of a ``Router``
subclass: send a request of ``num_tokens`` prompt tokens, whose blocks have the chained ``hashes``, to the
replica with the least cost

    prefill_weight x (num_tokens - block_size x prefix match)  +  queue_weight x waiting_tokens

(the prefill it would do, and the prefill it would wait for; the weights are ``self.settings``'s, the block
size ``self.block_size``). Among equal costs take the fewest requests in flight; among equals again, the
first replica after the one chosen last, so idle replicas take turns: ``self.pick(keys)`` returns the index
of the smallest key with exactly that tie-break, so return ``self.pick([...one key per replica...])``.

``check(MyRouter)`` routes random request streams over random fleets with your router and with kvlab's
``ROUTERS["kv_cost"]`` and compares every choice.
"""

import random
from dataclasses import dataclass

from kvlab.blocks.events import CachedHashes
from kvlab.puzzles.grading import Case, Report, grade, not_an_int, same, seeded
from kvlab.studies.routers import ROUTERS, Router, RouterSettings

NAME = "kv_cost_router"
REQUESTS_PER_FLEET = 10


class MyRouter(Router):
    needs_hashes = True

    def choose(self, replicas, num_tokens: int, hashes: list[int]) -> int:
        """The index of the replica for this request (see the module docstring). Your code here."""
        raise NotImplementedError


@dataclass
class FakeReplica:
    """A ``ReplicaView`` with made-up contents (the check's fleets)."""
    cached: CachedHashes
    num_in_flight: int
    waiting_tokens: int

    def in_flight(self) -> int:
        return self.num_in_flight


def check(router_class, *, strict: bool = False, seed: int = 0, num_cases: int = 200) -> Report:
    """Route ``num_cases`` random requests (from ``seed``) with ``router_class`` and with kvlab's kv_cost."""
    rng = seeded(seed, num_cases)
    return grade(NAME, router_class, _cases(rng, num_cases), num_cases=num_cases, strict=strict)


def _cases(rng: random.Random, num_cases: int):
    made = 0
    while made < num_cases:  # a fleet: one router of each kind routes its stream of requests
        bs, num_replicas = rng.choice((4, 16)), rng.randint(2, 5)
        settings = rng.choice((RouterSettings(), RouterSettings(prefill_weight=rng.choice((0.5, 2.0)),
                                                                queue_weight=rng.choice((0.0, 1.0, 3.0)))))
        conversations = [[rng.randrange(2**62) for _ in range(6)] for _ in range(4)]  # chained block hashes
        kvlab_router, theirs = ROUTERS["kv_cost"](settings, bs), {}
        for _ in range(min(REQUESTS_PER_FLEET, num_cases - made)):
            replicas = [_replica(rng, conversations, bs) for _ in range(num_replicas)]  # the fleet moved on
            hashes = rng.choice(conversations)[:rng.randint(0, 6)]
            yield _route(kvlab_router, theirs, settings, bs, replicas, bs * len(hashes) + rng.randint(1, bs), hashes)
            made += 1


def _replica(rng, conversations, bs) -> FakeReplica:
    """Small numbers, so that costs and loads often tie."""
    cached = CachedHashes()
    for conversation in conversations:
        if rng.random() < 0.4:
            cached.hashes.update(conversation[:rng.randint(1, 6)])
    return FakeReplica(cached, rng.randint(0, 3), bs * rng.randint(0, 3))


def _route(kvlab_router, theirs: dict, settings, bs, replicas, num_tokens, hashes) -> Case:
    """kvlab's choice now; the case asks the learner's router (built at the fleet's first case, kept after)."""
    expected = kvlab_router.choose(replicas, num_tokens, hashes)

    def run(router_class):
        if "router" not in theirs:
            theirs["router"] = router_class(settings, bs)
        return theirs["router"].choose(replicas, num_tokens, hashes)

    matches = [r.cached.prefix_match(hashes, len(hashes)) for r in replicas]
    keys = [(settings.prefill_weight * (num_tokens - bs * match) + settings.queue_weight * r.waiting_tokens,
             r.in_flight()) for r, match in zip(replicas, matches)]
    fleet = "; ".join(f"replica {i} caches {match} of them, {r.waiting_tokens} tokens waiting, "
                      f"{r.in_flight()} in flight" for i, (r, match) in enumerate(zip(replicas, matches)))
    inputs = (f"a request of {num_tokens} tokens ({len(hashes)} full blocks of {bs}), prefill_weight="
              f"{settings.prefill_weight}, queue_weight={settings.queue_weight}; {fleet}")
    return Case(inputs, run, lambda got: _judge(keys, expected, got))


def _judge(keys, expected, got):
    if same(got, expected):
        return None
    if not_an_int([got]) or not 0 <= got < len(keys):
        return (f"expected replica {expected}, got {got!r}: return a replica's index, an int in 0 .. "
                f"{len(keys) - 1}")
    if keys[got] == keys[expected]:
        return (f"expected replica {expected}, got {got}: both cost {keys[got][0]:g} with {keys[got][1]} in flight; "
                "equal keys go to the first replica after the one chosen last (return self.pick(keys))")
    costs = ", ".join(f"{cost:g}" for cost, _ in keys)
    return (f"expected replica {expected}, got {got}: the costs are [{costs}] and the requests in flight "
            f"{[load for _, load in keys]}; replica {expected} has the least (cost, in flight)")
