"""Thread safety for the block manager: every public method holds the manager's one re-entrant lock.

When the outermost public call returns (or raises), its state change is complete, and only then are the KV
events it queued delivered, outside the lock (``kvlab.blocks.kv_events``): a subscriber never sees, nor can
break, half an operation. ``self._kv_queue`` is the publisher's queue, or an empty tuple without one.
"""

import functools


def serialized(cls):
    """Make every public method of ``cls`` hold ``self._lock`` (re-entrant: public methods call each other).
    It wraps only what ``cls`` itself defines, so each class BlockManager is built from is decorated."""
    def locked(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            try:
                with self._lock:
                    return method(self, *args, **kwargs)
            finally:
                # A nested call (the lock still held by this thread) leaves delivery to the outermost one.
                if self._kv_queue and not self._lock._is_owned():
                    self.kv_events.deliver()
        return call
    for name, member in list(vars(cls).items()):
        if callable(member) and not name.startswith("_"):
            setattr(cls, name, locked(member))
    return cls
