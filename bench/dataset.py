"""The image set's old address, kept for the scripts a lent GPU box runs
(``../shared/gpu16/*.py`` import ``bench.dataset``); the code is ``bench/harness/dataset.py``."""

from bench.harness.dataset import ImageSetSpec, ensure_image_set, list_image_folder, synth_image

__all__ = ["ImageSetSpec", "ensure_image_set", "list_image_folder", "synth_image"]
