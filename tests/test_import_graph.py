"""forerun's modules import one another in one direction: no loop, however long.

Read from the sources (nothing is imported): every `import forerun...` and `from forerun...
import ...`, at module level and inside functions alike. The loops this guards against all
ran through imports deferred into functions (cli.py <-> bench/commands.py, config.py ->
drafters/base.py -> config.py, linears/int8.py <-> models/int8_probe.py): deferring an import
hides a loop from Python at import time, not from a reader. Only `if TYPE_CHECKING:` blocks
are left out (annotations, never run).
"""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "forerun"


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package ("forerun.drafters" is its __init__)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(node: ast.AST, here: str, is_package: bool, known: dict) -> list[str]:
    """The forerun modules one import statement names (`from a import b`: a.b where that is a
    module, else a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from its package, one level up per extra dot
            package = here.split(".") if is_package else here.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    found = []
    for name in names:
        while name and name not in known:  # `import forerun.linears.int8 as q` -> that module
            name = name.rpartition(".")[0]
        if name.startswith("forerun"):
            found.append(name)
    return found


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes inside `if TYPE_CHECKING:` blocks."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        skip = _type_checking_only(tree)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skip:
                targets |= set(_imported(node, name, path.name == "__init__.py", known))
        graph[name] = targets - {name}
    return graph


def find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop as [a, b, ..., a], or None (depth-first search, colouring nodes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (loop := visit(nxt)):
                return loop
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (loop := visit(start)):
            return loop
    return None


def test_the_scan_finds_a_loop_and_reads_imports_in_functions():
    assert find_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_loop({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert "forerun.cli_args" in graph["forerun.serve.main"]  # (imported inside cmd_serve)
    assert "forerun.kernels.loader" in graph["forerun.linears.int8"]
    assert "forerun.drafters.ngram" in graph["forerun.drafters"]  # from forerun.drafters import ngram


def test_no_import_loop_in_the_package():
    loop = find_loop(import_graph())
    assert loop is None, "import loop: " + " -> ".join(loop) + " (give what both need a module below them)"
