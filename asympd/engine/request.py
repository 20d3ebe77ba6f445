"""A request's state inside one engine, and what the engine reports about it.

Torch-free (tensors only in annotations): the planner runs the engine's scheduler on these requests
without importing torch.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asympd.engine.modes import Phase
from asympd.engine.sampling_params import SamplingParams
from asympd.model.depth import Depth

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # a stop token
    FINISHED_LENGTH = "length"  # max_tokens or max_seq_len
    FINISHED_ABORTED = "abort"
    FINISHED_EXPORTED = "exported"  # a prefill worker handed the prefix over
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (Status.WAITING, Status.RUNNING)


@dataclass(eq=False)  # an entity: identity, not field-by-field (the scheduler tests membership per step)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    phases: list[Phase]  # prompt rows this engine computes, in order
    imported: Any = None  # a PrefixState to write into this engine's cache first (decode worker)
    first_token: int | None = None  # sampled by the prefill worker (symmetric mode)
    sample_after_prompt: bool = True  # False on a prefill worker that only exports
    export_upto: int = 0  # prefill worker: positions whose global KV it hands over
    arrival_time: float = field(default_factory=time.monotonic)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    phase_index: int = 0
    cursor: int = 0  # next row of the current phase
    num_cached_import: int = 0  # leading imported positions already present (prefix cache hit)
    spec_enabled: bool = False  # this engine drafts for the request (speculative decoding on)
    spec_draft: list[int] = field(default_factory=list)  # drafts the next decode step verifies
    spec_draft_probs: torch.Tensor | None = None  # [len(spec_draft), vocab] for sampled requests
    generator: torch.Generator | None = None  # a seeded request's, on the model's device (LLMEngine.add_request)
    error: str | None = None
    scheduled_time: float | None = None  # first taken into a step: its wait in the queue ends here
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_reported: int = 0  # output tokens already sent as new_token_ids (a recompute must not resend them)
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_steps: int = 0
    exported: Any = None  # the PendingExport (engine/export.py) of the PrefixState a prefill worker produced
    exports: list[Any] = field(default_factory=list)  # every PendingExport out of its blocks, until freed
    streamed: int = 0  # prefill worker streaming its prefix: positions already handed over in slices
    stream_slices: bool = False  # prefill worker: hand the prefix over in slices (else whole, at the end)
    awaiting_import: bool = False  # decode worker: the streamed prefix has not fully arrived
    timings: dict[str, float] = field(default_factory=dict)
    images: list[Any] = field(default_factory=list)  # vision.ImageInput, spans in prompt order
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> its span rows (encoded here)
    imported_rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> image row P encoded

    def __post_init__(self) -> None:
        self.prompt_phases = list(self.phases)

    @property
    def cache_salt(self) -> str:
        """Part of the prefix-cache key: two prompts with the same ids but other images differ."""
        return "".join(f"|{im.start}:{im.digest}" for im in self.images)

    @property
    def image_spans(self) -> list[tuple[int, int]]:
        return [(im.start, im.end) for im in self.images]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # the engine reads these per request per step: without building all_token_ids, whose copy of the
    # whole history (prompt and output) costs O(context) each time (docs/performance.md §11)

    @property
    def num_tokens(self) -> int:
        """``len(all_token_ids)``."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        """``all_token_ids[-1]``."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def token_slice(self, lo: int, hi: int, extra: list[int] | None = None) -> list[int]:
        """``(all_token_ids + extra)[lo:hi]`` for 0 <= lo <= hi, copying only those positions."""
        n_p, n = len(self.prompt_token_ids), self.num_tokens
        out = self.prompt_token_ids[lo:hi] if lo < n_p else []
        if hi > n_p and lo < n:
            out = out + self.output_token_ids[max(lo - n_p, 0) : hi - n_p]
        if extra and hi > n:
            out = out + extra[max(lo - n, 0) : hi - n]
        return out

    @property
    def in_prompt(self) -> bool:
        return self.phase_index < len(self.phases)

    @property
    def import_len(self) -> int:
        return 0 if self.imported is None else self.imported.split

    def reset_for_recompute(self) -> None:
        """Preempted: every cached row is dropped and will be computed (or imported) again. Tokens
        already generated (all but the newest, which the next decode step feeds) are replayed as
        one chunk after the prompt phases."""
        n, out = self.num_prompt_tokens, len(self.output_token_ids)
        self.phases = list(self.prompt_phases)
        if out > 1:
            self.phases.append(Phase(n, n + out - 1, Depth.ALL, sample=False))
        self.phase_index = 0
        self.cursor = self.phases[0].lo if self.phases else 0
        self.spec_draft, self.spec_draft_probs = [], None  # the drafter's windows go with the slot
        self.num_preemptions += 1
        self.status = Status.WAITING


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)
    prefix_state: Any = None  # set by a prefill worker when the prefix is ready to hand over
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    prefix_export: Any = None  # prefix_state's PendingExport (engine/export.py): its bytes are valid after wait()

    def exported_state(self) -> Any:
        """``prefix_state`` once its copy is done (engine/export.py): read the bytes through this.
        Blocks until then; call it off an event loop."""
        if self.prefix_export is not None:
            self.prefix_export.wait()
        return self.prefix_state
