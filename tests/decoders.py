"""Decoders the tests hand to loaders: top-level, so that child processes (processes=2) unpickle them."""

from __future__ import annotations

import numpy as np


def as_array(index):
    return np.full(2, index, np.int64)


class FailsOn:
    """A decode that fails for the given indices (a corrupt file, as the pipeline sees it)."""

    def __init__(self, bad):
        self.bad = set(bad)

    def __call__(self, index):
        if index in self.bad:
            raise ValueError(f"sample {index} is corrupt")
        return np.full(2, index, np.int64)
