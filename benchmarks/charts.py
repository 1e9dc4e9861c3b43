"""Every chart of the benchmarks, drawn from their JSON results: the one place for chart code.

    python benchmarks/charts.py                 # every chart benchmarks/README.md shows
    python benchmarks/charts.py results/x.json  # the chart of one result, as results/x.png

With no argument it redraws each PNG in benchmarks/results/ from the JSON beside it
(see CHARTS). Given JSON files, it draws each one's chart beside it under the same
name; the kind of chart comes from the file's "benchmark" field, else from its name.
The benchmark scripts that wrote a chart themselves (comm.py, ingest.py,
stragglers.py, peers/run.py) call draw() on the JSON they have just written.
Needs matplotlib (`pip install matplotlib`); reads JSON only, runs no benchmark.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str, dpi: int = 100) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)


def comm(result: dict, path: str) -> None:
    """comm.py: median step per gradient size, dsgd against the plain step, the bound and the peer."""
    plt = _pyplot()
    rows = result["rows"]
    sizes = [r["mib"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("plain_s", "plain tf.function step"), ("dsgd_s", "dsgd ps step"),
                       ("shared_plain_s", "plain steps on every worker at once"),
                       ("peer_s", "plain-Ray exchange (peer)"), ("bound_s", "2 x memcpy")):
        ax.plot(sizes, [1000 * r[key] for r in rows], marker="o", label=label)
    ax.set_xlabel("gradient MiB per worker")
    ax.set_ylabel("median ms per step")
    ax.set_title(f"{rows[0]['workers']} workers, {rows[0]['num_ps']} PS actors, "
                 f"{result['grad_shard_bytes'] / 1e6:g} MB shards")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, path)


def step_time(result: dict, path: str) -> None:
    """step_time.py: median step per configuration, one panel per model, split into its phases."""
    plt = _pyplot()
    models = list(dict.fromkeys(r["model"] for r in result["rows"]))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rows = [r for r in result["rows"] if r["model"] == model]
        labels = [r["config"].replace(", 1 replica", "").replace("plain tf.function", "plain TF")
                  + f"\n{r['workers']} worker{'s' if r['workers'] > 1 else ''}"
                  if not r["config"].startswith("plain") else "plain TF" for r in rows]
        x = range(len(rows))
        bottom = [0.0] * len(rows)
        for key, label in (("median_compute_s", "compute"), ("median_exchange_s", "exchange"),
                           ("median_apply_s", "apply")):
            values = [1000 * r.get(key, 0.0) for r in rows]
            ax.bar(x, values, 0.6, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        plain = [1000 * r["median_step_s"] if r["config"].startswith("plain") else 0.0 for r in rows]
        ax.bar(x, plain, 0.6, color="tab:gray", label="plain step")
        for i, r in enumerate(rows):
            ax.plot([i - 0.3, i + 0.3], [1000 * r["median_step_s"]] * 2, color="k", lw=1.5)
            ax.annotate(f"{r['ratio_to_plain']:.2f}x", (i, 1000 * r["median_step_s"]),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x), labels, fontsize=8)
        ax.set_ylabel("median ms per step (black line: the whole step)")
        ax.set_title(f"{model}, batch {result['batch_size_per_replica']} per replica")
        ax.legend(fontsize=8)
    _save(fig, path)


def overhead(result: dict, path: str) -> None:
    """overhead.py: plain step against one dsgd worker, interleaved, per model."""
    plt = _pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(3.5 * len(rows), 3.8), squeeze=False)
    for ax, r in zip(axes[0], rows):
        values = [1000 * r["median_plain_s"], 1000 * r["median_dsgd_1_worker_s"]]
        ax.bar(["plain TF", "dsgd, 1 worker"], values, 0.6, color=["tab:gray", "tab:blue"])
        ax.set_title(f"{r['model']}: {r['ratio']:.3f}x", fontsize=10)
        ax.set_ylabel("median ms per step")
    fig.suptitle(f"One worker vs plain tf.function, medians of {rows[0]['samples']} interleaved "
                 "steps", fontsize=10)
    _save(fig, path)


def stragglers(result: dict, path: str) -> None:
    """stragglers.py: step time and accuracy per backup_workers x straggler mode."""
    plt = _pyplot()
    rows = result["rows"]
    labels = [f"b={r['backup_workers']}\n{r['mode']}" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    x = list(range(len(rows)))
    left.bar([i - 0.2 for i in x], [r["median_step_s"] * 1e3 for r in rows], 0.4, label="median")
    left.bar([i + 0.2 for i in x], [r["p95_step_s"] * 1e3 for r in rows], 0.4, label="p95")
    left.axhline(1.15 * result["sync_step_s"] * 1e3, color="k", ls="--", lw=1,
                 label="1.15 x straggler-free sync")
    left.set_xticks(x, labels)
    left.set_ylabel("step time (ms)")
    left.legend()
    right.bar([i - 0.2 for i in x], [r["accuracy_equal_steps"] for r in rows], 0.4,
              label=f"after {result['steps']} steps")
    right.bar([i + 0.2 for i in x], [r["accuracy_equal_time"] for r in rows], 0.4,
              label=f"after {result['equal_wall_time_s']:.0f} s")
    low = min(min(r["accuracy_equal_steps"], r["accuracy_equal_time"]) for r in rows)
    right.set_ylim(max(0.0, low - 0.05), 1.0)
    right.set_xticks(x, labels)
    right.set_ylabel("test accuracy")
    right.legend(loc="lower right")
    fig.suptitle(f"Backup workers, {result['workers']} workers, MNIST CNN, one straggler "
                 f"(worker {result['straggler']['worker']}); {result['device']}")
    _save(fig, path)


def ingest(result: dict, path: str) -> None:
    """ingest.py: step time per way of feeding, and download throughput per concurrency."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = list(result["feeding"]["step_s"])
    left.bar(names, [1000 * result["feeding"]["step_s"][n] for n in names], color="tab:blue")
    left.set_ylabel("median step (ms)")
    left.set_title("MNIST CNN, 2 workers: how batches arrive")
    rates = result["downloads"]
    cs = [int(c) for c in rates["items_per_s"]]
    right.plot(cs, list(rates["items_per_s"].values()), "o-", label="measured")
    right.plot(cs, list(rates["ideal_items_per_s"].values()), "--", label="ideal")
    right.set_xlabel("max_concurrency")
    right.set_ylabel("items/s")
    right.set_title(f"download_func sleeping {1000 * rates['sleep_s']:.0f} ms per item")
    right.legend()
    _save(fig, path)


def trainer_overhead(result: dict, path: str) -> None:
    """trainer_overhead.py: epoch time of Keras fit against Trainer.train(), per model and workers."""
    plt = _pyplot()
    runs = result["runs"]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = list(range(len(runs)))
    ax.bar([i - 0.2 for i in x], [r["fit_median_s"] for r in runs], 0.4, color="tab:gray",
           label="Keras fit (1 process)")
    ax.bar([i + 0.2 for i in x], [r["trainer_median_s"] for r in runs], 0.4, color="tab:blue",
           label="Trainer.train()")
    for i, r in enumerate(runs):
        ax.annotate(f"{r['ratio']:.2f}x", (i + 0.2, r["trainer_median_s"]), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(x, [f"{r['model']}\n{r['workers']} worker{'s' if r['workers'] > 1 else ''}"
                      for r in runs])
    ax.set_ylabel("median epoch (s)")
    ax.set_title(f"One epoch ({runs[0]['steps_per_epoch']} steps, global batch "
                 f"{runs[0]['global_batch']}), medians of {runs[0]['rounds']} rounds")
    ax.legend()
    _save(fig, path)


def chaos(result: dict, path: str) -> None:
    """chaos.py: every injected fault, when it struck and how long until the run recovered."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9.5, 4))
    log = result["fault_log"]
    phases = list(dict.fromkeys(f["phase"] for f in log))  # at_s: from the run's start
    markers = {"SIGKILL": "x", "SIGSTOP": "o"}
    colors = {"worker": "tab:blue", "ps": "tab:orange"}
    for role, color in colors.items():
        for kind, marker in markers.items():
            fs = [f for f in log if f["role"] == role and f["kind"] == kind
                  and f.get("recovered_after_s") is not None]
            if fs:
                ax.scatter([f["at_s"] for f in fs],
                           [f["recovered_after_s"] for f in fs], marker=marker,
                           color=color, label=f"{role} {kind}")
    for phase in phases[1:]:  # the phases run one after the other
        first = min(f["at_s"] for f in log if f["phase"] == phase)
        last = max(f["at_s"] + (f.get("recovered_after_s") or 0.0) for f in log
                   if f["phase"] != phase and f["at_s"] < first)
        ax.axvline((first + last) / 2, color="k", lw=0.8, ls=":")
    ax.axhline(result["step_timeout_s"], color="k", lw=0.8, ls="--",
               label=f"step_timeout_s = {result['step_timeout_s']:g}")
    ax.set_xlabel("seconds into the run (" + ", then ".join(phases) + ")")
    ax.set_ylabel("fault to recovered (s)")
    ax.set_title(f"{result['faults']} faults, {result['recoveries']} recovered, steps lost: "
                 f"engine {result['engine']['steps_lost']}, Trainer {result['trainer']['steps_lost']}")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def resnet_synthetic(results: list, path: str) -> None:
    """resnet_synthetic.py: images/s of every measured step, one line per result."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in results:
        steps = r["steps"]
        ax.plot([s["step"] for s in steps], [s["images_per_s"] for s in steps], "o-",
                label=f"{r['model']}: median {r['median_images_per_s']:.1f}")
    first = results[0]
    ax.set_xlabel("step (after warm-up)")
    ax.set_ylabel("images/s")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{first['num_workers']} worker, {first['image_size']}x{first['image_size']}, "
                 f"batch {first['batch_size_per_replica']}, {'GPU' if first['gpu'] else 'CPU'}")
    ax.legend()
    _save(fig, path)


def peers(result: dict, path: str) -> None:
    """peers/run.py: images/s of every peer, one panel per configuration, one bar per worker count."""
    plt = _pyplot()
    configs = result["configs"]
    fig, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4.5), squeeze=False)
    for ax, config in zip(axes[0], configs):
        rows = [r for r in result["rows"] if r["config"] == config]
        peer_names = list(dict.fromkeys(r["peer"] for r in rows))
        labels = {r["peer"]: r["label"] for r in rows}
        width = 0.8 / len(result["workers"])
        for k, workers in enumerate(result["workers"]):
            values, rounds = [], []
            for p in peer_names:
                ok = [r["images_per_s"] for r in rows if r["peer"] == p
                      and r["num_workers"] == workers and r["status"] == "ok"]
                # several interleaved rounds: the median, each round a dot
                values.append(sorted(ok)[len(ok) // 2] if ok else 0.0)
                rounds.append(ok)
            xs = [i + (k - (len(result["workers"]) - 1) / 2) * width for i in range(len(peer_names))]
            label = f"{workers} worker(s)" + (", median of rounds" if result.get("rounds", 1) > 1
                                              else "")
            ax.bar(xs, values, width, label=label)
            if result.get("rounds", 1) > 1:
                for x, ok in zip(xs, rounds):
                    ax.plot([x] * len(ok), ok, "k.", markersize=5)
        ax.set_xticks(range(len(peer_names)))
        ax.set_xticklabels([labels[p] for p in peer_names], rotation=30, ha="right", fontsize=8)
        c = result["config_details"][config]
        ax.set_title(f"{config}: {c['model']} {c['image_size']}², batch {c['batch_size']}/replica")
        ax.set_ylabel("images/s (higher is better)")
        ax.legend(fontsize=8)
    when = f", {result['date']}, commit {result['commit']}" if "date" in result else ""
    fig.suptitle(f"dsgd and peers, {result['machine']}{when}", fontsize=10)
    _save(fig, path, dpi=110)


def driver_cost(result: dict, path: str) -> None:
    """driver_cost.py: the driver's CPU per step against the number of workers, per path."""
    plt = _pyplot()
    labels = {"relayed": "driver-relayed step (backup workers)",
              "workers": "workers' own exchange, train()",
              "workers_step": "workers' own exchange, one step per call"}
    fig, ax = plt.subplots(figsize=(6, 4))
    versions = list(dict.fromkeys(r.get("label", "") for r in result["rows"]))
    for version in versions:  # code versions (before/after a change) in one file
        for path_name, label in labels.items():
            rows = sorted((r for r in result["rows"] if r.get("path") == path_name
                           and r.get("label", "") == version), key=lambda r: r["num_workers"])
            if rows:
                name = f"{label}: {version.split(':')[0]}" if len(versions) > 1 else label
                ax.plot([r["num_workers"] for r in rows],
                        [r["driver_cpu_ms_per_step"] for r in rows], marker="o", label=name,
                        linestyle="--" if version != versions[-1] else "-")
    ax.set_xlabel("workers")
    ax.set_ylabel("driver CPU ms per step (user + system)")
    ax.set_yscale("log")
    ax.set_title(f"{result['mib']:g} MiB of gradients in {result['shard_mib']:g} MiB shards")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    _save(fig, path)


def overlap(result: dict, path: str) -> None:
    """overlap.py: one two-worker step of the emulated accelerator, from its timeline:
    each worker's compute, sends, receives and applies, and each PS's sums."""
    plt = _pyplot()
    spans = result["timeline_step"]
    lanes = sorted({(e["process"], e["row"]) for e in spans},
                   key=lambda k: (k[0].startswith("PS"), k[0], ["step", "send", "receive",
                                                                "apply", "sum"].index(k[1])
                                  if k[1] in ("step", "send", "receive", "apply", "sum") else 9))
    colors = {"step": "#bbbbbb", "send": "#1f77b4", "sum": "#ff7f0e", "receive": "#2ca02c",
              "apply": "#d62728"}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(lanes) + 1.5))
    for y, (process, row) in enumerate(lanes):
        for e in spans:
            if (e["process"], e["row"]) == (process, row):
                ax.barh(y, max(e["dur_ms"], 0.3), left=e["start_ms"], height=0.6,
                        color=colors.get(row, "#999999"), edgecolor="black", linewidth=0.3)
                if row == "step" and e["dur_ms"] > 20:
                    ax.text(e["start_ms"] + e["dur_ms"] / 2, y, e["name"], ha="center",
                            va="center", fontsize=7)
    ax.set_yticks(range(len(lanes)), [f"{p}: {r}" for p, r in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of worker 0's compute (forward, then backward: "
                  "the last layers' gradient first)")
    ax.set_title(f"One step, 2 workers, {result['args']['layers']} layers of 4 MiB, emulated "
                 f"accelerator: exposed/own {result['exposed_over_own']:.2f}", fontsize=10)
    _save(fig, path)


def embeddings(result: dict, path: str) -> None:
    """embeddings.py: step time, and bytes per worker and step against the bytes of
    the rows a step touched, by table size and optimizer (today's dense exchange)."""
    plt = _pyplot()
    runs = result["runs"]
    optimizers = sorted({r["optimizer"] for r in runs})
    sizes = sorted({r["rows"] for r in runs})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(optimizers)
    for k, opt in enumerate(optimizers):
        by = {r["rows"]: r for r in runs if r["optimizer"] == opt}
        xs = [i + k * width for i, n in enumerate(sizes) if n in by]
        left.bar(xs, [1000 * by[n]["step_s"] for n in sizes if n in by], width, label=opt)
    left.set_xticks([i + 0.4 - width / 2 for i in range(len(sizes))],
                    [f"{n / 1e6:g}M rows" for n in sizes])
    left.set_ylabel("median ms per step")
    left.legend(fontsize=8)
    left.set_title("step time, dense exchange", fontsize=10)
    first = {r["rows"]: r for r in runs if r["optimizer"] == optimizers[0]}
    xs = range(len(sizes))
    right.bar([x - 0.2 for x in xs], [first[n]["bytes_per_worker_step"] / 2**20 for n in sizes],
              0.4, label="moved: the whole table, each way", color="tab:red")
    right.bar([x + 0.2 for x in xs], [first[n]["touched_bytes_both_ways"] / 2**20 for n in sizes],
              0.4, label="the rows the batch touched, each way", color="tab:green")
    right.set_yscale("log")
    right.set_xticks(list(xs), [f"{n / 1e6:g}M rows" for n in sizes])
    right.set_ylabel("MiB per worker and step")
    right.legend(fontsize=8)
    right.set_title(f"x {result['runs'][0]['dim']} floats per row", fontsize=10)
    _save(fig, path)


def trace(result: dict, path: str) -> None:
    """A dsgd timeline (the Chrome trace `timeline=` writes): one lane per process and
    row, each span a bar, over the steps the trace's `window_steps` names (default
    all), so the docs can show what Perfetto shows."""
    plt = _pyplot()
    events = result["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    window = result.get("window_steps")
    if window:
        first, last = window
        steps = [e for e in spans if first <= e.get("args", {}).get("step", -1) <= last]
        lo = min(e["ts"] for e in steps)
        hi = max(e["ts"] + e["dur"] for e in steps)
        spans = [e for e in spans if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    start = min(e["ts"] for e in spans)

    def lane(e):  # forward and backward lie inside compute: a lane of their own below it
        return (e["pid"], f"{e['tid']}: inside compute" if e["name"] in ("forward", "backward")
                else e["tid"])

    order = sorted({lane(e) for e in spans},
                   key=lambda k: (names.get(k[0], "") != "driver", names.get(k[0], ""), k[1]))
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3",
               "#8c8c8c", "#ccb974", "#64b5cd"]
    import re

    def kind_of(e):  # "send group 3" -> "send", "step 20" -> "call (step)"
        name = e["name"].split(" group")[0].split(" (")[0]
        return "call (steps)" if re.fullmatch(r"steps? [\d-]+", name) else name

    kinds = sorted({kind_of(e) for e in spans})
    color = {k: palette[i % len(palette)] for i, k in enumerate(kinds)}
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(order) + 1.6))
    for y, key in enumerate(order):
        for e in (e for e in spans if lane(e) == key):
            kind = kind_of(e)
            ax.barh(y, max(e["dur"] / 1000, 0.2), left=(e["ts"] - start) / 1000, height=0.6,
                    color=color[kind], edgecolor="black", linewidth=0.3)
    ax.set_yticks(range(len(order)),
                  [f"{names.get(p, p)}: {rows.get((p, t), t)}" for p, t in order], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[k]) for k in kinds]
    ax.legend(handles, kinds, fontsize=7, ncol=min(len(kinds), 6), loc="upper center",
              bbox_to_anchor=(0.5, -0.25 if len(order) < 8 else -0.12))
    ax.set_title(result.get("title", "dsgd timeline"), fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    _save(fig, path)


KINDS = {"driver_cost": driver_cost, "comm": comm, "step_time": step_time, "overhead": overhead, "stragglers": stragglers,
         "ingest": ingest, "trainer_overhead": trainer_overhead, "chaos": chaos, "peers": peers,
         "overlap": overlap, "embeddings": embeddings}

# The charts benchmarks/README.md shows: PNG -> (chart, the JSON files it is drawn from).
CHARTS = {
    "comm.png": (comm, ["comm.json"]),
    "step_time.png": (step_time, ["step_time.json"]),
    "overhead.png": (overhead, ["overhead.json"]),
    "stragglers.png": (stragglers, ["stragglers.json"]),
    "ingest.png": (ingest, ["ingest.json"]),
    "trainer_overhead.png": (trainer_overhead, ["trainer_overhead.json"]),
    "chaos.png": (chaos, ["chaos.json"]),
    "resnet_synthetic.png": (resnet_synthetic, ["resnet_synthetic_resnet50_1w_cpu.json",
                                                "resnet_synthetic_resnet101_1w_cpu.json"]),
    "peers.png": (peers, ["peers.json"]),
    "peers_default_path.png": (peers, ["peers_default_path.json"]),
    "driver_cost.png": (driver_cost, ["driver_cost.json"]),
    "overlap.png": (overlap, ["overlap.json"]),
    "timeline_mnist.png": (trace, ["timeline_mnist.json"]),
    "embeddings.png": (embeddings, ["embeddings.json"]),
}


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _kind(result: dict, path: str) -> str:
    if "traceEvents" in result:
        return "trace"
    name = result.get("benchmark") or os.path.basename(path)
    for kind in sorted(KINDS, key=len, reverse=True):  # "trainer_overhead" before "overhead"
        if name.startswith(kind):
            return kind
    if name.startswith("resnet_synthetic"):
        return "resnet_synthetic"
    raise ValueError(f"{path}: no chart for this result (benchmark {name!r})")


def draw(json_path: str) -> str:
    """Draws the chart of one JSON result beside it (x.json -> x.png); returns the PNG's path."""
    result = _load(json_path)
    kind = _kind(result, json_path)
    png = os.path.splitext(json_path)[0] + ".png"
    if kind == "resnet_synthetic":
        resnet_synthetic([result], png)
    elif kind == "trace":
        trace(result, png)
    else:
        KINDS[kind](result, png)
    return png


def draw_after_run(json_path: str):
    """What a benchmark script calls after writing its JSON: the chart beside it, except
    for a variant written into results/ that the report shows no chart of (results/
    keeps only the report's charts). Returns the PNG's path, or None."""
    png = os.path.splitext(os.path.basename(json_path))[0] + ".png"
    folder = os.path.dirname(os.path.abspath(json_path))
    if os.path.abspath(folder) == os.path.abspath(RESULTS) and png not in CHARTS:
        print(f"no chart drawn for {json_path} (a variant); python benchmarks/charts.py "
              f"{json_path} draws one")
        return None
    return draw(json_path)


def draw_all(results_dir: str = RESULTS) -> list:
    """Redraws every chart in CHARTS from its JSON; returns the PNGs' paths."""
    written = []
    for png, (chart, sources) in CHARTS.items():
        loaded = [_load(os.path.join(results_dir, s)) for s in sources]
        path = os.path.join(results_dir, png)
        chart(loaded if chart is resnet_synthetic else loaded[0], path)
        written.append(path)
    return written


def main(argv=None) -> None:
    args = sys.argv[1:] if argv is None else argv
    for path in ([draw(a) for a in args] if args else draw_all()):
        print(path)


if __name__ == "__main__":
    main()
