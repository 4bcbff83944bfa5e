"""kvlab's exception types.

Every error kvlab raises on purpose derives from ``KvlabError``, and also from the builtin a caller
would expect (``ValueError`` for a bad argument, ``RuntimeError`` for an operation that is not valid
now), so ``except ValueError`` keeps working. Raising one never leaves kvlab's state half-changed.
"""


class KvlabError(Exception):
    """Base class of every error kvlab raises on purpose."""


class InvalidArgumentError(KvlabError, ValueError):
    """An argument has the wrong type, value, shape, dtype, device or range."""


class SequenceStateError(KvlabError, RuntimeError):
    """The operation is not valid for this sequence now (unknown, already freed, not allocated...)."""


class OutOfBlocksError(KvlabError, RuntimeError):
    """Not enough free blocks for the operation; nothing was allocated."""


class InvariantViolation(KvlabError, AssertionError):
    """``check_invariants()`` found the block manager's bookkeeping inconsistent."""


class TraceFormatError(KvlabError, ValueError):
    """A trace file is malformed; the message names the file and the line."""


class NeedsGPUError(KvlabError, RuntimeError):
    """A GPU-only feature (e.g. the kernel benchmark) was called on a machine without CUDA."""


class MissingExtraError(KvlabError, ImportError):
    """A feature needs an optional dependency that is not installed; the message names kvlab's extra holding it
    (pyproject.toml's optional-dependencies) and the command that installs it."""


class UnsupportedError(KvlabError, NotImplementedError):
    """The feature exists, but not on this device or backend (e.g. an fp8 KV cache in the Triton interpreter);
    the message says where it runs and what to use here."""


class EvictionPolicyError(KvlabError, RuntimeError):
    """A user-supplied eviction policy raised or broke its contract; the manager's state is unchanged."""


class KVEventSubscriberWarning(RuntimeWarning):
    """A KV-event subscriber raised; it was dropped, and the manager and every other subscriber carried on."""


class ProposerWarning(RuntimeWarning):
    """A speculative-decoding proposer raised or broke its contract in a hook (``kvlab.engine.proposers``): the
    drafts it was making were dropped, or what it would have learnt was lost, and the engine and every request
    carried on (greedy output is unchanged). Warned once per hook and kind of failure; each one is counted in
    ``LLM.speculation.failures``."""


class PuzzleNotSolvedError(KvlabError, AssertionError):
    """A puzzle's ``check(fn, strict=True)`` found a case the learner's code gets wrong (kvlab.puzzles); the
    message names the case, its inputs, and what was expected against what came back."""


class LearnerPartError(KvlabError, AssertionError):
    """A learner's part of the capstone engine (``kvlab.course.engine_with``) is wrong: it failed its puzzle's
    check, broke its contract inside the engine, or made the engine's tokens differ from Hugging Face's; the
    message names the part and says what went wrong."""


class SolutionsNotShippedError(KvlabError, ImportError):
    """The puzzles' solutions were asked for where kvlab is installed without them (they ship with a checkout)."""


class ReplayError(KvlabError, RuntimeError):
    """A sweep's replay failed on every attempt (``kvlab.studies.sweep``); the message names each failed replay
    and its last error. The other replays finished: their rows are in ``rows`` (``None`` for a failed one) and,
    when the sweep has a rows file, saved there, so running the same sweep again replays only the failed ones."""

    def __init__(self, message: str, rows=()):
        super().__init__(message)
        self.rows = list(rows)
