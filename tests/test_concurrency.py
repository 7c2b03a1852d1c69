"""Threads and CUDA streams: the caches on the call path (``flashqla.caches``) fill once under
threads, and no stream reads a device tensor that another stream's kernel writes."""

import functools
import threading
import time

import pytest
import torch

import flashqla
from flashqla import autocp, caches, varlen
from flashqla.testing import Problem, rel_l2

api = flashqla.chunk_gated_delta_rule
LEAVES = ("q", "k", "v", "g", "beta", "initial_state")


def _fills(cache_decorator, threads=8):
    """How many times ``cache_decorator`` runs a slow fill when ``threads`` threads ask for one
    value at the same moment."""
    calls = []

    @cache_decorator
    def slow(n):
        calls.append(n)
        time.sleep(0.05)
        return n * n

    start = threading.Barrier(threads)

    def ask():
        start.wait()
        assert slow(3) == 9

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return len(calls)


def test_cache_once_fills_once_under_threads():
    assert _fills(caches.cache_once) == 1
    assert _fills(functools.cache) > 1  # the deliberately broken variant: functools.cache fills many times


def test_cache_once_fills_different_keys_in_parallel():
    """Two keys fill at once (each fill waits for the other at a barrier: serialized fills would
    time out), and ``__wrapped__`` is the uncached function."""
    meet = threading.Barrier(2, timeout=10)

    @caches.cache_once
    def fill(n):
        meet.wait()
        return n

    workers = [threading.Thread(target=fill, args=(n,)) for n in (1, 2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not meet.broken and fill(1) == 1 and fill(2) == 2
    assert fill.__wrapped__.__name__ == "fill"


def test_stream_key():
    assert caches.stream_key("cpu") == ("cpu",)


def test_chunk_table_is_kept_per_stream(monkeypatch):
    """A table is handed back only to the stream that built it (streams simulated on the CPU by
    the key); the broken variant, one key for every stream, hands one stream's table to another."""
    cu = torch.tensor([0, 70, 71, 200], dtype=torch.int32)
    stream = ["a"]
    monkeypatch.setattr(varlen, "stream_key", lambda device: stream[0])
    table_a = varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu"))
    assert varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu")) is table_a
    stream[0] = "b"
    table_b = varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu"))
    assert table_b is not table_a and all(torch.equal(x, y) for x, y in zip(table_a, table_b))
    stream[0] = "a"
    assert varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu")) is table_a
    monkeypatch.setattr(varlen, "stream_key", lambda device: "one key")   # broken
    first = varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu"))
    assert varlen.chunk_table(cu, 1, 200, 64, torch.device("cpu")) is first


def test_device_plan_is_kept_per_stream(monkeypatch):
    cu = torch.tensor([0, 4096, 8192], dtype=torch.int64)
    stream = ["a"]
    monkeypatch.setattr(autocp, "stream_key", lambda device: stream[0])
    p_a = autocp.plan(cu, 1, 8192, 2, 132, 2, torch.device("cpu"), force=16)
    assert autocp.plan(cu, 1, 8192, 2, 132, 2, torch.device("cpu"), force=16) is p_a
    stream[0] = "b"
    assert autocp.plan(cu, 1, 8192, 2, 132, 2, torch.device("cpu"), force=16) is not p_a


def test_host_bounds_under_threads():
    """Eight threads read and remember 200 cu_seqlens tensors at once (evicting as they go): each
    gets its own tensor's values."""
    tensors = [torch.tensor([0, n, 2 * n + 1]) for n in range(1, 201)]
    start = threading.Barrier(8)
    wrong = []

    def read(part):
        start.wait()
        for t in tensors[part::8]:
            for _ in range(3):
                if varlen.host_bounds(t) != t.tolist():
                    wrong.append(t)

    workers = [threading.Thread(target=read, args=(i,)) for i in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not wrong


def _train(x, cu=None):
    """Forward and backward through the API: [o, final state, and the gradient of every input]."""
    leaves = {n: x[n].clone().requires_grad_() for n in LEAVES}
    o, s = api(**{**x, **leaves, "cu_seqlens": x["cu_seqlens"] if cu is None else cu})
    (o.float().square().sum() + s.square().sum()).backward()
    return [o.detach(), s.detach()] + [leaves[n].grad for n in LEAVES]


def _on_threads(fn, args, threads=8):
    """fn(*args[i]) on thread i, all released at once; the results in order (an error re-raised)."""
    start = threading.Barrier(threads)
    results = [None] * threads

    def run(i):
        start.wait()
        try:
            results[i] = fn(*args[i])
        except BaseException as exc:  # noqa: BLE001 -- re-raised on the main thread
            results[i] = exc

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def test_eight_threads_on_the_reference():
    problems = [Problem(2, 4, (50 + 10 * i, 1, 64), K=8, V=8) for i in range(8)]
    inputs = [p.inputs(seed=i) for i, p in enumerate(problems)]
    want = [_train(x) for x in inputs]
    got = _on_threads(_train, [(x,) for x in inputs])
    for g, w in zip(got, want):
        assert all(torch.equal(a, b) for a, b in zip(g, w))


# ---- on the GPU ----

@pytest.mark.gpu
@pytest.mark.hopper
def test_two_streams_sharing_cu_seqlens(monkeypatch):
    """Two streams train on one cu_seqlens tensor (fresh, so their caches start empty) while the
    first stream is held back by a 50 ms spin: a chunk table cached by that stream and read by the
    other before it is written would give garbage gradients. Both give eager's bits; AutoCP
    splits these lengths (L = 38 on 132 SMs), so its host plan is shared by the streams too."""
    from flashqla import fwd

    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    lengths = (12000, 1, 3000)
    chunks = [-(-n // 64) for n in lengths]
    sms = autocp.num_sms("cuda")
    assert fwd.segment_chunks(chunks, 16, sms, fwd.STEP[fwd.block_v(chunks, 16, 128, sms)]) > 0
    x = Problem(4, 16, lengths).inputs("cuda")
    want = _train(x)
    cu = x["cu_seqlens"].clone()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    got = []
    for i, stream in enumerate(streams):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            leaves = {n: x[n].clone().requires_grad_() for n in LEAVES}
            o, s = api(**{**x, **leaves, "cu_seqlens": cu})
            if i == 0:
                torch.cuda._sleep(100_000_000)  # about 50 ms of this stream, before its backward
            (o.float().square().sum() + s.square().sum()).backward()
            got.append([o.detach(), s.detach()] + [leaves[n].grad for n in LEAVES])
    torch.cuda.synchronize()
    names = ("o", "final_state") + LEAVES
    for result in got:
        for name, a, b in zip(names, result, want):
            assert torch.equal(a, b), (name, rel_l2(a, b))


@pytest.mark.gpu
@pytest.mark.hopper
def test_eight_threads_on_the_kernels(monkeypatch):
    """Eight threads, each on its own stream, call the API at once (the first calls compile the
    kernels, once each): every thread gets the bits of the same call made alone."""
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    problems = [Problem(4, 16, (100 * i + 1, 64, 300)) if i % 2 else Problem(4, 16, (256, 256), varlen=False)
                for i in range(8)]
    inputs = [p.inputs("cuda", seed=i) for i, p in enumerate(problems)]
    streams = [torch.cuda.Stream() for _ in inputs]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())

    def on_stream(x, stream):
        with torch.cuda.stream(stream):
            result = _train(x)
        stream.synchronize()
        return result

    got = _on_threads(on_stream, list(zip(inputs, streams)))
    want = [_train(x) for x in inputs]
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            assert torch.equal(a, b), rel_l2(a, b)
