"""The package's shape: dependencies point down, nothing reaches into another module's privates.

- no import cycle among `selfspec`'s modules (imports inside functions count:
  a lazy import that closes a cycle is still a cycle);
- the engine never imports a tool (`selfspec.cli`, `selfspec.tuning`,
  `selfspec.training`, `selfspec.serving`);
- no module imports another module's underscored name;
- no file in the repository edits the module search path (sys + path);
- docs a newcomer can read: every module docstring in `selfspec` at most 200
  words, README.md at most 300 lines, every relative link in README.md,
  docs/ and benchmarks/*.md pointing at a file that exists.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import selfspec

PACKAGE = Path(selfspec.__file__).resolve().parent
REPO = PACKAGE.parent
TOOLS = ("selfspec.cli", "selfspec.tuning", "selfspec.training", "selfspec.serving")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(encoding="utf-8")) for p in sorted(PACKAGE.rglob("*.py"))}


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(known: dict[str, ast.Module]) -> dict[str, set[tuple[str, str | None]]]:
    """module -> {(imported module, imported name or None)} within selfspec."""
    found: dict[str, set[tuple[str, str | None]]] = {}
    for module, tree in known.items():
        is_package = (PACKAGE.parent / module.replace(".", "/") / "__init__.py").is_file()
        edges = found.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update((a.name, None) for a in node.names if a.name.startswith("selfspec"))
            elif isinstance(node, ast.ImportFrom):
                target = resolve(module, is_package, node)
                if not target.startswith("selfspec"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    edges.add((sub, None) if sub in known else (target, alias.name))
    return found


def test_no_import_cycles():
    known = modules()
    graph = {m: {t for t, _ in edges if t in known and t != m} for m, edges in imports(known).items()}
    # A package's __init__ importing its own submodules is how a package exports; not a cycle.
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    cycles, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_engine_never_imports_a_tool():
    known = modules()
    engine = [m for m in known if not m.startswith(TOOLS) and m != "selfspec.testing"]
    bad = sorted(
        f"{m} imports {t}" for m in engine for t, _ in imports(known)[m] if t.startswith(TOOLS)
    )
    assert not bad, bad


def test_no_module_imports_another_modules_private_name():
    known = modules()
    bad = sorted(
        f"{m} imports {name} from {t}"
        for m, edges in imports(known).items()
        for t, name in edges
        if name and name.startswith("_") and not name.startswith("__") and t != m
    )
    assert not bad, bad


def test_no_file_edits_the_module_search_path():
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        if any(part.startswith(".") or part in ("build", "dist") for part in path.relative_to(REPO).parts):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "path" and getattr(node.value, "id", None) == "sys":
                offenders.append(str(path.relative_to(REPO)))
                break
    assert not offenders, f"files that touch the module search path: {offenders}"


DOCSTRING_WORDS = 200
README_LINES = 300


def test_module_docstrings_are_short():
    """A module docstring says what the module is, does and does not know; details live in docs/."""
    long = sorted(
        f"{p.relative_to(REPO)}: {n} words"
        for p in PACKAGE.rglob("*.py")
        if (n := len((ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "").split())) > DOCSTRING_WORDS
    )
    assert not long, f"module docstrings over {DOCSTRING_WORDS} words: {long}"


def test_readme_fits_a_newcomer():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; at most {README_LINES} (topics go to docs/)"


def test_doc_links_point_at_files():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").glob("*.md"))]
    assert (REPO / "docs").is_dir() and len(pages) > 3
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"links to missing files: {broken}"
