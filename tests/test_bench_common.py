"""bench/common.py's helpers that hold arithmetic of their own (the rest time or print)."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: `bench` as a package

from bench.common import own_times, spans_of_run


def test_own_times_take_each_kernel_from_the_end_of_the_ones_before():
    assert own_times([(0, 5), (6, 8)]) == [5, 2]  # serial, with a gap that is nobody's
    assert own_times([(0, 10), (8, 15)]) == [10, 5]  # PDL: launched at 8, waited until 10
    assert own_times([(0, 10), (2, 9), (3, 12)]) == [10, 0, 2]  # the second ended inside the first's span
    assert own_times([]) == []


def union_length(spans):
    """The length of the union of the intervals, merged in start order."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            total += 0 if cur_end is None else cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    return total + (0 if cur_end is None else cur_end - cur_start)


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 30)), max_size=12))
def test_own_times_tile_the_time_some_kernel_ran(steps):
    """Starts in launch order (non-decreasing, as one stream starts its kernels) and any durations: the own times are
    never negative and add up to the time during which at least one kernel ran."""
    spans, start = [], 0
    for step, duration in steps:
        start += step
        spans.append((start, start + duration))
    own = own_times(spans)
    assert len(own) == len(spans) and min(own, default=0) >= 0
    assert sum(own) == union_length(spans)


def test_spans_of_run_find_the_launches_among_other_kernels_in_start_order():
    kernels = [("b", 3, 4), ("copy", 0, 1), ("a", 2, 3.5), ("c", 5, 6), ("a", 7, 8), ("b", 8, 9)]
    assert spans_of_run(kernels, ["a", "b", "c"]) == [(2, 3.5), (3, 4), (5, 6)]  # sorted by start, first match
    assert spans_of_run(kernels, ["a", "b"]) == [(2, 3.5), (3, 4)]
    assert spans_of_run(kernels, ["b", "a"]) is None  # not in that order
    assert spans_of_run(kernels, []) is None
    assert spans_of_run([], ["a"]) is None


def test_spans_of_run_pass_over_copies_no_launch_names_but_not_other_kernels():
    kernels = [("a", 0, 1), ("Memcpy DtoD (Device -> Device)", 1, 2), ("b", 2, 3), ("Memset (Device)", 3, 4),
               ("c", 4, 5)]
    assert spans_of_run(kernels, ["a", "b", "c"]) == [(0, 1), (2, 3), (4, 5)]
    assert spans_of_run(kernels, ["b", "Memset (Device)", "c"]) == [(2, 3), (3, 4), (4, 5)]  # a launch's own copy
    assert spans_of_run(kernels, ["a", "c"]) is None  # b ran between them


def test_spans_of_run_match_inductors_kernels_whatever_their_names():
    kernels = [("a", 0, 1), ("triton_red_fused_add_dense_gemv_0", 1, 2), ("b", 2, 3)]
    assert spans_of_run(kernels, ["a", "triton_red_fused_add_0", "b"]) == [(0, 1), (1, 2), (2, 3)]
    assert spans_of_run(kernels, ["a", "c", "b"]) is None  # other kernels still by name
