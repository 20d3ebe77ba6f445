"""Engram rows looked up from a host-memory table: gathered into reusable staging buffers, copied to
the GPU on a side stream. The CPU half checks the staging itself; the CUDA half the whole fetch."""

import pytest
import torch

from asympd.model.engram import Engram, HostStaging


def _table(rows: int = 1000, dim: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(0, 120, (rows, dim), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    scale = torch.randint(100, 130, (rows, dim // 32), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu)
    return table, scale


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_staging_gathers_exact_rows_and_grows_per_turn():
    table, scale = _table()
    staging = HostStaging(pin=False)
    g = torch.Generator().manual_seed(1)
    seen = []
    for n in (8, 50, 5, 120, 8):
        flat = torch.randint(0, table.shape[0], (n,), generator=g)
        rows, scales = staging.gather(table, scale, flat)
        assert torch.equal(_bytes(rows), _bytes(table)[flat])
        assert torch.equal(_bytes(scales), _bytes(scale)[flat])
        seen.append(rows.data_ptr())
        staging._turn ^= 1  # what ``copied`` does after queueing the copy (it also records an event)
    # turns alternate between two buffers; a turn's buffer is reused while it is large enough
    assert seen[0] != seen[1] and seen[2] == seen[0] and seen[4] == seen[0]
    assert staging._slots[0][0].shape[0] == 8
    assert staging._slots[1][0].shape[0] == 120  # grown to the larger of the need and twice the old size
    staging._turn = 1
    staging.gather(table, scale, torch.zeros(130, dtype=torch.long))
    assert staging._slots[1][0].shape[0] == 240


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging and side-stream copy need CUDA")
def test_host_table_fetch_on_cuda_equals_the_gather():
    table, scale = _table(rows=20_000)
    e = Engram.__new__(Engram)
    torch.nn.Module.__init__(e)
    e.table, e.table_scale, e._stream, e._staging = table.pin_memory(), scale.pin_memory(), None, None
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(2)
    fetched, wanted = [], []
    for tokens in (1, 300, 17, 1200, 5):  # growth and reuse of both staging buffers
        ids = torch.randint(0, table.shape[0], (tokens, 6), generator=g)
        fetched.append(e.fetch(ids, dev))
        wanted.append(ids)
    torch.cuda.synchronize()
    for f, ids in zip(fetched, wanted, strict=True):
        assert f.rows.shape == (*ids.shape, 64) and f.rows.is_cuda
        assert torch.equal(_bytes(f.rows).cpu(), _bytes(table)[ids])
        assert torch.equal(_bytes(f.scales).cpu(), _bytes(scale)[ids])
