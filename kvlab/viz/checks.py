"""Explanatory checks for notebooks with knobs a student can turn.

A notebook states facts about its run ("B reuses 2 of A's blocks") and checks them, so that a broken kvlab
fails CI. Many of those facts hold only for the notebook's default settings: with ``BS = 8`` B reuses one
block, and a bare ``assert`` would stop a student who did nothing wrong. ``check`` keeps the guard for the
defaults and turns the failure into an explanation otherwise.
"""


class NotebookCheckError(AssertionError):
    """A fact that must hold with the notebook's default settings did not: kvlab (or the notebook) is broken."""


def check(ok, message: str, *, defaults: bool) -> None:
    """Nothing when ``ok`` holds. Otherwise: with the notebook's default knobs (``defaults=True``) raise
    NotebookCheckError with ``message``; with changed knobs print ``message`` (what changed and why) and go on."""
    if ok:
        return
    if defaults:
        raise NotebookCheckError(f"{message}\n(This must hold with the notebook's default settings: kvlab or the "
                                 "notebook is broken.)")
    print(f"Changed by your settings: {message}")
