"""Reading Inductor's generated code in tests (shared by tests/passes and tests/gpu)."""

import ast
import re


def arena_arg(code: str, numel: int) -> str:
    """The name under which the generated ``call`` receives the arena (the input asserted as uint8 [numel])."""
    names = re.findall(rf"assert_size_stride\((\w+), \({numel}, \), \(1, \)(?:, '\w+')?\)", code)
    assert len(names) == 1, names
    return names[0]


def op_calls(code: str, op: str) -> list[list[str]]:
    """The arguments (as source text) of every call of ``torch.ops.unimem.<op>.default`` in ``code``."""
    calls = []
    for line in code.splitlines():
        if f"torch.ops.unimem.{op}.default(" in line:
            tree = ast.parse(line.strip())
            call = next(n for n in ast.walk(tree)
                        if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(op + ".default"))
            calls.append([ast.unparse(a) for a in call.args])
    return calls
