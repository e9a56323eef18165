"""The order ``--dist loadfile`` hands files to the workers (tests/_support/lane_order.py):
the measured slowest files first, the longest first, then the rest, the most tests first."""

from __future__ import annotations

from dataclasses import dataclass

from tests._support.lane_order import file_of, slowest_files_first


@dataclass(frozen=True)
class _Item:
    nodeid: str


def _items(*nodeids: str) -> list[_Item]:
    return [_Item(n) for n in nodeids]


def test_a_file_is_the_node_id_before_its_first_separator() -> None:
    assert file_of("tests/cluster/test_x.py::test_a[1::2]") == "tests/cluster/test_x.py"
    assert file_of("tests/cluster/test_x.py::Class::test_a") == "tests/cluster/test_x.py"


def test_measured_files_go_first_the_longest_first_and_keep_their_order() -> None:
    items = _items(
        "many.py::a", "many.py::b", "many.py::c",
        "one.py::a",
        "slow.py::a",
        "two.py::a", "two.py::b",
        "slower.py::b", "slower.py::a",
    )  # fmt: skip
    ordered = slowest_files_first(items, {"slow.py": 30.0, "slower.py": 90.0, "gone.py": 99.0})
    assert [i.nodeid for i in ordered] == [
        "slower.py::b", "slower.py::a",  # within a file: as collected
        "slow.py::a",
        "many.py::a", "many.py::b", "many.py::c",  # then xdist's own: most tests first
        "two.py::a", "two.py::b",
        "one.py::a",
    ]  # fmt: skip
    assert sorted(ordered, key=lambda i: i.nodeid) == sorted(items, key=lambda i: i.nodeid)


def test_files_of_equal_weight_keep_their_collected_order() -> None:
    items = _items("b.py::x", "a.py::x", "c.py::x")
    assert slowest_files_first(items, {}) == items
    assert slowest_files_first(items, {"c.py": 1.0, "b.py": 1.0}) == [items[0], items[2], items[1]]
