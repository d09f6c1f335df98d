"""The house's floors, read off every module's imports (its AST, so imports inside functions and under
TYPE_CHECKING count too): each part imports only the parts below it, and no modules import each other in a loop."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each part, lowest floor first, with the parts it may import. A module belongs to the longest part its name
# starts with. Third-party packages are not parts: they are not checked here.
SPEC = "prima_rpc.spec"  # the shared words: manifest, shapes, profiles, windows, the home folder
WIRE = ("prima_rpc.v1", "prima_rpc")  # stubs, codec, channel, client
FLOORS: dict[str, tuple[str, ...]] = {
    SPEC: (),
    "prima_rpc.v1": (),
    "prima_rpc": (SPEC, "prima_rpc.v1"),
    "solver": (SPEC,),
    "nodes": (SPEC, *WIRE),  # nodes/__init__.py, nodes/errors.py
    "nodes.engine": (SPEC, "nodes"),
    "nodes.generation": (SPEC, *WIRE, "nodes", "nodes.engine"),
    "nodes.profiling": (SPEC, *WIRE, "nodes", "nodes.engine", "nodes.generation"),
    # the head re-plans live (nodes/ring/replanner.py): it solves Halda itself
    "nodes.ring": (SPEC, *WIRE, "solver", "nodes", "nodes.engine", "nodes.generation", "nodes.profiling"),
    "tools": (SPEC, *WIRE, "solver", "nodes", "nodes.engine", "nodes.generation"),  # importers, synth
    "prima_rpc.app": (SPEC, *WIRE, "solver", "nodes", "nodes.engine", "nodes.generation", "tools"),
    # Above the application: the benchmarks and the tests drive it as a user would (they start local rings).
    "tools.bench": ("*",),
    "tools.testbed": ("*",),  # a home of devices on one machine: it starts their nodes and waits for them
    "tests": ("*",),
}
# The application reaches the importers through one module, not through each of them.
APP_TO_TOOLS = {"tools.importers"}


def modules() -> dict[str, Path]:
    """Every Python module of the project (tests included) by dotted name."""
    files = [p for top in ("prima_rpc", "nodes", "solver", "tools", "tests") for p in (ROOT / top).rglob("*.py")]
    return {dotted(p): p for p in files}


def dotted(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    rel = path.relative_to(ROOT)
    package = rel.parent.parts if rel.name != "__init__.py" else rel.parent.parts
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: tuple[str, ...]) -> set[str]:
    """The absolute module names a module of `package` imports (relative imports resolved against it)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from prima_rpc import app`
    return names


def part_of(name: str) -> str | None:
    """The part a module name belongs to (the longest match), None for a third-party name."""
    matches = [p for p in FLOORS if name == p or name.startswith(p + ".")]
    return max(matches, key=len) if matches else None


def project_imports() -> dict[str, set[str]]:
    """Module -> the project modules it imports (names of modules, not of their attributes)."""
    mods = modules()
    return {name: {n for n in imported(path) if n in mods and n != name} for name, path in mods.items()}


def test_every_part_imports_only_the_floors_below_it():
    bad = {}
    for name, path in modules().items():
        src = part_of(name)
        allowed = FLOORS[src]
        if "*" in allowed:
            continue
        for n in imported(path):
            dst = part_of(n)
            if dst is None or dst == src:
                continue
            if dst not in allowed or (src == "prima_rpc.app" and dst == "tools" and n not in APP_TO_TOOLS
                                      and n.rsplit(".", 1)[0] not in APP_TO_TOOLS):
                bad.setdefault(name, []).append(n)
    assert not bad


def test_the_shared_words_import_nothing_but_the_standard_library():
    spec = {name: path for name, path in modules().items() if part_of(name) == SPEC}
    assert {"prima_rpc.spec.manifest", "prima_rpc.spec.windows", "prima_rpc.spec.home"} <= set(spec)
    allowed = {"__future__", "dataclasses", "enum", "functools", "hashlib", "json", "math", "os", "pathlib",
               "typing", "prima_rpc.spec"}
    bad = {name: sorted(n for n in imported(path) if n.split(".")[0] not in allowed
                        and not n.startswith(SPEC))
           for name, path in spec.items()}
    assert not {k: v for k, v in bad.items() if v}


def test_no_modules_import_each_other_in_a_loop():
    graph = project_imports()
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    assert not circles


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of a directed graph."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_the_checks_see_what_they_look_for():
    """The checks above would pass on a walk that saw nothing: show they find what they look for."""
    assert "tools.importers" in imported(ROOT / "prima_rpc" / "app" / "cli_store.py")  # inside a function
    source = "def f():\n    from .app import cli\n    from . import app\n    import solver.halda\n"
    assert {"prima_rpc.app", "prima_rpc.app.cli", "solver.halda"} <= imports_in(source, ("prima_rpc",))
    assert "nodes.engine.store" in imports_in("from ..store import LayerStore\n", ("nodes", "engine", "sub"))
    assert part_of("nodes.ring.node") == "nodes.ring" and part_of("prima_rpc.codec") == "prima_rpc"
    assert part_of("prima_rpc.spec.manifest") == SPEC and part_of("torch") is None
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": {"a"}}) in ([["a", "b"], ["c"]], [["c"], ["a", "b"]])
    assert len(project_imports()["nodes.ring.node"]) > 5
