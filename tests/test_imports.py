"""The import graph of the project's packages: dependencies point one way,
flows -> pipelines -> model.decoding -> model -> components, and no module imports itself
back: decoding reads the networks and restored models; the networks and their training
never import decoding (a training stage gives the loop its dev decoding).

Every import counts, also one inside a function (imported on use): a lazy import upward
still ties a lower layer to a higher one. `theory/` stands apart: it imports none of the
translation packages.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# A module may import its own package or one of lower rank.
RANKS = {"components": 0, "model": 1, "model.decoding": 2, "pipelines": 3, "flows": 4}
PACKAGES = ("components", "model", "pipelines", "flows", "theory")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path
           for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}


def _imports(module: str) -> set[str]:
    """The project modules `module` imports, anywhere in its body."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from components import dag` names a module; `from components.dag import X` not.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            assert not isinstance(node, ast.ImportFrom), f"{module}: relative import"
            continue
        found.update(name for name in names if name in MODULES and name != module)
    return found


GRAPH = {module: _imports(module) for module in MODULES}


def _package(module: str) -> str:
    """The layer of a module: its top package, or `model.decoding`."""
    return "model.decoding" if module.startswith("model.decoding") else module.split(".")[0]


def test_the_graph_covers_every_package():
    assert {_package(module) for module in MODULES} == {*RANKS, "theory"}
    assert "flows.stages" in GRAPH["flows.cli"] and "flows.stages" in GRAPH["flows.flow"]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module):
    package = _package(module)
    for imported in GRAPH[module]:
        target = _package(imported)
        if package == "theory" or target == "theory":
            assert package == target or package == "flows", (
                f"{module} imports {imported}: theory/ and the translation packages are apart "
                "(only flows/ may run theory)")
            continue
        assert RANKS[target] <= RANKS[package], (
            f"{module} imports {imported}: upward (flows -> pipelines -> model.decoding -> "
            "model -> components)")


def test_no_import_cycle():
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = path[path.index(module):] + (module,)
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(GRAPH[module]):
            visit(imported, path + (module,))
        done.add(module)

    for module in sorted(GRAPH):
        visit(module, ())
