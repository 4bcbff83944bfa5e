"""How much of kvlab a reader walks through to follow one operation: a ``sys.settrace`` count of kvlab's files,
functions, line events and call depth, and of the prefix lookups made (the "small" design card's measure).

``trace_admission(manager_factory)`` traces the scheduler's admission of a 5-block prompt (16-token blocks) whose
first 4 blocks are cached by an earlier, freed sequence: ``hit = lookup(prompt)``, then ``can_allocate`` and
``allocate`` with that hit (as vLLM V1 passes its one lookup's hit into ``allocate_slots``): the operation a student
follows first.
"""

import sys
from dataclasses import dataclass
from pathlib import Path

import kvlab
from kvlab import Sequence
from kvlab.blocks.prefix_cache import PrefixIndex

KVLAB_DIR = str(Path(kvlab.__file__).parent)
BLOCK_SIZE = 16


@dataclass(frozen=True)
class CallTrace:
    files: frozenset       # kvlab files with a line executed, relative to the package
    functions: frozenset   # (file, function name, first line)
    line_events: int
    max_depth: int         # deepest nesting of kvlab frames below the traced call (the call itself is 1)
    prefix_lookups: int    # PrefixIndex.lookup calls


def trace_calls(operation) -> CallTrace:
    """Run ``operation()`` under ``sys.settrace`` and count what it executed inside kvlab."""
    files, functions = set(), set()
    line_events = max_depth = prefix_lookups = 0
    depth = {None: 0}

    def tracer(frame, event, arg):
        nonlocal line_events, max_depth, prefix_lookups
        code = frame.f_code
        if not code.co_filename.startswith(KVLAB_DIR):
            return None  # frames outside kvlab (the standard library) are not followed
        if event == "call":
            parent = frame.f_back
            while parent is not None and parent not in depth:
                parent = parent.f_back  # skip frames outside kvlab
            depth[frame] = depth[parent] + 1
            max_depth = max(max_depth, depth[frame])
            name = Path(code.co_filename).relative_to(KVLAB_DIR).as_posix()
            files.add(name)
            functions.add((name, code.co_name, code.co_firstlineno))
            if code is PrefixIndex.lookup.__code__:
                prefix_lookups += 1
        elif event == "line":
            line_events += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        operation()
    finally:
        sys.settrace(previous)
    return CallTrace(frozenset(files), frozenset(functions), line_events, max_depth, prefix_lookups)


def trace_admission(make_manager) -> CallTrace:
    """``lookup`` + ``can_allocate`` + ``allocate`` of a prompt of 4 cached blocks and one new, partly filled block."""
    manager = make_manager(num_blocks=32, block_size=BLOCK_SIZE)
    warm = Sequence(range(1, 4 * BLOCK_SIZE + 2), BLOCK_SIZE)
    manager.allocate(warm)
    manager.free(warm)
    prompt = Sequence(list(range(1, 4 * BLOCK_SIZE + 1)) + [999, 998, 997], BLOCK_SIZE)

    admitted = []

    def admit():
        hit = manager.lookup(prompt)
        manager.can_allocate(prompt, hit=hit)
        admitted.append(manager.allocate(prompt, hit=hit))

    trace = trace_calls(admit)
    assert admitted[0].num_cached_tokens == 4 * BLOCK_SIZE, "the prompt must hit its 4 cached blocks"
    return trace
