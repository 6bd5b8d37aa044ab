"""What a decode returns that cannot travel between processes (``batch/crossing.py``).

In a child, a value put aside that does not pickle (a ``memoryview``, a lock) fails its sample
alone, naming the field and the type: raised, or skipped and counted; never a child thread that
dies while the parent waits for ever. In this process nothing travels: such values are handed
out as they are, and the default does not move such a run to children.
"""

from __future__ import annotations

import re
import threading
import warnings

import numpy as np
import pytest

from asyncload import AsyncLoader, SampleError
from tests.switching import children_of, force_switch

ITEMS = list(range(24))


def with_a_view(i):
    return {"x": np.full(2, i, np.int64), "m": memoryview(b"%d" % i)}


def with_a_lock(i):
    return {"x": np.full(2, i, np.int64), "m": threading.Lock()}


def with_an_object_field(i):
    """A structured array whose dtype is not ``object`` but holds objects (``dtype.hasobject``)."""
    return {"x": np.full(2, i, np.int64), "m": np.array([(i, memoryview(b"v"))], dtype=[("a", "i8"), ("o", "O")])}


def a_view_for_multiples_of_five(i):
    return {"x": np.full(2, i, np.int64), "m": memoryview(b"v") if i % 5 == 0 else b"%d" % i}


class PicklesOnce:
    """Pickles the first time (the child's check when it is written) and never again (the
    answer that carries it): what no check can foresee."""

    def __init__(self) -> None:
        self.pickled = 0

    def __reduce__(self):
        self.pickled += 1
        if self.pickled > 1:
            raise TypeError("this object pickles only once")
        return (PicklesOnce, ())


def pickles_once(i):
    return {"x": np.full(2, i, np.int64), "m": PicklesOnce()}


class Fatal(BaseException):
    """Not an ``Exception``: no sample's error handling catches it, so it ends the decode thread."""


def fatal_after_the_first_batch(i):
    if i >= 4:
        raise Fatal(f"item {i} ended its thread")
    return {"x": np.full(2, i, np.int64), "m": b"%d" % i}


def xs(batches) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch["x"]]


@pytest.mark.parametrize("decode, kind, pickle_says", [
    (with_a_view, "memoryview", "cannot pickle memoryview objects"),
    (with_a_lock, "_thread.lock", "cannot pickle '_thread.lock' object"),
    (with_an_object_field, "numpy.ndarray", "cannot pickle memoryview objects")])
def test_a_value_that_cannot_leave_a_child_fails_its_sample_naming_the_field_and_type(decode, kind, pickle_says):
    with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=decode, processes=2,
                     decode_timeout=600) as loader:
        with pytest.raises(SampleError) as caught:
            list(loader)
    text = str(caught.value)  # which sample a child reaches first depends on the run
    assert re.fullmatch(r"sample \d+ failed at decode: CannotCross: .*", text), text
    assert f"field 'm' is a {kind}, which cannot travel between processes (TypeError: {pickle_says})" in text
    assert text.endswith("or use processes=0")


def test_values_that_cannot_leave_a_child_are_skipped_and_counted():
    with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=a_view_for_multiples_of_five,
                     processes=2, on_error="skip", max_failures=10) as loader:
        batches = list(loader)
        failures = loader.stats.failures
    bad = {i for i in ITEMS if i % 5 == 0}
    assert sorted(xs(batches)) == sorted(set(ITEMS) - bad), "each other sample exactly once"
    assert sorted(f.item for f in failures) == sorted(bad)
    assert all("field 'm' is a memoryview" in str(f.error) for f in failures)


def test_an_answer_that_cannot_be_sent_is_an_error_in_the_parent_not_a_hang():
    with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=pickles_once, processes=1,
                     decode_timeout=600) as loader:
        with pytest.raises(RuntimeError, match="a loader process cannot go on") as caught:
            list(loader)
    assert "could not send its Done answer: TypeError: this object pickles only once" in str(caught.value.__cause__)


def test_a_decode_thread_of_a_child_that_dies_is_an_error_in_the_parent_not_a_hang():
    with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=fatal_after_the_first_batch,
                     processes=2, decode_timeout=600) as loader:
        with pytest.raises(RuntimeError, match="a loader process cannot go on") as caught:
            list(loader)
    cause = str(caught.value.__cause__)
    assert re.match(r"thread asyncload-decode-\d+ of a loader process \(pid \d+\) died: Fatal: item \d+ ended its "
                    r"thread", cause), cause


def test_in_this_process_such_values_are_handed_out_as_they_are():
    with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=with_a_view, processes=0) as loader:
        batches = list(loader)
    assert xs(batches) == ITEMS
    assert [bytes(view) for batch in batches for view in batch["m"]] == [b"%d" % i for i in ITEMS]


def test_the_default_does_not_move_such_a_run_to_children(monkeypatch):
    force_switch(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AsyncLoader(ITEMS, batch_size=4, shuffle=False, read=False, decode=with_a_view) as loader:
            batches = list(loader)
            assert children_of(loader) == 0
            choice = loader.stats.processes_choice
    assert xs(batches) == ITEMS
    said = [str(w.message) for w in caught if "processes=None stays in this process" in str(w.message)]
    assert len(said) == 1 and "field 'm' is a memoryview, which cannot travel between processes" in said[0]
    assert "child processes cannot be used: field 'm' is a memoryview" in choice
