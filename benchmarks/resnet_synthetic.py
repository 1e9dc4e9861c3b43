"""ResNet-50/101 on synthetic ImageNet-shaped data through dsgd, like the TensorFlow
benchmark the original Ray SGD was measured with.

    python benchmarks/resnet_synthetic.py --model resnet50 [--num-workers 1] [--strategy ps]
        [--gpu] [--image-size 64] [--batch-size 8] [--steps 10] [--warmup 3]

Keras' architectures with `weights=None` and 1000 classes. The images and labels are
made once per replica, on its device, so no input pipeline is measured. Defaults fit
a 2-core CPU (64x64 images, batch 8 per replica); with `--gpu` they are 224 and 64.
Prints images/s per step and writes the median to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dsgd  # noqa: E402

MODELS = {"resnet50": "ResNet50", "resnet101": "ResNet101"}


class SyntheticResNet(dsgd.Model):
    def __init__(self, model_name: str, image_size: int, batch_size: int, seed: int):
        import keras
        import tensorflow as tf

        self.model = getattr(keras.applications, MODELS[model_name])(
            weights=None, input_shape=(image_size, image_size, 3), classes=1000)
        self.optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        generator = tf.random.Generator.from_seed(seed)
        self.images = generator.uniform([batch_size, image_size, image_size, 3])
        self.labels = generator.uniform([batch_size], maxval=1000, dtype=tf.int64)

    def get_loss(self, batch):
        return self.loss_fn(self.labels, self.model(self.images, training=True))

    def get_optimizer(self):
        return self.optimizer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="resnet50")
    p.add_argument("--image-size", type=int, default=None, help="default: 224 with --gpu, else 64")
    p.add_argument("--batch-size", type=int, default=None, help="per replica; default 64 with --gpu, else 8")
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--devices-per-worker", type=int, default=1)
    p.add_argument("--strategy", choices=["simple", "ps"], default="ps")
    p.add_argument("--gpu", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    image_size = args.image_size or (224 if args.gpu else 64)
    batch = args.batch_size or (64 if args.gpu else 8)
    import ray

    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, args.num_workers),
             include_dashboard=False, log_to_driver=False)
    devices = args.devices_per_worker
    name, size = args.model, image_size

    def creator(worker_index, device_index):
        return SyntheticResNet(name, size, batch, seed=worker_index * devices + device_index)

    replicas = args.num_workers * devices
    print(f"{args.model}: {args.num_workers} worker(s) x {devices} device(s), {image_size}x{image_size}, "
          f"batch {batch} per replica, strategy {args.strategy}", flush=True)
    with dsgd.DistributedSGD(creator, args.num_workers, devices, gpu=args.gpu,
                             strategy=args.strategy) as sgd:
        grad_bytes = sum(s.nbytes for s in sgd.plan.shards)
        per_step = []
        for i in range(args.warmup + args.steps):
            stats = sgd.step(fetch_stats=True)
            images_per_s = batch * replicas / stats["step_s"]
            tag = "warm-up" if i < args.warmup else "step"
            print(f"{tag} {i + 1}: {images_per_s:.1f} images/s  loss {stats['loss']:.3f}", flush=True)
            if i >= args.warmup:
                per_step.append({"images_per_s": images_per_s, **stats})
    result = {
        "benchmark": "resnet_synthetic", "model": args.model, "image_size": image_size,
        "batch_size_per_replica": batch, "num_workers": args.num_workers,
        "devices_per_worker": devices, "strategy": args.strategy, "gpu": args.gpu,
        "gradient_bytes": grad_bytes, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "median_images_per_s": statistics.median(s["images_per_s"] for s in per_step),
        "median_step_s": statistics.median(s["step_s"] for s in per_step), "steps": per_step,
    }
    print(f"median: {result['median_images_per_s']:.1f} images/s", flush=True)
    out = args.out or os.path.join(
        os.path.dirname(__file__), "results",
        f"resnet_synthetic_{args.model}_{args.num_workers}w_{'gpu' if args.gpu else 'cpu'}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
