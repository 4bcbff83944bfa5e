"""What the notebooks need to be a course rather than a demo: exercises whose answers the notebook checks
(``answer``), and what two notebooks share: the fork engine of 03a/03b (``kvlab.course.forks``) and the tier
replay of 14a/14b (``kvlab.course.tiers``)."""

from kvlab.course.exercises import answer, reveal, student_edition

__all__ = ["answer", "reveal", "student_edition"]
