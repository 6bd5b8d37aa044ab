import contextlib
import fcntl
import os
import struct
import sys
import termios
import threading

import numpy as np
import pytest

from asyncload import AsyncLoader
from asyncload.order.positions import Cursor, Positions
from tests.decoders import FailsOn


def test_positions_merge_into_intervals():
    done = Positions()
    done.add([5, 6, 7, 1, 2, 9])
    assert done.intervals() == [[1, 3], [5, 8], [9, 10]]
    done.add_interval(3, 5)
    assert done.intervals() == [[1, 8], [9, 10]]
    assert 4 in done and 8 not in done and 0 not in done and len(done) == 8


def test_a_whole_epoch_delivered_batch_by_batch_is_one_interval():
    done = Positions()
    for start in range(0, 1000, 10):
        done.add(range(start, start + 10))
    assert done.intervals() == [[0, 1000]]


def test_cursor_skips_done_positions():
    cursor = Cursor(12, Positions([[1, 8], [9, 10]]))
    assert cursor.take(3) == [0, 8, 10]
    assert cursor.take(5) == [11]
    assert cursor.take(1) == []


def test_cursor_without_done_positions_counts_up():
    cursor = Cursor(7, Positions())
    assert [cursor.take(3), cursor.take(3), cursor.take(3)] == [[0, 1, 2], [3, 4, 5], [6]]


# ----- the progress bar (progress=True), as a terminal shows it -----


@contextlib.contextmanager
def terminal(monkeypatch, columns: int, rows: int):
    """Standard error on a pseudo-terminal of ``columns`` x ``rows`` (0 x 0: a terminal that
    reports no size); yields a list that holds, once the block ends, the lines it shows."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the terminal's other end is closed and nothing is left
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stream = open(slave, "w", buffering=1)
    monkeypatch.setattr(sys, "stderr", stream)
    shown: list[str] = []
    try:
        yield shown
    finally:
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        stream.close()
        reader.join(5)
        os.close(master)
    shown += screen(b"".join(chunks).decode())


def screen(output: str) -> list[str]:
    """The lines a terminal shows for ``output``: ``\\r`` returns to the line's start and what
    follows overwrites it; a line's trailing spaces are not seen."""
    lines = []
    for line in output.replace("\r\n", "\n").split("\n")[:-1]:
        cells: list[str] = []
        for part in line.split("\r"):
            cells[: len(part)] = part
        lines.append("".join(cells).rstrip())
    return lines


def bar_loader(processes=0, **kwargs):
    options = dict(batch_size=8, shuffle=False, read=False, decode=np.int64, num_threads=2, progress=True)
    return AsyncLoader(list(range(40)), processes=processes, **{**options, **kwargs})


@pytest.mark.parametrize("processes", [0, 2])
def test_the_bar_ends_at_100_percent_when_a_skipped_sample_leaves_the_epoch_short(monkeypatch, processes):
    with terminal(monkeypatch, 100, 24) as shown:
        with bar_loader(processes, decode=FailsOn({7}), on_error="skip", max_failures=3) as loader:
            delivered = sum(len(batch) for batch in loader)
    assert delivered == 39
    (line,) = shown
    assert line.startswith("epoch 0: 100%|") and " 39/39 [" in line, line


def test_a_resumed_epoch_counts_what_was_delivered_before(monkeypatch):
    with bar_loader(progress=False) as loader:
        iterator = iter(loader)
        next(iterator), next(iterator)
        state = loader.state_dict()
        del iterator
    with terminal(monkeypatch, 100, 24) as shown:
        with bar_loader() as resumed:
            resumed.load_state_dict(state)
            assert sum(len(batch) for batch in resumed) == 24
    (line,) = shown
    assert line.startswith("epoch 0: 100%|") and " 40/40 [" in line, line


def test_no_blank_lines_on_a_terminal_that_reports_no_size(monkeypatch):
    """A pseudo-terminal nobody sized (0 x 0) made tqdm draw at -1 columns: nothing but a blank
    line per epoch."""
    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.delenv("LINES", raising=False)
    with terminal(monkeypatch, 0, 0) as shown:
        with bar_loader() as loader:
            for epoch in range(2):
                assert sum(len(batch) for batch in loader) == 40
    assert len(shown) == 2, shown
    for epoch, line in enumerate(shown):
        assert line.startswith(f"epoch {epoch}: 100%|") and " 40/40 [" in line, line
