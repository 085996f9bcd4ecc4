"""benchmarks/profile.py's ``--kernel-times``: on CPU, the per-kernel medians and gaps taken from
profiler events of graph replays (each replay's first call left out), and calls that did not launch
alike refused; on CUDA, the whole tool on a call of two kernels."""

import pytest
import torch

from benchmarks import profile

from .conftest import HAS_CUDA


def _events(calls, replays, kernels, skew=0.0):
    """(start, end, name) of every kernel: ``kernels`` is a call's (name, time, gap before) list;
    the calls run back to back, replays 100 µs apart; ``skew`` lengthens every call after the first
    of each replay by that many µs in its first kernel."""
    events, t = [], 0.0
    for _ in range(replays):
        for c in range(calls):
            for k, (name, took, gap) in enumerate(kernels):
                t += gap
                took = took + (skew if c and k == 0 else 0.0)
                events.append((t, t + took, name))
                t += took
        t += 100.0
    return events[::-1]  # in any order


def test_medians_and_gaps_per_kernel():
    call = [("quantize", 7.0, 0.0), ("gate_up", 110.0, 0.5), ("down", 80.0, -20.0)]
    span, rows = profile.kernel_times(_events(2, 5, call, skew=1.0), calls=2, replays=5)
    assert [r[0] for r in rows] == ["quantize", "gate_up", "down"]
    assert [r[1] for r in rows] == [8.0, 110.0, 80.0]  # the skewed calls, every replay's first left out
    assert rows[0][2] is None and rows[1][2] == 0.5 and rows[2][2] == -20.0
    assert span == 8.0 + 0.5 + 110.0 - 20.0 + 80.0


def test_calls_that_launch_differently_are_refused():
    call = [("a", 1.0, 0.0), ("b", 2.0, 0.0)]
    events = _events(2, 2, call)
    assert profile.kernel_times(events[1:], calls=2, replays=2) is None  # a kernel missing
    renamed = [(s, e, "c" if i == 3 else n) for i, (s, e, n) in enumerate(sorted(events))]
    assert profile.kernel_times(renamed, calls=2, replays=2) is None  # another kernel in one call
    assert profile.kernel_times(events, calls=1, replays=4) is None  # every call is a replay's first


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_kernel_times_of_replayed_calls_cuda(capsys):
    x = torch.ones(1 << 20, device="cuda")

    def call():  # two kernels a call
        x.add_(1.0)
        x.mul_(0.5)

    profile.print_kernel_times(call, calls=3, replays=4)
    printed = capsys.readouterr().out
    assert "a call: 2 kernels" in printed, printed  # each replay holds three calls, not one
    assert len([line for line in printed.splitlines() if " µs" in line]) == 3, printed
