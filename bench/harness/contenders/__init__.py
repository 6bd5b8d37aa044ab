"""The contenders: each builds, for a workload and one point of its sweep, an iterable of batches.

Every contender exposes the same small interface (``Contender``) so that the worker measures them
all with one loop. A contender whose package is missing or broken says why in ``unavailable()``,
and the report lists that reason instead of the row.
"""

from __future__ import annotations

from bench.harness.contenders.base import Contender, RunData, batch_size_of
from bench.harness.contenders.asyncload_ import AsyncLoadContender
from bench.harness.contenders.dataloader import DataLoaderContender
from bench.harness.contenders.spdl_ import SPDLContender
from bench.harness.contenders.torchdata_ import TorchDataContender

CONTENDERS: dict[str, Contender] = {
    c.name: c
    for c in (AsyncLoadContender(), DataLoaderContender(), TorchDataContender(), SPDLContender())
}

__all__ = ["CONTENDERS", "Contender", "RunData", "batch_size_of"]
