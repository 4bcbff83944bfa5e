"""A solution of kvlab.puzzles.kv_cost_router."""

from kvlab.studies.routers import Router


class MyRouter(Router):
    needs_hashes = True

    def choose(self, replicas, num_tokens: int, hashes: list[int]) -> int:
        s, keys = self.settings, []
        for replica in replicas:
            cached_tokens = self.block_size * replica.cached.prefix_match(hashes, len(hashes))
            cost = s.prefill_weight * (num_tokens - cached_tokens) + s.queue_weight * replica.waiting_tokens
            keys.append((cost, replica.in_flight()))
        return self.pick(keys)
