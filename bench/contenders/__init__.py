"""The contenders: each builds, for a workload and one point of its sweep, an iterable of batches.

Every contender exposes the same small interface (``Contender``) so that the worker measures them
all with one loop. A contender whose package is missing or broken says why in ``unavailable()``,
and the report lists that reason instead of the row.
"""

from __future__ import annotations

from bench.contenders.base import Contender, RunData, batch_size_of
from bench.contenders.asyncload_ import AsyncLoadContender
from bench.contenders.dataloader import DataLoaderContender
from bench.contenders.spdl_ import SPDLContender
from bench.contenders.torchdata_ import TorchDataContender

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (AsyncLoadContender(), DataLoaderContender(), TorchDataContender(), SPDLContender())
}

__all__ = ["CONTENDERS", "Contender", "RunData", "batch_size_of"]
