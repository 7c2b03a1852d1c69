"""What the caches on the call path share: fills under a lock, and device tensors kept per stream.

Threads: a cache is checked and filled under a lock, so threads that call at once build a value
once. For the compiled kernels that is more than thrift: TileLang compiling one kernel twice at
once collides in its disk cache ("Cannot find function ...").

CUDA streams: a device tensor that a kernel writes asynchronously (``flashqla.varlen``'s chunk
table, ``flashqla.autocp``'s device-built plan) is kept per stream (``stream_key``) and handed
back only to calls on the stream that wrote it. That orders every read after the write, and the
caching allocator, which recycles a freed block for its own stream's next allocation, never gives
it away while another stream still reads it. A tensor written by a blocking host-to-device copy
(``autocp.host_plan``'s) is complete before any stream can read it, so one copy serves every
stream; it is marked with ``Tensor.record_stream`` for each stream that reads it, so that its
memory is not reused before that stream's work is done.
"""

from __future__ import annotations

import functools
import threading

import torch


def cache_once(fn):
    """``functools.cache`` for a function of hashable arguments whose value costs seconds (a
    compile): threads asking for the same arguments at once wait for one fill; different
    arguments fill in parallel. ``__wrapped__`` is the uncached function."""
    values: dict = {}
    locks: dict = {}
    guard = threading.Lock()

    @functools.wraps(fn)
    def cached(*args):
        try:
            return values[args]
        except KeyError:
            pass
        with guard:
            lock = locks.setdefault(args, threading.Lock())
        with lock:
            if args not in values:
                values[args] = fn(*args)
        return values[args]

    return cached


def stream_key(device) -> tuple:
    """Which queue work for ``device`` goes to now: (device type, index, stream id) on CUDA, the
    device type alone elsewhere (the CPU runs one op after another)."""
    device = torch.device(device)
    if device.type != "cuda":
        return (device.type,)
    stream = torch.cuda.current_stream(device)
    return ("cuda", stream.device_index, stream.stream_id)
