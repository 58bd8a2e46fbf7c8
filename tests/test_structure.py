"""The package's size rule: no module in `hf_loopspec/` over 450 lines, no function or method over 80.

A function's length counts from its `def` line to the last line of its body (decorators excluded, nested functions
included in their parent's length and measured on their own too). The limits are the project's style rule, checked
here so that a change that breaks it fails with the module or function named, rather than waiting for a reader.
"""

from __future__ import annotations

import ast

from processes import ROOT

PACKAGE = ROOT / "hf_loopspec"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def oversized(source: str, where: str) -> list[str]:
    """One message per breach of the size rule in one module's `source` (`where` names the module)."""
    breaches = []
    lines = len(source.splitlines())
    if lines > MAX_MODULE_LINES:
        breaches.append(f"{where}: module has {lines} lines (limit {MAX_MODULE_LINES})")
    for node in ast.walk(ast.parse(source, filename=where)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                breaches.append(f"{where}:{node.lineno}: function {node.name} has {length} lines "
                                f"(limit {MAX_FUNCTION_LINES})")
    return breaches


def test_rule_catches_long_modules_and_functions():
    """The check itself: a function of 81 lines and a module of 451 are reported by name; 80 and 450 are not."""
    def function(name: str, length: int) -> str:  # a `def` line and length - 1 body lines
        return "\n".join([f"def {name}():"] + ["    x = 1"] * (length - 1))

    assert oversized(function("ok", 80), "m.py") == []
    assert oversized(function("too_long", 81), "m.py") == ["m.py:1: function too_long has 81 lines (limit 80)"]
    method = "class C:\n" + "\n".join("    " + line for line in function("long_method", 81).splitlines())
    assert oversized(method, "m.py") == ["m.py:2: function long_method has 81 lines (limit 80)"]
    assert oversized("x = 1\n" * 450, "m.py") == []
    assert oversized("x = 1\n" * 451, "m.py") == ["m.py: module has 451 lines (limit 450)"]


def test_package_modules_and_functions_are_small():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no modules found under {PACKAGE}"
    breaches = [b for path in modules
                for b in oversized(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE.parent)))]
    assert not breaches, "split along responsibilities:\n" + "\n".join(breaches)
