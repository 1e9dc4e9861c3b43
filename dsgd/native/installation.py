"""Is the imported dsgd complete? Its compiled modules must sit beside its sources.

Standard library only: this runs first in `dsgd/__init__.py`, before anything
that needs the compiled modules or third-party packages.

Why: installed with `pip install .` (not editable), the compiled modules live
only in site-packages. Python run from the repository root imports the source
tree instead (the current directory comes first on `sys.path`, and Ray puts
the driver's directory first on its workers' `sys.path` too), which has no
compiled modules; without this check that surfaced as an unhelpful
"cannot import name '_core' from partially initialized module 'dsgd.native' (most
likely due to a circular import)".
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

OPS_LIBRARY = "_dsgd_ops.so"
CORE_MODULE = "_core"
TF_VERSION_FILE = "_tf_version.txt"
NATIVE_DIR = "native"  # where the compiled files sit inside the package


def missing_compiled(package_dir: str) -> list[str]:
    """The compiled files the dsgd package at `package_dir` lacks in its
    `native/` folder: the pybind11 module `_core`, the TensorFlow op library
    and the TensorFlow version it was built against."""
    native = os.path.join(package_dir, NATIVE_DIR)
    names = set(os.listdir(native)) if os.path.isdir(native) else set()
    missing = []
    if not any(CORE_MODULE + suffix in names for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        missing.append(CORE_MODULE + importlib.machinery.EXTENSION_SUFFIXES[0])
    missing += [name for name in (OPS_LIBRARY, TF_VERSION_FILE) if name not in names]
    return missing


def complete_copies(exclude_dir: str) -> list[str]:
    """Other `dsgd` package directories on `sys.path` that hold the compiled modules."""
    found = []
    for entry in sys.path:
        candidate = os.path.realpath(os.path.join(entry or os.getcwd(), "dsgd"))
        if candidate != os.path.realpath(exclude_dir) and candidate not in found \
                and os.path.isdir(candidate) and not missing_compiled(candidate):
            found.append(candidate)
    return found


def check_compiled(package_dir: str) -> None:
    """ImportError naming `package_dir` and what to do, if it lacks its compiled modules."""
    missing = missing_compiled(package_dir)
    if not missing:
        return
    others = complete_copies(package_dir)
    installed = (f" It shadows the installed dsgd at {others[0]}." if others else
                 " No built dsgd was found elsewhere on sys.path either.")
    raise ImportError(
        f"dsgd was imported from {package_dir}, a source tree without its compiled modules "
        f"({', '.join(missing)}).{installed} This happens when dsgd is installed with "
        "`pip install .` (not editable) and Python runs in the repository root: the current "
        "directory comes first on sys.path, in the driver and in the Ray worker processes it "
        "starts. Run from another directory, or install in place with `pip install -e .`, "
        "which also puts the compiled modules into the source tree.")
