"""No class reads another's private fields: an underscore attribute is read or written only on ``self`` (or
``cls``), so every part of kvlab talks to the others through what they publish (the design card; before the
flat block manager, its mixins read ``_pool``, ``_members`` and ``_views`` that other classes created)."""

import ast
from pathlib import Path

import kvlab

KVLAB = Path(kvlab.__file__).parent


def private_reads(source: str) -> list[str]:
    """``x._name`` where ``x`` is not ``self`` or ``cls`` (dunders and protocol names such as IPython's
    ``_ipython_display_`` excepted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.endswith("_")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_checker_sees_a_private_read():
    assert private_reads("def f(pool):\n    return pool._free\n") == ["2: pool._free"]
    assert private_reads("class A:\n    def f(self):\n        return self._free, self.__dict__\n") == []


def test_no_module_reads_another_objects_private_fields():
    found = {str(path.relative_to(KVLAB)): reads for path in sorted(KVLAB.rglob("*.py"))
             if (reads := private_reads(path.read_text()))}
    assert not found, found
