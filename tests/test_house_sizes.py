"""The house's sizes: a module past ~400 lines or a function past ~60 has taken on another job (STYLE.md)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60
GENERATED = "prima_rpc/v1/"


def sources(tops=("prima_rpc", "nodes", "solver", "tools")) -> dict[str, str]:
    files = [p for top in tops for p in (ROOT / top).rglob("*.py")]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in files
            if not p.relative_to(ROOT).as_posix().startswith(GENERATED)}


def long_functions(source: str) -> dict[str, int]:
    """name -> lines, for every function (methods and nested ones too) longer than the limit."""
    return {f"{node.name}:{node.lineno}": node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}


def test_no_module_is_over_the_limit():
    files = sources(("prima_rpc", "nodes", "solver", "tools", "tests"))
    assert len(files) > 100
    assert not {rel: text.count("\n") for rel, text in files.items() if text.count("\n") > MAX_MODULE_LINES}


def test_no_function_is_over_the_limit():
    assert not {rel: found for rel, text in sources().items() if (found := long_functions(text))}


def test_the_function_check_sees_methods_and_nested_functions():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    source = f"class A:\n    def m(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    source += f"def outer():\n    def inner():\n    {body.replace(chr(10), chr(10) + '    ')}\n"
    assert set(long_functions(source)) == {"m:2", "outer:" + str(MAX_FUNCTION_LINES + 3),
                                           "inner:" + str(MAX_FUNCTION_LINES + 4)}
