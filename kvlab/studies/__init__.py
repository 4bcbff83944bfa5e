"""Cache-hit and memory-waste studies on real and synthetic traces.

    replay(trace, block_size=, capacity=, policy=, mode=)  one replay through the BlockManager -> dict
    cache_hit_study(traces, block_sizes=, capacities=, policies=, mode=, jobs=, dask_scheduler=)  a sweep -> DataFrame
    reuse_profile(trace, block_size)                      trace-only reuse stats and the infinite-cache ceiling
    memory_waste(trace, budget_tokens=, max_len=, block_sizes=)  the vLLM paper's Figure 2 -> DataFrame
The command line is ``kvlab study`` (``kvlab.studies.cli``).
"""

from kvlab.studies.engine_model import EngineModel
from kvlab.studies.memory_waste import memory_waste
from kvlab.studies.reuse import reuse_profile
from kvlab.studies.simulator import replay
from kvlab.studies.study import cache_hit_study

__all__ = ["EngineModel", "cache_hit_study", "memory_waste", "replay", "reuse_profile"]
