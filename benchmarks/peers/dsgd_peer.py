"""Peer: dsgd (`strategy` "ps" or "simple", optionally `compression`), `num_workers`
worker actors with one replica each, on an embedded local Ray cluster."""

from __future__ import annotations

import os

import common

import dsgd


class PeerModel(dsgd.Model):
    def __init__(self, config: str, seed: int):
        self.model = common.build_model(config)
        self.optimizer, self.loss_fn = common.make_optimizer(), common.make_loss_fn()
        self.images, self.labels = common.synthetic_batch(config, seed)

    def get_loss(self, batch):
        return self.loss_fn(self.labels, self.model(self.images, training=True))

    def get_optimizer(self):
        return self.optimizer


def main(argv=None):
    args = common.peer_args(__doc__, argv)
    import ray

    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers),
             include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(common)
    config = args.config

    def creator(worker_index, device_index):
        return PeerModel(config, seed=worker_index)

    compression = args.compression if args.num_workers > 1 else None  # 1 worker: no exchange
    with dsgd.DistributedSGD(creator, args.num_workers, 1, gpu=False, strategy=args.strategy,
                             compression=compression) as sgd:
        grad_bytes = sum(s.nbytes for s in sgd.plan.shards)
        stats = []

        def step():
            stats.append(sgd.step(fetch_stats=True))

        times = common.time_steps(step, args.warmup, args.steps)
        measured = stats[args.warmup:]
    phases = {k: sorted(s[k] for s in measured)[len(measured) // 2]
              for k in ("compute_s", "exchange_s", "apply_s")}
    common.report(common.summarize(config, args.num_workers, times, gradient_bytes=grad_bytes,
                                   **{f"median_{k}": v for k, v in phases.items()}))


if __name__ == "__main__":
    main()
