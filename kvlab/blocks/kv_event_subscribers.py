"""The subscriber side of KV events (``kvlab.blocks.kv_events``): subscriptions, and the JSONL writer's target.

A ``Subscription`` is one subscriber: a callback, or (without one) a buffer to iterate. The publisher hands it
each event with ``receive``; a callback that raises is dropped there, so its failure stays its own (see
"Delivery" in ``kvlab.blocks.kv_events``).
"""

import io
import json
import os
import warnings
from collections import deque
from typing import Callable, Optional

from kvlab.errors import InvalidArgumentError, KVEventSubscriberWarning


class Subscription:
    """One subscriber of a ``KVEventPublisher``. Without a callback it buffers: iterating yields the events
    published since the last iteration, then stops (nothing blocks: the manager runs in the caller's thread).
    ``closed`` tells whether it still receives events; ``error`` holds the exception that dropped it, if any."""

    def __init__(self, subscriptions: list, callback: Optional[Callable], on_close: Optional[Callable] = None):
        self._subscriptions, self._on_close = subscriptions, on_close
        self._buffer: deque = deque()
        self.callback = self._buffer.append if callback is None else callback
        self.closed = False
        self.error: Optional[BaseException] = None

    def receive(self, event) -> None:
        if self.closed:  # closed by an earlier subscriber's callback during this delivery
            return
        try:
            self.callback(event)
        except Exception as error:  # noqa: BLE001 - a subscriber's failure must not reach the manager
            self.error = error
            self.close()
            warnings.warn(KVEventSubscriberWarning(
                f"KV-event subscriber {self.callback!r} raised {type(error).__name__}: {error} on "
                f"{type(event).__name__}; it was dropped (subscription.error holds the exception) and every "
                "other subscriber still gets every event. Subscribe again to resume."), stacklevel=2)

    def __iter__(self):
        while self._buffer:
            yield self._buffer.popleft()

    def close(self) -> None:
        """Stop receiving events (idempotent); a JSONL path opened by ``write_jsonl`` is closed."""
        if self.closed:
            return
        self.closed = True
        self._subscriptions.remove(self)
        if self._on_close is not None:
            self._on_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def jsonl_writer(target, encode: Callable[[object], dict]) -> tuple[Callable, Optional[Callable]]:
    """``(write(event), on_close)`` for ``write_jsonl(target)``: ``target`` is a path (str or os.PathLike,
    opened for writing now; ``on_close`` closes it) or a text file open for writing (left open, ``on_close``
    None). Raises InvalidArgumentError, opening nothing, for anything else."""
    if hasattr(target, "write"):
        _check_text_file(target)
        file, on_close = target, None
    else:
        file = _open_path(target)
        on_close = file.close
    return (lambda event: file.write(json.dumps(encode(event)) + "\n")), on_close


def _check_text_file(file) -> None:
    name = getattr(file, "name", None) or type(file).__name__
    if getattr(file, "closed", False):
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} is closed; pass a text file open for writing")
    if isinstance(file, (io.RawIOBase, io.BufferedIOBase)):
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} is open in binary mode; pass a text file "
                                   "(open(path, 'w')) or a path")
    try:  # an empty write proves the file takes str now (a read-only text file raises here)
        file.write("")
    except (OSError, ValueError, TypeError) as error:
        raise InvalidArgumentError(f"write_jsonl: the file {name!r} cannot be written as text ({error}); pass a text "
                                   "file open for writing or a path") from None


def _open_path(target):
    # An int would be taken by open() as an OS file descriptor (and closed with the subscription): refused.
    if not isinstance(target, (str, os.PathLike)) or isinstance(os.fspath(target), bytes):
        raise InvalidArgumentError(f"write_jsonl takes a path (str or os.PathLike) or a text file open for "
                                   f"writing, got {type(target).__name__} {target!r}")
    path = os.fspath(target)
    if not path:
        raise InvalidArgumentError("write_jsonl: the path is empty; name a file to write")
    if os.path.isdir(path):
        raise InvalidArgumentError(f"write_jsonl: {path!r} is a directory; name a file in it")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidArgumentError(f"write_jsonl: the folder {folder!r} of {path!r} does not exist")
    try:
        return open(path, "w", encoding="utf-8")
    except OSError as error:
        raise InvalidArgumentError(f"write_jsonl cannot open {path!r} for writing: "
                                   f"{error.strerror or error}") from None
