"""What one worker process is asked to run: ``ServeConfig`` holds the ``EngineConfig`` (and its
``SchedulerConfig``) plus what only a server needs, and ``asympd serve``'s flags are generated
from these dataclasses, so a setting and its default are written once."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from asympd.engine import modes
from asympd.engine.engine import CUDA_GRAPH_CAPTURE, CUDA_GRAPH_MODES, EngineConfig
from asympd.engine.scheduler import SchedulerConfig
from asympd.parallel.cp_engine import check_cp
from asympd.serve.admission import POLICIES, default_policy, policy_settings
from asympd.serve.http import DEFAULT_MAX_BODY_BYTES
from asympd.transfer.prefix_state import KV_FORMATS

DTYPES = ("auto", "float32", "bfloat16", "float16")  # asympd.model.dtypes; auto: bf16 on CUDA, fp32 on CPU
WEIGHTS = ("auto", "packed-experts", "packed", "dequantized", "reference")  # asympd.model.loader.LAYOUTS


@dataclass
class ServeConfig:
    """A worker: the engine it runs (``engine.role``, ``engine.mode``, cache, scheduler) and how it
    is served."""

    checkpoint: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    transport: str | None = None  # None: NIXL, falling back to TCP (with a warning) where it cannot run
    on_prefill_failure: str = "recompute"
    api_key: str | None = None  # argv is visible in `ps`: prefer api_key_file or $ASYMPD_API_KEY
    api_key_file: str | None = None
    internal_key_file: str | None = None  # None: $ASYMPD_INTERNAL_KEY, else the per-user key file
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    generation_config: str = "auto"  # auto: the checkpoint's generation_config.json; vllm: none; or a folder
    device: str = "cpu"
    dtype: str = "auto"  # resolved to a name by resolve()
    weights: str = "auto"  # packed-experts on CUDA, dequantized on CPU (asympd.model.loader)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    transfer_timeout: float = 10.0  # D: the whole fetch of one prefix state
    transfer_ttl: float = 120.0  # P: how long an unacked prefix state keeps its blocks
    transfer_host: str | None = None  # P: data-plane bind address (default: host)
    transfer_port: int = 0
    advertise_host: str | None = None  # P: address D should connect to (default: the bind address)
    threads: int | None = None
    ep: int = 1  # expert-parallel ranks (one process each, started by this worker); docs/parallel.md
    cp: int = 1  # prefill worker: context-parallel ranks its prefixes are split over (parallel/cp_engine.py)
    tp: int = 1  # only 1: attention is replicated
    max_images: int = 8  # image parts per chat request (docs/vision.md)
    max_image_bytes: int = 4 << 20  # each image, encoded (the body limit bounds them all)
    allow_image_urls: bool = False  # fetch http(s) image URLs (off: data URLs only)
    admission_policy: str | None = None  # decode/colocated: fills the admission settings left unset
    benchmark_shared_experts: bool = False  # load a checkpoint whose layers share layer 0's experts (bench only)

    @property
    def role(self) -> str:
        return self.engine.role

    @property
    def mode(self) -> str:
        return self.engine.mode

    def resolve(self) -> ServeConfig:
        """Check what the engine cannot: raise ValueError with a message for the command line."""
        e = self.engine
        self._check_device()
        if self.tp != 1:
            raise ValueError("tensor parallel attention is not implemented: attention is replicated; use --ep")
        if self.ep < 1:
            raise ValueError(f"--ep must be >= 1, got {self.ep}")
        if self.threads is not None and self.threads < 0:
            raise ValueError(f"--threads must be >= 1 (0 or left out: torch's default), got {self.threads}")
        modes.check_role_mode(e.role, e.mode)
        check_cp(self.cp, e.role, e.mode)
        if e.stream_prefix and e.role != "prefill":
            raise ValueError("--stream-prefix is a prefill worker's setting (the decode worker follows what P sends)")
        if e.stream_prefix and self.transport == "nixl":
            raise ValueError("--stream-prefix needs --transport tcp: the NIXL transport has no stream operation")
        if e.stream_prefix and self.cp > 1:
            raise ValueError(
                f"--stream-prefix with --cp {self.cp}: a context-parallel prefill exports its prefix whole"
            )
        if self.benchmark_shared_experts and (self.ep > 1 or self.cp > 1):
            raise ValueError("--benchmark-shared-experts runs on one rank: not with --ep or --cp")
        if self.cp > 1 and self.ep > 1:
            raise ValueError(f"--cp {self.cp} with --ep {self.ep}: a worker runs one kind of parallelism")
        if self.ep > 1:  # the ranks meet in collectives every step: no CUDA graphs (parallel/executor.py),
            e.enforce_eager = True  # so none are built at start-up either, on rank 0's experts alone
        if self.on_prefill_failure not in ("recompute", "fail"):
            raise ValueError(f"unknown --on-prefill-failure {self.on_prefill_failure!r}: recompute or fail")
        if self.transport not in (None, "nixl", "tcp", "auto"):
            raise ValueError(f"unknown transport {self.transport!r}: nixl, tcp or auto")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: {', '.join(DTYPES)}")
        if self.dtype == "auto":  # a concrete name from here on (/info, the EP ranks)
            from asympd.model.dtypes import resolve_dtype

            self.dtype = str(resolve_dtype("auto", self.device)).removeprefix("torch.")
        if self.weights not in WEIGHTS:
            raise ValueError(f"unknown weights {self.weights!r}: {', '.join(WEIGHTS)}")
        if self.max_images < 0 or self.max_image_bytes < 1:
            raise ValueError(
                f"--max-images must be >= 0 and --max-image-bytes >= 1, got {self.max_images}, {self.max_image_bytes}"
            )
        if (e.num_blocks or 0) < 0 or e.kv_cache_bytes < 1:
            raise ValueError(
                f"--num-blocks must be >= 0 (0: from --kv-cache-bytes) and --kv-cache-bytes positive, got "
                f"{e.num_blocks}, {e.kv_cache_bytes}"
            )
        from asympd.serve.http import check_body_limit, check_port, client_key

        if self.api_key_file is not None:
            client_key(self.api_key, self.api_key_file)  # unreadable or empty: a ValueError naming the file
        check_port(self.port, "--port")  # before the model loads
        check_port(self.transfer_port, "--transfer-port")
        check_body_limit(self.max_body_bytes)
        if self.admission_policy is None:  # by role: serve/admission.py says why
            self.admission_policy = default_policy(e.role)
        policy = policy_settings(self.admission_policy)
        if e.role == "prefill":
            e.num_spec_tokens = 0  # a prefill worker never drafts
        else:  # the recommended D admission policy, unless a setting is given explicitly (serve/admission.py)
            s = e.scheduler
            if s.max_new_admissions is None:
                s.max_new_admissions = policy.max_new_admissions
            if s.admission_token_budget is None:
                s.admission_token_budget = policy.admission_token_budget
            s.mixed_steps = policy.mixed_steps
        e.validate()
        e.scheduler.validate()
        return self

    def _check_device(self) -> None:
        import torch

        try:
            dev = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"--device {self.device!r} is not a device torch knows (cpu, cuda, cuda:N)") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {self.device}: this torch ({torch.__version__}) sees no CUDA device")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"--device {self.device}: there are {torch.cuda.device_count()} CUDA devices")


# ---- the command line, from the dataclasses ----------------------------------------------------------

_HELP = {
    "checkpoint": "checkpoint directory (with tokenizer.json)",
    "role": "colocated serves end to end; prefill (P) and decode (D) split a request",
    "mode": "default: colocated for --role colocated, asymmetric otherwise",
    "prefill_semantics": "what a colocated engine computes for a prompt (see asympd.engine.modes)",
    "transport": "prefix-state data plane; default NIXL, falling back to TCP (with a warning) if it cannot run",
    "on_prefill_failure": "decode worker, when the prefix cannot be had from P: compute it here, or answer 503",
    "api_key": "require Authorization: Bearer KEY on /v1/* (visible in ps: prefer --api-key-file or $ASYMPD_API_KEY)",
    "api_key_file": "file holding the client API key",
    "internal_key_file": "file holding the deployment's internal key (default: $ASYMPD_INTERNAL_KEY, else "
    "~/.cache/asympd/internal.key, created on first use)",
    "port": "0 picks a free port (printed when ready)",
    "kv_wire_format": "prefill worker: fp4 ships the global KV in the released cache formats (NVFP4/MXFP4, "
    "lossless), unpacked in the cache dtype",
    "served_model_name": "default: the --checkpoint argument",
    "generation_config": "auto: sampling fields a request leaves out (temperature, top_p, top_k, min_p, "
    "repetition_penalty, max_tokens from max_new_tokens) default to the checkpoint's generation_config.json, as "
    "vLLM's; vllm: the API's own defaults; or a folder holding a generation_config.json",
    "max_body_bytes": "largest request body accepted (413 above it)",
    "num_spec_tokens": "decoding workers: DSpark drafts verified per request per step (0: off)",
    "max_new_admissions": "new requests admitted per step (Sarathi-style cap; default: --admission-policy's)",
    "admission_token_budget": "prompt rows per step for prefills and bounded prefills (default: "
    "--admission-policy's; none: the step budget)",
    "admission_policy": "decode and colocated workers: cap-4 = at most 4 new requests and 512 prompt rows per "
    "step; alone-4 = the same caps, those rows in steps of their own taking turns with decode steps (both then "
    "replay CUDA graphs); admit-all = no cap; the two flags above override the caps. Default: alone-4 on a "
    "decode worker, cap-4 on a colocated one (docs/performance.md §10, §6)",
    "num_blocks": "KV blocks (overrides --kv-cache-bytes)",
    "transfer_timeout": "decode worker: seconds for one fetch",
    "transfer_ttl": "prefill worker: seconds an unfetched prefix state keeps its blocks",
    "transfer_host": "prefill worker: data-plane bind address (default --host)",
    "transfer_port": "prefill worker: data-plane port (0: any)",
    "advertise_host": "prefill worker: address decode workers connect to",
    "threads": "torch intra-op threads",
    "stream_prefix": "prefill worker: answer the router at once and stream the prefix to the decode worker "
    "by chunk as it is computed (TCP transport; asympd/serve/streaming.py)",
    "ep": "expert-parallel ranks: this worker starts ep-1 more processes (docs/parallel.md)",
    "cp": "prefill worker: split each prefix over cp context-parallel ranks (cp-1 more processes; "
    "docs/prefix-transfer.md)",
    "tp": "tensor parallel attention: only 1 (attention is replicated)",
    "dtype": "auto: bfloat16 on CUDA, float32 on CPU",
    "weights": "auto: packed-experts on CUDA (MXFP4 experts as released), dequantized on CPU",
    "cuda_graph_mode": "full: steps that are not pure decode/verify run eagerly; full_and_piecewise: they "
    "replay piecewise graphs around attention (a prefill worker's prompt steps up to 2048 rows too). Default: "
    "full_and_piecewise on a prefill worker, full elsewhere",
    "warm_up": "run a throwaway prompt at each prompt-step size class before serving, so that Triton compiles"
    " at start-up, not mid-traffic (default: on a CUDA device; --no-warm-up skips it)",
    "enforce_eager": "run every step eagerly (default on CUDA: decode and verify steps, a D's first steps and a "
    "symmetric P's window steps replay CUDA graphs)",
    "cuda_graph_capture": "startup: capture the decode/verify and drafter graphs before serving (logged: sizes, "
    "seconds, memory); lazy: the first step of each shape captures it",
    "cuda_graph_max_captures": "decode/verify graphs captured at start-up, shortest contexts first; the rest "
    "are captured when first met",
    "max_seq_len_to_capture": "start-up capture covers contexts up to this many tokens (vLLM's name); steps of "
    "longer ones are captured when first met",
    "max_images": "image parts accepted in one chat request (400 above it)",
    "max_image_bytes": "largest encoded image accepted (400 above it)",
    "allow_image_urls": "fetch http(s) image_url parts (default: only data: URLs are accepted)",
    "benchmark_shared_experts": "benchmarks only: load a checkpoint whose layers share layer 0's routed experts "
    "(bench/e2e.py --depth 40; asympd/model/shared_experts.py); such a checkpoint is refused without it",
}
_CHOICES = {
    "role": modes.ROLES,
    "mode": modes.MODES,
    "prefill_semantics": modes.SEMANTICS,
    "boundary_policy": modes.BOUNDARY_POLICIES,
    "transport": ("nixl", "tcp", "auto"),
    "on_prefill_failure": ("recompute", "fail"),
    "dtype": DTYPES,
    "weights": WEIGHTS,
    "kv_wire_format": KV_FORMATS,
    "cuda_graph_mode": CUDA_GRAPH_MODES,
    "cuda_graph_capture": CUDA_GRAPH_CAPTURE,
    "admission_policy": tuple(POLICIES),
}
_CLI_DEFAULTS = {"mode": None, "num_spec_tokens": 0}  # mode None: derived from the role
_NOT_FLAGS = {"engine", "scheduler", "eos_token_id", "mixed_steps"}  # nested, from the checkpoint or the policy
_DUPLICATE = {(SchedulerConfig, "num_spec_tokens")}  # EngineConfig.num_spec_tokens is the flag


def _fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [
        (f, hints[f.name])
        for f in dataclasses.fields(cls)
        if f.name not in _NOT_FLAGS and (cls, f.name) not in _DUPLICATE
    ]


def _scalar(tp: Any) -> type:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _default(f: dataclasses.Field) -> Any:
    if f.name in _CLI_DEFAULTS:
        return _CLI_DEFAULTS[f.name]
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per field of ServeConfig, EngineConfig and SchedulerConfig."""
    for cls in (ServeConfig, EngineConfig, SchedulerConfig):
        for f, tp in _fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind, default = _scalar(tp), _default(f)
            if kind is bool:
                if default is None:  # unset: the engine decides (e.g. warm_up: on a CUDA device)
                    p.add_argument(flag, dest=f.name, action="store_true", default=None, help=_HELP.get(f.name))
                    p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false", default=None)
                elif default:
                    p.add_argument(f"--no-{f.name.replace('_', '-')}", dest=f.name, action="store_false")
                else:
                    p.add_argument(flag, dest=f.name, action="store_true")
                continue
            p.add_argument(
                flag,
                dest=f.name,
                type=kind,
                default=default,
                required=f.name == "checkpoint",
                choices=_CHOICES.get(f.name),
                help=_HELP.get(f.name),
            )


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig the flags describe (``--mode`` defaults from ``--role``)."""

    def pick(cls: type) -> dict[str, Any]:
        return {f.name: getattr(args, f.name) for f, _ in _fields(cls)}

    engine = pick(EngineConfig)
    if engine["mode"] is None:
        engine["mode"] = modes.default_mode(engine["role"])
    scheduler = SchedulerConfig(**pick(SchedulerConfig))
    return ServeConfig(**pick(ServeConfig), engine=EngineConfig(**engine, scheduler=scheduler))
