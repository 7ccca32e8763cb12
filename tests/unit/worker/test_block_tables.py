"""A worker's block tables (runtime.worker.block_tables.SlotTables): what rank 0 sends, on the
device, with the scratch block past each table's end."""

from __future__ import annotations

import pytest
import torch

from runtime.worker.block_tables import SlotTables

CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(30)


def test_tables_as_sent_with_scratch_past_their_end():
    books = SlotTables(3, 4, 10, 16, CPU)  # pool of 10 < 3 x 4: no fixed tables
    assert [books.capacity(s) for s in range(3)] == [0, 0, 0]
    assert books.all.tolist() == [[10] * 4] * 3
    books.set([1, 2], [[7, 3], [5]])
    rows = books.rows([2, 1])
    assert rows.tolist() == [[5, 10, 10, 10], [7, 3, 10, 10]]
    assert books.rows([2, 1]) is rows  # unchanged tables: the same tensor
    books.extend([1, 2], [[], [9, 8]])
    assert books.rows([2, 1]) is not rows  # a change: built again
    assert books.rows([2, 1]).tolist() == [[5, 9, 8, 10], [7, 3, 10, 10]]
    assert (books.capacity(1), books.capacity(2)) == (32, 48)
    books.set([2], [[4]])  # a new sequence: shorter table
    assert books.rows([2]).tolist() == [[4, 10, 10, 10]]
    books.reset([1, 2])
    assert books.all.tolist() == [[10] * 4] * 3 and books.capacity(1) == 0


def test_a_pool_for_every_slot_starts_with_the_fixed_tables():
    books = SlotTables(2, 3, 6, 4, CPU)
    assert books.rows([0, 1]).tolist() == [[0, 1, 2], [3, 4, 5]]
    books.set([1], [[0]])
    books.reset([1])
    assert books.rows([1]).tolist() == [[3, 4, 5]]


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda b: b.set([0], [[10]]), "out of range"),
        (lambda b: b.set([0], [[-1]]), "out of range"),
        (lambda b: b.set([3], [[1]]), "slot 3"),
        (lambda b: b.set([0], [[1, 2, 3, 4, 5]]), "exceeds 4"),
        (lambda b: (b.set([0], [[1, 2, 3]]), b.extend([0], [[4, 5]])), "exceeds 4"),
    ],
)
def test_bad_tables_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call(SlotTables(3, 4, 10, 16, CPU))
