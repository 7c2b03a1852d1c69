"""flashqla.varlen: the chunk table the kernels read, against a plain Python walk over the sequences;
on the GPU, the table kernel against the PyTorch table."""

import pytest
import torch

from flashqla import varlen
from flashqla.varlen import chunk_table, seq_bounds


def python_table(bounds, chunk_size):
    return [(s, min(s + chunk_size, e)) for b, e in zip(bounds, bounds[1:])
            for s in range(b, e, chunk_size)]


@pytest.mark.parametrize("lengths", [(1, 200, 777, 64, 130), (0, 64, 0, 65), (5,), (128, 128)])
def test_varlen_table(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int64)
    table, first = chunk_table(cu, 1, bounds[-1], 64, torch.device("cpu"))
    want = python_table(bounds, 64)
    assert table.dtype == torch.int32 and table.shape[0] >= len(want)
    assert [tuple(r) for r in table[: len(want)].tolist()] == want
    assert all(s == e == bounds[-1] for s, e in table[len(want):].tolist())  # empty rows
    assert first.tolist() == [sum(-(-n // 64) for n in lengths[:i]) for i in range(len(lengths) + 1)]


def test_batch_table_is_exact():
    table, first = chunk_table(None, 3, 100, 64, torch.device("cpu"))
    assert [tuple(r) for r in table.tolist()] == python_table([0, 100, 200, 300], 64)
    assert first.tolist() == [0, 2, 4, 6]
    assert seq_bounds(None, 3, 100, torch.device("cpu")).tolist() == [0, 100, 200, 300]


def test_a_batch_of_empty_sequences_has_its_bounds():
    # B sequences of T = 0 tokens: B + 1 bounds, all 0 (the kernels' drivers size h0 and ht by them)
    assert seq_bounds(None, 2, 0, torch.device("cpu")).tolist() == [0, 0, 0]
    table, first = chunk_table(None, 2, 0, 64, torch.device("cpu"))
    assert table.shape[0] == 0 and first.tolist() == [0, 0, 0]


def test_cache_follows_the_tensor_and_its_edits():
    cu = torch.tensor([0, 10, 100], dtype=torch.int32)
    first = chunk_table(cu, 1, 100, 64, torch.device("cpu"))
    assert chunk_table(cu, 1, 100, 64, torch.device("cpu")) is first
    cu[1] = 70  # an in-place edit bumps the tensor's version: rebuilt
    assert chunk_table(cu, 1, 100, 64, torch.device("cpu"))[0][:2].tolist() == [[0, 64], [64, 70]]
    other = chunk_table(cu.clone(), 1, 100, 64, torch.device("cpu"))
    assert other is not first


def test_table_kernel_compiles_for_hopper():
    source = varlen.table_kernel_source()
    for needle in ("chunk_table_build_kernel", "__syncthreads", "first_chunk", "table"):
        assert needle in source, needle


def cases_for_the_kernel():
    """Bounds of varlen batches: empty sequences, lengths around C, more sequences than the
    kernel's threads (a thread sums several) and more rows than its threads (several passes)."""
    gen = torch.Generator().manual_seed(0)
    choices = torch.tensor([0, 1, 63, 64, 65, 200, 4096])
    cases = [(1, 200, 777, 64, 130), (0, 64, 0, 65), (5,), (), (0, 0), (70000,)]
    for n in (3, 17, 1500, 3000):
        cases.append(tuple(choices[torch.randint(0, 7, (n,), generator=gen)].tolist()))
    return cases


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("lengths", cases_for_the_kernel(), ids=lambda ls: f"{len(ls)} seqs, {sum(ls)} tokens")
def test_table_kernel_matches_the_torch_table(lengths):
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device="cuda")
    args = (cu, 1, bounds[-1], 64, cu.device)
    table, first = varlen._build_chunk_table(*args)       # the kernel on a Hopper GPU
    want_table, want_first = varlen._build_chunk_table_torch(*args)
    assert torch.equal(table, want_table) and torch.equal(first, want_first), lengths
    # and an equal-length batch, whose table is exact
    for B, T in ((3, 100), (2, 4096 * 9 + 1)):
        got = varlen._build_chunk_table(None, B, T, 64, cu.device)
        want = varlen._build_chunk_table_torch(None, B, T, 64, cu.device)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (B, T)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("lengths", cases_for_the_kernel() + [None],
                         ids=lambda ls: "batch 3 x 100" if ls is None else f"{len(ls)} seqs, {sum(ls)} tokens")
def test_cumsum_s03_builds_the_torch_table_and_s02s_cumsum(lengths):
    """chunk_local_cumsum.s03 writes the chunk table and first_chunk that ``varlen``'s PyTorch ops
    build, and g_cum bit for bit s02's."""
    from flashqla.stages import load

    s02, s03 = load("chunk_local_cumsum", 2), load("chunk_local_cumsum", 3)
    B, T, cu = 3, 100, None
    if lengths is not None:
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        B, T, cu = 1, bounds[-1], torch.tensor(bounds, dtype=torch.int32, device="cuda")
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, 8, device="cuda"))
    g_cum, table, first = s03.cumsum_and_table(g, cu)
    want_table, want_first = varlen._build_chunk_table_torch(cu, B, T, 64, g.device)
    assert torch.equal(table, want_table) and torch.equal(first, want_first), lengths
    if B * T:
        assert torch.equal(g_cum.view(B, T, 8), s02.run(g, cu)), lengths


def test_host_bounds_reads_each_tensor_version_once(monkeypatch):
    """host_bounds keeps the values of a (tensor, version): a second call copies nothing; an
    in-place edit is read again."""
    from flashqla import varlen

    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    assert varlen.host_bounds(cu) == [0, 5, 9]
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("read twice"))
    assert varlen.host_bounds(cu) == [0, 5, 9]
    monkeypatch.undo()
    cu[1] = 4
    assert varlen.host_bounds(cu) == [0, 4, 9]
