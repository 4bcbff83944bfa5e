"""Thread safety for the block manager: every public method holds the manager's one re-entrant lock."""

import functools


def serialized(cls):
    """Make every public method of ``cls`` hold ``self._lock`` (re-entrant: public methods call each other).
    It wraps only what ``cls`` itself defines, so each class BlockManager is built from is decorated."""
    def locked(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with self._lock:
                return method(self, *args, **kwargs)
        return call
    for name, member in list(vars(cls).items()):
        if callable(member) and not name.startswith("_"):
            setattr(cls, name, locked(member))
    return cls
