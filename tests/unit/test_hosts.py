"""Host lists, hostfiles and slot assignment (runner/hosts.py): pure, one process."""
import pytest

from hvdlite.runner.hosts import (Host, HostSpecError, assign_slots, parse_host_list,
                                  parse_hostfile)


def test_host_list_with_slots_parses_in_order():
    assert parse_host_list("a:4,b:2") == [Host("a", 4), Host("b", 2)]


def test_host_list_without_slots_gives_one_slot():
    assert parse_host_list("a,b:3, c") == [Host("a", 1), Host("b", 3), Host("c", 1)]


def test_host_list_ipv6_in_brackets_keeps_colons():
    assert parse_host_list("[::1]:2,[fe80::1]") == [Host("::1", 2), Host("fe80::1", 1)]


@pytest.mark.parametrize("text", ["", "a:", "a:x", "a:0", "a:-1", "a::2", "a,,b", ",a",
                                  "a:2:3", "[::1", "[::1]x", "a b:2", "a:1,a:2", "a=b:1"])
def test_host_list_bad_syntax_raises(text):
    with pytest.raises(HostSpecError):
        parse_host_list(text)


def test_host_list_error_names_the_entry():
    with pytest.raises(HostSpecError, match="'b:x'.*'x' is not a whole number"):
        parse_host_list("a:1,b:x")


def test_hostfile_reads_slots_comments_and_blank_lines():
    text = """
    # cluster
    node1 slots=4   # the big one
    node2 slots=2 max_slots=8

    node3
    """
    assert parse_hostfile(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


@pytest.mark.parametrize("text", ["node1 slots=x", "node1 slots=0", "node1 4", "node1 cpus=4",
                                  "# only a comment\n", "a slots=1\na slots=2"])
def test_hostfile_bad_lines_raise(text):
    with pytest.raises(HostSpecError):
        parse_hostfile(text, "hosts.txt")


def test_hostfile_error_names_file_and_line():
    with pytest.raises(HostSpecError, match=r"hosts\.txt:3"):
        parse_hostfile("a slots=1\n\nb slots=two\n", "hosts.txt")


def _table(slots):
    return [(s.hostname, s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in slots]


def test_assign_fills_hosts_in_order():
    slots = assign_slots([Host("a", 2), Host("b", 2)], 4)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 2),
        ("a", 1, 1, 2, 0, 2),
        ("b", 2, 0, 2, 1, 2),
        ("b", 3, 1, 2, 1, 2),
    ]
    assert all(s.size == 4 for s in slots)


def test_assign_uneven_hosts_cross_sizes_count_only_hosts_with_that_local_rank():
    slots = assign_slots([Host("a", 3), Host("b", 1), Host("c", 2)], 6)
    assert _table(slots) == [
        ("a", 0, 0, 3, 0, 3),
        ("a", 1, 1, 3, 0, 2),
        ("a", 2, 2, 3, 0, 1),
        ("b", 3, 0, 1, 1, 3),
        ("c", 4, 0, 2, 2, 3),
        ("c", 5, 1, 2, 1, 2),
    ]


def test_assign_fewer_ranks_than_slots_leaves_later_hosts_unused():
    slots = assign_slots([Host("a", 2), Host("b", 2), Host("c", 4)], 3)
    assert _table(slots) == [
        ("a", 0, 0, 2, 0, 2),
        ("a", 1, 1, 2, 0, 1),
        ("b", 2, 0, 1, 1, 2),
    ]


def test_assign_none_uses_every_slot():
    assert len(assign_slots([Host("a", 2), Host("b", 3)], None)) == 5


def test_assign_more_ranks_than_slots_raises_naming_the_hosts():
    with pytest.raises(HostSpecError, match=r"5 ranks .* a:2,b:2 have only 4 slots"):
        assign_slots([Host("a", 2), Host("b", 2)], 5)


def test_assign_zero_ranks_raises():
    with pytest.raises(HostSpecError):
        assign_slots([Host("a", 2)], 0)


def test_assign_single_local_host():
    slots = assign_slots([Host("localhost", 3)], 3)
    assert [(s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in slots] \
        == [(0, 0, 3, 0, 1), (1, 1, 3, 0, 1), (2, 2, 3, 0, 1)]
