"""Counts of the package's structure that grow when capabilities arrive as modes:
modules over 600 lines, functions over 80 lines, remote waits outside
dsgd/comm/waits.py, attributes first set outside `__init__`, and worker.py's
length. Not timed: a census of the source.

    python benchmarks/structure.py [--root .] [--verbose]

Definitions (the same before and after a change):
- a wait: a call `ray.wait(...)`, or `ray.get(..., timeout=...)`, in dsgd/ outside
  dsgd/comm/waits.py;
- a late attribute: `self.x = ...` (a plain target, not `self.a.b = ...`) in a
  method of a class, where `x` is not set by `__init__`, `__post_init__`, an
  `_init*` method or a method `__init__` calls on `self`, nor declared in the
  class body; the mixins of `Worker` (exchange_session.py, apply_schedule.py,
  spans.py) count what `Worker.__init__` sets as declared.

Prints JSON; `--verbose` lists every late attribute and wait.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib

MIXINS = {"ExchangeSession", "ApplySchedule", "StepSpans"}


def self_attrs(fn) -> set[str]:
    """Attributes `fn` assigns on `self` as plain targets."""
    out = set()
    for sub in ast.walk(fn):
        targets = sub.targets if isinstance(sub, ast.Assign) else \
            [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for tt in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(tt, ast.Attribute) and isinstance(tt.value, ast.Name) \
                        and tt.value.id == "self":
                    out.add(tt.attr)
    return out


def late_attributes(cls: ast.ClassDef, rel: str, declared_elsewhere: set[str]) -> list[tuple]:
    methods = [m for m in cls.body if isinstance(m, ast.FunctionDef)]
    init_names = {"__init__", "__post_init__"} | {m.name for m in methods
                                                  if m.name.startswith("_init")}
    for m in methods:
        if m.name == "__init__":
            init_names |= {c.func.attr for c in ast.walk(m) if isinstance(c, ast.Call)
                           and isinstance(c.func, ast.Attribute)
                           and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"}
    in_init = set().union(*[self_attrs(m) for m in methods if m.name in init_names])
    declared = set(declared_elsewhere) | {m.name for m in methods}
    for s in cls.body:
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            target = s.target if isinstance(s, ast.AnnAssign) else s.targets[0]
            declared |= {t.id for t in ast.walk(target) if isinstance(t, ast.Name)}
    late, seen = [], set()
    for m in methods:
        if m.name in init_names:
            continue
        for a in sorted(self_attrs(m) - in_init - declared - seen):
            seen.add(a)
            late.append((rel, cls.name, a, m.name))
    return late


def census(root: pathlib.Path) -> dict:
    package = root / "dsgd"
    worker_init: set[str] = set()
    for node in ast.walk(ast.parse((package / "worker/worker.py").read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            worker_init |= self_attrs(node)
    modules, functions, waits, late = [], [], [], []
    for path in sorted(package.rglob("*.py")):
        rel = str(path.relative_to(root))
        text = path.read_text()
        if text.count("\n") > 600:
            modules.append((rel, text.count("\n")))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.end_lineno - node.lineno + 1 > 80:
                functions.append((rel, node.name, node.end_lineno - node.lineno + 1))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray" \
                    and rel != "dsgd/comm/waits.py" and (
                        node.func.attr == "wait" or (node.func.attr == "get" and any(
                            k.arg == "timeout" for k in node.keywords))):
                waits.append((rel, node.lineno, node.func.attr))
            if isinstance(node, ast.ClassDef):
                late += late_attributes(node, rel,
                                        worker_init if node.name in MIXINS else set())
    return {"modules_over_600_lines": modules, "functions_over_80_lines": functions,
            "waits_outside_waits_py": len(waits), "late_attributes": len(late),
            "worker_py_lines": (package / "worker/worker.py").read_text().count("\n"),
            "_waits": waits, "_late": late}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="a checkout of the repository")
    p.add_argument("--verbose", action="store_true", help="list every wait and late attribute")
    args = p.parse_args()
    out = census(pathlib.Path(args.root))
    if not args.verbose:
        out = {k: v for k, v in out.items() if not k.startswith("_")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
