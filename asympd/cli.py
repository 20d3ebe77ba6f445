"""``asympd`` command line.

Each subcommand is an ``add_arguments(parser)`` function and a ``run(args) -> int`` function,
registered in ``COMMANDS``; adding one is writing those two and one ``COMMANDS`` entry. Bad input
(unknown preset, missing directory, invalid checkpoint) exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class UsageError(Exception):
    """Bad command-line input: reported as one line, exit status 2."""


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _config(name_or_path: str):
    from asympd.config import ConfigError, resolve_config

    try:
        return resolve_config(name_or_path)
    except ConfigError as e:
        raise UsageError(str(e)) from e


# ---- make-checkpoint ------------------------------------------------------------------------------


def _make_checkpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="tiny | v41-flash | path to a config.json")
    p.add_argument("--out", required=True, help="output directory (created; must not hold a checkpoint)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-bytes", type=int, default=None, help="target shard size in bytes")


def _make_checkpoint(args: argparse.Namespace) -> int:
    from asympd.model.checkpoint import DEFAULT_SHARD_BYTES, write_checkpoint

    if not args.out:  # Path("") is the current directory
        raise UsageError("--out must name a directory, got ''")
    if args.shard_bytes is not None and args.shard_bytes < 1:  # 0 meant the default, below 0 a shard a tensor
        raise UsageError(f"--shard-bytes must be positive, got {args.shard_bytes}")
    cfg = _config(args.config)
    out = write_checkpoint(cfg, args.out, args.seed, shard_bytes=args.shard_bytes or DEFAULT_SHARD_BYTES)
    print(out)
    return 0


# ---- memory ---------------------------------------------------------------------------------------


def _memory_args(p: argparse.ArgumentParser) -> None:
    from asympd.plan.memory import DEFAULT_CONTEXT_TOKENS, DEFAULT_RESERVE_GB

    p.add_argument("--config", default="v41-flash", help="tiny | v41-flash | path to a config.json")
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=DEFAULT_RESERVE_GB,
        help="per-GPU reserve for activations, CUDA context and buffers",
    )
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT_TOKENS, help="context length for the request count")
    p.add_argument("--engram-on-gpu", action="store_true", help="count the Engram tables as GPU-resident")
    p.add_argument("--json", action="store_true")


def _memory(args: argparse.Namespace) -> int:
    from asympd.plan.memory import format_memory_report, memory_report

    cfg = _config(args.config)
    if not 0 <= args.reserve_gb < float("inf"):
        raise UsageError(f"--reserve-gb must be >= 0 and finite, got {args.reserve_gb}")
    if not 1 <= args.context <= cfg.max_seq_len:
        raise UsageError(f"--context must be in [1, {cfg.max_seq_len}] (the model's context), got {args.context}")
    report = memory_report(
        cfg, reserve_gb=args.reserve_gb, context_tokens=args.context, engram_on_gpu=args.engram_on_gpu
    )
    print(json.dumps(report, indent=2) if args.json else format_memory_report(report))
    return 0


# ---- plan -----------------------------------------------------------------------------------------


def _plan_args(p: argparse.ArgumentParser) -> None:
    from asympd.plan.command import add_arguments

    add_arguments(p)


def _plan(args: argparse.Namespace) -> int:
    from asympd.plan.command import run
    from asympd.plan.planner import PlanError
    from asympd.plan.steps import PlanInputError
    from asympd.plan.validate import ValidationError

    try:
        return run(args)
    except (PlanError, PlanInputError, ValidationError) as e:
        raise UsageError(str(e)) from e


# ---- inspect --------------------------------------------------------------------------------------


def _inspect_args(p: argparse.ArgumentParser) -> None:
    from asympd.model.schema import ROLES

    p.add_argument("--checkpoint", required=True, help="checkpoint directory (may hold only some shards)")
    p.add_argument("--role", default="full", choices=ROLES)
    p.add_argument("--list", action="store_true", help="print the name of every tensor read")
    p.add_argument("--json", action="store_true")


def _inspect(args: argparse.Namespace) -> int:
    from asympd.model.checkpoint import load_config, load_tensors, role_files
    from asympd.model.schema import checkpoint_schema

    cfg = load_config(args.checkpoint)
    files = role_files(args.checkpoint, cfg, args.role)
    shards = {
        "shards_needed": files.shards_needed,
        "shards_missing": files.shards_missing,
        "tensors_missing": files.tensors_missing,
    }
    if not files.complete:  # a partial download: say what the role still needs, exit 1
        if args.json:
            print(json.dumps({"checkpoint": str(args.checkpoint), "role": args.role, **shards}, indent=2))
            return 1
        print(f"checkpoint     {args.checkpoint}")
        print(f"role           {args.role}: incomplete")
        print(f"shards needed  {len(files.shards_needed)}: {' '.join(files.shards_needed)}")
        print(f"shards missing {len(files.shards_missing)}: {' '.join(files.shards_missing)}")
        print(f"tensors missing {len(files.tensors_missing)}")
        for name in files.tensors_missing:
            print(f"  {name}")
        return 1
    resident: int | None = None
    try:
        from asympd.model.loader import load_model
    except ImportError:
        load_model = None
    if load_model is not None:
        import torch

        model = load_model(args.checkpoint, role=args.role, device="cpu", dtype=torch.float32)
        report = model.load_report
        resident = model.resident_bytes()
    else:
        _, report = load_tensors(args.checkpoint, cfg, args.role)
    part_of = {s.name: s.part.value for s in checkpoint_schema(cfg)}
    by_part: dict[str, dict[str, int]] = {}
    for name in report.tensors_read:
        entry = by_part.setdefault(part_of.get(name, "other"), {"tensors": 0})
        entry["tensors"] += 1
    out: dict[str, Any] = {
        "checkpoint": str(args.checkpoint),
        "role": args.role,
        "tensors_read": len(report.tensors_read),
        "bytes_read": report.bytes_read,
        "resident_bytes": resident,
        "files_opened": report.files_opened,
        "tensors_by_part": {k: v["tensors"] for k, v in by_part.items()},
        **shards,
    }
    if args.json:
        out["tensor_names"] = report.tensors_read
        print(json.dumps(out, indent=2))
        return 0
    print(f"checkpoint     {out['checkpoint']}")
    print(f"role           {args.role}")
    print(f"tensors read   {out['tensors_read']}  ({', '.join(f'{k} {v}' for k, v in out['tensors_by_part'].items())})")
    print(f"bytes read     {report.bytes_read}  ({report.bytes_read / 1e9:.3f} GB)")
    print(f"files opened   {len(report.files_opened)}")
    print(f"shards needed  {len(files.shards_needed)}: {' '.join(files.shards_needed)}")
    if resident is None:
        print("resident bytes n/a (asympd.model.loader not available)")
    else:
        print(f"resident bytes {resident}  ({resident / 1e9:.3f} GB, as loaded)")
    if args.list:
        for name in report.tensors_read:
            print(f"  {name}")
    return 0


# ---- serve / router / demo ------------------------------------------------------------------------


def _serve_args(p: argparse.ArgumentParser) -> None:
    from asympd.serve.config import add_serve_arguments

    add_serve_arguments(p)  # one flag per field of ServeConfig / EngineConfig / SchedulerConfig
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from asympd.serve.api_server import serve
    from asympd.serve.config import serve_config_from_args

    if not any(Path(args.checkpoint, name).exists() for name in ("config.json", "inference/config.json")):
        raise UsageError(f"--checkpoint {args.checkpoint!r} holds no config.json")
    from asympd.engine.engine import EngineConfigError
    from asympd.serve.http import BindError

    try:
        cfg = serve_config_from_args(args).resolve()
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    try:
        serve(cfg, args.log_level)
    except (EngineConfigError, BindError) as e:  # what only the loaded model (a block size) or the host refuses
        raise UsageError(str(e)) from e
    return 0


def _router_args(p: argparse.ArgumentParser) -> None:
    from asympd.engine.modes import MODES

    p.add_argument("--prefill", nargs="*", default=[], metavar="URL", help="prefill worker URLs")
    p.add_argument(
        "--decode",
        nargs="+",
        required=True,
        metavar="URL",
        help="decode worker URLs (colocated workers for --mode colocated)",
    )
    p.add_argument("--mode", default=None, choices=MODES, help="default: the mode the workers report")
    p.add_argument(
        "--checkpoint", default=None, help="for the tokenizer and window size (default: fetched from a worker)"
    )
    p.add_argument(
        "--api-key", default=None, help="require Authorization: Bearer KEY (visible in ps: prefer --api-key-file)"
    )
    p.add_argument("--api-key-file", default=None, help="file holding the client API key (or $ASYMPD_API_KEY)")
    p.add_argument(
        "--internal-key-file",
        default=None,
        help="the deployment's internal key, shared with the workers (default: $ASYMPD_INTERNAL_KEY, else "
        "~/.cache/asympd/internal.key)",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="largest request body accepted (413 above)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed when ready)")
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--prefill-timeout", type=float, default=60.0, help="seconds for a whole prefill call")
    p.add_argument(
        "--progress-timeout",
        "--stream-idle-timeout",
        dest="stream_idle_timeout",
        type=float,
        default=60.0,
        help="longest wait for a decode worker's next bytes (tokens, or progress of a non-streamed request)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def _router(args: argparse.Namespace) -> int:
    from asympd.serve.router import RouterConfig, run_router

    cfg = RouterConfig(
        prefill=args.prefill,
        decode=args.decode,
        host=args.host,
        port=args.port,
        mode=args.mode,
        checkpoint=args.checkpoint,
        api_key=args.api_key,
        api_key_file=args.api_key_file,
        internal_key_file=args.internal_key_file,
        max_body_bytes=args.max_body_bytes,
        health_interval=args.health_interval,
        prefill_timeout=args.prefill_timeout,
        stream_idle_timeout=args.stream_idle_timeout,
    )
    try:
        run_router(cfg, args.log_level)
    except ValueError as e:
        raise UsageError(str(e)) from e
    return 0


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", default=None, help="default: a tiny random checkpoint in ~/.cache/asympd")
    p.add_argument("--transport", default=None, choices=("nixl", "tcp", "auto"))
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--keep-logs", action="store_true")


def _demo(args: argparse.Namespace) -> int:
    from asympd.serve.demo import run_demo

    return run_demo(args.checkpoint, args.transport, args.max_tokens, args.keep_logs)


# ---- compare --------------------------------------------------------------------------------------


def _compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--json", action="store_true", help="print the raw report as JSON")
    p.add_argument("--prompts-per-length", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def _compare(args: argparse.Namespace) -> int:
    for flag, value in (("--max-tokens", args.max_tokens), ("--prompts-per-length", args.prompts_per_length)):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if not -(2**63) <= args.seed < 2**64:  # what torch.Generator.manual_seed takes
        raise UsageError(f"--seed must be a 64-bit integer, got {args.seed}")
    from asympd.bench.compare import main as compare_main

    return compare_main(args.checkpoint, args.json, args.prompts_per_length, args.max_tokens, args.seed)


# ---- bench ----------------------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser) -> None:
    from asympd.bench.serve_load import add_arguments

    sub = p.add_subparsers(dest="bench_command", required=True, parser_class=_Parser)
    help = "load an OpenAI-compatible endpoint (asympd, vLLM, SGLang) and measure TTFT, TPOT, ITL, goodput"
    add_arguments(sub.add_parser("serve", help=help, description=help))


def _bench(args: argparse.Namespace) -> int:
    from asympd.bench.serve_load import BenchError, run

    try:
        return run(args)
    except BenchError as e:
        raise UsageError(str(e)) from e


COMMANDS: dict[str, Command] = {
    "make-checkpoint": Command(
        "write a random-weight checkpoint in the released format", _make_checkpoint_args, _make_checkpoint
    ),
    "memory": Command("resident bytes per role and KV room per GPU", _memory_args, _memory),
    "plan": Command("the cheapest P/D deployment for a traffic mix and TTFT/ITL targets", _plan_args, _plan),
    "inspect": Command(
        "the shards a role needs; load it and report what was read (exit 1: shards missing)", _inspect_args, _inspect
    ),
    "serve": Command("serve a checkpoint over an OpenAI-compatible API (one worker)", _serve_args, _serve),
    "router": Command("route requests over prefill and decode workers", _router_args, _router),
    "demo": Command("start a 1P1D deployment + router locally and send a few requests", _demo_args, _demo),
    "compare": Command("each mode's outputs against colocated/full: agreement and KL", _compare_args, _compare),
    "bench": Command("benchmarks against running servers: `bench serve`", _bench_args, _bench),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(f"{self.prog}: {message}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with ``command`` only that subcommand's arguments (the others keep
    their name and help): adding a subcommand's arguments imports its modules, and those of
    ``serve`` or ``bench`` take seconds that ``plan`` or ``memory`` need not wait for."""
    parser = _Parser(prog="asympd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        if command is None or name == command:
            cmd.add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    from asympd.config import ConfigError
    from asympd.model.schema import CheckpointError

    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
        return COMMANDS[args.command].run(args)
    except (UsageError, ConfigError, CheckpointError, FileNotFoundError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
