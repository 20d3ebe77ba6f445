"""One engine: a role (colocated, prefill worker, decode worker) running a mode.

The loop is vLLM's: ``add_request`` / ``abort_request`` / ``step`` -> incremental outputs. The
scheduler decides, the runner executes, this file applies the results to requests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asympd.config import ModelConfig
from asympd.engine import modes
from asympd.engine.cuda_graphs import (
    PIECE_ROWS,
    PREFILL_PIECE_ROWS,
    DecodeGraphs,
    DraftGraphs,
    PrefillPieces,
    PrefillSteps,
    StartupCapture,
    capture_at_startup,
    piece_sizes_for,
)
from asympd.engine.request import CompletionOutput, Request, RequestOutput, Status
from asympd.engine.runner import ModelRunner
from asympd.engine.sampler import Drawn, SampleJob, sample_step
from asympd.engine.sampling import SamplingParams
from asympd.engine.sampling_params import SamplingParamsError
from asympd.engine.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from asympd.engine.spec_decode import DraftRequest, DSparkProposer, Proposer, rollback, spec_metrics
from asympd.engine.warm_up import WarmUp, warm_up
from asympd.kv.block_manager import BlockManager, KVCacheError
from asympd.kv.paged_cache import PagedKVCache
from asympd.kv.spec import KVCacheSpec
from asympd.model.transformer import Transformer
from asympd.model.vision import ImageInput, check_spans
from asympd.transfer.prefix_state import KV_FORMATS, PrefixState, PrefixStateError, model_fingerprint
from asympd.transfer.stream import PrefixStream

log = logging.getLogger("asympd.engine")


class RequestError(ValueError):
    """A request the engine refuses (bad input): maps to HTTP 400 naming ``param``, the field at
    fault where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(cfg: ModelConfig, ids: list[int], params: SamplingParams) -> None:
    """Refuse an empty prompt, out-of-range ids, bad sampling parameters, or a request longer than
    the model's context, with RequestError (every engine checks a prompt the same way)."""
    if not ids:
        raise RequestError("the prompt is empty", "prompt")
    not_ints = [t for t in ids if not isinstance(t, int) or isinstance(t, bool)]
    if not_ints:
        raise RequestError(f"prompt token ids must be integers: {not_ints[:8]}", "prompt")
    bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {cfg.vocab_size}): {bad[:8]}", "prompt")
    try:
        params.validate(cfg.vocab_size)
    except SamplingParamsError as e:
        raise RequestError(str(e), e.param) from e
    if len(ids) + params.max_tokens > cfg.max_seq_len:
        raise RequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds max_seq_len {cfg.max_seq_len}"
        )


CUDA_GRAPH_MODES = ("full", "full_and_piecewise")
CUDA_GRAPH_CAPTURE = ("startup", "lazy")
STREAM_MODES = ("asymmetric", "encoder-only")  # P exports the global KV only: no windows, no first token


@dataclass
class EngineConfig:
    role: str = "colocated"  # colocated | prefill | decode
    mode: str = "colocated"  # colocated | symmetric | encoder-only | asymmetric
    prefill_semantics: str = "full"  # for the colocated role
    boundary_policy: str = "carry"
    block_size: int = 16
    kv_cache_bytes: int = 64 << 20  # paged groups; windows and open groups are per slot
    num_blocks: int | None = None  # overrides kv_cache_bytes
    enable_prefix_caching: bool = True
    eos_token_id: int | None = None
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # speculative decoding with the DSpark draft blocks: drafts per request per step (0 = off; at most
    # dspark_block_size). When set, overrides scheduler.num_spec_tokens. A prefill worker never drafts.
    num_spec_tokens: int | None = None
    # optional: stop a request's drafts before the first with sigmoid(confidence) below this (the
    # reference computes DSpark's confidence head but applies no threshold; None keeps every draft)
    spec_confidence_threshold: float | None = None
    # prefill worker: how the exported global KV crosses the wire; fp4 = the released cache formats
    # (NVFP4 main KV, MXFP4 index keys), lossless since the cache holds those values already
    kv_wire_format: str = "fp4"
    # prefill worker: hand the prefix over in slices as its chunked prefill advances (each chunk's
    # finished global KV), so that the transfer overlaps the compute (asymmetric, encoder-only)
    stream_prefix: bool = False
    # decoding workers on CUDA replay decode/verify steps as CUDA graphs (engine/cuda_graphs.py);
    # True runs every step eagerly (vLLM's flag)
    enforce_eager: bool = False
    # full: other steps (prefill chunks, bounded prefills beside decodes) run eagerly; full_and_piecewise:
    # they replay their layers' parts around attention as piecewise graphs. None: full_and_piecewise on
    # a prefill worker, whose eager prompt steps are the host's (about 24,000 host ops a step; piecewise
    # took its 896-1792-row steps 1.1-2.2x faster on an H200 and its busy time up to 16 % down end to end,
    # docs/performance.md §12), full elsewhere (D's mixed steps measured no faster piecewise, §11)
    cuda_graph_mode: str | None = None
    # startup: build the decode/verify graphs (every padded batch size; 1 + k rows, 1 row, the counts
    # between; context bounds shortest first) and the drafter's before serving, at most
    # cuda_graph_max_captures decode/verify graphs; the rest, and all with lazy, are captured when first met
    cuda_graph_capture: str = "startup"
    cuda_graph_max_captures: int = 128
    # start-up capture covers contexts up to this many tokens (vLLM's max_seq_len_to_capture); steps of
    # longer ones are captured when first met
    max_seq_len_to_capture: int = 8192
    # run a throwaway prompt at each shape class of the eager prompt path before serving, so that its
    # Triton kernels compile at start-up, not mid-traffic (engine/warm_up.py); None: on a CUDA device
    warm_up: bool | None = None

    def warms_up(self, device: torch.device) -> bool:
        """Whether an engine on ``device`` runs the start-up warm-up (``warm_up``; None: on CUDA)."""
        return bool(self.warm_up) or (self.warm_up is None and device.type == "cuda")

    def validate(self) -> None:
        modes.check_role_mode(self.role, self.mode)
        if self.prefill_semantics not in modes.SEMANTICS:
            raise ValueError(f"unknown prefill semantics {self.prefill_semantics!r}")
        if self.boundary_policy not in modes.BOUNDARY_POLICIES:
            raise ValueError(f"unknown boundary policy {self.boundary_policy!r}")
        if self.kv_wire_format not in KV_FORMATS:
            raise ValueError(f"unknown kv_wire_format {self.kv_wire_format!r}; expected one of {', '.join(KV_FORMATS)}")
        if self.cuda_graph_mode is None:
            self.cuda_graph_mode = "full_and_piecewise" if self.role == "prefill" else "full"
        if self.cuda_graph_mode not in CUDA_GRAPH_MODES:
            raise ValueError(f"unknown cuda_graph_mode {self.cuda_graph_mode!r}; expected one of {CUDA_GRAPH_MODES}")
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURE:
            raise ValueError(
                f"unknown cuda_graph_capture {self.cuda_graph_capture!r}; expected one of {CUDA_GRAPH_CAPTURE}"
            )
        if self.cuda_graph_max_captures < 0:
            raise ValueError(f"cuda_graph_max_captures must be >= 0, got {self.cuda_graph_max_captures}")
        if self.max_seq_len_to_capture <= 0:
            raise ValueError(f"max_seq_len_to_capture must be positive, got {self.max_seq_len_to_capture}")
        if self.stream_prefix and self.mode not in STREAM_MODES:
            raise ValueError(f"stream_prefix needs mode {' or '.join(STREAM_MODES)}, not {self.mode!r}")
        if self.num_spec_tokens is not None and self.num_spec_tokens < 0:
            raise ValueError(f"num_spec_tokens must be >= 0, got {self.num_spec_tokens}")
        if self.spec_confidence_threshold is not None and not 0 <= self.spec_confidence_threshold <= 1:
            raise ValueError(f"spec_confidence_threshold must be in [0, 1], got {self.spec_confidence_threshold}")


def checkpoint_id(path: str | Path | None) -> str:
    """A content id for the fingerprint: two processes loading the same files agree."""
    if path is None:
        return "in-memory"
    p = Path(path)
    h = hashlib.sha256()
    for name in ("config.json", "inference/config.json", "model.safetensors.index.json"):
        if (p / name).exists():
            h.update((p / name).read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def free_memory_bytes(device: torch.device) -> int | None:
    """What a device can still allocate: the GPU's free memory plus what this process's allocator
    holds unused (the load's freed temporaries), the host's available memory on a CPU (Linux); None
    where neither can be read."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
    return None


class EngineConfigError(ValueError):
    """A setting this model cannot run with, found as the engine starts on it (after the checkpoint is
    read): the command line reports it as a usage error."""


class LLMEngine:
    def __init__(
        self,
        model: Transformer,
        config: EngineConfig | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        self.config = config or EngineConfig()
        self.config.validate()
        if self.config.role != "prefill" and model.role == "prefill":
            raise EngineConfigError("a prefill-role model can only run a prefill worker")
        if modes.PREFILL_MODEL_ROLE.get(self.config.mode) == "full" and model.role == "prefill":
            raise EngineConfigError(f"the {self.config.mode} mode's prefill worker needs the full model")
        self.model, self.cfg = model, model.cfg
        self.detokenize = detokenize
        c = self.config
        k = c.scheduler.num_spec_tokens if c.num_spec_tokens is None else c.num_spec_tokens
        if self.config.role == "prefill":
            k = 0  # P never decodes: no drafts, no rollback slack
        self.config.scheduler = dataclasses.replace(self.config.scheduler, num_spec_tokens=k)
        sc = self.config.scheduler
        self.num_spec_tokens = k
        self.proposer: Proposer | None = None
        if k and self.config.mode == "symmetric-windows":
            raise EngineConfigError(
                "num_spec_tokens > 0 is not supported in mode symmetric-windows: D computes no prompt row, "
                "and P does not ship the drafter's hidden states to seed its window"
            )
        if k:
            drafter = getattr(model, "drafter", None)
            if drafter is None:
                raise EngineConfigError(
                    f"num_spec_tokens={k} needs the DSpark draft blocks (mtp.*), which this {model.role}-role model "
                    "does not hold"
                )
            if k > self.cfg.dspark_block_size:
                raise EngineConfigError(
                    f"num_spec_tokens={k} exceeds the DSpark block size {self.cfg.dspark_block_size}"
                )
            self.proposer = DSparkProposer(drafter, self.config.spec_confidence_threshold)
        try:
            self.spec = KVCacheSpec.from_config(
                self.cfg, block_size=self.config.block_size, spec_slack=sc.num_spec_tokens + 1, dtype=model.dtype
            )
        except ValueError as e:  # a block size the model's cache ratios do not divide
            raise EngineConfigError(str(e)) from None
        num_blocks = self.config.num_blocks or self.config.kv_cache_bytes // self.spec.bytes_per_block
        if num_blocks < 1:
            raise EngineConfigError(
                f"kv_cache_bytes {self.config.kv_cache_bytes} holds no KV block of this model "
                f"({self.spec.bytes_per_block} bytes a block of {self.spec.block_size} tokens)"
            )
        pool = num_blocks * self.spec.bytes_per_block
        free = free_memory_bytes(model.device)
        if free is not None and pool > free:
            raise EngineConfigError(
                f"a KV pool of {num_blocks} blocks ({pool / 1e9:.2f} GB) does not fit: {free / 1e9:.2f} GB is "
                f"free on {model.device}; lower kv_cache_bytes or num_blocks"
            )
        self.blocks = BlockManager(self.spec, num_blocks, sc.max_num_seqs, self.config.enable_prefix_caching)
        decodes = self.config.role != "prefill"
        self._first_steps = self._first_step_graphs()
        if not decodes and self._first_steps is not None and not self.config.enforce_eager:
            # a symmetric P: its window chunks come alone, as many as its graphs hold, to replay them
            sc = self.config.scheduler = dataclasses.replace(
                sc, one_depth_per_step=True, max_deepest_chunks=self._first_steps.most
            )
        graphed = decodes or self._first_steps is not None  # its cache has room for padded graph rows
        self.cache = PagedKVCache(self.spec, num_blocks, sc.max_num_seqs, device=model.device, scratch=graphed)
        self.fingerprint = model_fingerprint(self.cfg, checkpoint_id(getattr(model, "checkpoint", None)), model.dtype)
        self.scheduler = Scheduler(sc, self.blocks, prefix_cache_key=self.fingerprint)
        self.runner = ModelRunner(model, self.cache, self.blocks)
        self.startup_capture: StartupCapture | None = None  # what the CUDA graphs' start-up built
        graphable = not any(getattr(m, "syncs_host", False) for m in model.modules())
        if graphed and model.device.type == "cuda" and model.batched and not graphable:
            log.info("CUDA graphs off: the routed experts read expert bounds on the host (unpacked fp32 experts)")
        if graphed and model.device.type == "cuda" and model.batched and graphable and not self.config.enforce_eager:
            self.runner.graphs = self.make_graphs(capture=True)
            if isinstance(self.proposer, DSparkProposer):
                self.proposer.graphs = DraftGraphs(
                    self.proposer.drafter, self.cache, max_batch=sc.max_num_seqs, num_drafts=k, seed_rows=1 + k
                )
            if self.config.cuda_graph_capture == "startup":
                self.startup_capture = self.capture_graphs()
        elif model.device.type == "cuda" and model.batched and graphable and not self.config.enforce_eager:
            self.runner.graphs = self.make_prefill_pieces(capture=True)  # a P's default; None with full
        self.requests: dict[str, Request] = {}
        self.held: dict[str, Request] = {}  # prefill worker: exported, blocks kept until released
        # prefill worker: done with, but a copy out of their blocks may still run (engine/export.py)
        self.draining: dict[str, Request] = {}
        # OpenAI's n: choices waiting for the first choice's prompt to be done, to fork from it
        # (their prompt is not computed again); parent id -> children, in order
        self.forks: dict[str, list[Request]] = {}
        self._fork_draws: dict[str, Drawn] = {}  # this step's first tokens of children forked in it
        self._forked: dict[str, list[Request]] = {}  # this step's forks, parent id -> children (_draft)
        self.counters = {
            "preemptions": 0,
            "prompt_tokens": 0,
            "generation_tokens": 0,
            "steps": 0,
            "spec_proposed": 0,
            "spec_accepted": 0,
            "spec_steps": 0,
            "prefix_cache_queries": 0,  # imported positions looked up at admission
            "prefix_cache_hits": 0,  # of those, found cached (shared blocks)
        }
        self.warm_up_report: WarmUp | None = None
        if self.config.warms_up(model.device):
            self.warm_up_report = warm_up(self)

    def make_graphs(self, capture: bool) -> DecodeGraphs:
        """This engine's CUDA graphs (``capture=False``: their static path, eagerly, as the CPU tests
        run it). A decoding worker's graphs serve its decode and verify steps and its first steps
        alone; a symmetric P's serve only its steps of window chunks alone (``_first_step_graphs``)."""
        sc, first = self.config.scheduler, self._first_steps
        decodes = self.config.role != "prefill"
        return DecodeGraphs(
            self.model,
            self.cache,
            max_batch=sc.max_num_seqs if decodes else first.most,
            capture=capture,
            piecewise=self.config.cuda_graph_mode == "full_and_piecewise",  # a symmetric P's prompt steps too
            max_rows=1 + self.num_spec_tokens if decodes else 0,
            prefill_rows=first.rows if first else None,
            piece_rows=piece_sizes_for(sc.max_num_batched_tokens, PIECE_ROWS if decodes else PREFILL_PIECE_ROWS),
        )

    def make_prefill_pieces(self, capture: bool) -> PrefillPieces | None:
        """A prefill worker without whole-step graphs (asymmetric, encoder-only): with
        ``cuda_graph_mode`` full_and_piecewise its prompt steps replay their layers' parts around
        attention as piecewise graphs (the warm-up's prompts capture them before serving); else
        None (every step eager; a P with window steps has ``make_graphs``, pieces included)."""
        if self.config.role != "prefill" or self._first_steps is not None:
            return None
        if self.config.cuda_graph_mode != "full_and_piecewise":
            return None
        sizes = piece_sizes_for(self.config.scheduler.max_num_batched_tokens, PREFILL_PIECE_ROWS)
        return PrefillPieces(self.cache.device, capture=capture, sizes=sizes)

    def capture_graphs(self) -> StartupCapture:
        """Build the CUDA graphs now, so that serving never pays a capture or a first-shape compile
        mid-traffic: verify steps of 1 + k rows, decode steps of 1, verify steps of fewer drafts, up
        to the longest sequence the model and the cache allow (``engine/cuda_graphs.py``)."""
        graphs, k = self.runner.graphs, self.num_spec_tokens
        if graphs is None:
            raise ValueError("this engine replays no CUDA graphs (a prefill worker, a CPU device or enforce_eager)")
        longest = min(self.cfg.max_seq_len + k, self.blocks.num_blocks * self.spec.block_size)
        drafts = getattr(self.proposer, "graphs", None)
        rows = [1 + k, 1, *range(k, 1, -1)] if k else [1]  # verify, decode, fewer drafts (near max_tokens)
        if self.config.role == "prefill":
            rows = []  # P never decodes: its window steps only
        prefills = [self._first_steps] if self._first_steps else []
        c = self.config
        report = capture_at_startup(
            graphs, drafts, rows, longest, c.cuda_graph_max_captures, prefills, c.max_seq_len_to_capture
        )
        log.info(report.line())
        return report

    def _first_step_graphs(self) -> PrefillSteps | None:
        """The W-row chunks through every layer whose steps alone replay graphs too. A D's first step
        for a request (asymmetric: a bounded prefill writing global KV; the symmetric modes and
        encoder-only: a replay over P's), for as many requests as one step admits. A symmetric P's
        last phase (the prompt's last W rows through all 40 layers, sampling the first token), for up
        to ``modes.P_WINDOW_GRAPH_BATCH`` requests: eagerly it took 250-390 ms a request at true depth,
        where a D's graph of the same shape takes ~90 ms (docs/performance.md §10, twelfth session),
        work the symmetric baselines need not do. None where the worker computes no such rows
        (symmetric-windows' D, an asymmetric or encoder-only P) or they are no more than a verify
        step's."""
        sc, w, c = self.config.scheduler, self.cfg.window_size, self.config
        if c.role == "prefill":
            first = modes.p_window_phase(self.cfg, c.mode, c.boundary_policy)
            most = modes.p_window_batch(self.cfg, c.mode, sc.max_num_batched_tokens, sc.max_num_seqs, c.boundary_policy)
            if first is None or most is None:
                return None
            return PrefillSteps(first.hi - first.lo, most, "last" if first.sample else "none", first.write_global)
        if c.role != "decode":
            return None
        phases = modes.decode_plan(self.cfg, 2 * w, c.mode, c.boundary_policy).phases
        first = phases[0] if phases else None
        rows = first.hi - first.lo if first else 0
        if rows <= 1 + self.num_spec_tokens:
            return None
        admit = min(sc.max_num_seqs, (sc.admission_token_budget or sc.max_num_batched_tokens) // rows)
        admit = min(admit, sc.max_new_admissions or admit)
        return PrefillSteps(rows, max(admit, 1), "last" if first.sample else "none", first.write_global)

    # ---- requests ----------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        prefix_state: PrefixState | None = None,
        first_token: int | None = None,
        first_token_logprobs: dict[int, float] | None = None,
        prefix_stream: bool = False,
        images: list[ImageInput] | None = None,
        whole_prefix: bool = False,
        fork_of: str | None = None,
    ) -> None:
        """Queue a request. Bad input raises RequestError (or PrefixStateError for a bad prefix
        state) before anything is allocated. ``prefix_stream``: a decode worker's request whose
        prefix arrives in slices (``import_slice``); it computes nothing until the last one.
        ``whole_prefix``: on a prefill worker that streams prefixes (``stream_prefix``), export this
        request's prefix in one piece when its prompt is done, as a worker that does not stream would
        (a server's n > 1 request: D's n requests each import the one whole state).
        ``images``: the prompt's images, their spans already expanded in ``prompt_token_ids``
        (``vision.expand_placeholders``). ``fork_of``: another choice of the same request (OpenAI's
        n: the same prompt, images and prefix state): this one waits for that request's prompt and
        starts from its KV, sampling its first token from the same logits, instead of computing the
        prompt again; where that cannot be (the other already sampled, or is gone, or no memory is
        left at the fork), it runs as any request would, with the same tokens."""
        params = params or SamplingParams()
        if request_id in self.requests or request_id in self.held or request_id in self.draining:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        check_prompt(self.cfg, ids, params)
        need = self.spec.blocks_for_tokens(len(ids) + params.max_tokens + 1 + self.config.scheduler.num_spec_tokens)
        if need > self.blocks.num_blocks:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks but the "
                f"whole cache has {self.blocks.num_blocks}: it could never be scheduled"
            )
        if prefix_stream:
            if self.config.role != "decode" or self.config.mode not in STREAM_MODES or prefix_state is not None:
                raise RequestError(f"a streamed prefix needs a decode worker in mode {' or '.join(STREAM_MODES)}")
            split = modes.decode_plan(self.cfg, len(ids), self.config.mode, self.config.boundary_policy).import_upto
            if split == 0:
                raise RequestError("this prompt has no prefix to stream (N <= W): add it without prefix_stream")
            prefix_state = PrefixStream(self.cfg, self.fingerprint, split, ids)
        images = list(images or [])
        self._check_images(ids, images)
        if prefix_state is not None and not isinstance(prefix_state, PrefixStream):
            self._check_image_state(prefix_state, ids, images)
        req = self._plan_request(request_id, ids, params, prefix_state, first_token)
        if params.seed is not None:  # the sampler draws a seeded request's noise where its logits are
            req.generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        req.images = images
        req.awaiting_import = prefix_stream
        req.stream_slices = self.config.stream_prefix and not whole_prefix
        req.spec_enabled = self.proposer is not None and not params.adjusts_logits  # drafts assume raw logits
        if first_token_logprobs is not None and req.output_token_ids and params.logprobs is not None:
            req.logprobs.append(dict(first_token_logprobs))
        parent = self._fork_parent(fork_of, req)  # (refuses a fork of another prompt)
        self.requests[request_id] = req
        if parent is not None:
            self.forks.setdefault(parent.request_id, []).append(req)
        else:
            self.scheduler.add(req)

    def _fork_parent(self, fork_of: str | None, child: Request) -> Request | None:
        """The request ``child`` can fork from, or None (then it runs on its own)."""
        if fork_of is None:
            return None
        parent = self.requests.get(fork_of)
        if parent is None or parent.output_token_ids or parent.status.finished:
            return None  # gone, or past its first token: nothing left to share but blocks
        if (
            parent.prompt_token_ids != child.prompt_token_ids
            or parent.imported is not child.imported
            or parent.cache_salt != child.cache_salt
        ):
            raise RequestError(f"request {child.request_id!r} forks from {fork_of!r}, whose prompt is another")
        if self.config.role == "prefill" or not parent.sample_after_prompt or parent.awaiting_import:
            return None
        return parent

    def _check_images(self, ids: list[int], images: list[ImageInput]) -> None:
        if images and self.model.vision is None:
            raise RequestError("this model was loaded without a vision tower: it cannot take images")
        if images:
            try:
                check_spans(self.cfg, ids, images)
            except ValueError as e:
                raise RequestError(str(e)) from None

    def _check_image_state(self, ps: PrefixState, ids: list[int], images: list[ImageInput]) -> None:
        """D: the state's image spans are this request's, and it ships exactly the rows P encoded
        for D (modes.image_rows_shipped); nothing else may replace an embedding."""
        spans = [(im.start, im.end) for im in images]
        got = [] if ps.image_spans is None else [(a, a + n) for a, n in ps.image_spans.tolist()]
        if got != spans:
            raise PrefixStateError(f"the prefix state's image spans {got} are not this request's {spans}")
        c = self.config
        want = modes.image_rows_shipped(self.cfg, len(ids), c.mode, c.boundary_policy, spans)
        pos = [] if ps.image_pos is None else ps.image_pos.tolist()
        if pos != want:
            raise PrefixStateError(f"the prefix state ships image rows at {pos[:8]}..., expected {want[:8]}...")

    def _plan_request(
        self, rid: str, ids: list[int], params: SamplingParams, ps: PrefixState | None, first_token: int | None
    ) -> Request:
        c, n = self.config, len(ids)
        if c.role == "colocated":
            return Request(
                rid, ids, params, modes.colocated_phases(self.cfg, n, c.prefill_semantics, c.boundary_policy)
            )
        if c.role == "prefill":
            plan = modes.prefill_plan(self.cfg, n, c.mode, c.boundary_policy)
            return Request(
                rid,
                ids,
                params,
                plan.phases,
                sample_after_prompt=plan.samples_first_token,
                export_upto=plan.export_upto,
            )
        plan = modes.decode_plan(self.cfg, n, c.mode, c.boundary_policy)
        if ps is None and plan.import_upto > 0:
            # no prefix from a prefill worker (it failed, or the router skipped it): compute it here
            return Request(rid, ids, params, modes.decode_fallback_plan(self.cfg, n, c.mode, c.boundary_policy))
        if isinstance(ps, PrefixStream):
            pass  # checked slice by slice as it arrives
        elif ps is not None:
            ps.validate(self.cfg, self.fingerprint)
            if plan.imports_windows and not ps.swa_kv:
                raise PrefixStateError(f"mode {c.mode}: the prefix state carries no sliding windows")
            if ps.split != plan.import_upto or list(ps.token_ids.tolist()) != ids:
                raise PrefixStateError(
                    f"prefix state covers [0, {ps.split}) of a {ps.token_ids.numel()}-token prompt; this "
                    f"{n}-token request in mode {c.mode}/{c.boundary_policy} needs [0, {plan.import_upto}) "
                    "of the same prompt"
                )
        req = Request(rid, ids, params, plan.phases, imported=ps)
        if plan.first_token_from_prefill:
            if first_token is None:
                raise RequestError(
                    f"mode {c.mode}: the decode worker needs the first token sampled by the prefill worker"
                )
            req.output_token_ids.append(int(first_token))
            req.first_token_time = time.monotonic()
        return req

    def import_slice(self, request_id: str, piece: PrefixState) -> bool:
        """Decode worker: the next slice of a streamed prefix. Written into the request's blocks at
        once if it holds them (else at admission); True when the prefix is complete and the request
        may run. A bad slice raises PrefixStateError and leaves the request as it was."""
        req = self.requests.get(request_id)
        if req is None or not isinstance(req.imported, PrefixStream) or not req.awaiting_import:
            raise RequestError(f"request {request_id!r} is not waiting for a streamed prefix")
        if piece.split == req.imported.split:
            self._check_image_state(piece, req.prompt_token_ids, req.images)
        req.imported.add(piece)
        if req.status is Status.RUNNING:
            self.runner.import_slice(req, piece)
        req.awaiting_import = not req.imported.complete
        return not req.awaiting_import

    def compute_streamed_prefix_here(self, request_id: str) -> bool:
        """Decode worker: a streamed prefix not one slice of which came (P died, or dropped the
        stream, before D's first pull): the request computes its prefix here instead, as one whose
        prefill failed (``--on-prefill-failure recompute``). False, and nothing changed, once a slice
        is in (its rows may already be in the request's blocks) or for an unknown request."""
        req = self.requests.get(request_id)
        if req is None or not isinstance(req.imported, PrefixStream) or req.imported.slices or not req.awaiting_import:
            return False
        self.abort_request(request_id)  # its blocks hold nothing yet
        self.add_request(request_id, req.prompt_token_ids, req.params, images=req.images)
        return True

    def abort_request(self, request_id: str) -> None:
        """Stop a request wherever it is and free its blocks (a no-op for an unknown id)."""
        req = self.requests.pop(request_id, None) or self.held.pop(request_id, None)
        if req is None:
            return
        for child in self.forks.pop(request_id, ()):  # its choices compute their prompt themselves
            self._run_alone(child)
        for children in self.forks.values():  # a choice waiting to fork
            if req in children:
                children.remove(req)
        self.scheduler.remove(req, free=False)
        self._free(req)
        req.status = Status.FINISHED_ABORTED

    def release_transfer(self, request_id: str) -> None:
        """Prefill worker: D has the prefix (or the lease expired); free the blocks behind it."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self._free(req)

    def _free(self, req: Request) -> None:
        """Free a finished request's blocks and slot, and give its exports' host buffers back, but
        not while a copy out of those blocks still runs (engine/export.py): a later step could reuse
        and overwrite them under it. Such a request waits in ``draining`` until its copies are done."""
        if not all(e.ready() for e in req.exports):
            self.draining[req.request_id] = req
            return
        self.draining.pop(req.request_id, None)
        for e in req.exports:
            e.release()
        req.exports.clear()
        if req.request_id in self.blocks:
            self.blocks.free(req.request_id)

    def _reap(self) -> None:
        """Free what ``_free`` parked whose copies have completed. With nothing else to run there is
        nothing to overlap the copies with: wait for them."""
        for req in list(self.draining.values()):
            if not self.requests:
                for e in req.exports:
                    e.wait()
            self._free(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self.draining)

    # ---- the loop ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.draining:
            self._reap()
        sched = self.scheduler.schedule()
        self.counters["steps"] += 1
        self.counters["preemptions"] += len(sched.preempted)
        outputs: list[RequestOutput] = []
        for req, msg in sched.failed:
            req.error = msg
            outputs.append(self._finish(req, Status.FINISHED_ERROR))
        now = time.monotonic()
        for req in sched.admitted:
            if req.scheduled_time is None:  # set once: a request re-admitted after a preemption keeps it
                req.scheduled_time = now
            if req.imported is not None and self.config.enable_prefix_caching:
                self.counters["prefix_cache_queries"] += req.import_len
                self.counters["prefix_cache_hits"] += req.num_cached_import
            self.runner.prepare(req)
            if not req.phases:  # nothing to compute here (asymmetric P with N <= W)
                outputs.extend(self._prompt_done(req, None))
        chunks = [c for c in sched.chunks if c.request.status is Status.RUNNING]
        # what this step ran, for the server's step log (bench/e2e.py's co-run calibration)
        self.last_step = (sum(c.num_rows for c in chunks if c.phase is not None), sum(c.phase is None for c in chunks))
        wants = [self._wants_logits(c) for c in chunks]
        logits = self.runner.execute(chunks, wants) if chunks else []
        drawn = self._draw(chunks, logits, self.runner.last_argmax) if chunks else []
        self._rollbacks: list[tuple[str, int, int]] = []
        for sc, lg, d in zip(chunks, logits, drawn, strict=True):
            outputs.extend(self._apply(sc, lg, d))
        rollback(self.runner.cache, self.blocks, self._rollbacks)
        if self.proposer is not None and chunks:
            self._draft(chunks, self.runner.last_draft_hidden)
        self._forked.clear()
        self._fork_draws.clear()
        return outputs

    def _wants_logits(self, sc: ScheduledChunk) -> str:
        if sc.phase is None:
            return "all" if sc.num_rows > 1 else "last"  # verify rows [t, d1..dk]
        req = sc.request
        last_phase = req.phase_index == len(req.phases) - 1
        if (
            last_phase
            and sc.hi == sc.phase.hi
            and sc.phase.sample
            and req.sample_after_prompt
            and not req.output_token_ids
        ):
            return "last"
        return "none"

    def _draw(
        self, chunks: list[ScheduledChunk], logits: list[torch.Tensor | None], argmax: list[list[int] | None]
    ) -> list[Drawn | None]:
        """Every token the step samples, verifies or reports logprobs for, in one batched pass on
        the model's device (asympd.engine.sampler): a chunk with logits samples from its last row,
        or verifies its drafts."""
        jobs, at = [], []
        for n, (sc, lg, am) in enumerate(zip(chunks, logits, argmax, strict=True)):
            if lg is None:
                continue
            req = sc.request
            verifying = sc.phase is None and bool(req.spec_draft)
            jobs.append(
                SampleJob(
                    lg if verifying else lg[-1:],
                    req.params,
                    req.generator,
                    am,
                    list(req.spec_draft) if verifying else [],
                    req.spec_draft_probs if verifying else None,
                    req.prompt_token_ids,
                    req.output_token_ids,
                    self.config.eos_token_id,
                )
            )
            at.append(n)
            if not verifying and sc.phase is not None:  # a prompt's last row: its fork children's draws too
                for child in self.forks.get(req.request_id, ()):
                    jobs.append(
                        SampleJob(
                            lg[-1:],
                            child.params,
                            child.generator,
                            am,
                            prompt_ids=child.prompt_token_ids,
                            eos=self.config.eos_token_id,
                        )
                    )
                    at.append(child)
        drawn: list[Drawn | None] = [None] * len(chunks)
        for n, d in zip(at, sample_step(jobs), strict=True):
            if isinstance(n, Request):
                self._fork_draws[n.request_id] = d
            else:
                drawn[n] = d
        return drawn

    def _apply(self, sc: ScheduledChunk, logits: torch.Tensor | None, drawn: Drawn | None) -> list[RequestOutput]:
        req = sc.request
        if sc.phase is not None:
            self.counters["prompt_tokens"] += sc.num_rows
            req.cursor = sc.hi
            if req.stream_slices and req.streamed < sc.hi < req.export_upto:
                return [self._stream_slice(req, sc.hi)]
            if req.cursor == sc.phase.hi:
                req.phase_index += 1
                if req.in_prompt:
                    req.cursor = req.phases[req.phase_index].lo
                else:
                    return self._prompt_done(req, drawn)
            return []
        if req.spec_draft:
            return self._verify(sc, drawn)
        return self._append_token(req, drawn)

    def _prompt_done(self, req: Request, drawn: Drawn | None) -> list[RequestOutput]:
        if req.imported is not None and self.config.enable_prefix_caching:
            # a no-op but for a streamed prefix admitted before its last slice came (the scheduler
            # caches a whole import at admission)
            self.blocks.commit_cached(
                req.request_id, req.prompt_token_ids, req.import_len, self.fingerprint + req.cache_salt
            )
        if self.config.role == "prefill":
            if drawn is not None:  # a symmetric P samples the first token: it generated it, D does not count it
                tok = self._sample(req, drawn)
                req.output_token_ids.append(tok)
                self.counters["generation_tokens"] += 1
                req.first_token_time = time.monotonic()
            req.exported = export = self.runner.export_prefix(
                req,
                fingerprint=self.fingerprint,
                mode=self.config.mode,
                policy=self.config.boundary_policy,
                kv_format=self.config.kv_wire_format,
                start=req.streamed,  # 0 unless it went out in slices
                windows=modes.prefill_plan(
                    self.cfg, req.num_prompt_tokens, self.config.mode, self.config.boundary_policy
                ).exports_windows,
            )
            req.exports.append(export)
            req.image_embeds.clear()  # exported: the encodings are no longer needed
            self.scheduler.running.remove(req)
            self.held[req.request_id] = req
            return [self._finish(req, Status.FINISHED_EXPORTED, free=False)]
        req.image_embeds.clear()  # the prompt is done: its image rows are in the cache now
        forked = self._fork(req) if req.request_id in self.forks else []
        if drawn is not None:
            return self._append_token(req, drawn) + forked
        new = req.output_token_ids[req.num_reported :]  # symmetric D: P's first token, unless already sent
        if new:
            reason = self._stop_reason(req)
            if reason is not None:
                return [self._finish(req, reason, new=new)]
            return [self._output(req, new, finished=False)]
        return []

    def _fork(self, parent: Request) -> list[RequestOutput]:
        """The parent's prompt is done (this step computed its last row): each choice waiting on it
        takes its KV (BlockManager.fork, PagedKVCache.fork_slot) and the first token the step's
        sampler drew for it from the same logits row, as if it had computed the prompt itself; the
        drafter seeds its window with the same rows (_draft)."""
        outputs: list[RequestOutput] = []
        n = parent.num_prompt_tokens
        for child in self.forks.pop(parent.request_id):
            drawn = self._fork_draws.pop(child.request_id, None)
            if drawn is None:  # nothing sampled for it (a symmetric D's first token comes from P)
                self._run_alone(child)
                continue
            try:
                copies = self.blocks.fork(
                    parent.request_id, child.request_id, n + 1 + self.scheduler.config.num_spec_tokens, n
                )
            except KVCacheError:
                self._run_alone(child, drew=True)
                continue
            slots = self.blocks.slot(parent.request_id), self.blocks.slot(child.request_id)
            self.runner.cache.fork_slot(*slots, child.request_id, copies)
            child.status = Status.RUNNING
            child.phase_index = len(child.phases)
            child.scheduled_time = time.monotonic()
            self.scheduler.running.append(child)
            self._forked.setdefault(parent.request_id, []).append(child)
            outputs.extend(self._append_token(child, drawn))
        return outputs

    def _run_alone(self, child: Request, drew: bool = False) -> None:
        """A choice that cannot fork: it computes its prompt as any request (the same tokens; a
        seeded one's generator starts again if it drew for the fork)."""
        if drew and child.params.seed is not None:
            child.generator = torch.Generator(device=self.model.device).manual_seed(child.params.seed)
        self.scheduler.add(child)

    def _sample(self, req: Request, drawn: Drawn) -> int:
        """The token the step's sampler drew for the request (and its logprobs, if asked)."""
        req.logprobs.extend(drawn.logprobs)
        return drawn.tokens[0]

    def _stop_reason(self, req: Request) -> Status | None:
        tok, p = req.output_token_ids[-1], req.params
        if tok in p.stop_token_ids or (tok == self.config.eos_token_id and not p.ignore_eos):
            return Status.FINISHED_STOPPED
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_seq_len:
            return Status.FINISHED_LENGTH
        return None

    def _append_token(self, req: Request, drawn: Drawn) -> list[RequestOutput]:
        tok = self._sample(req, drawn)
        req.output_token_ids.append(tok)
        self.counters["generation_tokens"] += 1
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        reason = self._stop_reason(req)
        if reason is not None:
            return [self._finish(req, reason, new=[tok])]
        return [self._output(req, [tok], finished=False)]

    # ---- speculative decoding ----------------------------------------------------------------

    def _verify(self, sc: ScheduledChunk, drawn: Drawn) -> list[RequestOutput]:
        """Accept a prefix of the drafts (the sampler's greedy or rejection test), emit it plus one
        more token, and roll back whatever the rejected rows wrote."""
        req = sc.request
        drafts = req.spec_draft
        req.spec_draft, req.spec_draft_probs = [], None
        tokens, accepted = drawn.tokens, drawn.accepted
        req.spec_proposed += len(drafts)
        req.spec_accepted += accepted
        req.spec_steps += 1
        self.counters["spec_proposed"] += len(drafts)
        self.counters["spec_accepted"] += accepted
        self.counters["spec_steps"] += 1
        new: list[int] = []
        for i, tok in enumerate(tokens):
            if req.params.logprobs is not None:
                req.logprobs.append(drawn.logprobs[i])
            req.output_token_ids.append(tok)
            new.append(tok)
            self.counters["generation_tokens"] += 1
            reason = self._stop_reason(req)
            if reason is not None:
                return [self._finish(req, reason, new=new)]
        keep = req.num_tokens - 1  # positions whose KV stays: the newest token is not computed yet
        self._rollbacks.append((req.request_id, keep, sc.hi))  # applied for the whole step at once
        return [self._output(req, new, finished=False)]

    def _num_drafts(self, req: Request) -> int:
        """Drafts worth proposing: never past max_tokens (one token always comes from the target)
        or max_seq_len."""
        left = min(req.params.max_tokens - len(req.output_token_ids), self.cfg.max_seq_len - req.num_tokens)
        return max(0, min(self.num_spec_tokens, left - 1))

    def _draft(self, chunks: list[ScheduledChunk], hidden: list[torch.Tensor | None]) -> None:
        """One draft pass for the step: seed each request's drafter window with the rows it just
        computed at full depth and kept (a prompt chunk's last W rows, a decode step's accepted rows),
        then draft for every request that decodes next step. A request whose logits are adjusted
        (``spec_enabled`` False) gets no drafts: its verify step would test them against the raw
        logits (the scheduler gives it one row, and a draft there was taken as the raw argmax)."""
        w = self.cfg.window_size
        items = []
        running, live, view = Status.RUNNING, self.requests, self.runner.view  # per request: no lookups
        for sc, hid in zip(chunks, hidden, strict=True):
            if hid is None:
                continue
            req = sc.request
            # the request, and the choices forked from its prompt in this step (seeded with its rows,
            # as if they had computed them: even when the request itself ended at its first token)
            owners = (req, *self._forked[req.request_id]) if req.request_id in self._forked else (req,)
            owners = [r for r in owners if r.spec_enabled and r.status is running and r.request_id in live]
            if not owners:
                continue
            newest = req.num_tokens - 1
            hi = sc.hi if sc.phase is not None else newest
            lo = max(sc.lo, hi - w)  # only the last W rows can reach a draft query
            # every computed row kept (a verify step's drafts all accepted): the rows as they are
            rows = hid if lo == sc.lo and hi - lo == hid.shape[0] else hid[lo - sc.lo : hi - sc.lo]
            for r in owners:
                k = 0 if r.in_prompt else self._num_drafts(r)
                items.append(DraftRequest(view(r), rows, lo, newest, r.last_token, k, r.params, r.generator, r))
        if not items:
            return
        for item, prop in zip(items, self.proposer(items), strict=True):
            req = item.request
            req.spec_draft, req.spec_draft_probs = list(prop.tokens), prop.probs

    def _finish(self, req: Request, status: Status, new: list[int] | None = None, free: bool = True) -> RequestOutput:
        for child in self.forks.pop(req.request_id, ()):  # it ended before its prompt did
            self._run_alone(child)
        req.status = status
        req.finish_time = time.monotonic()
        self.requests.pop(req.request_id, None)
        if free:
            self.scheduler.remove(req, free=False)
            self._free(req)
        return self._output(req, new or [], finished=True)

    def _stream_slice(self, req: Request, upto: int) -> RequestOutput:
        """Prefill worker streaming: the slice [req.streamed, upto) of the prefix, not finished yet."""
        piece = self.runner.export_prefix(
            req,
            fingerprint=self.fingerprint,
            mode=self.config.mode,
            policy=self.config.boundary_policy,
            kv_format=self.config.kv_wire_format,
            start=req.streamed,
            upto=upto,
        )
        req.exports.append(piece)
        req.streamed = upto
        out = self._output(req, [], finished=False)
        out.prefix_state, out.prefix_export = piece.state, piece
        return out

    def _output(self, req: Request, new: list[int], finished: bool) -> RequestOutput:
        req.num_reported += len(new)
        text = self.detokenize(req.output_token_ids) if self.detokenize else ""
        reason = req.status.value if req.status.finished else None
        metrics = {
            "arrival_time": req.arrival_time,
            "num_preemptions": req.num_preemptions,
            **spec_metrics(req.spec_proposed, req.spec_accepted, req.spec_steps),
        }
        if req.scheduled_time is not None:  # vLLM's request queue time: added to first scheduled
            metrics["queue"] = req.scheduled_time - req.arrival_time
        if req.first_token_time is not None:
            metrics["ttft"] = req.first_token_time - req.arrival_time
        if req.finish_time is not None:
            metrics["e2e"] = req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    list(req.output_token_ids),
                    text,
                    list(req.logprobs) if req.params.logprobs is not None else None,
                    reason,
                )
            ],
            finished=finished,
            new_token_ids=new,
            prefix_state=req.exported.state if finished and req.exported is not None else None,
            prefix_export=req.exported if finished else None,
            metrics=metrics,
            error=req.error,
        )

    # ---- visibility --------------------------------------------------------------------------

    def _graphed_steps(self) -> int:
        """Steps whose forward took the CUDA-graph path (replayed, or run once before its capture);
        the others ran eagerly: how an operator sees what the admission policy buys."""
        graphs = self.runner.graphs
        return graphs.stats["replayed"] + graphs.stats["first"] if graphs is not None else 0

    def stats(self) -> dict[str, Any]:
        return {
            "running": sum(1 for r in self.scheduler.running if r.status is Status.RUNNING),
            "waiting": len(self.scheduler.waiting) + sum(len(c) for c in self.forks.values()),
            "held_for_transfer": len(self.held),
            "exports_draining": len(self.draining),
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_usage_bytes": self.blocks.usage(),
            **self.counters,
            "graphed_steps": self._graphed_steps(),
            "warm_up_prompts": len(self.warm_up_report.rows) if self.warm_up_report else 0,
            "num_spec_tokens": self.num_spec_tokens,
            **spec_metrics(self.counters["spec_proposed"], self.counters["spec_accepted"], self.counters["spec_steps"]),
        }
