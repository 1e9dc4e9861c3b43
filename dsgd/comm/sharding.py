"""The gradient shard plan: which slice of which gradient goes where.

Pure Python and numpy, no TensorFlow: the driver computes one plan from the
variables' shapes and every worker packs and unpacks with it.

Gradients are taken in reverse variable order (the last layers' gradients are
ready first) and packed into shards of at most `shard_bytes`: small tensors are
fused into one shard, a tensor that does not fit in the room left starts a new
shard, and only a tensor larger than a whole shard is split across shards. A shard holds one dtype only. Every piece starts at a multiple of
`align_bytes` within its shard (zero padding between pieces), so a variable held
whole by one shard can be read from it in place, without a copy.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import numpy as np

from dsgd import constants

logger = logging.getLogger("dsgd")


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name (bfloat16 included, which numpy lacks)."""
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def wire_numpy_dtype(dtype: str) -> np.dtype:
    return np.dtype(np.uint16) if dtype == "bfloat16" else np.dtype(dtype)


def to_wire(values: np.ndarray, wire_dtype: str) -> np.ndarray:
    """numpy values as a shard of `wire_dtype` holds them (bfloat16: uint16 bits),
    rounded to nearest even."""
    if wire_dtype == "bfloat16":
        import ml_dtypes  # TensorFlow's dependency; only needed for bfloat16

        return np.asarray(values).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.asarray(values).astype(wire_dtype, copy=False)


def from_wire(values: np.ndarray, wire_dtype: str, dtype: str) -> np.ndarray:
    """Shard values (bfloat16 as uint16 bits, or already bfloat16) as `dtype`."""
    if wire_dtype == "bfloat16":
        import ml_dtypes

        if values.dtype == np.uint16:
            values = values.view(ml_dtypes.bfloat16)
        return values if dtype == "bfloat16" else values.astype(dtype)
    return values.astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class Piece:
    """Elements [var_offset, var_offset + length) of the flattened variable
    `var_index`, stored at [shard_offset, shard_offset + length) of its shard."""

    var_index: int
    var_offset: int
    length: int
    shard_offset: int


@dataclasses.dataclass(frozen=True)
class Shard:
    dtype: str
    pieces: tuple[Piece, ...]

    @property
    def num_elements(self) -> int:
        """Elements in the shard's buffer, padding included."""
        last = self.pieces[-1]
        return last.shard_offset + last.length

    @property
    def nbytes(self) -> int:
        return self.num_elements * itemsize(self.dtype)

    @property
    def wire_numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the shard's buffers (bfloat16 travels as uint16 bits)."""
        return wire_numpy_dtype(self.dtype)


@dataclasses.dataclass(frozen=True)
class ShardPlan:
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    shards: tuple[Shard, ...]

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def wire_dtypes(self) -> tuple[str, ...]:
        """The dtype each variable's gradient travels as: its shards' (float16 or
        bfloat16 for a compressed float32 gradient), or its own if it has no
        elements (and so no shard)."""
        wire = list(self.dtypes)
        for shard in self.shards:
            for piece in shard.pieces:
                wire[piece.var_index] = shard.dtype
        return tuple(wire)

    def pieces_of(self, var_index: int) -> list[tuple[int, Piece]]:
        """(shard index, piece) of one variable, in variable-offset order."""
        found = [(j, p) for j, s in enumerate(self.shards) for p in s.pieces
                 if p.var_index == var_index]
        return sorted(found, key=lambda jp: jp[1].var_offset)

    def unpack(self, shards: Sequence[np.ndarray], copy: bool = True) -> list[np.ndarray]:
        """Each variable's values from shard buffers (as a PS writes them),
        in the variable's own dtype (16-bit wire values widened). With
        `copy=False`, a variable that sits whole in one shard of its own dtype
        comes back as a view of that buffer (which it keeps alive); the others
        are copied."""
        out = []
        for v, shape in enumerate(self.shapes):
            parts = [from_wire(shards[j][p.shard_offset:p.shard_offset + p.length],
                               self.shards[j].dtype, self.dtypes[v])
                     for j, p in self.pieces_of(v)]
            if not parts:
                flat = np.zeros(0, self.dtypes[v])
            elif len(parts) == 1 and not copy:
                flat = parts[0]
            else:
                flat = np.concatenate(parts)
            out.append(flat.reshape(shape))
        return out


def plan_shards(shapes: Sequence[Sequence[int]], dtypes: Sequence[str],
                shard_bytes: int, align_bytes: int = 64,
                compression: str | None = None) -> ShardPlan:
    """Pack variables (in reverse order) into shards of at most `shard_bytes` bytes,
    each piece starting at a multiple of `align_bytes` (rounded to whole elements).
    With `compression` ("fp16" or "bf16"), float32 gradients travel as that 16-bit
    type: their shards' dtype is "float16" or "bfloat16" (plan.dtypes stays the
    variables' own); other dtypes travel as they are."""
    if len(shapes) != len(dtypes):
        raise ValueError(f"plan_shards: {len(shapes)} shapes but {len(dtypes)} dtypes")
    if compression is not None and compression not in constants.COMPRESSIONS:
        raise ValueError(f"compression must be None or one of {list(constants.COMPRESSIONS)}, "
                         f"got {compression!r}")
    wire = [constants.COMPRESSIONS[compression] if compression and str(d) == "float32" else str(d)
            for d in dtypes]
    if not isinstance(shard_bytes, int) or shard_bytes <= 0:
        raise ValueError(f"grad_shard_bytes must be a positive int, got {shard_bytes!r}")
    shards: list[Shard] = []
    pieces: list[Piece] = []
    dtype: str | None = None
    used = 0  # elements in the open shard

    def close():
        nonlocal pieces, used
        if pieces:
            shards.append(Shard(dtype, tuple(pieces)))
        pieces, used = [], 0

    for v in reversed(range(len(shapes))):
        size_of = itemsize(wire[v])
        align = max(1, align_bytes // size_of)
        capacity = shard_bytes // size_of
        if capacity == 0:
            raise ValueError(f"grad_shard_bytes={shard_bytes} is smaller than one element "
                             f"of variable {v} ({wire[v]}, {size_of} bytes)")
        if wire[v] != dtype:
            close()
            dtype = wire[v]
        size = math.prod(shapes[v])
        # A variable that fits in a shard is never split (it starts a new shard if
        # the open one is too full): whole variables are read without a copy.
        if size <= capacity and -(-used // align) * align + size > capacity:
            close()
        offset = 0
        while offset < size:
            used = -(-used // align) * align
            if used >= capacity:
                close()
            take = min(size - offset, capacity - used)
            pieces.append(Piece(v, offset, take, used))
            used += take
            offset += take
    close()
    return ShardPlan(tuple(tuple(int(d) for d in s) for s in shapes),
                     tuple(str(d) for d in dtypes), tuple(shards))


def spread_shard_bytes(total_bytes: int, shard_bytes: int, num_ps: int,
                       align_bytes: int = 64) -> int:
    """The shard size that cuts a gradient of `total_bytes` into equal shards,
    the same number for each of `num_ps` PS actors, each at most `shard_bytes`:
    ceil(G / (num_ps * k)) bytes with k = ceil(G / (num_ps * shard_bytes)) shards
    per PS, rounded up to `align_bytes` (never above `shard_bytes`, never below
    `align_bytes`)."""
    per_ps = -(-max(1, total_bytes) // max(1, num_ps))  # (ceilings throughout)
    k = -(-per_ps // shard_bytes)
    size = -(-per_ps // k)
    size = -(-size // align_bytes) * align_bytes
    return max(min(align_bytes, shard_bytes), min(shard_bytes, size))


def spread_plan(shapes: Sequence[Sequence[int]], dtypes: Sequence[str], shard_bytes: int,
                num_ps: int, compression: str | None = None) -> ShardPlan:
    """`plan_shards` for a job whose PS actors are on several nodes (one per node:
    `param_server.default_num_ps`): shards of at most `shard_bytes`, cut smaller
    where that leaves a PS with more bytes than another
    (`spread_shard_bytes`), so that each node's NIC carries one PS's equal share
    both ways. Without it, a 100 MB gradient in 10 MB shards keeps at most 10
    PS busy however many nodes send: at 64 workers the simulator puts that
    default at 35 % efficiency against 71 % spread (docs/scaling.md).
    `num_ps` <= 1: `plan_shards` as it is."""
    plan = plan_shards(shapes, dtypes, shard_bytes, compression=compression)
    if num_ps <= 1:
        return plan
    size = spread_shard_bytes(sum(s.nbytes for s in plan.shards), shard_bytes, num_ps)
    return plan if size >= shard_bytes else plan_shards(shapes, dtypes, size,
                                                       compression=compression)


def whole_plan(shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> ShardPlan:
    """One shard per variable, unsplit: the plan of strategy="simple"."""
    shards = tuple(Shard(str(dtypes[v]), (Piece(v, 0, math.prod(shapes[v]), 0),))
                   for v in range(len(shapes)))
    return ShardPlan(tuple(tuple(int(d) for d in s) for s in shapes),
                     tuple(str(d) for d in dtypes), shards)


def assign_shards(shard_nbytes: Sequence[int], num_ps: int) -> list[int]:
    """PS index of every shard, balancing bytes: largest shard first onto the
    least-loaded PS (ties go to the lower index, so the result is deterministic)."""
    if num_ps < 1:
        raise ValueError(f"num_ps must be >= 1, got {num_ps}")
    load = [0] * num_ps
    owner = [0] * len(shard_nbytes)
    for j in sorted(range(len(shard_nbytes)), key=lambda j: (-shard_nbytes[j], j)):
        ps = min(range(num_ps), key=lambda p: (load[p], p))
        owner[j] = ps
        load[ps] += shard_nbytes[j]
    return owner


def group_shards(owner: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Which shards travel together as one object-store object: the shards of one
    PS (`owner[j]` is shard j's PS), in shard order; groups are ordered by their
    first shard, so every PS gets work early. Ray's fixed cost per object
    (create, seal, pin, report to its owner, free) exceeds copying a large shard
    (benchmarks/design_measurements.md): grouping keeps shards as the unit
    of fusion and of the PS sum while cutting the objects per step."""
    groups: dict[int, list[int]] = {}
    for j, ps in enumerate(owner):
        groups.setdefault(ps, []).append(j)
    return tuple(tuple(g) for g in groups.values())


@dataclasses.dataclass(frozen=True)
class ExchangeLayout:
    """Which PS serves which gradients: the shard `plan`, the shard indices that
    travel as one object per worker and exchange (`groups`, one per PS), and the
    PS index of every group (`ps_of_group`). The one place that decides it, for
    the engine, the Trainer's custom epochs and the Ray Train exchange."""

    plan: ShardPlan
    groups: tuple[tuple[int, ...], ...]
    ps_of_group: tuple[int, ...] = ()  # () where no PS exchanges (strategy "simple")

    @property
    def ps_of_shard(self) -> tuple[int, ...]:
        """The PS index of every shard (() where no PS exchanges)."""
        if not self.ps_of_group:
            return ()
        owner = [0] * self.plan.num_shards
        for group, ps in zip(self.groups, self.ps_of_group):
            for j in group:
                owner[j] = ps
        return tuple(owner)

    @property
    def num_ps(self) -> int:
        return max(self.ps_of_group, default=-1) + 1

    def shards(self, g: int) -> tuple[Shard, ...]:
        """The `Shard`s of group `g`."""
        return tuple(self.plan.shards[j] for j in self.groups[g])


def exchange_layout(plan: ShardPlan, num_ps: int) -> ExchangeLayout:
    """The layout for `num_ps` PS actors: shards balanced by bytes
    (`assign_shards`), one group per PS (`group_shards`). The one layout of the
    engine's "ps" strategy and of the Ray Train exchange."""
    if num_ps > plan.num_shards:
        logger.warning("num_ps=%d but the gradients make only %d shard(s); %d PS actor(s) "
                       "will idle (lower grad_shard_bytes to make more shards)",
                       num_ps, plan.num_shards, num_ps - plan.num_shards)
    owner = assign_shards([s.nbytes for s in plan.shards], num_ps)
    groups = group_shards(owner)
    return ExchangeLayout(plan, groups, tuple(owner[group[0]] for group in groups))


@dataclasses.dataclass(frozen=True)
class ReadyProfile:
    """When the backward pass makes each shard's gradient, and what one bucket's
    exchange costs: the input of buckets closed by deadline (`bucket_layout`).
    Seconds on one clock (the step's start at 0); bytes per second per NIC
    direction."""

    ready_s: tuple[float, ...]  # per shard of the plan: its last piece's gradient made
    end_s: float                # the backward pass's end
    link_bytes_per_s: float     # one NIC direction's rate
    workers: int

    def exchange_s(self, nbytes: int) -> float:
        """The least time one bucket of `nbytes` takes through its PS's NIC: every
        other worker's part in, the mean out to each of them, 2(N-1)·S/B."""
        return 2 * (self.workers - 1) * nbytes / self.link_bytes_per_s


def bucket_layout(layout: ExchangeLayout, min_bytes: int,
                  profile: ReadyProfile | None = None) -> ExchangeLayout:
    """The groups of the overlapped exchange (`StepExchange`): buckets of consecutive
    shards (so of consecutive variables, which the backward pass makes at about
    the same time; the plan packs the last variables first, so bucket 0 is the
    first the backward pass makes), each at least `min_bytes` or the gradient's share of one
    PS, whichever is less (but the last: so that every PS gets work; and, where that is
    the share, from 3/4 of it when the next shard would make 1.5 shares), about
    `constants.MAX_BUCKETS_PER_PS` per PS at most, each
    bucket on the PS least loaded by the buckets before it (ties: the lower
    index), so that buckets made one after the other in the backward pass go
    to different PS actors. The PS actors are `layout`'s.

    With a `profile` (buckets by deadline, issue 47: not yet what the engine
    does, whose buckets are the rule above; benchmarks/simulate runs it), a
    bucket is closed, once it holds `min_bytes` (or the floor above), when taking
    the next shard would end its exchange (`ReadyProfile.exchange_s`, from that
    shard's ready time) after the backward pass, or make it more than one PS's
    share: the first buckets, made early, are large; the last ones, made as the
    backward pass ends, small, so that their means can come back before it ends."""
    from dsgd import constants

    shards = layout.plan.shards
    num_ps = max(1, layout.num_ps)
    total = sum(s.nbytes for s in shards)
    share = -(-total // num_ps)  # one PS's share of the gradient
    min_bytes = max(min(min_bytes, share),  # (no more than the PS's threads take)
                    -(-total // (constants.MAX_BUCKETS_PER_PS * num_ps)))
    buckets, current, size = [], [], 0
    for j, shard in enumerate(shards):
        current.append(j)
        size += shard.nbytes
        following = shards[j + 1].nbytes if j + 1 < len(shards) else 0
        if profile is not None:  # (by deadline: the docstring)
            close = following == 0 or size >= min_bytes and (
                size + following > share
                or profile.ready_s[j + 1] + profile.exchange_s(size + following) > profile.end_s)
        else:
            # Closed at min_bytes; and where min_bytes is one PS's share, also at 3/4 of it
            # when the next shard would take it past 1.5 x: shards of about one share each
            # (shard_bytes = G / num_ps, a little under it once padded and cut) then stay
            # one per bucket and per PS rather than pairing up on half of the PS actors.
            # (Every bucket but the last holds >= 3/4 of a share: at most 4/3 x num_ps + 1.)
            close = size >= min_bytes or (min_bytes == share and size >= 0.75 * min_bytes
                                          and size + following > 1.5 * min_bytes)
        if close:
            buckets.append(tuple(current))
            current, size = [], 0
    if current:
        buckets.append(tuple(current))
    load, owner = [0] * num_ps, [0] * len(buckets)
    for b in range(len(buckets)):  # the order the backward pass makes them
        ps = min(range(num_ps), key=lambda p: (load[p], p))
        owner[b] = ps
        load[ps] += sum(shards[j].nbytes for j in buckets[b])
    return ExchangeLayout(layout.plan, tuple(buckets), tuple(owner))
