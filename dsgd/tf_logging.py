"""Importing TensorFlow without its start-up probing lines.

TensorFlow prints a few lines when it is first imported and when it first looks
for devices: that it found no CUDA driver, a failed `cuInit`, that oneDNN ops are
on, which CPU instructions it was built without. It prints them before its own
logging is set up, so `TF_CPP_MIN_LOG_LEVEL` does not hide them. In a Ray job
every worker process prints them again, and Ray forwards them to the driver's
terminal: noise the user did not ask for.

`import dsgd` calls `filter_tensorflow_import()`: from then on, whoever imports
TensorFlow first in the process (dsgd, Keras, the user's code) imports it with the
process's stderr (file descriptor 2) sent to a temporary file, and every line is
then written back except those:

- `TF_CPP_MIN_LOG_LEVEL` unset: the probing lines above are dropped, anything
  else TensorFlow printed is written back.
- `TF_CPP_MIN_LOG_LEVEL=N` set: TensorFlow's own rule applies to these lines too
  (records below severity N, INFO=0 WARNING=1 ERROR=2 FATAL=3, are dropped);
  `TF_CPP_MIN_LOG_LEVEL=0` shows everything. Set it before `ray.init` for the
  workers to inherit it.

Where TensorFlow is already imported, nothing is captured: its lines were printed
by whoever imported it. A process that imports dsgd and never TensorFlow (a PS
actor, a Ray task that downloads data with a function of the user's script) does
not pay TensorFlow's import: ~5 s of CPU and ~0.6 GB per process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import re
import sys
import tempfile

LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"

# A record starts with absl's prefix: severity letter, MMDD (0000 before logging is set up).
_RECORD = re.compile(r"^([IWEF])\d{4} ")
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_HEADER = "All log messages before absl::InitializeLog() is called are written to STDERR"
# Probing records dropped when TF_CPP_MIN_LOG_LEVEL is unset (source file of the record).
_PROBES = ("cudart_stub.cc", "cuda_platform.cc", "cuda_executor.cc", "cuda_diagnostics.cc",
           "cpu_feature_guard.cc", "port.cc", "cuda_dnn.cc", "cuda_fft.cc", "cuda_blas.cc")
_NO_DRIVER = "Could not find cuda drivers"


def filter_tensorflow_import() -> None:
    """From now on, TensorFlow's first import in this process drops its probing lines
    (module docstring). Imports nothing itself; returns at once. Does nothing where
    TensorFlow is already imported or `TF_CPP_MIN_LOG_LEVEL=0` (show everything)."""
    if "tensorflow" in sys.modules or os.environ.get(LEVEL_VARIABLE) == "0":
        return
    if not any(isinstance(finder, _TensorFlowFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _TensorFlowFinder())


class _TensorFlowFinder(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` where Python's path finder does, with a loader that runs
    its import under the capture. Only the package itself: its submodules load
    as usual, inside that import."""

    def find_spec(self, name, path=None, target=None):
        if name != "tensorflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _CapturingLoader(spec.loader)
        return spec


class _CapturingLoader(importlib.abc.Loader):
    """The path finder's loader for `tensorflow`, executing it with fd 2 captured."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        level = os.environ.get(LEVEL_VARIABLE)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        with tempfile.TemporaryFile() as captured:
            saved = os.dup(2)
            os.dup2(captured.fileno(), 2)
            try:
                self._loader.exec_module(module)
                sys.stderr.flush()
                captured.seek(0)
                if _NO_DRIVER.encode() in captured.read():
                    # No driver: no GPU can be set up, so listing devices here changes
                    # nothing (with a driver, device setup is left for later: Ray sets
                    # CUDA_VISIBLE_DEVICES in an actor after its class is imported).
                    module.config.list_physical_devices("GPU")
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                text = captured.read().decode(errors="replace")
                kept = filter_lines(text, level)
                if kept:
                    os.write(2, kept.encode())


def filter_lines(text: str, level: str | None) -> str:
    """The lines of `text` (captured stderr) that stay, by the rule of the module docstring.

    A record is a line starting with absl's prefix plus the unprefixed lines after
    it (TensorFlow continues some messages on a second line); other text, such as
    a Python warning, is always kept.
    """
    try:
        min_level = int(level) if level is not None else None
    except ValueError:
        min_level = None
    kept, dropping = [], False
    for line in text.splitlines(keepends=True):
        match = _RECORD.match(line)
        if match:
            if min_level is None:
                dropping = any(f" {name}:" in line for name in _PROBES)
            else:
                dropping = _SEVERITY[match.group(1)] < min_level
        elif _ABSL_HEADER in line:
            dropping = min_level != 0
        elif not line.startswith(("To enable the following instructions", " ")):
            dropping = False
        if not dropping:
            kept.append(line)
    return "".join(kept)
