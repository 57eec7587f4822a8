"""The project's size limits and the planner's import hygiene, checked rather than hoped for.

* every file under ``src/`` has at most :data:`MAX_FILE_LINES` lines and every function (method,
  nested function) at most :data:`MAX_FUNCTION_LINES`, from its ``def`` line to its last line;
  what is over today is named in :data:`ALLOWED`, with the lines it may have, and may not grow;
* no planner module imports another planner module inside a function (nor an ``api/`` module
  any of the package's): the rooms' layers
  (``pyproject.toml``'s planner contract, checked by ``lint-imports``) leave no cycle to dodge,
  and the run-time import graph inside ``planner/`` has no cycle at all (also inside a room).

Pure source reading (``ast``), no process group: well under a second.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PLANNER = SRC / "hybridpar" / "planner"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60

#: What is over a limit, with the size it may not exceed: empty, and to stay empty (split by
#: concern instead). Keys: a path under src/ (a file's lines), or "path::function" (a function's).
ALLOWED: dict[str, int] = {}


def _sources() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _key(path: Path) -> str:
    return path.relative_to(SRC).as_posix()


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def over_limits() -> dict[str, int]:
    """Every file and function over its limit, with its size."""
    over: dict[str, int] = {}
    for path in _sources():
        text = path.read_text()
        lines = len(text.splitlines())
        if lines > MAX_FILE_LINES:
            over[_key(path)] = lines
        for fn in _functions(ast.parse(text)):
            size = fn.end_lineno - fn.lineno + 1
            if size > MAX_FUNCTION_LINES:
                over[f"{_key(path)}::{fn.name}"] = size
    return over


def test_files_and_functions_within_limits():
    over = over_limits()
    new = {k: v for k, v in over.items() if k not in ALLOWED or v > ALLOWED[k]}
    assert not new, (f"over {MAX_FILE_LINES} lines a file or {MAX_FUNCTION_LINES} a function (split by concern, "
                     f"not to meet the number): {new}")
    stale = sorted(set(ALLOWED) - set(over))
    assert not stale, f"back within the limits: remove {stale} from ALLOWED"


def test_the_limit_check_sees_a_long_function_and_a_long_file(tmp_path, monkeypatch):
    """The check itself: a 61-line function and a 501-line file are reported, a 60-line one not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(59))
    (tmp_path / "ok.py").write_text(f"def fits():\n{body}\n")
    (tmp_path / "long.py").write_text(f"def too_long():\n{body}\n    x = 0\n" + "\n" * 440)
    monkeypatch.setitem(globals(), "SRC", tmp_path)
    assert over_limits() == {"long.py": 501, "long.py::too_long": 61}


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _planner_imports(tree: ast.Module) -> tuple[set[str], list[int]]:
    """(planner modules imported at run time at module level, lines of planner imports inside a
    function). ``if TYPE_CHECKING:`` blocks hold type names only, no run-time dependency."""
    top: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.ImportFrom) and (sub.module or "").startswith("hybridpar.planner"):
                top |= {f"{sub.module}.{a.name}" for a in sub.names} | {sub.module}
    inner = [sub.lineno for fn in _functions(tree) for sub in ast.walk(fn)
             if isinstance(sub, ast.Import | ast.ImportFrom)
             and any(m.startswith("hybridpar.planner") for m in [getattr(sub, "module", "") or ""]
                     + [a.name for a in sub.names])]
    return top, inner


def test_planner_has_no_function_level_imports_and_no_cycle():
    modules = {_module(p): p for p in PLANNER.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    inner: dict[str, list[int]] = {}
    for name, path in modules.items():
        top, lines = _planner_imports(ast.parse(path.read_text()))
        graph[name] = {m for m in top if m in modules and m != name}
        if lines:
            inner[name] = lines
    assert not inner, f"planner modules importing planner modules inside functions (lines): {inner}"
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, f"import cycle in planner/: {' -> '.join([*path[path.index(node):], node])}"
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*path, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])


def test_api_has_no_function_level_imports_of_the_package():
    """``api/``'s modules import the package's modules at module level (its layers in
    ``pyproject.toml`` leave no cycle to break inside a function, issue 40)."""
    inner = {str(p.relative_to(SRC)): lines for p in (SRC / "hybridpar" / "api").rglob("*.py")
             if (lines := [sub.lineno for fn in _functions(ast.parse(p.read_text())) for sub in ast.walk(fn)
                           if isinstance(sub, ast.Import | ast.ImportFrom)
                           and any(m.startswith("hybridpar") for m in [getattr(sub, "module", "") or ""]
                                   + [a.name for a in sub.names])])}
    assert not inner, f"api/ modules importing hybridpar inside functions (lines): {inner}"
