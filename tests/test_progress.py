from asyncload.order.positions import Cursor, Positions


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
