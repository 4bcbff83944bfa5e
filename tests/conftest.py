"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE (default "dev"; .ci/run sets "ci"; "long" is for soaking
the model-checking state machines locally: KVLAB_LONG_EXAMPLES examples each, 2000 by default; their
programs are KVLAB_STATEFUL_STEPS operations long, 40 by default).

Neither profile has a deadline: the machines are shared and kernels run in the Triton interpreter on
CPU, so a per-example time limit would only make tests flaky (timing belongs in benchmarks).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,  # same examples every run: a red CI is reproducible, never luck
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=int(os.environ.get("KVLAB_LONG_EXAMPLES", "2000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
