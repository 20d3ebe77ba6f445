"""The release's two config layouts: the root Transformers-layout config.json and inference/config.json."""

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from asympd import cli
from asympd.config import ConfigError, ModelConfig, resolve_config, tiny, v41_flash
from asympd.model.checkpoint import CheckpointError, load_config
from asympd.model.loader import load_model
from asympd.release_config import FIELDS, flat_to_root, read_config_dir, root_to_flat

RELEASE_CONFIG = Path(__file__).parent / "data" / "v41-flash-config.json"  # the root config.json, by hand


def _fields(cfg: ModelConfig) -> dict:
    return {f.name: (getattr(cfg, f.name), type(getattr(cfg, f.name))) for f in dataclasses.fields(cfg)}


def test_release_root_config_equals_the_preset_field_for_field():
    assert _fields(resolve_config(RELEASE_CONFIG)) == _fields(v41_flash())


def test_memory_of_the_release_config_equals_the_preset(capsys):
    totals = []
    for config in ("v41-flash", str(RELEASE_CONFIG)):
        assert cli.main(["memory", "--config", config, "--json"]) == 0
        totals.append(json.loads(capsys.readouterr().out))
    assert totals[0] == totals[1]
    assert totals[0]["roles"]["full"]["weights_bytes"] == pytest.approx(306.56e9, rel=0.005)


@pytest.mark.parametrize("cfg", [tiny(), v41_flash(), tiny().replace(dtype="bf16", expert_dtype=None)])
def test_round_trip_through_the_root_layout(cfg):
    assert ModelConfig.from_dict(root_to_flat(json.loads(json.dumps(flat_to_root(cfg))))) == cfg


def test_no_yarn_is_a_null_rope_scaling():
    root = flat_to_root(tiny().replace(original_seq_len=0))
    assert root["text_config"]["rope_scaling"] is None
    assert ModelConfig.from_dict(root_to_flat(root)).original_seq_len == 0


def test_every_field_but_dtype_has_one_root_key():
    assert set(FIELDS) == ModelConfig.field_names() - {"dtype"}
    assert len(set(FIELDS.values())) == len(FIELDS)


def _release(edit) -> dict:
    raw = json.loads(RELEASE_CONFIG.read_text())
    edit(raw)
    return raw


def test_inert_fields_accepted_and_vision_never_changes_the_text_model():
    def edit(raw):
        raw["transformers_version"] = "4.57.0"
        raw["text_config"]["use_cache"] = False
        raw["text_config"]["initializer_range"] = 0.01
        raw["vision_config"]["layer_norm_eps"] = 1e-6  # vision is not built: its keys are free
        raw["vision_config"]["num_hidden_layers"] = 2

    cfg = ModelConfig.from_dict(root_to_flat(_release(edit)))
    assert cfg == v41_flash().replace(vision_n_layers=2)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r["text_config"].update(num_hash_layers=3), "text_config.num_hash_layers"),
        (lambda r: r["text_config"]["rope_scaling"].update(mscale=0.7), "text_config.rope_scaling.mscale"),
        (lambda r: r.update(logit_scale=2.0), "logit_scale"),
        (lambda r: r["quantization_config"].update(weight_block_size=[128, 128]), "weight_block_size=\\[128, 128\\]"),
        (lambda r: r["text_config"].update(num_key_value_heads=8), "text_config.num_key_value_heads=8"),
        (lambda r: r["text_config"].update(hidden_act="gelu"), "text_config.hidden_act='gelu'"),
        (lambda r: r["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (lambda r: r["text_config"]["rope_scaling"].update(rope_type="linear"), "rope_type='linear'"),
        (lambda r: r.pop("text_config"), "no text_config"),
    ],
)
def test_math_changing_fields_refused_by_name(edit, message):
    with pytest.raises(ConfigError, match=message):
        root_to_flat(_release(edit))


def test_unquantized_root_config_is_bf16():
    def edit(raw):
        del raw["quantization_config"]

    cfg = ModelConfig.from_dict(root_to_flat(_release(edit)))
    assert (cfg.dtype, cfg.expert_dtype) == ("bf16", None)


# ---- checkpoint folders -------------------------------------------------------------------------


@pytest.fixture()
def folder(tiny_ckpt, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, d)
    return d


def test_written_folder_has_both_layouts(folder):
    assert json.loads((folder / "inference" / "config.json").read_text()) == tiny().to_dict()
    root = json.loads((folder / "config.json").read_text())
    assert root["text_config"]["hidden_size"] == 128 and root["architectures"] == ["DeepseekV41ForCausalLM"]
    assert json.loads((folder / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 1}
    tok_cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"]) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    assert load_config(folder) == tiny()


def test_flat_only_and_root_only_folders_load(folder):
    flat_only = folder
    (flat_only / "config.json").unlink()
    assert load_model(flat_only, "prefill").cfg == tiny()
    root_only = folder.parent / "root-only"
    shutil.copytree(flat_only, root_only)
    shutil.rmtree(root_only / "inference")
    (root_only / "config.json").write_text(json.dumps(flat_to_root(tiny())))
    assert load_model(root_only, "prefill").cfg == tiny()
    # an older asympd folder: the flat key set in the root config.json
    (root_only / "config.json").write_text(json.dumps(tiny().to_dict()))
    assert load_config(root_only) == tiny()


def test_disagreeing_files_refused_naming_the_field(folder):
    flat = json.loads((folder / "inference" / "config.json").read_text())
    flat["n_activated_experts"] = 3
    (folder / "inference" / "config.json").write_text(json.dumps(flat))
    with pytest.raises(
        CheckpointError,
        match=r"disagree on n_activated_experts \(config.json: text_config.num_experts_per_tok=2,"
        r" inference/config.json: n_activated_experts=3\)",
    ):
        load_config(folder)
    with pytest.raises(ConfigError, match="disagree on n_activated_experts"):
        resolve_config(folder)


def test_key_only_one_file_states_is_taken_from_it(folder):
    flat = json.loads((folder / "inference" / "config.json").read_text())
    for name in [n for n in flat if n.startswith("vision_") or n == "max_seq_len"]:
        del flat[name]  # the reference's flat file need not carry them
    (folder / "inference" / "config.json").write_text(json.dumps(flat))
    assert read_config_dir(folder) == tiny()


def test_unknown_flat_field_refused_by_name(folder):
    flat = json.loads((folder / "inference" / "config.json").read_text())
    flat["n_hash_layers"] = 3
    (folder / "inference" / "config.json").write_text(json.dumps(flat))
    with pytest.raises(CheckpointError, match="inference/config.json has unknown fields: n_hash_layers"):
        load_config(folder)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"dim": "128"}, "dim must be an integer, got '128'"),
        ({"n_layers": None}, "n_layers must be an integer, got None"),
        ({"vocab_size": True}, "vocab_size must be an integer, got True"),
        ({"route_scale": "1.5"}, "route_scale must be a finite number, got '1.5'"),
        (
            {"compress_ratios": [0, 2, 2, 1.0, 1, 1, 1, 0]},
            "compress_ratios must be a list of integers, got (0, 2, 2, 1.0",
        ),
        ({"o_groups": 0}, "sizes out of range: o_groups = 0 (counts and widths are at least 1"),
        ({"dim": 0, "vocab_size": -1}, "sizes out of range: vocab_size = -1, dim = 0"),
        ({"vision_n_heads": 0}, "sizes out of range: vision_n_heads = 0"),
        ({"n_activated_experts": 9}, "n_activated_experts = 9 exceeds n_routed_experts = 8"),
    ],
)
def test_a_field_of_the_wrong_type_or_size_is_refused_by_name(tmp_path, capsys, edit, message):
    """A config.json can hold anything: a field of another type, or a size that a build would divide
    by, is a ConfigError naming it (they were tracebacks deep in ``memory`` or the loader)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**tiny().to_dict(), **edit}))
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        ModelConfig.from_json(path)
    assert cli.main(["memory", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err
