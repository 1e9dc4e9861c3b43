"""Workloads for the simulator: ResNet-50/101 on published GPU step times, and the
two models of the emulated cluster (benchmarks/overlap.py's emulated accelerator,
benchmarks/scaling_check.py's compute-free model).

ResNet's gradients are `keras.applications.ResNet50` / `ResNet101`'s trainable
variables (224x224, 1,000 classes). When each gradient becomes ready during the
backward pass is taken as proportional to the layers' FLOPs (backward ≈ 2x
forward, layer by layer, in reverse): each layer's forward FLOPs are computed
from its shapes (Conv2D 2·H·W·k²·Cin·Cout, Dense 2·in·out, BatchNormalization
~4·H·W·C), shared equally by its variables. That is the usual first-order
profile; a GPU's kernels are not equally efficient on every layer (the early,
large-activation layers run at lower FLOP rates), so real early-layer gradients
come somewhat later than this says. No GPU was available to measure one.
"""

from __future__ import annotations

import json
import math
import os

from sim import Workload, backward_profile

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.path.join(HERE, "..", "results", "simulate_profiles.json")

# Published one-GPU step times (forward + backward + update), synthetic data.
# NVIDIA DeepLearningExamples, TensorFlow/Classification/ConvNets/resnet50v1.5/README.md,
# "Training performance" (20.06-tf1 container).
GPU_STEP = {
    ("resnet50", "V100"): (128 / 412, "DGX-1 1x V100 16G, FP32+XLA, batch 128: 412 img/s "
                                      "(NVIDIA DeepLearningExamples, TF ResNet-50 v1.5 README)"),
    ("resnet50", "A100"): (256 / 2375, "DGX A100 1x A100 40G, AMP+XLA, batch 256: 2,375 img/s "
                                       "(same README)"),
}
# ResNet-101 on V100: Ray's 2018 DistributedSGD benchmark (ray-project/ray issue 3033,
# shared/reference/anchors.md): batch 64 per GPU, 218 img/s on one V100. On A100: no
# published figure of the same kind; ResNet-50's scaled by forward FLOPs (below).
GPU_STEP[("resnet101", "V100")] = (64 / 218, "1x V100, batch 64: 218 img/s (Ray's 2018 "
                                             "DistributedSGD benchmark, ray issue 3033)")


def _layer_flops(layer) -> float:
    import keras

    try:
        out = layer.output.shape
        inp = layer.input.shape
    except (AttributeError, ValueError):
        return 0.0
    if isinstance(layer, keras.layers.Conv2D):
        kh, kw = layer.kernel_size
        return 2.0 * out[1] * out[2] * kh * kw * inp[-1] * out[-1]
    if isinstance(layer, keras.layers.Dense):
        return 2.0 * inp[-1] * out[-1]
    if isinstance(layer, keras.layers.BatchNormalization):
        return 4.0 * math.prod(d for d in out[1:] if d)
    return 0.0


def resnet(name: str) -> dict:
    """{"shapes": [...], "flops": [...] per variable, "forward_flops": total}, cached."""
    cache = {}
    if os.path.exists(CACHE):
        with open(CACHE) as f:
            cache = json.load(f)
    if name in cache:
        return cache[name]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import keras

    build = {"resnet50": keras.applications.ResNet50,
             "resnet101": keras.applications.ResNet101}[name]
    model = build(weights=None, input_shape=(224, 224, 3), classes=1000)
    shapes, flops = [], []
    by_var = {}
    for layer in model.layers:
        vs = layer.trainable_variables
        for v in vs:
            by_var[id(v)] = _layer_flops(layer) / len(vs)
    for v in model.trainable_variables:
        shapes.append([int(d) for d in v.shape])
        flops.append(by_var.get(id(v), 0.0))
    entry = {"shapes": shapes, "flops": flops,
             "forward_flops": sum(_layer_flops(layer) for layer in model.layers),
             "source": f"keras.applications.{build.__name__} (224x224, 1000 classes), "
                       "FLOPs from layer shapes"}
    cache[name] = entry
    os.makedirs(os.path.dirname(CACHE), exist_ok=True)
    with open(CACHE, "w") as f:
        json.dump(cache, f)
    return entry


def gpu_workload(name: str, gpu: str) -> tuple[Workload, str]:
    """ResNet-50/101 on one V100 or A100: (workload, source of its step time).
    The step time is split 1/3 forward, 2/3 backward."""
    r = resnet(name)
    if (name, gpu) in GPU_STEP:
        step, source = GPU_STEP[(name, gpu)]
    else:
        base, base_source = GPU_STEP[("resnet50", gpu)]
        ratio = r["forward_flops"] / resnet("resnet50")["forward_flops"]
        step, source = base * ratio, (f"ResNet-50's {1e3 * base:.0f} ms scaled by forward FLOPs "
                                      f"(x{ratio:.2f}): {base_source}")
    ready = backward_profile(r["flops"], step / 3, 2 * step / 3)
    return Workload(f"{name} {gpu}", tuple(tuple(s) for s in r["shapes"]), tuple(ready),
                    step), source


def sleepy_workload(layers: int, forward_s: float, backward_s: float,
                    overhead_s: float = 0.0) -> Workload:
    """benchmarks/overlap.py's SleepyModel: `layers` 1024x1024 float32 weights; the
    forward sleeps `forward_s` per layer, the backward `backward_s` per layer in
    reverse (layer k's gradient exists once layers k..L-1 have waited).
    `overhead_s`: the engine's measured compiled-step cost beyond the sleeps."""
    shapes = tuple((1024, 1024) for _ in range(layers))
    ready = tuple(overhead_s + layers * forward_s + (layers - k) * backward_s
                  for k in range(layers))
    return Workload(f"sleepy {layers}x4MiB {1e3 * forward_s:.0f}/{1e3 * backward_s:.0f} ms",
                    shapes, ready, overhead_s + layers * (forward_s + backward_s),
                    cpu_compute_s=overhead_s)


def flat_workload(mib: float, num_variables: int, compute_s: float) -> Workload:
    """benchmarks/scaling_check.py's FlatModel: `num_variables` float32 vectors of
    `mib` MiB in all, gradient a constant fill; its compute (measured) holds a
    core and every gradient is ready when it ends."""
    n = int(mib * 2**20 / 4 / num_variables)
    shapes = tuple((n,) for _ in range(num_variables))
    return Workload(f"flat {mib:g} MiB", shapes, tuple(compute_s for _ in shapes), compute_s,
                    cpu_compute_s=compute_s)
