"""The offline API: ``LLM(checkpoint, mode=...).generate(...)``.

In the P/D modes one process holds a prefill engine (the prefill role for asymmetric and
encoder-only, the full model for symmetric) and a decode engine, and moves every PrefixState
through the same serialization the network path uses, so what is tested offline is what crosses
the wire.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import torch

from asympd.engine import modes
from asympd.engine.engine import EngineConfig, LLMEngine
from asympd.engine.images import decode_image
from asympd.engine.request import RequestOutput
from asympd.engine.sampling import SamplingParams
from asympd.engine.sampling_params import sampling_defaults
from asympd.engine.scheduler import SchedulerConfig
from asympd.model.checkpoint import CheckpointError, checkpoint_dir, read_generation_config
from asympd.model.loader import load_model
from asympd.model.vision import ImageInput, expand_placeholders
from asympd.transfer.prefix_state import PrefixState
from asympd.transfer.seal import new_transfer_id, seal, verify


def load_tokenizer(checkpoint: str | Path):
    """The checkpoint's tokenizer.json through `tokenizers` (None if either is missing)."""
    path = Path(checkpoint) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot parse
        raise CheckpointError(f"invalid tokenizer.json in {str(checkpoint)!r}: {e}") from e


def load_sampling_defaults(checkpoint: str | Path, source: str = "auto") -> dict[str, Any]:
    """What a request's omitted sampling fields default to (vLLM's ``--generation-config``): the
    checkpoint's ``generation_config.json`` (auto), none (vllm), or another folder's file. A value
    SamplingParams would refuse is a CheckpointError naming the file."""
    if source == "vllm":
        return {}
    folder = checkpoint if source == "auto" else source
    try:
        return sampling_defaults(read_generation_config(folder))
    except ValueError as e:
        raise CheckpointError(f"{folder}/{e}") from None


def eos_id(tokenizer) -> int | None:
    if tokenizer is None:
        return None
    for name in ("<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>"):
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return tid
    return None


class LLM:
    def __init__(
        self,
        checkpoint: str | Path,
        mode: str = "colocated",
        prefill_semantics: str = "full",
        *,
        boundary_policy: str = "carry",
        device: str = "cpu",
        dtype: torch.dtype | str = "auto",
        scheduler: SchedulerConfig | None = None,
        block_size: int = 16,
        kv_cache_bytes: int = 64 << 20,
        enable_prefix_caching: bool = True,
        num_spec_tokens: int = 0,
        spec_confidence_threshold: float | None = None,
        weights: str = "auto",
        kv_wire_format: str = "fp4",
        stream_prefix: bool = False,
        enforce_eager: bool = False,
        cuda_graph_capture: str = "startup",
        cuda_graph_mode: str | None = None,
        warm_up: bool | None = None,
        generation_config: str = "auto",
    ):
        """``num_spec_tokens`` > 0 turns on speculative decoding with the checkpoint's DSpark draft
        blocks in the engine that decodes (the colocated engine, or D); the prefill worker never drafts.
        ``dtype="auto"``: bf16 on CUDA, fp32 on CPU (``asympd.model.dtypes.resolve_dtype``).
        ``weights``: packed-experts (the CUDA default), packed or dequantized (the CPU default).
        ``kv_wire_format``: how P's global KV crosses to D (fp4: the released cache formats).
        ``stream_prefix``: P hands its prefix over in slices as each prefill chunk finishes, and D
        writes each into its cache as it arrives (asymmetric, encoder-only). ``enforce_eager``: no
        CUDA graphs (by default decode and verify steps replay them on CUDA). ``cuda_graph_capture``:
        startup builds them before the first request, lazy when a step first needs one.
        ``cuda_graph_mode``: full_and_piecewise replays the other steps' layers around attention as
        piecewise graphs (a P's prompt steps too); None: that for the prefill worker, full for the rest.
        ``warm_up``: run the eager prompt path once per size class before the first request
        (engine/warm_up.py; None: on CUDA). ``generation_config`` (vLLM's): ``generate`` without
        sampling parameters samples with the checkpoint's ``generation_config.json`` defaults (auto),
        the SamplingParams defaults (vllm), or another folder's file."""
        self.mode = mode
        checkpoint_dir(checkpoint)  # before generation_config="auto" reads it as a folder
        self.tokenizer = load_tokenizer(checkpoint)
        self.sampling_defaults = load_sampling_defaults(checkpoint, generation_config)
        detok = (lambda ids: self.tokenizer.decode(ids)) if self.tokenizer else None

        def config(role: str) -> EngineConfig:
            return EngineConfig(
                role=role,
                mode=mode,
                prefill_semantics=prefill_semantics,
                boundary_policy=boundary_policy,
                block_size=block_size,
                kv_cache_bytes=kv_cache_bytes,
                enable_prefix_caching=enable_prefix_caching,
                eos_token_id=eos_id(self.tokenizer),
                scheduler=scheduler or SchedulerConfig(),
                num_spec_tokens=0 if role == "prefill" else num_spec_tokens,
                spec_confidence_threshold=spec_confidence_threshold,
                kv_wire_format=kv_wire_format,
                stream_prefix=stream_prefix and role == "prefill",
                enforce_eager=enforce_eager,
                cuda_graph_capture=cuda_graph_capture,
                cuda_graph_mode=cuda_graph_mode,
                warm_up=warm_up,
            )

        self.prefill: LLMEngine | None = None

        def engine(role: str) -> LLMEngine:
            model = self._load_model(role, checkpoint, modes.model_role(role, mode), device, dtype, weights)
            return LLMEngine(model, config(role), detok)

        if mode == "colocated":
            self.engine = engine("colocated")
        else:
            self.prefill = engine("prefill")
            self.engine = engine("decode")
        self.cfg = self.engine.cfg
        self._next_id = 0
        self._params: dict[str, SamplingParams] = {}  # requests at the prefill engine
        self._images: dict[str, list[ImageInput] | None] = {}  # and their images
        self.transfer_bytes: dict[str, int] = {}  # request -> size of the serialized prefix state it moved
        self.slices: dict[str, list[tuple[int, int]]] = {}  # streamed request -> [start, split) of each slice
        self._secret = secrets.token_bytes(32)  # seals the prefix states this process hands itself

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` samples with when given none (vLLM's name): the generation config's."""
        return SamplingParams(**self.sampling_defaults)

    def _load_model(
        self, engine_role: str, checkpoint: str | Path, role: str, device: str, dtype: torch.dtype, weights: str
    ):
        """The model of the ``engine_role`` engine (``ParallelLLM`` loads its sharded engine's share)."""
        return load_model(checkpoint, role, device, dtype, weights)

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        images: list[list[bytes | ImageInput]] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. ``images``: per prompt,
        its images (encoded bytes or ``ImageInput``), one per ``image_token_id`` placeholder in order;
        each placeholder becomes the image's span (docs/vision.md)."""
        if prompt_token_ids is None:
            if prompts is None:
                raise ValueError("give prompts or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("this checkpoint has no tokenizer.json: pass prompt_token_ids")
            prompts = [prompts] if isinstance(prompts, str) else prompts
            prompt_token_ids = [self.tokenizer.encode(p).ids for p in prompts]
        elif prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        params = sampling_params or self.get_default_sampling_params()
        params_list = params if isinstance(params, list) else [params] * len(prompt_token_ids)
        if images is not None and len(images) != len(prompt_token_ids):
            raise ValueError(f"images has {len(images)} entries for {len(prompt_token_ids)} prompts")
        ids = []
        for j, (toks, p) in enumerate(zip(prompt_token_ids, params_list, strict=True)):
            rid = str(self._next_id)
            self._next_id += 1
            ids.append(rid)
            if images is not None and images[j]:
                inputs = [decode_image(im, self.cfg) if isinstance(im, bytes) else im for im in images[j]]
                self.add(rid, expand_placeholders(self.cfg, list(toks), inputs), p, inputs)
            else:
                self.add(rid, toks, p)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in ids:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def add(
        self, rid: str, token_ids: list[int], params: SamplingParams, images: list[ImageInput] | None = None
    ) -> None:
        if self.prefill is None or modes.skips_prefill(self.mode, len(token_ids), self.cfg.window_size):
            self.engine.add_request(rid, token_ids, params, images=images)
        else:
            self.prefill.add_request(rid, token_ids, params, images=images)
            self._params[rid] = params
            self._images[rid] = images  # D takes them from the request too (as a server's D parses the body)

    def step(self) -> list[RequestOutput]:
        """One step of each engine; finished prefills move to the decode engine, serialized."""
        outs: list[RequestOutput] = []
        if self.prefill is not None:
            for out in self.prefill.step():
                if out.error:
                    outs.append(out)
                    continue
                state = self._cross(out.request_id, out.exported_state(), out.prompt_token_ids)
                if self.prefill.config.stream_prefix and not (out.finished and out.request_id not in self.slices):
                    self._stream(out, state)  # (a prefix in one piece is handed over whole, below)
                    continue
                first = out.outputs[0].token_ids[0] if out.outputs[0].token_ids else None
                first_lp = out.outputs[0].logprobs[0] if first is not None and out.outputs[0].logprobs else None
                params = self._params.pop(out.request_id)
                self.engine.add_request(
                    out.request_id,
                    out.prompt_token_ids,
                    params,
                    prefix_state=state,
                    first_token=first,
                    first_token_logprobs=first_lp,
                    images=self._images.pop(out.request_id, None),
                )
                self.prefill.release_transfer(out.request_id)
        outs.extend(self.engine.step())
        return outs

    def _cross(self, rid: str, state: PrefixState, prompt: list[int]) -> PrefixState:
        """What crosses the network: the bytes, sealed on P and verified on D (transfer.seal)."""
        tid = new_transfer_id()
        tag = seal(self._secret, tid, state)
        blob = state.serialize()
        self.transfer_bytes[rid] = self.transfer_bytes.get(rid, 0) + len(blob)
        got = PrefixState.deserialize(blob)
        verify(self._secret, tid, got, tag, prompt if got.start == 0 else [])
        return got

    def _stream(self, out, piece: PrefixState) -> None:
        """One slice of a streamed prefix: the first opens the request on D, each is written into
        D's cache as it arrives, the last lets D run and frees P's blocks."""
        rid = out.request_id
        if rid not in self.slices:
            self.engine.add_request(
                rid, out.prompt_token_ids, self._params[rid], prefix_stream=True, images=self._images.pop(rid, None)
            )
            self.slices[rid] = []
        self.slices[rid].append((piece.start, piece.split))
        self.engine.import_slice(rid, piece)
        if out.finished:
            self._params.pop(rid)
            self.prefill.release_transfer(rid)
