"""The shape of the code, checked: few modules at the top of the package, state
changed only by its owner's methods, layers that import downward only."""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dsgd")

# Who may import whom (dsgd/<package> -> packages it may import). Top-level
# modules (config, constants, errors, model, progress, ray_private) are shared by all.
LAYERS = {
    "native": set(),
    "comm": {"native"},
    "worker": {"comm", "native"},
    "engine": {"worker", "comm", "native"},
    "data": {"engine", "worker", "comm", "native"},
    "trainer": {"data", "engine", "worker", "comm", "native"},
    "train": {"comm", "native"},
    "examples": {"trainer", "train", "data", "engine", "worker", "comm", "native"},
}
TOP_LEVEL_LIMIT = 8


def python_files():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), ast.parse(open(path).read(), path)


def attribute_stores_on(function, names: set[str]) -> list[str]:
    """`x.attr = ...` (or +=, or annotated) in `function` where x, or the start
    of a chain x.a.b, is one of `names`."""
    found = []
    for node in ast.walk(function):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                   else [])
        for target in targets:
            for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                base = element
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(element, ast.Attribute) and isinstance(base, ast.Name) \
                        and base.id in names:
                    found.append(f"{function.name}:{element.lineno} {ast.unparse(element)}")
    return found


def parameters(function) -> set[str]:
    args = function.args
    return {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs
            + [a for a in (args.vararg, args.kwarg) if a is not None]}


def test_at_most_eight_modules_directly_in_the_package():
    modules = sorted(n for n in os.listdir(PACKAGE) if n.endswith(".py"))
    assert len(modules) <= TOP_LEVEL_LIMIT, modules


def test_no_module_level_function_sets_attributes_of_its_arguments():
    offenders = []
    for path, tree in python_files():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                offenders += [f"{path} {x}" for x in attribute_stores_on(node, parameters(node))]
    assert offenders == []


def test_no_method_sets_attributes_of_an_object_handed_to_it():
    """Methods change their own object only (self.x = ...), never another
    object passed to them: that would be a method in the wrong place."""
    offenders = []
    for path, tree in python_files():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for method in cls.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    others = parameters(method) - {"self", "cls"}
                    offenders += [f"{path} {cls.name}.{x}"
                                  for x in attribute_stores_on(method, others)]
    assert offenders == []


def imported_dsgd_packages(tree) -> set[str]:
    """The dsgd subpackages a module imports (`dsgd.X...` or `from dsgd import X`)."""
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "dsgd" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downward_only(layer):
    wrong = {}
    for path, tree in python_files():
        if path.split(os.sep)[0] != layer:
            continue
        bad = imported_dsgd_packages(tree) - LAYERS[layer] - {layer}
        if bad:
            wrong[path] = sorted(bad)
    assert wrong == {}


def test_top_level_modules_import_no_layer():
    """config, constants, errors, model, progress, ray_private: shared by every
    layer, so they import none (dsgd/__init__.py, the public face, may)."""
    wrong = {path: sorted(imported_dsgd_packages(tree)) for path, tree in python_files()
             if os.sep not in path and path != "__init__.py" and imported_dsgd_packages(tree)}
    assert wrong == {}
