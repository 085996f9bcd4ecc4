"""How every benchmark here times a GPU call, and what its result files record about the machine.

A call is captured in a CUDA graph and timed by replaying the graph, so host overhead (Python,
dispatch, launch) is left out and only device time is measured. :func:`median_replay_ms` is the
one timing protocol of ``run.py``, ``train.py``, ``tune.py`` and ``tune_backward.py``:

1. ``fn`` runs a few times eagerly on a side stream (first-call compiles and allocations happen
   outside the capture), then once under capture;
2. the graph is replayed a few times (warm-up);
3. optionally, it is replayed back to back for ``settle_s`` seconds, so that the GPU reaches
   the clock and power state that this work drives it to (under a power cap the heavy paths are
   slowed down, and without settling a figure depends on what ran just before);
4. ``reps`` replays are timed one by one with CUDA events; the median is returned.
"""

import platform
import statistics
import time

import torch


def environment() -> dict:
    """What every result file records: GPU, torch, triton, python and the date (UTC)."""
    import triton

    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def capture_graph(fn, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``fn`` captured in a CUDA graph, after ``warmup`` eager calls on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def settle(graph: torch.cuda.CUDAGraph, seconds: float) -> None:
    """Replay ``graph`` back to back for about ``seconds`` (a host sync every 10 replays only)."""
    torch.cuda.synchronize()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()


def median_replay_ms(fn, reps: int, settle_s: float = 0.0, warmup_replays: int = 5) -> float:
    """Median time in ms of one CUDA-graph replay of ``fn`` over ``reps`` timed replays."""
    graph = capture_graph(fn)
    for _ in range(warmup_replays):
        graph.replay()
    if settle_s > 0:
        settle(graph, settle_s)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
