"""The README's and the documentation's Python code blocks run, as a user runs them.

Each ```python block of README.md is a user's own script (it calls `ray.init`
itself) and runs alone in a fresh process. The blocks of one documentation page
(docs/*.md, benchmarks/README.md) run in order in one fresh process, sharing
names, as a reader follows the page. Both run in a temporary directory with the
environment a user has: no `TF_CPP_MIN_LOG_LEVEL` (the test session sets one for
its own workers), no Ray address, worker output forwarded to the terminal.

The README's first example is also checked to print none of TensorFlow's
start-up probing lines (dsgd/tf_logging.py) from the driver or any worker.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsgd import tf_logging

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("**/*.md")) + [ROOT / "benchmarks" / "README.md"]
PAGES = [p for p in PAGES if p.exists() and p.relative_to(ROOT).parts[1:2] != ("benchmarks",)]
PROBING = re.compile(r"Could not find cuda drivers|failed call to cuInit|oneDNN custom operations"
                     r"|cpu_feature_guard|absl::InitializeLog")
BLOCK_TIMEOUT_S = 300


def python_blocks(path: Path) -> list[str]:
    """The ```python fenced blocks of a Markdown file, in order."""
    blocks, current = [], None
    for line in path.read_text().splitlines():
        if current is None and line.strip() == "```python":
            current, indent = [], len(line) - len(line.lstrip())
        elif current is not None and line.strip() == "```":
            blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line[indent:])
    assert current is None, f"{path}: a ```python block is not closed"
    return blocks


def user_env(**extra) -> dict:
    """A user's shell: no TF_CPP_MIN_LOG_LEVEL, no cluster to join. RAY_ADDRESS=local
    keeps a block's `ray.init()` from joining another test process's cluster (a
    `ray.cluster_utils.Cluster` head registers itself as this machine's latest
    cluster, which a bare `ray.init()` would connect to)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_CPP_MIN_LOG_LEVEL", "PYTEST_CURRENT_TEST")}
    env["RAY_ADDRESS"] = "local"
    env.update(extra)
    return env


def run_script(source: str, tmp_path: Path, name: str, **env) -> str:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=user_env(**env),
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{name} failed (exit {done.returncode}):\n{output[-6000:]}"
    return output


README_BLOCKS = python_blocks(ROOT / "README.md")


def code_of(block: str) -> list[str]:
    """A block's code lines, without comments and blank lines (to compare programs)."""
    lines = (re.sub(r"\s*#.*$", "", line).rstrip() for line in block.splitlines())
    return [line for line in lines if line]


# A README block that is, comments aside, a docs page's whole program runs once, as that
# page (tests/test_docs_pages.py): the README's Ray Train example is docs/raytrain.md's.
PAGE_PROGRAMS = {tuple(code_of("\n".join(python_blocks(p)))) for p in PAGES if python_blocks(p)}
RUN_AS_A_PAGE = [i for i, b in enumerate(README_BLOCKS) if tuple(code_of(b)) in PAGE_PROGRAMS]


def test_every_page_with_python_is_collected():
    assert README_BLOCKS, "README.md has no ```python block"
    assert any(python_blocks(page) for page in PAGES)


def test_probing_filter_keeps_other_lines():
    captured = (
        "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
        "I0000 00:00:1.0 1 port.cc:153] oneDNN custom operations are on.\n"
        "I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on your machine.\n"
        "I0000 00:00:1.0 1 cpu_feature_guard.cc:227] This TensorFlow binary is optimized\n"
        "To enable the following instructions: AVX2 FMA, in other operations, rebuild.\n"
        "E0000 00:00:1.0 1 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)\n"
        "W0000 00:00:1.0 1 op_kernel.cc:1] something the user should see\n"
        "/x.py:1: UserWarning: a Python warning\n")
    assert tf_logging.filter_lines(captured, None) == (
        "W0000 00:00:1.0 1 op_kernel.cc:1] something the user should see\n"
        "/x.py:1: UserWarning: a Python warning\n")
    # A level the user set applies to these lines as TensorFlow's rule would.
    kept = tf_logging.filter_lines(captured, "2").splitlines()
    assert [line[:5] for line in kept] == ["E0000", "/x.py"]
    assert tf_logging.filter_lines(captured, "0") == captured


# A script that imports dsgd first, then uses TensorFlow in its own process and in a
# Ray worker that imports dsgd, as every dsgd actor does (~12 s on 2 cores; the README's
# first example, which shows the same in 2 workers over 100 steps, is a `slow` block).
USES_TENSORFLOW_HERE_AND_IN_A_WORKER = """
import dsgd
import keras
import ray
import tensorflow as tf
ray.init(num_cpus=1, include_dashboard=False)
@ray.remote
def uses_tensorflow():
    import dsgd  # noqa: F401
    import tensorflow as tf
    return float(tf.reduce_sum(tf.ones(3)))
print("sums", float(tf.reduce_sum(tf.ones(2))), ray.get(uses_tensorflow.remote(), timeout=300))
"""


def probing_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if PROBING.search(line)]


@pytest.mark.cluster
def test_importing_dsgd_first_prints_no_tensorflow_probing(tmp_path):
    output = run_script(USES_TENSORFLOW_HERE_AND_IN_A_WORKER, tmp_path, "quiet")
    assert "sums 2.0 3.0" in output
    assert not probing_lines(output), \
        "TensorFlow's probing lines reached the terminal:\n" + "\n".join(probing_lines(output))


@pytest.mark.slow
def test_tensorflow_logging_shows_when_asked(tmp_path):
    """TF_CPP_MIN_LOG_LEVEL=0 turns the filter off: a worker's probing lines come
    through to the terminal (so the check above can see them when they are there)."""
    output = run_script(USES_TENSORFLOW_HERE_AND_IN_A_WORKER, tmp_path, "verbose",
                        TF_CPP_MIN_LOG_LEVEL="0")
    assert re.search(r"pid=\d+.*Could not find cuda drivers", output), output[-3000:]


@pytest.mark.slow
def test_readme_first_example_prints_no_tensorflow_probing(tmp_path):
    output = run_script(README_BLOCKS[0], tmp_path, "readme_0")
    assert "step 81: loss" in output
    assert not probing_lines(output), \
        "TensorFlow's probing lines reached the terminal:\n" + "\n".join(probing_lines(output))


def test_the_readme_ray_train_example_is_the_docs_page_that_runs():
    """Block 3 runs as docs/raytrain.md: an edit to one and not the other makes it
    run on its own again, and this fails to say so."""
    assert RUN_AS_A_PAGE == [3], RUN_AS_A_PAGE


@pytest.mark.slow
@pytest.mark.parametrize("index", [i for i in range(1, len(README_BLOCKS)) if i not in RUN_AS_A_PAGE])
def test_readme_block_runs(index, tmp_path):
    run_script(README_BLOCKS[index], tmp_path, f"readme_{index}")
