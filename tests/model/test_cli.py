"""The ``asympd`` command line, driven through ``main``."""

import json
import re
import shutil
import sys
import types

import pytest
import torch

from asympd import cli
from asympd.config import tiny
from asympd.model.schema import role_schema
from asympd.release_config import flat_to_root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert (
        cli.main(["make-checkpoint", "--config", "tiny", "--out", str(out), "--seed", "3", "--shard-bytes", "500000"])
        == 0
    )
    return out


def test_make_checkpoint(ckpt):
    assert (ckpt / "model.safetensors.index.json").is_file() and (ckpt / "tokenizer.json").is_file()
    assert json.loads((ckpt / "inference" / "config.json").read_text()) == tiny().to_dict()
    assert json.loads((ckpt / "config.json").read_text()) == flat_to_root(tiny())


def test_memory_json(capsys):
    assert cli.main(["memory", "--config", "v41-flash", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["roles"]["full"]["weights_bytes"] == pytest.approx(306.56e9, rel=0.005)
    assert rep["gpus"]["B300"]["roles"]["prefill"]["fits"] is True


def test_memory_text(capsys):
    assert cli.main(["memory", "--config", "v41-flash", "--reserve-gb", "20"]) == 0
    out = capsys.readouterr().out
    assert "149.48" in out and "20 GB reserved" in out


def _no_loader(monkeypatch):
    monkeypatch.setitem(sys.modules, "asympd.model.loader", None)  # import raises ImportError


def test_inspect_fallback_without_loader(ckpt, capsys, monkeypatch):
    _no_loader(monkeypatch)
    assert cli.main(["inspect", "--checkpoint", str(ckpt), "--role", "prefill", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    specs = role_schema(tiny(), "prefill", vision=True)
    assert out["tensors_read"] == len(specs) and set(out["tensor_names"]) == {s.name for s in specs}
    assert out["bytes_read"] == sum(s.nbytes for s in specs)
    assert out["resident_bytes"] is None
    assert "decoder_layers" not in out["tensors_by_part"]
    assert cli.main(["inspect", "--checkpoint", str(ckpt), "--role", "full"]) == 0
    text = capsys.readouterr().out
    assert "tensors read" in text and "resident bytes n/a" in text


def test_inspect_uses_loader_contract(ckpt, capsys, monkeypatch):
    from asympd.model.checkpoint import load_config, load_tensors

    calls = []

    def load_model(path, role, device, dtype):
        calls.append((str(path), role, device, dtype))
        _, report = load_tensors(path, load_config(path), role)
        return types.SimpleNamespace(load_report=report, resident_bytes=lambda: 12345)

    monkeypatch.setitem(sys.modules, "asympd.model.loader", types.SimpleNamespace(load_model=load_model))
    assert cli.main(["inspect", "--checkpoint", str(ckpt), "--role", "decode", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert calls == [(str(ckpt), "decode", "cpu", torch.float32)]
    assert out["resident_bytes"] == 12345


def _inspect_json(capsys, ckpt, role: str, status: int = 0) -> dict:
    assert cli.main(["inspect", "--checkpoint", str(ckpt), "--role", role, "--json"]) == status
    return json.loads(capsys.readouterr().out)


def test_inspect_lists_the_shards_a_prefill_host_needs(ckpt, capsys):
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    prefill = _inspect_json(capsys, ckpt, "prefill")
    need = sorted({weight_map[s.name] for s in role_schema(tiny(), "prefill", vision=True)})
    assert prefill["shards_needed"] == need == sorted(prefill["files_opened"])
    assert set(need) < set(weight_map.values())  # a strict subset: the decoder's shards are skipped
    assert prefill["shards_missing"] == [] and prefill["tensors_missing"] == []
    assert _inspect_json(capsys, ckpt, "full")["shards_needed"] == sorted(set(weight_map.values()))


def test_inspect_partial_folder_names_what_is_missing(ckpt, tmp_path, capsys):
    """A P host that downloaded only the prefill shards: prefill loads, decode says exactly what it lacks."""
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    need = {weight_map[s.name] for s in role_schema(tiny(), "prefill", vision=True)}
    part = tmp_path / "partial"
    shutil.copytree(ckpt, part, ignore=lambda d, names: [n for n in names if n.startswith("model-") and n not in need])
    prefill = _inspect_json(capsys, part, "prefill")
    assert prefill["tensors_read"] == len(role_schema(tiny(), "prefill", vision=True))
    decode = _inspect_json(capsys, part, "decode", status=1)
    absent = set(weight_map.values()) - need
    assert decode["shards_missing"] == sorted(absent)
    decode_specs = role_schema(tiny(), "decode", vision=True)
    assert decode["tensors_missing"] == [s.name for s in decode_specs if weight_map[s.name] in absent]
    assert cli.main(["inspect", "--checkpoint", str(part), "--role", "decode"]) == 1
    text = capsys.readouterr().out
    assert f"shards missing {len(absent)}: {' '.join(sorted(absent))}" in text
    assert f"  {decode['tensors_missing'][0]}" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["memory", "--config", "no-such-preset"], "neither a preset"),
        (["make-checkpoint", "--config", "nope", "--out", "x"], "neither a preset"),
        (["inspect", "--checkpoint", "/no/such/dir", "--role", "prefill"], "does not exist"),
        (["inspect", "--checkpoint", ".", "--role", "nonsense"], "invalid choice"),
        (["make-checkpoint", "--config", "tiny"], "required"),
        (["frobnicate"], "invalid choice"),
        (["memory", "--reserve-gb", "-5"], "--reserve-gb must be >= 0 and finite, got -5.0"),
        (["memory", "--reserve-gb", "inf"], "--reserve-gb must be >= 0 and finite, got inf"),
        (["memory", "--context", "0"], "--context must be in [1, 1048576] (the model's context), got 0"),
        (["compare", "--checkpoint", ".", "--max-tokens", "0"], "--max-tokens must be a positive integer, got 0"),
        (["compare", "--checkpoint", ".", "--seed", str(2**64)], f"--seed must be a 64-bit integer, got {2**64}"),
        ([], "required"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys, monkeypatch):
    _no_loader(monkeypatch)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--port", "99999"], "error: --port 99999 is out of range: ports are 0-65535 (0: a free one)"),
        (["--block-size", "7"], "error: block_size 7 must be a multiple of every KV-source ratio [1, 2]"),
        (["--num-spec-tokens", "99"], "error: num_spec_tokens=99 exceeds the DSpark block size 3"),
    ],
)
def test_serve_settings_refused_exit_2_before_binding(ckpt, extra, message, capsys):
    """The last two only the loaded model can refuse (the engine's EngineConfigError): still one line,
    exit 2, nothing bound (they were tracebacks)."""
    assert cli.main(["serve", "--checkpoint", str(ckpt), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err.splitlines() and "Traceback" not in err


@pytest.mark.parametrize("flag", ["--kv-cache-bytes", "--num-blocks"])
def test_a_kv_pool_larger_than_the_device_is_refused(ckpt, capsys, flag):
    """A pool past what the device can allocate is one line naming the free memory (it was a
    MemoryError or OverflowError traceback from the block manager's tables)."""
    assert cli.main(["serve", "--checkpoint", str(ckpt), flag, str(10**20)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"error: a KV pool of \d+ blocks \([\d.]+ GB\) does not fit: [\d.]+ GB is free on cpu; "
        r"lower kv_cache_bytes or num_blocks\n",
        err,
    ), err


def test_a_gpu_s_free_memory_counts_what_the_allocator_holds_unused(monkeypatch):
    """On a GPU the pool may reuse what the load freed into torch's cache: free = the driver's free
    memory + reserved - allocated (the driver counts the cache as used)."""
    from asympd.engine.engine import free_memory_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 7 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 << 30)
    assert free_memory_bytes(torch.device("cuda", 0)) == 13 << 30
    assert free_memory_bytes(torch.device("meta")) is None


def test_serve_and_router_on_a_port_in_use_exit_2(ckpt, capsys):
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = str(held.getsockname()[1])
    try:
        for argv in (["serve", "--checkpoint", str(ckpt)], ["router", "--decode", "http://127.0.0.1:9"]):
            assert cli.main([*argv, "--port", port]) == 2
            err = capsys.readouterr().err
            assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in err.splitlines(), err
    finally:
        held.close()


def test_make_checkpoint_refuses_existing(ckpt, capsys):
    assert cli.main(["make-checkpoint", "--config", "tiny", "--out", str(ckpt)]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_commands_registry():
    assert {"make-checkpoint", "memory", "inspect"} <= set(cli.COMMANDS)
    assert all(callable(c.add_arguments) and callable(c.run) for c in cli.COMMANDS.values())


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize("index", ['{"weight_map": {"embed.weight": 5}}', "[]"])
def test_inspect_a_malformed_index_is_one_line(ckpt, tmp_path, capsys, index):
    """A shard name that is not a string was a TypeError traceback; a list, 'list indices must be integers'."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "model.safetensors.index.json").write_text(index)
    assert cli.main(["inspect", "--checkpoint", str(bad)]) == 2
    assert _one_line_error(capsys) == (
        f"error: invalid model.safetensors.index.json in '{bad}': weight_map is not an object of tensor name -> "
        "shard file name"
    )


def test_inspect_a_corrupt_single_file_checkpoint_is_one_line(ckpt, tmp_path, capsys):
    """A model.safetensors without an index whose header is garbage (was safetensors' traceback)."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad, ignore=lambda d, names: [n for n in names if n.startswith("model")])
    (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    assert cli.main(["inspect", "--checkpoint", str(bad)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith("error: cannot open 'model.safetensors': Error while deserializing header")


def test_a_file_given_as_the_checkpoint_is_named_a_file(ckpt, capsys):
    shard = next(ckpt.glob("model-*.safetensors"))
    for command in ("inspect", "compare"):
        assert cli.main([command, "--checkpoint", str(shard)]) == 2
        assert _one_line_error(capsys) == f"error: checkpoint '{shard}' is a file, not a directory"


def test_compare_on_a_missing_checkpoint_names_the_checkpoint(tmp_path, capsys):
    """It said 'generation config folder ... does not exist'."""
    assert cli.main(["compare", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert _one_line_error(capsys) == f"error: checkpoint directory '{tmp_path / 'nope'}' does not exist"


@pytest.mark.parametrize("broken", ["malformed", "missing"])
def test_compare_on_a_broken_tokenizer_is_one_line(ckpt, tmp_path, capsys, broken):
    """tokenizers' bare Exception was a traceback, from the LLM's tokenizer or the Engram hash's."""
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    if broken == "malformed":
        (bad / "tokenizer.json").write_text("{")
    else:
        (bad / "tokenizer.json").unlink()
    assert cli.main(["compare", "--checkpoint", str(bad)]) == 2
    line = _one_line_error(capsys)
    if broken == "malformed":
        assert line == f"error: invalid tokenizer.json in '{bad}': EOF while parsing an object at line 1 column 1"
    else:
        assert line == f"error: checkpoint '{bad}' has no tokenizer.json: the Engram hashes need it"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--out", ""], "error: --out must name a directory, got ''"),  # wrote into the current directory
        (["--shard-bytes", "0"], "error: --shard-bytes must be positive, got 0"),  # was the default
        (["--shard-bytes", "-5"], "error: --shard-bytes must be positive, got -5"),  # was a shard per tensor
    ],
)
def test_make_checkpoint_bad_flags_write_nothing(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["make-checkpoint", "--config", "tiny", "--out", "ck", *extra]) == 2
    assert _one_line_error(capsys) == message
    assert list(tmp_path.iterdir()) == []


def test_make_checkpoint_where_no_folder_can_be_made(tmp_path, capsys):
    """Under a file here; read-only or unwritable places take the same path (were tracebacks)."""
    (tmp_path / "f").write_text("")
    assert cli.main(["make-checkpoint", "--config", "tiny", "--out", str(tmp_path / "f" / "ck")]) == 2
    assert _one_line_error(capsys) == f"error: cannot create '{tmp_path / 'f' / 'ck'}': Not a directory"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--threads", "-1"], "error: --threads must be >= 1 (0 or left out: torch's default), got -1"),
        (["--max-new-admissions", "0"], "error: max_new_admissions must be positive (or unset: no cap), got 0"),
        (
            ["--admission-token-budget", "-1"],
            "error: admission_token_budget must be positive (or unset: no cap), got -1",
        ),
    ],
)
def test_serve_refuses_settings_that_break_it_before_binding(ckpt, capsys, extra, message):
    """--threads -1 was torch's traceback after the model loaded; an admission cap below 1 served, admitting
    nothing, every request waiting for ever. The port is held so that a server that starts exits at once."""
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        assert cli.main(["serve", "--checkpoint", str(ckpt), "--port", str(held.getsockname()[1]), *extra]) == 2
    finally:
        held.close()
    assert _one_line_error(capsys) == message
