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


# namedtuple's documented API (its names start with "_" so as not to clash with fields).
PUBLIC_UNDERSCORED = {"_fields", "_asdict", "_replace", "_make", "_field_defaults"}
# The private attributes of another file or library the engine may read, each with a comment
# beside it saying why no public way exists (issue 21: at most 3).
ALLOWED_FOREIGN_PRIVATE = {
    ("arena_loader._process", "_popen"),  # multiprocessing: a reaped process's sentinel
    ("arena_loader._worker_torch", "_worker_info"),  # torch: what get_worker_info() returns
    ("arena_loader._datapipe", "_IterDataPipeSerializationWrapper"),  # torch: DataPipes
}


def own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions and classes, names it assigns, attributes it
    sets on ``self``/``cls``, and ``__slots__`` entries."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            names.update(c.value for c in ast.walk(node.value)
                         if isinstance(c, ast.Constant) and isinstance(c.value, str))
    return names


def foreign_private_reads(source: str) -> list[tuple[str, int]]:
    """(attribute, line) for each use of a private attribute the module does not define
    itself, on anything but ``self``/``cls``: ``x._name`` or ``getattr(x, "_name")``."""
    tree = ast.parse(source)
    own = own_names(tree) | PUBLIC_UNDERSCORED
    found = []
    for node in ast.walk(tree):
        attr = None
        if isinstance(node, ast.Attribute) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            attr = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            attr = node.args[1].value
        if attr and attr.startswith("_") and not attr.startswith("__") and attr not in own:
            found.append((attr, node.lineno))
    return found


def test_private_attributes_of_other_files_or_libraries_are_read_three_times_at_most():
    found = {}
    for name, path in engine_modules().items():
        source = path.read_text()
        lines = source.splitlines()
        for attr, line in foreign_private_reads(source):
            found.setdefault((name, attr), []).append(line)
            if (name, attr) in ALLOWED_FOREIGN_PRIVATE:
                near = " ".join(lines[max(0, line - 4): line + 3]).lower()
                assert "private" in near, f"{name}:{line}: say beside .{attr} why it is read"
    unexpected = {key: lines for key, lines in found.items()
                  if key not in ALLOWED_FOREIGN_PRIVATE}
    assert not unexpected, (
        f"private attributes of another file or library read (module, attribute): lines "
        f"{unexpected}; use or add a public way (a property, a parameter) instead")
    assert len(ALLOWED_FOREIGN_PRIVATE) <= 3


def test_the_private_read_finder_finds_reads():
    """The check above is only as good as its finder."""
    source = ("class A:\n    def __init__(self):\n        self._mine = 1\n"
              "    def f(self, other, b):\n        return other._theirs, b._mine, self._x, "
              "getattr(other, '_hidden'), other.__class__, other._fields\n")
    assert sorted(attr for attr, _ in foreign_private_reads(source)) == ["_hidden", "_theirs"]
