import pytest
import torch

from asympd.config import tiny, v41_flash
from asympd.kv import GroupKind, KVCacheSpec


def test_groups_derive_from_config():
    cfg = v41_flash()
    spec = KVCacheSpec.from_config(cfg, block_size=16, spec_slack=4, dtype=torch.bfloat16)
    assert spec.kv_source_layers == (2, 8, 14, 20)
    assert [g.name for g in spec.paged_groups] == [f"{k}.{s}" for s in (2, 8, 14, 20) for k in ("ckv", "idx")]
    assert spec.window_layers == tuple(range(43))  # 40 backbone layers + 3 draft blocks
    assert spec.pair_layers == (2, 8, 14)  # ratio-2 sources only
    assert spec.group("ckv.2").entries_per_block == 8
    assert spec.group("ckv.20").entries_per_block == 16
    assert spec.group("idx.8").width == 128
    assert spec.group("swa.42").capacity == 128 + 4
    assert spec.group("pair.14").capacity == 2 + 4
    assert spec.group("pair.14").dtype == "float32"  # raw compressor rows stay fp32
    assert spec.group("pair.2").kind is GroupKind.PAIR


def test_bytes_v41_bf16():
    spec = KVCacheSpec.from_config(v41_flash(), block_size=16, dtype=torch.bfloat16)
    # per token: ckv 3 x 512/2 + 512 entries-elements, idx 3 x 128/2 + 128, 2 bytes each
    assert spec.bytes_per_token() == (3 * 256 + 512 + 3 * 64 + 128) * 2 == 3200
    assert spec.bytes_per_block == 3200 * 16
    assert spec.group("ckv.2").bytes_per_block == 8 * 512 * 2
    window = 43 * 128 * (512 * 2 + 8)
    pairs = 3 * 2 * (2 * 512 * 4 + 8)
    assert spec.bytes_per_slot == window + pairs
    assert spec.num_blocks_for_budget(10 * spec.bytes_per_block + 5) == 10
    assert spec.num_blocks_for_budget(10 * spec.bytes_per_block + 2 * spec.bytes_per_slot, max_seqs=2) == 10
    assert spec.num_blocks_for_budget(100, max_seqs=2) == 0


def test_schedule_changes_follow_config():
    cfg = tiny().replace(compress_ratios=(0, 4, 4, 1, 1, 1, 1, 0))
    spec = KVCacheSpec.from_config(cfg, block_size=8)
    assert spec.group("ckv.1").entries_per_block == 2
    assert spec.group("pair.1").capacity == 4
    with pytest.raises(ValueError, match="multiple of every KV-source ratio"):
        KVCacheSpec.from_config(cfg, block_size=6)
    with pytest.raises(ValueError):
        KVCacheSpec.from_config(cfg, spec_slack=-1)
