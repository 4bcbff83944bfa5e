"""What the notebooks need to be a course rather than a demo: exercises whose answers the notebook checks
(``answer``), and what two notebooks share: the fork engine of 03a/03b (``kvlab.course.forks``) and the tier
replay of 14a/14b (``kvlab.course.tiers``); and the capstone, SmolLM2 served on the learner's puzzle solutions
(``engine_with``, ``check_engine``: ``kvlab.course.capstone``)."""

from kvlab.course.capstone import check_engine, engine_with
from kvlab.course.exercises import answer, reveal, student_edition

__all__ = ["answer", "check_engine", "engine_with", "reveal", "student_edition"]
