"""The API reference (docs/reference/*.md) has an entry for every public name.

Each page lists objects as mkdocstrings entries (`::: dsgd.Name`), optionally
with `options: members: [...]`. A public name (in `dsgd.__all__`,
`dsgd.train.__all__`, or a public class of `dsgd.train.callbacks`) without an
entry fails here. The names are read from the sources with `ast`, so that this
test imports neither TensorFlow nor Ray.
"""

from __future__ import annotations

import ast
import pathlib
import re


ROOT = pathlib.Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference"
ENTRY = re.compile(r"^:::\s*(?P<id>[\w.]+)\s*$")
MEMBER = re.compile(r"^\s+-\s*(?P<name>\w+)\s*$")


def _all_of(path: pathlib.Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} defines no __all__")


def _public_classes(path: pathlib.Path) -> list[str]:
    return [n.name for n in ast.parse(path.read_text()).body
            if isinstance(n, ast.ClassDef) and not n.name.startswith("_")]


def public_names() -> list[str]:
    names = [f"dsgd.{n}" for n in _all_of(ROOT / "dsgd" / "__init__.py") if n != "__version__"]
    train = _all_of(ROOT / "dsgd" / "train" / "__init__.py")
    names += [f"dsgd.train.{n}" for n in train if n != "callbacks"]
    if "callbacks" in train:
        names += [f"dsgd.train.callbacks.{n}"
                  for n in _public_classes(ROOT / "dsgd" / "train" / "callbacks.py")]
    return names


def documented() -> dict[str, str]:
    """Every documented identifier (entries and their listed members) -> its page."""
    found: dict[str, str] = {}
    for page in sorted(REFERENCE.glob("*.md")):
        current, in_members = None, False
        for line in page.read_text().splitlines():
            entry = ENTRY.match(line)
            if entry:
                current, in_members = entry["id"], False
                found[current] = page.name
            elif current and line.strip() == "members:":
                in_members = True
            elif current and in_members and MEMBER.match(line):
                found[f"{current}.{MEMBER.match(line)['name']}"] = page.name
            elif line and not line[0].isspace():
                current, in_members = None, False
    return found


def test_public_names_are_found():
    names = public_names()
    assert "dsgd.DistributedSGD" in names and "dsgd.train.DsgdTrainer" in names
    assert "dsgd.train.callbacks.BroadcastGlobalVariablesCallback" in names


def test_every_public_name_has_a_reference_entry():
    entries = documented()
    missing = [n for n in public_names() if n not in entries]
    assert not missing, (f"public names without an entry (`::: name`) in docs/reference/*.md: "
                         f"{missing}")

# That every `::: identifier` names a real object is checked by the strict docs build
# (.ci/run: mkdocs build --strict fails on an entry it cannot load).
