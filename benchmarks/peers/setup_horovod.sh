#!/usr/bin/env bash
# Builds Horovod 0.28.1 (the last release) from its PyPI sdist against the
# TensorFlow installed in the current Python environment, for benchmarks/peers.
#
#     bash benchmarks/peers/setup_horovod.sh        # PYTHON=/path/to/python to pick another
#
# Its release does not build against TensorFlow 2.21 as-is: one source file,
# horovod/tensorflow/xla_mpi_ops.cc (the XLA custom-call bridge, unused here),
# no longer compiles. The script drops that file from Horovod's CMake source
# list, makes process sets use HOROVOD_GLOO_IFACE (below), and builds the TensorFlow + Gloo parts only (no MPI, PyTorch or MXNet),
# ~80 s on 2 cores. Nothing is kept in the repository; the sdist is unpacked
# into a temporary directory that is removed afterwards.
set -euo pipefail
PY=${PYTHON:-python}
VERSION=0.28.1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$PY" -c "import tensorflow as tf; print('building Horovod $VERSION against TensorFlow', tf.__version__)"
# CMake 4 refuses the cmake_minimum_required(<3.5) of the Gloo Horovod vendors.
"$PY" -m pip install --quiet "cmake<4" setuptools wheel cloudpickle psutil pyyaml packaging
"$PY" -m pip download --quiet "horovod==$VERSION" --no-deps --no-binary :all: -d "$work"
tar xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"
grep -q 'xla_mpi_ops.cc' "$src/horovod/tensorflow/CMakeLists.txt" || {
    echo "setup_horovod: xla_mpi_ops.cc is not in Horovod's CMake list any more; check the patch" >&2
    exit 1
}
sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
# Horovod 0.28.1 gives a process set's Gloo context (the global set's too) an empty
# interface instead of HOROVOD_GLOO_IFACE, so its ranks advertise whatever the host
# name resolves to: fine on real hosts, 127.0.0.1 for every rank on the emulated
# cluster's nodes (network namespaces of one host, simulate/emulated_ring.py). The
# process set now takes the global context's interface.
ctx="$src/horovod/common/gloo/gloo_context.cc"
sed -i '/^void GlooContext::InitializeForProcessSet/,/CreateDevice/ s/^  device_attr.iface = gloo_iface_;/  gloo_iface_ = global_context.gloo_iface_;\n  device_attr.iface = gloo_iface_;/' "$ctx"
grep -q 'gloo_iface_ = global_context.gloo_iface_;' "$ctx" || {
    echo "setup_horovod: the process-set interface patch did not apply; check gloo_context.cc" >&2
    exit 1
}
HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="-j$(nproc)" "$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir "$src"
"$PY" -c "import horovod, horovod.tensorflow as hvd; print('horovod', horovod.__version__, 'built; gloo:', hvd.gloo_built())"
