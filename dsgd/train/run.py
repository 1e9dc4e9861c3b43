"""`python -m dsgd.train.run -np N script.py [args...]`: horovodrun's place.

Runs the unmodified script's top level (as `__main__`, with its `sys.argv`) in
each of N `DsgdTrainer` workers, where `import dsgd.train as hvd` finds the
run's exchange. Starts a local Ray cluster, or joins the one `--address` or
`RAY_ADDRESS` names. Every rank's output reaches this terminal through Ray's
log forwarding (prefixed with the worker's pid); a rank that raises (or exits
non-zero) fails the command with that rank's traceback and exit status 1.

    horovodrun -np 2 python train.py --epochs 3
    python -m dsgd.train.run -np 2 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from dsgd import constants

_PYTHONS = ("python", "python3", os.path.basename(sys.executable))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dsgd.train.run",
        description="Run a Horovod-style TensorFlow script on N dsgd Ray Train workers "
                    "(`import dsgd.train as hvd` inside it).")
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, required=True,
                   help="number of workers (ranks)")
    p.add_argument("--gpu", action="store_true", help="give each worker one GPU")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: $RAY_ADDRESS, else a new local cluster)")
    p.add_argument("--timeout", type=float, default=constants.DEFAULT_STEP_TIMEOUT_S,
                   help="seconds one exchange may wait for the other ranks (default: %(default)s)")
    p.add_argument("--compression", choices=sorted(constants.COMPRESSIONS), default=None,
                   help="default wire compression of the run's exchanges")
    p.add_argument("--storage-path", default=None,
                   help="Ray Train's storage path (default: Ray's, ~/ray_results)")
    p.add_argument("script", help="the Python script (a leading `python` is skipped)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return p


def run_script(config: dict) -> None:
    """(in every Ray Train worker) Run the script's source as `__main__`."""
    import builtins

    path, argv = config["path"], config["argv"]
    sys.argv = [path] + list(argv)
    if os.path.isdir(config["cwd"]):
        os.chdir(config["cwd"])
    script_dir = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(script_dir) and script_dir not in sys.path:
        sys.path.insert(0, script_dir)
    namespace = {"__name__": "__main__", "__file__": path, "__builtins__": builtins}
    try:
        exec(compile(config["source"], path, "exec"), namespace)  # noqa: S102 - the user's script
    except SystemExit as e:
        if e.code not in (None, 0):
            raise RuntimeError(f"{path} exited with status {e.code}") from e


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (0: every rank finished)."""
    args = parser().parse_args(argv)
    script, script_args = args.script, list(args.args)
    if script in _PYTHONS and script_args:  # `-np 2 python train.py`, as horovodrun takes it
        script, script_args = script_args[0], script_args[1:]
    if args.num_proc < 1:
        print(f"dsgd.train.run: -np must be >= 1, got {args.num_proc}", file=sys.stderr)
        return 2
    try:
        with open(script) as f:
            source = f.read()
    except OSError as e:
        print(f"dsgd.train.run: cannot read the script {script!r}: {e}", file=sys.stderr)
        return 2

    import ray
    from ray.train import RunConfig, ScalingConfig

    from dsgd.train import DsgdConfig, DsgdTrainer

    # The script's prints reach this terminal once (Ray Train would also log each
    # one). TensorFlow's start-up probing lines are dropped where dsgd imports it
    # (dsgd/tf_logging.py); a TF_CPP_MIN_LOG_LEVEL set here reaches every rank.
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    env_vars = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
    if "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        env_vars["TF_CPP_MIN_LOG_LEVEL"] = os.environ["TF_CPP_MIN_LOG_LEVEL"]
    quiet = {"env_vars": env_vars}
    if not ray.is_initialized():
        address = args.address or os.environ.get("RAY_ADDRESS")
        if address and address != "local":
            ray.init(address=address, runtime_env=quiet)
        else:  # a local cluster: room for every rank, as horovodrun oversubscribes
            ray.init(address="local", num_cpus=max(args.num_proc, os.cpu_count() or 1),
                     runtime_env=quiet)
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < args.num_proc:
        print(f"dsgd.train.run: -np {args.num_proc} needs {args.num_proc} CPUs but the Ray "
              f"cluster has {cpus:g}", file=sys.stderr)
        return 2
    name = f"dsgd-run-{os.path.splitext(os.path.basename(script))[0]}-{time.strftime('%Y%m%d-%H%M%S')}"
    trainer = DsgdTrainer(
        run_script,
        train_loop_config={"path": os.path.abspath(script), "source": source,
                           "argv": script_args, "cwd": os.getcwd()},
        dsgd_config=DsgdConfig(timeout_s=args.timeout, compression=args.compression),
        scaling_config=ScalingConfig(num_workers=args.num_proc, use_gpu=args.gpu),
        run_config=RunConfig(name=name, storage_path=args.storage_path))
    try:
        result = trainer.fit()
    except Exception as e:  # noqa: BLE001 - Ray Train's error carries the rank's traceback
        print(f"dsgd.train.run: {script} failed:\n{e}", file=sys.stderr)
        return 1
    if result.error is not None:
        print(f"dsgd.train.run: {script} failed:\n{result.error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
