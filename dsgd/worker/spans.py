"""The timeline's spans of a worker's steps (dsgd/comm/timeline.py): a mixin of
`Worker` (dsgd/worker/worker.py), which holds `replicas` and `worker_index`."""

from __future__ import annotations

from dsgd.comm import timeline


class StepSpans:
    """How a worker draws its steps on the timeline: a step's row (data,
    compute, exchange, apply), the forward and backward spans inside a
    compiled call, and this worker's recorder turned on or off as the
    driver's calls say."""

    def timeline_events(self) -> list[dict]:
        """This worker's timeline events since the last call (dsgd/comm/timeline.py)."""
        from dsgd.comm import timeline

        return timeline.recorder().drain()

    def _record_step(self, seq: int, start: float, computed: float, sent: float,
                     exchanged: float, sat_out: bool = False) -> None:
        """The timeline's row of one step of the workers' exchange, from
        `perf_counter` stamps: start, batches read, gradient computed, means
        read and applied (each bucket's receive and apply have their own rows)."""
        from dsgd.comm import timeline

        tl = timeline.recorder()
        if not tl.on:
            return
        to_wall = tl.to_wall
        step = seq & ((1 << 32) - 1)
        spans = [("sat out", start, sent)] if sat_out else \
            [("data", start, computed), ("compute", computed, sent)]
        # (the buckets left during or at the end of "compute")
        spans.append(("decide, receive and apply", sent, exchanged))
        for name, a, b in spans:
            if b > a:
                tl.add(name, "step", a + to_wall, b + to_wall, step=step)
        if not sat_out:
            self.forward_backward_spans(tl, computed, sent, step)

    def forward_backward_spans(self, tl, computed: float, end: float, step: int,
                          row: str = "step", **args) -> None:
        """The timeline's `forward` and `backward` spans within a compiled call
        begun at `computed` and ended at `end` (perf_counter), where the call
        noted the forward pass's end (Replicas.mark_forward)."""
        forward = self.replicas.forward_at
        if tl.on and forward is not None and computed <= forward <= end:
            to_wall = tl.to_wall
            tl.add("forward", row, computed + to_wall, forward + to_wall, step=step, **args)
            tl.add("backward", row, forward + to_wall, end + to_wall, step=step, **args)

    def begin_compute(self) -> None:
        """Before a compiled step: note its forward pass's end iff a timeline records."""
        self.replicas.begin_step(mark_forward=timeline.recorder().on)

    def use_timeline(self, on: bool):
        """This worker's recorder, turned on or off as the driver's call says."""
        if on != timeline.recorder().on:
            timeline.enable(f"worker {self.worker_index}", on)
        return timeline.recorder()
