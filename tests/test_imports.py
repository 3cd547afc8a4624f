"""Import structure: the domain library is independent of the pipeline, only the CLI imports the CLI,
and no import placed inside a function hides an import cycle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "memalpha"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside functions) of one file."""
    tree = ast.parse(path.read_text())
    top, inner = set(), set()
    function_nodes = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                      for n in ast.walk(f)}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        names = [n for n in names if n.startswith("memalpha")]
        (inner if id(node) in function_nodes else top).update(names)
    return top, inner


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    top, inner = {}, {}
    for name, path in modules.items():
        t, i = _imports(path)
        top[name] = {m for m in t if m in modules}
        inner[name] = {m for m in i if m in modules}
    return modules, top, inner


def _reaches(top: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            stack.extend(top.get(node, ()))
            # importing a submodule runs its package's __init__ first
            parent = node.rsplit(".", 1)[0]
            if parent != node:
                stack.append(parent)
    return False


def test_no_function_level_import_hides_a_cycle():
    _, top, inner = _graph()
    hidden = [(module, target) for module, targets in inner.items() for target in targets
              if target != module and _reaches(top, target, module)]
    assert hidden == [], f"moving these imports to module level would create a cycle: {hidden}"


def test_only_the_cli_and_its_commands_import_the_cli():
    _, top, inner = _graph()
    importers = {m for m in top if "memalpha.cli" in top[m] | inner[m]}
    assert importers <= {"memalpha.cli", "memalpha.__main__"} | {m for m in top if m.startswith("memalpha.commands")}


def test_the_domain_library_imports_neither_prefect_nor_mlflow():
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            assert not any(n.split(".")[0] in ("prefect", "mlflow", "tasks", "flows") for n in names), path
