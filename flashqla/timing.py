"""Wall-clock timing of a callable: CUDA events on a GPU, perf_counter on the CPU. Median of repeats."""

from __future__ import annotations

import statistics
import time

import torch


def median_ms(fn, device: torch.device, warmup: int = 2, repeat: int = 5) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` untimed calls (the first call pays any JIT)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
