"""The MNIST example's inputs from files: the offline digits written once as PNG
files, read back either by a `dsgd.Dataset` of paths (download_func decodes a
file, transform scales in the worker) or by Ray Data (`read_images` +
`map_batches`)."""

from __future__ import annotations

import os

import numpy as np

import dsgd

DONE_MARKER = ".complete"


def default_directory() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dsgd", "mnist_png")


def write_png_files(x_train: np.ndarray, y_train: np.ndarray, directory: str) -> list[str]:
    """Write the training images once as `directory/<label>/<index>.png` (8-bit
    grey); later calls reuse them. Returns the paths, in index order."""
    from PIL import Image

    paths = [os.path.join(directory, str(int(y)), f"{i:05d}.png") for i, y in enumerate(y_train)]
    if os.path.exists(os.path.join(directory, DONE_MARKER)):
        return paths
    for label in range(10):
        os.makedirs(os.path.join(directory, str(label)), exist_ok=True)
    for path, image in zip(paths, x_train):
        Image.fromarray(np.round(image[..., 0] * 255).astype(np.uint8), mode="L").save(path)
    with open(os.path.join(directory, DONE_MARKER), "w") as f:
        f.write(f"{len(paths)} files\n")
    return paths


def decode_png(path: str) -> tuple[np.ndarray, np.int64]:
    """download_func: one file -> (uint8 image (28, 28, 1), label from its directory)."""
    from PIL import Image

    with Image.open(path) as image:
        pixels = np.asarray(image, dtype=np.uint8)[..., None]
    return pixels, np.int64(os.path.basename(os.path.dirname(path)))


def scale(batch):
    """transform (runs in the worker): uint8 pixels -> float32 in [0, 1]."""
    pixels, labels = batch
    return pixels.astype(np.float32) / 255.0, labels


def files_dataset(paths: list[str], batch_size: int, max_concurrency: int) -> dsgd.Dataset:
    # The files are sorted by label: shuffle, or every batch would hold one digit.
    return dsgd.Dataset(paths, download_func=decode_png, max_concurrency=max_concurrency,
                        transform=scale, batch_size=batch_size, shuffle=True)


def to_training_batch(batch: dict) -> dict:
    """Ray Data map_batches: {"image", "path"} -> {"image": float32 (n, 28, 28, 1), "label"}."""
    labels = np.array([int(os.path.basename(os.path.dirname(p))) for p in batch["path"]], np.int64)
    return {"image": batch["image"][..., None].astype(np.float32) / 255.0, "label": labels}


def ray_data_dataset(directory: str, batch_size: int) -> dsgd.Dataset:
    import ray

    images = ray.data.read_images(directory, mode="L", include_paths=True, file_extensions=["png"])
    # The files are sorted by label: shuffle, or every batch would hold one digit.
    return dsgd.Dataset(images.map_batches(to_training_batch).random_shuffle(seed=0),
                        batch_size=batch_size)
