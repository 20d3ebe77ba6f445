"""Context parallelism on P (gloo on CPU): CP = 2 and 3 export the PrefixState of one rank byte for
byte, with slice boundaries at odd positions inside a ratio-2 compressor group, at window edges,
one-row slices, and chunk edges inside the slices, and with the slices in another rank order (a
server's rank 0 computes the last slice)."""

from __future__ import annotations

import pytest
import torch.multiprocessing as mp

from asympd import LLM, SamplingParams
from asympd.engine.scheduler import SchedulerConfig
from asympd.parallel.cp import slice_bounds
from asympd.transfer import PrefixState
from tests.parallel.cp_ranks import cp_rank
from tests.util import random_prompts

W = 16  # tiny: window 16; KV sources layer 1 (ratio 2) and layer 3 = K (ratio 1)
LENS = [60, 61]  # splits 44 (even) and 45 (odd: the open pair at s crosses too)
CASES = {  # world -> [(prompt index, bounds, chunk, slice order)]
    2: [
        (0, [0, 17, 44], None, None),
        (1, [0, 16, 45], 7, None),
        (1, [0, 1, 45], None, [1, 0]),
        (0, [0, 31, 44], 5, None),
    ],
    3: [
        (1, [0, 3, 19, 45], None, None),
        (0, [0, 15, 16, 44], 7, [1, 2, 0]),
        (1, None, None, None),
        (0, [0, 7, 14, 44], 7, [2, 0, 1]),
    ],
}


def reference(ckpt: str, prompts: list[list[int]]) -> tuple[list[bytes], str]:
    """What one P engine exports (chunks of 7 rows), serialized."""
    llm = LLM(ckpt, "asymmetric", scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7))
    p, blobs = llm.prefill, []
    for i, ids in enumerate(prompts):
        p.add_request(str(i), ids, SamplingParams(max_tokens=1))
        outs = []
        while not outs:
            outs = [o for o in p.step() if o.finished]
        blobs.append(outs[0].prefix_state.serialize())
    return blobs, p.fingerprint


@pytest.mark.parametrize("world", [2, 3])
def test_cp_exports_the_bytes_of_one_rank(tiny_ckpt, tmp_path, world):
    prompts = random_prompts(LENS, seed=17)
    want, fingerprint = reference(tiny_ckpt, prompts)
    splits = [n - W for n in LENS]  # split_point under carry
    cases = [(prompts[i], splits[i], bounds, chunk, order) for i, bounds, chunk, order in CASES[world]]
    init = f"file://{tmp_path}/rendezvous"
    mp.spawn(cp_rank, args=(world, init, tiny_ckpt, cases, fingerprint, str(tmp_path)), nprocs=world, join=True)
    for j, (i, *_) in enumerate(CASES[world]):
        got = (tmp_path / f"{world}-{j}.bin").read_bytes()
        assert PrefixState.deserialize(got).split == splits[i]
        assert got == want[i], f"world {world}, case {j}"


def test_slice_bounds():
    assert slice_bounds(45, 3) == [0, 15, 30, 45]
    assert slice_bounds(5, 2) == [0, 2, 5]
    with pytest.raises(ValueError, match="at least 3 rows, not 2"):
        slice_bounds(2, 3)
