"""Importing TensorFlow without its start-up probing lines.

TensorFlow prints a few lines when it is first imported and when it first looks
for devices: that it found no CUDA driver, a failed `cuInit`, that oneDNN ops are
on, which CPU instructions it was built without. It prints them before its own
logging is set up, so `TF_CPP_MIN_LOG_LEVEL` does not hide them. In a Ray job
every worker process prints them again, and Ray forwards them to the driver's
terminal: noise the user did not ask for.

`import_tensorflow()` runs when `dsgd` is imported (so in every dsgd actor, and in
a user's script that imports dsgd before TensorFlow). It imports TensorFlow with
the process's stderr (file descriptor 2) sent to a temporary file, then writes
back every line except those:

- `TF_CPP_MIN_LOG_LEVEL` unset: the probing lines above are dropped, anything
  else TensorFlow printed is written back.
- `TF_CPP_MIN_LOG_LEVEL=N` set: TensorFlow's own rule applies to these lines too
  (records below severity N, INFO=0 WARNING=1 ERROR=2 FATAL=3, are dropped);
  `TF_CPP_MIN_LOG_LEVEL=0` shows everything. Set it before `ray.init` for the
  workers to inherit it.

Where TensorFlow is already imported, nothing is captured: its lines were printed
by whoever imported it.
"""

from __future__ import annotations

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


def import_tensorflow():
    """Import TensorFlow once, dropping its start-up probing lines (module docstring).

    Blocks while TensorFlow imports (seconds). Without a CUDA driver it also lists
    the devices, inside the same capture, so the failed `cuInit` line is caught
    here rather than printed at the first op. Returns the `tensorflow` module.
    """
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    level = os.environ.get(LEVEL_VARIABLE)
    if level == "0":
        import tensorflow

        return tensorflow
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    with tempfile.TemporaryFile() as captured:
        saved = os.dup(2)
        os.dup2(captured.fileno(), 2)
        try:
            import tensorflow

            sys.stderr.flush()
            captured.seek(0)
            if _NO_DRIVER.encode() in captured.read():
                # No driver: no GPU can be set up, so listing devices here changes
                # nothing (with a driver, device setup is left for later: Ray sets
                # CUDA_VISIBLE_DEVICES in an actor after its class is imported).
                tensorflow.config.list_physical_devices("GPU")
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = filter_lines(text, level)
            if kept:
                os.write(2, kept.encode())
    return tensorflow


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
