"""No import cycle inside the kvlab package: a cycle means two modules that are really one (or a helper that
belongs in a third), and makes import order matter. The graph is built statically with ``ast``, from every
import in a module at any depth (inside functions too): ``import a.b`` and ``from a import b`` give an edge
to ``a.b`` where that is a module, else to ``a`` (``from a.b import name`` with ``name`` not a module)."""

import ast
from pathlib import Path

import kvlab

PACKAGE = Path(kvlab.__file__).parent


def module_names() -> dict[str, Path]:
    """{dotted name: file} of every module in the package (a package is its ``__init__.py``)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("kvlab",) + path.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules) -> set[str]:
    """The kvlab modules ``name`` imports."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package holding this module, up level - 1 more
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import kvlab.a.b.name`: the module that holds it
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of the graph, or None (depth-first search, colouring the stack)."""
    state = {}  # name -> "open" while on the stack, "done" after

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_sees_imports_at_any_depth_and_resolves_submodules():
    graph = import_graph()
    assert "kvlab.kernels.paged_prefill" in graph["kvlab.kernels"]          # from kvlab.kernels.x import y
    assert "kvlab.device" in graph["kvlab.kernels.paged_prefill"]           # import kvlab.device
    assert "kvlab.engine.llm" in graph["kvlab.engine"]


def test_no_import_cycle_in_kvlab():
    graph = import_graph()
    cycles = []
    while (cycle := find_cycle(graph)) is not None:  # every cycle, one edge removed per cycle found
        cycles.append(" -> ".join(cycle))
        graph[cycle[-2]] = graph[cycle[-2]] - {cycle[-1]}
    assert not cycles, "import cycles in kvlab:\n" + "\n".join(cycles)
