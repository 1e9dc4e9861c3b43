"""A dsgd source tree without its compiled modules (what `pip install .` leaves
behind when Python runs in the repository root) is a clear ImportError naming
the path imported and what to do, never a "circular import"."""

import os
import shutil
import subprocess
import sys

import dsgd
from dsgd.native import installation

PACKAGE_DIR = os.path.dirname(os.path.abspath(dsgd.__file__))

# Python as it runs in a repository root next to a non-editable install: the
# current directory first on sys.path. This test environment's editable install
# maps `dsgd` to the checkout with a meta-path finder; drop it so that only the
# path decides, as with `pip install .`.
IMPORT_FROM_CWD = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "ScikitBuild" not in type(f).__name__]
import dsgd
"""


def source_tree_without_compiled_modules(root):
    """A copy of dsgd's Python sources under root/dsgd, as a fresh clone has them."""
    shutil.copytree(PACKAGE_DIR, root / "dsgd",
                    ignore=shutil.ignore_patterns("*.so", "_tf_version.txt", "__pycache__"))
    return root / "dsgd"


def test_source_tree_import_names_the_path_and_the_fix(tmp_path):
    package = source_tree_without_compiled_modules(tmp_path)
    result = subprocess.run([sys.executable, "-c", IMPORT_FROM_CWD], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("ImportError: dsgd was imported from " + str(package))
    assert "without its compiled modules (_core" in error and "_dsgd_ops.so" in error
    assert "pip install -e ." in error and "Run from another directory" in error
    assert "circular import" not in result.stderr
    # A complete dsgd on sys.path (the one this test runs with) is named as the one shadowed.
    shadowed = error.split("It shadows the installed dsgd at ", 1)[1].split(". ", 1)[0]
    assert os.path.isdir(shadowed) and installation.missing_compiled(shadowed) == []


def test_the_installed_package_is_complete():
    assert installation.missing_compiled(PACKAGE_DIR) == []


def test_missing_files_are_listed(tmp_path):
    (tmp_path / "native").mkdir()
    (tmp_path / "native" / "_dsgd_ops.so").write_bytes(b"")
    missing = installation.missing_compiled(str(tmp_path))
    assert missing[0].startswith("_core") and missing[1:] == ["_tf_version.txt"]
