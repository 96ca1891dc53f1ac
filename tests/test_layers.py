"""The layer rule, held by walking the AST of every module (as tests/core/test_contract.py does for exit statuses).

egress's packages are layers (docs/architecture.md, "The house"); each may import only layers
below it:

    core  <-  scan  <-  agent  <-  policy  <-  observe  <-  proxy  <-  host  <-  serve, run  <-  cli  <-  entry

and sandbox/, the platform layer, imports nothing of egress but egress.core. Three rules:

- no import goes up or sideways (a package importing a sibling of its own rank, or one above);
- no circle between modules, counting imports inside functions too (a lazy import hides an
  arrow from a reader, not from this test);
- an import inside a function is a start-up tool: it must defer an outside module the importer
  has not already paid for (mitmproxy, click, re, ...), or sit at one of the named seams below.
"""

from __future__ import annotations

import ast
import collections
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Rank of each layer: an import must go to a strictly lower rank, or stay inside its package.
RANKS = {
    "egress.core": 0, "egress": 0,  # egress/__init__.py holds the version alone
    "egress.scan": 1, "sandbox": 1,
    "egress.agent": 2,
    "egress.policy": 3,
    "egress.observe": 4,
    "egress.proxy": 5,
    "egress.host": 6,
    "egress.serve": 7, "egress.run": 7,
    "egress.cli": 8,
    "egress.entry": 9, "egress.__main__": 10,
}

# sandbox/ may import exactly these of egress.
PLATFORM_MAY_IMPORT = ("egress.core",)

# Modules whose imports inside functions are their purpose, with the reason.
SEAMS = {
    "egress.entry": "the console script: `egress run` starts without click, every other command with it",
    "egress.run.warm.server": "imports, before it forks, every module a run's child will use",
}

# Known breaches of the rules, each to be removed by issue 27's work: this list only shrinks.
KNOWN_UP: set[tuple[str, str]] = set()
KNOWN_CIRCLES: set[frozenset[str]] = set()
KNOWN_LAZY: set[tuple[str, str]] = set()

# Outside modules that cost nothing to have imported (the interpreter loads them at start).
FREE = {"__future__", "os", "sys", "errno", "stat", "time", "types", "collections", "functools",
        "itertools", "operator", "abc", "enum", "io", "codecs", "posixpath", "genericpath",
        "contextlib", "typing", "warnings", "keyword", "reprlib"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in [*ROOT.glob("egress/**/*.py"), *ROOT.glob("sandbox/**/*.py")]:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _targets(module: str, node: ast.Import | ast.ImportFrom, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - node.level + 1]
        base = ".".join([*parts, *([node.module] if node.module else [])])
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]


Import = collections.namedtuple("Import", "module target line lazy")


def _imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        is_package = path.name == "__init__.py"

        def walk(node, lazy, typing_only):
            for child in ast.iter_child_nodes(node):
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                typing = typing_only or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
                if isinstance(child, (ast.Import, ast.ImportFrom)) and not typing:
                    for target in _targets(module, child, is_package):
                        found.append(Import(module, target, child.lineno, lazy))
                walk(child, inner, typing)

        walk(ast.parse(path.read_text()), False, False)
    return found


IMPORTS = _imports()


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("egress", "sandbox")


def _known(name: str) -> str:
    """The module an imported name lives in (``egress.policy.matcher.Policy`` -> the module)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "sandbox" or len(parts) == 1:
        return parts[0]
    return ".".join(parts[:2])


def test_every_module_sits_in_a_layer():
    stray = sorted(module for module in MODULES if layer(module) not in RANKS)
    assert not stray, f"modules outside every layer (add them to a package, or a layer to RANKS): {stray}"


def test_every_package_folder_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {module for module, path in MODULES.items() if path.name == "__init__.py"}
    assert packages - listed == set(), "pyproject.toml's [tool.setuptools] packages misses these"


def test_no_import_goes_up_or_sideways():
    breaches = set()
    for edge in IMPORTS:
        if not _ours(edge.target):
            continue
        source, target = layer(edge.module), layer(_known(edge.target))
        if source == target:
            continue
        if source == "sandbox":
            if not any(_known(edge.target).startswith(allowed) for allowed in PLATFORM_MAY_IMPORT):
                breaches.add((edge.module, _known(edge.target)))
        elif RANKS[target] >= RANKS[source]:
            breaches.add((edge.module, _known(edge.target)))
    assert breaches - KNOWN_UP == set(), "imports that go up or sideways (docs/architecture.md, The house)"
    assert KNOWN_UP - breaches == set(), "fixed: remove these from KNOWN_UP"


def _circles() -> set[frozenset[str]]:
    graph = collections.defaultdict(set)
    for edge in IMPORTS:
        if _ours(edge.target) and _known(edge.target) != edge.module:
            graph[edge.module].add(_known(edge.target))
    # Tarjan's strongly connected components
    index, low, stack, on_stack, found = {}, {}, [], set(), set()

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.add(frozenset(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_circles_between_modules():
    circles = _circles()
    assert circles - KNOWN_CIRCLES == set(), "modules that import each other, directly or round a loop"
    assert KNOWN_CIRCLES - circles == set(), "fixed: remove these from KNOWN_CIRCLES"


def _top_level_closure() -> dict[str, set[str]]:
    top = collections.defaultdict(set)
    for edge in IMPORTS:
        if not edge.lazy:
            top[edge.module].add(_known(edge.target) if _ours(edge.target) else edge.target)
    memo: dict[str, set[str]] = {}

    def closure(module: str) -> set[str]:
        if module in memo:
            return memo[module]
        seen = memo[module] = set()
        todo = [module]
        while todo:
            name = todo.pop()
            parts = name.split(".")
            for each in [".".join(parts[:i]) for i in range(1, len(parts) + 1)]:  # a package's __init__ runs first
                if each not in seen:
                    seen.add(each)
                    todo.extend(top.get(each, ()))
        return seen

    return closure


def test_an_import_inside_a_function_defers_a_cost_or_sits_at_a_named_seam():
    closure = _top_level_closure()

    def outside(modules):
        return {name.split(".")[0] for name in modules if not _ours(name)} - FREE

    hidden = set()
    for edge in IMPORTS:
        if not edge.lazy or not _ours(edge.target) or edge.module in SEAMS:
            continue
        if not outside(closure(_known(edge.target))) - outside(closure(edge.module)):
            hidden.add((edge.module, _known(edge.target)))
    assert hidden - KNOWN_LAZY == set(), (
        "imports inside functions that defer nothing: import at the top of the module "
        "(or name the seam in SEAMS, with its reason)")
    assert KNOWN_LAZY - hidden == set(), "fixed: remove these from KNOWN_LAZY"
