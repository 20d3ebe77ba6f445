"""Nothing hard-codes the released schedule: another layer layout builds, loads, splits and serves."""

from __future__ import annotations

import pytest

from asympd import LLM, SamplingParams
from asympd.config import ConfigError, tiny
from asympd.model.checkpoint import write_checkpoint
from asympd.model.engram_hash import engram_num_embeddings
from asympd.model.loader import load_model
from tests.util import random_prompts


def other_schedule():
    """Nine layers: three ratio-2 KV sources feeding reuse layers, the last KV source ratio 1 at
    layer 6 with its own candidate pool, a re-index layer after it, Engram on a reuse layer."""
    cfg = tiny().replace(
        n_layers=9,
        compress_ratios=(0, 2, 2, 2, 2, 2, 1, 1, 1, 0),
        kv_source_layers=(1, 3, 6),
        index_source_layers=(1, 3, 6, 8),
        candidate_source_layer=6,
        engram_layer_ids=(2,),
        engram_num_embeddings=(0,),
        dspark_target_layer_ids=(7, 8),
    )
    return cfg.replace(engram_num_embeddings=engram_num_embeddings(cfg))


@pytest.fixture(scope="module")
def other_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("other") / "ck"
    write_checkpoint(other_schedule(), out, seed=3)
    return str(out)


def test_other_schedule_roles_and_pd_equivalence(other_ckpt):
    cfg = load_model(other_ckpt, "full").cfg
    assert cfg.last_kv_source == 6 and list(cfg.encoder_layers) == [0, 1, 2, 3, 4, 5]
    prefill = load_model(other_ckpt, "prefill")
    assert [b is not None for b in prefill.blocks] == [True] * 7 + [False] * 2
    prompts = random_prompts([5, 30, 77], seed=42)
    params = SamplingParams(max_tokens=5, temperature=0)
    split = LLM(other_ckpt, "colocated", "split").generate(prompt_token_ids=prompts, sampling_params=params)
    asym = LLM(other_ckpt, "asymmetric").generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in asym] == [o.outputs[0].token_ids for o in split]


def test_inconsistent_schedules_are_named():
    with pytest.raises(ConfigError, match="compress_ratios has 9 entries"):
        tiny().replace(compress_ratios=(0, 2, 2, 1, 1, 1, 1, 0, 0))
    with pytest.raises(ConfigError, match=r"layer 1 \(ratio 2\) has no KV source at or below it"):
        tiny().replace(kv_source_layers=(3,), index_source_layers=(1, 3, 5))
    with pytest.raises(ConfigError, match="candidate_source_layer must be an index source"):
        tiny().replace(candidate_source_layer=4)
