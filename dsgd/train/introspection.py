"""Horovod's introspection functions (`hvd.mpi_built()`, `hvd.nccl_built()`, ...),
answered for dsgd.train: what the build has and which transport is enabled."""

# dsgd exchanges through Ray's object store and its PS actors: none of Horovod's
# transports or libraries is built or enabled, so a port's checks take their "without" path.
def mpi_built() -> bool:
    """Horovod's: False (dsgd uses no MPI)."""
    return False


def mpi_enabled() -> bool:
    """Horovod's: False (dsgd uses no MPI)."""
    return False


def mpi_threads_supported() -> bool:
    """Horovod's: raises ValueError, as Horovod does without MPI."""
    raise ValueError("dsgd does not use MPI (mpi_enabled() is False); its collectives go "
                     "through Ray's object store and dsgd's PS actors")


def gloo_built() -> bool:
    """Horovod's: False (dsgd uses no Gloo)."""
    return False


def gloo_enabled() -> bool:
    """Horovod's: False (dsgd uses no Gloo)."""
    return False


def nccl_built() -> int:
    """Horovod's: the NCCL version Horovod was built with, 0 for none: 0 (dsgd.train
    exchanges through Ray's object store)."""
    return 0


def ddl_built() -> bool:
    """Horovod's: False."""
    return False


def ccl_built() -> bool:
    """Horovod's: False."""
    return False


def cuda_built() -> bool:
    """Horovod's: False (no CUDA code in the exchange; TensorFlow's GPUs work as usual)."""
    return False


def rocm_built() -> bool:
    """Horovod's: False."""
    return False
