"""No function of the decoding runtime, the trainers, the benchmark or the command line runs past 80 lines: a longer
one is split into named steps (transformers' `get_candidates` is the model), so that a reader sees the steps before
their details."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ["hf_diffspec/runtime", "hf_diffspec/bench", "trainers", "hf_diffspec/cli.py"]
MAX_LINES = 80


def long_functions(paths, max_lines: int = MAX_LINES) -> list[str]:
    """`path:line name (n lines)` of every function or method longer than `max_lines` (decorators not counted,
    its docstring and nested functions counted)."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > max_lines:
                    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                    found.append(f"{where}:{node.lineno} {node.name} ({lines} lines)")
    return found


def checked_files():
    for name in CHECKED:
        path = ROOT / name
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def test_the_check_sees_a_long_method(tmp_path):
    def method(name, lines):
        return f"    def {name}(self):\n" + "".join(f"        x = {i}\n" for i in range(lines - 1))

    (tmp_path / "a.py").write_text("class A:\n" + method("fits", MAX_LINES) + method("too_long", MAX_LINES + 1))
    found = long_functions([tmp_path / "a.py"])
    assert found == [f"{tmp_path / 'a.py'}:{MAX_LINES + 2} too_long ({MAX_LINES + 1} lines)"]


def test_no_function_over_80_lines():
    found = long_functions(list(checked_files()))
    assert not found, "split these into named steps:\n" + "\n".join(found)
