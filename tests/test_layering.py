"""The house's layering, read off every module's imports (its AST, so imports inside functions count too):
the wire imports no package above it, and only the application imports the application."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIRE = {"prima_rpc/codec.py", "prima_rpc/channel.py", "prima_rpc/client.py", "prima_rpc/__init__.py"}
ABOVE_THE_WIRE = ("nodes", "solver", "tools", "prima_rpc.app")  # what the wire must not import
APP = "prima_rpc.app"
# Above the application: the tests and the benchmarks drive it as a user would (they start local rings).
DRIVERS = ("tests/", "tools/bench/")


def modules() -> dict[str, Path]:
    """Every Python module of the project (tests included): its repository path -> file."""
    files = [p for top in ("prima_rpc", "nodes", "solver", "tools", "tests") for p in (ROOT / top).rglob("*.py")]
    return {p.relative_to(ROOT).as_posix(): p for p in files}


def imported(path: Path) -> set[str]:
    return imports_in(path.read_text(), path.relative_to(ROOT).parent.parts)


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


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def test_the_wire_imports_nothing_above_it():
    wire = {rel: p for rel, p in modules().items() if rel in WIRE or rel.startswith("prima_rpc/v1/")}
    assert len(wire) >= 6, sorted(wire)  # the walk found the wire (codec, channel, client, the v1 stubs)
    bad = {rel: sorted(n for n in imported(p) if any(within(n, up) for up in ABOVE_THE_WIRE))
           for rel, p in wire.items()}
    assert not {rel: names for rel, names in bad.items() if names}


def test_only_the_application_and_its_drivers_import_the_application():
    outside = {rel: p for rel, p in modules().items() if not rel.startswith(("prima_rpc/app/", *DRIVERS))}
    assert "nodes/node.py" in outside and "solver/halda.py" in outside
    bad = {rel: sorted(n for n in imported(p) if within(n, APP)) for rel, p in outside.items()}
    assert not {rel: names for rel, names in bad.items() if names}


def test_the_walk_sees_imports_in_functions_and_relative_ones():
    """The checks above would pass on a walk that saw nothing: show it sees what they look for."""
    assert "tools.synth" in imported(ROOT / "prima_rpc" / "app" / "cli.py")  # imported inside a function
    source = "def f():\n    from .app import cli\n    from . import app\n    import solver.halda\n"
    assert {"prima_rpc.app", "prima_rpc.app.cli", "solver.halda"} <= imports_in(source, ("prima_rpc",))
    assert "nodes.manifest" in imports_in("from ..manifest import StoreError\n", ("nodes", "sub"))
