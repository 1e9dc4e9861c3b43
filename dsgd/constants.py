"""Every tunable default of dsgd, with its unit, in one place."""

STRATEGIES = ("simple", "ps")
"""`DistributedSGD(strategy=)`: "ps" (sharded parameter-server actors sum the
gradients) or "simple" (the driver averages whole gradients; the reference path)."""
COMPRESSIONS = {"fp16": "float16", "bf16": "bfloat16"}
"""`compression=` of `DistributedSGD` (strategy "ps") and `dsgd.train.DsgdConfig`:
each accepted name and the 16-bit type float32 gradients travel as (None: no
compression)."""
ALL_REDUCE_ALGS = ("simple", "tree", "nccl")
"""`DistributedSGD(all_reduce_alg=)`: the local allreduce across one worker's
devices (see dsgd/comm/device_mean.py); "nccl" needs `gpu=True`."""

DEFAULT_GRAD_SHARD_BYTES = 10_000_000
"""Default `grad_shard_bytes`: the largest gradient shard, in bytes."""
BUCKET_MIN_BYTES = 4 * 2**20
"""The workers' exchange sends the gradient during the backward pass in buckets
of consecutive shards of at least this many bytes (dsgd/comm/sharding.py
`bucket_layout`): one object and one PS call per bucket per worker, so smaller
shards are merged where Ray's cost per call (about 1 ms on 2 cores) would
exceed copying them."""
MAX_BUCKETS_PER_PS = 4
"""At most this many buckets per PS actor and step (bucket_layout merges shards
into fewer, larger buckets beyond it): each bucket's call waits in one of the
PS's threads until every worker's part is in, and the PS has
(MAX_BUCKETS_PER_PS + 2) x workers + 8 of them (param_server.rendezvous_concurrency)."""
APPLY_SPLIT_MIN_SHARE = 0.25
"""The overlapped exchange applies the buckets already summed when the step is
decided in one update and the rest in a second only when the rest is at least
this share of the gradient's bytes; else it waits and applies once (a second
update costs a compiled call, and on a CPU it competes with the PS's last sum)."""
LOCAL_STEPS_PER_CALL = 8
"""`local_steps_per_call=None` (the default): `train()` runs this many steps per
actor call with one worker (Worker.local_steps), so Ray's cost per call is paid
once per that many steps; the progress bar moves in such chunks."""
CALL_STEPS_PER_WORKER = 4
"""`local_steps_per_call=None` on the workers' own exchange (Worker.exchange_steps):
a call of each worker runs max(LOCAL_STEPS_PER_CALL, CALL_STEPS_PER_WORKER x N)
steps, so that the driver makes at most one call per this many steps whatever
the number of workers N (its cost per call is O(N): one call and one tally per
worker)."""
# Each worker and PS actor faults in its page-table entries for this many
# steps' worth of objects at the start of its object-store mapping
# ((num_workers + 1) x gradient bytes per step; see store.warm).
STORE_WARM_STEPS = 8
# ... but at most this many bytes per process (8 MB of page tables), so
# that start-up stays short with very large gradients or many workers.
STORE_WARM_MAX_BYTES = 4 * 2**30
DEFAULT_STEP_TIMEOUT_S = 600.0
"""Default `step_timeout_s`, in seconds: a step (or any other remote call) that
has not answered after this long raises `StepTimeoutError`."""
DEFAULT_START_TIMEOUT_S = 600.0
"""Default `start_timeout_s`, in seconds: worker start-up (import TensorFlow,
build the replicas) must finish within this."""
DEFAULT_NUM_CPUS_PER_WORKER = 1
"""Default `num_cpus_per_worker`: CPUs Ray reserves for each worker actor (its
devices run in that process)."""
# PS actors only sum buffers; they reserve no CPU slot so that they never keep
# a worker from being scheduled on a small node.
PS_NUM_CPUS = 0

ON_NONFINITE = ("raise", "skip", "ignore")
"""`DistributedSGD(on_nonfinite=)`: what a step does with a NaN/Inf gradient."""
DEFAULT_MAX_FAILURES = 3
"""Default `max_failures`: failures (actor deaths, hangs replaced with `replace_hung`, and
faults met while recovering) a `DistributedSGD` survives over its life."""
DEFAULT_SNAPSHOT_INTERVAL_S = 60.0
"""Default `snapshot_interval_s`: how often (seconds of training) the driver keeps an
automatic snapshot of the replicated state in its own memory, so that losing every
worker at once (a node) is survived without a checkpoint (engine/loop.py)."""
RECOVERY_BACKOFF_S = 0.5
"""A recovery that follows another with no step completed between them (a retried
step that failed again, a fault while recovering) first waits this many seconds,
doubling with each in a row (dsgd/engine/recovery.py `Recovery._back_off`) ..."""
RECOVERY_BACKOFF_MAX_S = 8.0
"""... but at most this many seconds."""
MAX_STALL_WARNING_S = 60.0
"""Longest interval between stall reports while a wait is pending, in seconds:
the default `stall_warning_s` is `step_timeout_s / 4`, at most this (Horovod's
stall inspector warns after 60 s)."""
# The same while workers start (import TensorFlow, build and compile: seconds by nature).
START_STALL_WARNING_S = 30.0
# elastic=True: how often a shrunk DistributedSGD looks for room to grow back, in seconds.
GROW_CHECK_INTERVAL_S = 10.0
# After killing or losing workers: how long their resources may take to be
# released by Ray (a killed SIGSTOPped process is reaped asynchronously) before
# a replacement is judged not to fit.
RESOURCE_RELEASE_S = 8.0
# A new DistributedSGD whose workers do not fit in what the cluster has free waits this
# long (seconds) for room before a ResourceError names who holds it (engine/resources.py
# `wait_for_room`), instead of its workers waiting for CPUs until start_timeout_s.
START_ROOM_WAIT_S = 15.0

WORKER_NAME_PREFIX = "dsgd-worker-"
PS_NAME_PREFIX = "dsgd-ps-"

# Ray starts worker processes at niceness 15 (`RAY_worker_niceness`) so that its
# daemons stay responsive; a training process then loses the CPU to every
# nice-0 process and runs slower than the same step in the driver
# (benchmarks/design_measurements.md). dsgd's actors run at 0, like a plain training
# process (Ray's worker lowers its own priority at start-up; at 0 it simply
# does not, so no privilege is needed). Merged with the job's runtime_env env_vars by Ray.
ACTOR_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}

# dsgd.Dataset of a Python iterable: examples per object-store block (one download
# task makes one block): batch_size, but at most this many.
DATA_BLOCK_MAX_ROWS = 256
# DistributedSGD.train keeps the feeds (and the workers' data loaders, e.g. Ray Data
# split iterators) of this many most recently used datasets.
DATA_FEEDS_KEPT = 4
# Trainer.validate: a worker validates its whole share in one call, allowed this many
# step timeouts.
VALIDATION_TIMEOUT_STEPS = 10
