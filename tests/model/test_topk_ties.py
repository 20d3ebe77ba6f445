"""The top-k tie rule, tested directly: equal scores go to the lowest position. Every numerics test
elsewhere is differential (both sides share the same top-k), so only these pin the rule itself."""

from __future__ import annotations

import copy

import torch

from asympd.model.attention import select_candidate_blocks
from asympd.model.loader import load_model
from asympd.model.ops import stable_topk

NEG = float("-inf")


def test_stable_topk_gives_ties_to_the_lowest_position():
    scores = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0, 3.0],  # four-way tie at the top, k = 3 keeps the first three
            [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all equal
            [NEG, 5.0, NEG, 5.0, 1.0, NEG],  # -inf ties after the real scores
            [2.0, 1.0, 2.0, 1.0, 1.0, 0.0],  # a tie straddling the k-th place
        ]
    )
    assert stable_topk(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 4], [0, 2, 1]]
    assert stable_topk(scores[3:], 4).tolist() == [[0, 2, 1, 3]]
    # bf16 index scores tie often: the rule holds in bf16 and over a longer row too
    row = torch.zeros(40, dtype=torch.bfloat16)
    row[[7, 30]] = 1.0
    assert stable_topk(row, 5).tolist() == [7, 30, 0, 1, 2]


def test_candidate_blocks_tie_to_the_lowest_block():
    # 4 blocks of 2 entries, every block scoring 1.0; the newest visible entry (index 7) pins block 3
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]])
    keep = select_candidate_blocks(scores, torch.tensor([8]), topk_blocks=2, block=2)
    assert keep.tolist() == [[True, True, False, False, False, False, True, True]]
    keep = select_candidate_blocks(scores, torch.tensor([8]), topk_blocks=3, block=2)
    assert keep.tolist() == [[True, True, True, True, False, False, True, True]]


def test_moe_routing_ties_go_to_the_lowest_expert(tiny_ckpt):
    moe = copy.copy(load_model(tiny_ckpt, "full").blocks[0].ffn)
    assert moe.topk == 2 and moe.n_experts == 8
    moe.gate = torch.zeros_like(moe.gate)  # every expert scores the same before the bias
    moe.bias = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    _, ids = moe.route(torch.randn(3, moe.gate.size(1)))
    assert ids.tolist() == [[1, 3]] * 3
    moe.bias = torch.zeros(8)
    assert moe.route(torch.randn(2, moe.gate.size(1)))[1].tolist() == [[0, 1]] * 2
