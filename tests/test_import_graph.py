"""The package's import graph has no circles: a circle makes import order matter, hides which module owns a type, and
is what lazy imports inside functions were papering over. Every import counts, at module level or inside a function."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# directory -> installed package (pyproject's package-dir)
PACKAGES = {"hf_diffspec": "hf_diffspec", "modeling": "hf_diffspec.modeling", "trainers": "hf_diffspec.trainers"}


def module_files():
    """``{dotted module name: path}`` for every module of the installed packages."""
    modules = {}
    for directory, package in PACKAGES.items():
        for path in (ROOT / directory).rglob("*.py"):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported_modules(name, path, modules):
    """The modules of ours that `name` (at `path`) imports, resolved the way Python resolves them: `from a import b`
    names the module `a.b` when it exists, else `a`'s `__init__`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(target for target in targets if target in modules and target != name)
    return found


def import_graph():
    modules = module_files()
    return {name: imported_modules(name, path, modules) for name, path in modules.items()}


def find_cycle(graph):
    """One import circle as a list of modules (first == last), or None."""
    state = {}  # module -> "open" while on the current path, "done" after

    def visit(module, path):
        state[module] = "open"
        path.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return path[path.index(imported) :] + [imported]
            if imported not in state:
                cycle = visit(imported, path)
                if cycle:
                    return cycle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [])
            if cycle:
                return cycle
    return None


def test_graph_sees_relative_and_function_level_imports():
    graph = import_graph()
    assert "hf_diffspec.runtime.decoding" in graph["hf_diffspec"]
    assert "hf_diffspec.runtime.files" in graph["hf_diffspec.trainers.data"]
    assert "hf_diffspec.targets" in graph["hf_diffspec"]  # imported inside `__getattr__`


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle) + " (move what both sides need into a leaf module)"
