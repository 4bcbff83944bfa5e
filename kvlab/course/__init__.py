"""What the notebooks need to be a course rather than a demo: exercises whose answers the notebook checks
(``answer``), and the small engines some notebooks share (``kvlab.course.forks``)."""

from kvlab.course.exercises import answer

__all__ = ["answer"]
