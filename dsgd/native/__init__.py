"""dsgd's compiled code as Python sees it: the pybind11 module `_core` (csrc/core
through csrc/bindings: sums, casts, copies on plain buffers), the TensorFlow op
library `_dsgd_ops.so` (csrc/tf_ops, loaded by `ops`), DLPack views (`dlpack`)
and the check that they were built (`installation`). Nothing here imports
TensorFlow at import time."""
