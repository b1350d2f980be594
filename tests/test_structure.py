"""The engine's layout bounds (docs/design.md, its opening paragraphs): no module of
``arena_loader/`` outside ``bench/`` over 400 lines, no class over 250, and no circle among
the modules' run-time imports. Checked from the source, so a change that crosses a bound
fails here and not in a later review."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "arena_loader"
MAX_MODULE_LINES = 400
MAX_CLASS_LINES = 250


def engine_modules() -> dict[str, Path]:
    """Dotted name -> path, for every module of the package outside ``bench/``."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "bench" in parts:
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def runtime_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports when it is imported: relative imports at module
    level (``if TYPE_CHECKING:`` blocks and imports inside functions run later or never)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if not isinstance(node, ast.ImportFrom) or not node.level:
            continue
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:  # `from . import x` may name a module
            if f"{target}.{alias.name}" in known:
                found.add(f"{target}.{alias.name}")
        if target in known:
            found.add(target)
    found.discard(name)
    return found


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (a package's ``__init__`` excluded: importing a
    submodule imports its package first, which is no circle of ours), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (circle := visit(nxt, path)) is not None:
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (circle := visit(start, [])) is not None:
            return circle
    return None


def test_no_engine_module_is_over_400_lines():
    long = {name: n for name, path in engine_modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them): {long}"


def test_no_engine_class_is_over_250_lines():
    long = {}
    for name, path in engine_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_CLASS_LINES:
                    long[f"{name}.{node.name}"] = lines
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them): {long}"


def test_no_import_circle_among_engine_modules():
    modules = engine_modules()
    known = set(modules)
    packages = {name for name, path in modules.items() if path.name == "__init__.py"}
    graph = {name: runtime_imports(name, path, known) - packages
             for name, path in modules.items() if name not in packages}
    assert find_circle(graph) is None, f"import circle: {' -> '.join(find_circle(graph))}"


def test_the_circle_finder_finds_a_circle():
    """The check above is only as good as its finder: a -> b -> c -> a is found."""
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_the_import_reader_sees_the_engines_imports():
    """An import reader that saw nothing would find no circle: known edges are read."""
    modules = engine_modules()
    known = set(modules)
    process = runtime_imports("arena_loader._process", modules["arena_loader._process"], known)
    assert {"arena_loader._slab", "arena_loader._worker", "arena_loader.errors"} <= process
    slab = runtime_imports("arena_loader._slab", modules["arena_loader._slab"], known)
    assert "arena_loader._forksafe" in slab  # `from . import _forksafe`
