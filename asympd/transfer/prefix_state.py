"""What the prefill worker P hands the decode worker D when it stops at split s.

See docs/model.md §3: for each KV-source layer L, the compressed main KV ``ckv[L]`` and the
indexer keys ``idx[L]`` (n_L = s // ratio(L) rows each); when s is not a multiple of a source's
ratio, that compressor's open group (raw kv and score rows, fp32); and the prompt token ids.
Nothing else: no top-k selections, no draft state, and no SWA except in mode ``symmetric-windows``,
where P also ships every model layer's sliding window (``swa_kv[L]`` rows in the cache dtype and
their int64 positions ``swa_pos[L]``) so that D starts decoding without a replay.

On the wire a state is a versioned, self-describing set of contiguous buffers: a JSON header (format
version, metadata, and a table of ``{name, dtype, shape, nbytes, offset}``) plus the raw buffers.
The same header serves every data plane: TCP streams the buffers after it, NIXL lets D allocate
matching receive tensors from it and RDMA-read into them, and ``serialize`` frames both in one blob.
A receiver must call ``validate`` before writing anything into its cache.

``kv_format`` says how the compressed main KV and index keys cross the wire. ``fp4`` (what the engine
ships): the released cache formats, NVFP4 codes + E4M3 scales per 16 for ``ckv`` and MXFP4 codes +
UE8M0 scales per 32 for ``idx`` (buffers ``ckv.L`` / ``ckv_scale.L``, ``idx.L`` / ``idx_scale.L``;
transfer/kv_pack.py), lossless because the cache holds those values already. ``unpacked``: the cache
dtype as it is. In memory a state always holds the unpacked values; packing happens in
``to_buffers`` and unpacking in ``from_buffers``. The open compressor pair, the token ids and the
windows are never packed (the reference does not quantize them).

With images (docs/vision.md) a state also carries the prompt's image spans (``image_spans``, int64
``[n, 2]``: start and length of each) and the embedding rows of the image rows D computes but P
encoded (``image_pos`` int64 ``[k]``, ``image_rows`` ``[k, dim]`` in the state dtype): the tail of
an image that straddles D's first row, so D never re-encodes an image P already encoded. They
travel in the slice that ends at the split.

A state may be one *slice* of a prefix streamed as P's chunked prefill advances (transfer/stream.py):
``start`` > 0 means its ckv/idx hold entries ``[start // r, split // r)`` only, and it carries no
token ids (the slice at ``start`` 0 does). A whole state is the slice with ``start`` 0.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import threading
import zlib
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..config import ModelConfig
from . import kv_pack

FORMAT_VERSION = 2  # 2: kv_format (the released FP4 cache formats on the wire)
HEADER_MAGIC = "asympd.prefix_state"  # inside the JSON header (the to_buffers path)
BLOB_MAGIC = b"ASYMPDPS"  # first bytes of a serialized blob
# magic, format version, header length, header crc32, payload length, payload crc32
_PREFIX = struct.Struct("<8sIIIQI")
_ALIGN = 64  # payload offsets are 64-byte aligned so any receiver can view them in place
_MAX_HEADER = 16 << 20  # a header is a few KB; anything near this is corruption

# dtype name (as written in headers) -> torch dtype; names are torch's own, without "torch."
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,  # packed formats (e.g. NVFP4/MXFP4 bytes)
    "float8_e8m0fnu": torch.float8_e8m0fnu,  # MXFP4 scales
    "int64": torch.int64,
}
# dtypes the compressed KV / index keys may be stored in
CACHE_DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")
PAIR_DTYPE = "float32"  # the open group of a compressor is kept in fp32 (docs/model.md §3)
TOKEN_DTYPE = "int64"
_WINDOW_KINDS = ("swa_kv", "swa_pos")  # optional: only a state that ships the windows has them
_KINDS = ("ckv", "idx", "pair_kv", "pair_score", *_WINDOW_KINDS)
_IMAGE_NAMES = ("image_spans", "image_pos", "image_rows")  # optional, layer-less
_META_KEYS = ("split", "num_prompt_tokens", "boundary_policy", "mode", "dtype", "fingerprint", "kv_format", "start")
KV_FORMATS = ("fp4", "unpacked")
# packed kinds: the format of each, and the name of its scale buffer on the wire
_PACKED = {"ckv": kv_pack.NVFP4, "idx": kv_pack.MXFP4}
# CUDA priority of the hand-off's own streams (P's pack, D's unpack); lower is higher, and torch
# maps it into the device's range. Their kernels are few and small: scheduled ahead of the pending
# blocks of the steps in flight, they do not wait for a prefill's kernels to drain first.
HANDOFF_STREAM_PRIORITY = -1
_SCALE_KINDS = tuple(f"{k}_scale" for k in _PACKED)


class PrefixStateError(ValueError):
    """A prefix state that must not be written into a cache: malformed, corrupted or mismatched."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """The header name of a torch dtype ("bfloat16"), accepting names too."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise PrefixStateError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
        return name
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise PrefixStateError(f"dtype {dtype} is not supported (supported: {', '.join(DTYPES)})")


def model_fingerprint(cfg: ModelConfig, checkpoint_id: str, dtype: torch.dtype | str) -> str:
    """A short sha256 of what makes two workers' caches interchangeable: the model schema, the
    checkpoint and the cache's numeric format. ``max_seq_len`` is a runtime limit, not a shape,
    so it is left out: P and D may bound lengths differently and still share state."""
    schema = cfg.to_dict()
    schema.pop("max_seq_len", None)
    text = json.dumps(
        {"config": schema, "checkpoint": checkpoint_id, "dtype": dtype_name(dtype), "format": FORMAT_VERSION},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def expected_buffers(
    cfg: ModelConfig, split: int, num_tokens: int, dtype: torch.dtype | str, start: int = 0
) -> dict[str, tuple]:
    """name -> (dtype name, shape) of every buffer a state (or the slice from ``start``) at ``split``
    must carry under ``cfg``."""
    cache_dtype = dtype_name(dtype)
    out: dict[str, tuple] = {}
    for layer in cfg.kv_source_layers:
        r = cfg.ratio(layer)
        out[f"ckv.{layer}"] = (cache_dtype, (split // r - start // r, cfg.head_dim))
        out[f"idx.{layer}"] = (cache_dtype, (split // r - start // r, cfg.index_head_dim))
    for layer in cfg.kv_source_layers:
        r = cfg.ratio(layer)
        if r > 1 and split % r:
            out[f"pair_kv.{layer}"] = (PAIR_DTYPE, (split % r, cfg.head_dim))
            out[f"pair_score.{layer}"] = (PAIR_DTYPE, (split % r, cfg.head_dim))
    out["token_ids"] = (TOKEN_DTYPE, (num_tokens if start == 0 else 0,))
    return out


def _parse_name(name: str) -> tuple[str, int | None]:
    if name == "token_ids" or name in _IMAGE_NAMES:
        return name, None
    kind, _, layer = name.partition(".")
    if kind not in _KINDS + _SCALE_KINDS or not layer.isdigit():
        raise PrefixStateError(f"unknown buffer name {name!r}")
    return kind, int(layer)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class PrefixState:
    """The prefix P hands D at split ``split`` (see module docstring). Layers are dict keys."""

    split: int
    token_ids: torch.Tensor
    ckv: dict[int, torch.Tensor]
    idx: dict[int, torch.Tensor]
    pair_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    pair_score: dict[int, torch.Tensor] = field(default_factory=dict)
    swa_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    swa_pos: dict[int, torch.Tensor] = field(default_factory=dict)
    fingerprint: str = ""
    dtype: str = "bfloat16"
    boundary_policy: str = "carry_pair"
    mode: str = "asymmetric"
    num_prompt_tokens: int = -1  # -1: taken from token_ids
    kv_format: str = "unpacked"  # how ckv/idx cross the wire (module docstring)
    start: int = 0  # > 0: a slice of a streamed prefix (module docstring)
    version: int = FORMAT_VERSION
    image_spans: torch.Tensor | None = None  # [n, 2] int64 (start, length); None: no images
    image_pos: torch.Tensor | None = None  # [k] int64 positions of the rows below
    image_rows: torch.Tensor | None = None  # [k, dim] embeddings of image rows P encoded for D
    # P on a GPU: the copy still filling these buffers (engine/export.py); every read through this
    # class (named_buffers and all that build on it) waits for it first
    pending: Any = field(default=None, repr=False, compare=False)
    # P on a GPU: the CUDA stream its hand-off packs and copies on (engine/export.py), never the
    # compute stream, where each host sync of the pack would wait for the step in progress
    pack_stream: Any = field(default=None, repr=False, compare=False)
    # the wire buffers once made: packed once, by whoever asks first (P's seal, then its send); a
    # state's buffers are not changed after that (a changed state is a new one: ``to``, ``from_buffers``)
    _wire: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _wire_host: dict[str, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)
    _wire_lock: Any = field(default_factory=threading.Lock, init=False, repr=False, compare=False)
    # a received state: the header bytes and buffers exactly as they crossed the wire, set by the
    # transport that read them. D authenticates these (transfer/seal.py ``verify``) instead of packing
    # the unpacked values again, which costs a CPU several times the unpacking
    arrived: tuple[bytes, list[torch.Tensor]] | None = field(default=None, init=False, repr=False, compare=False)
    # a received state: how long its bytes took to arrive and to unpack (``arrive_s``, ``unpack_s``)
    # and D's checks (``check_s``), in seconds, for the request's TTFT split (tools/ttft_breakdown.py)
    receipt: dict[str, float] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0 and self.start > 0:
            raise PrefixStateError("a slice (start > 0) carries no token ids: give num_prompt_tokens")
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = int(self.token_ids.numel())
        self.dtype = dtype_name(self.dtype)
        if self.kv_format not in KV_FORMATS:
            raise PrefixStateError(f"unknown kv_format {self.kv_format!r} (expected one of {', '.join(KV_FORMATS)})")

    # ---- construction ----------------------------------------------------------------------------

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        split: int,
        token_ids: torch.Tensor | Iterable[int],
        *,
        fingerprint: str,
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str = "cpu",
        boundary_policy: str = "carry_pair",
        mode: str = "asymmetric",
        kv_format: str = "unpacked",
    ) -> PrefixState:
        """Empty buffers of the right shapes for ``cfg`` and ``split``, for P to fill."""
        tokens = torch.as_tensor(token_ids, dtype=torch.int64).reshape(-1).clone()
        buffers = {
            name: torch.empty(shape, dtype=DTYPES[dt], device=device)
            for name, (dt, shape) in expected_buffers(cfg, split, tokens.numel(), dtype).items()
            if name != "token_ids"
        }
        return cls._from_named(
            buffers,
            {
                "split": split,
                "fingerprint": fingerprint,
                "dtype": dtype_name(dtype),
                "boundary_policy": boundary_policy,
                "mode": mode,
                "num_prompt_tokens": tokens.numel(),
                "kv_format": kv_format,
                "version": FORMAT_VERSION,
            },
            tokens,
        )

    @classmethod
    def _from_named(cls, buffers: Mapping[str, torch.Tensor], meta: Mapping[str, Any], tokens: torch.Tensor):
        groups: dict[str, dict[int, torch.Tensor]] = {k: {} for k in _KINDS}
        images = {n: buffers[n] for n in _IMAGE_NAMES if n in buffers}
        for name, t in buffers.items():
            kind, layer = _parse_name(name)
            if layer is not None:
                groups[kind][layer] = t
        return cls(token_ids=tokens, **groups, **images, **meta)

    # ---- views -----------------------------------------------------------------------------------

    def named_buffers(self) -> dict[str, torch.Tensor]:
        """Every buffer by wire name, in a fixed order (the order of the header table)."""
        if self.pending is not None:
            self.pending.wait()
        out: dict[str, torch.Tensor] = {}
        for kind in _KINDS:
            for layer, t in sorted(getattr(self, kind).items()):
                out[f"{kind}.{layer}"] = t
        out["token_ids"] = self.token_ids
        for name in _IMAGE_NAMES:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers as held in memory (unpacked)."""
        return sum(_nbytes(t) for t in self.named_buffers().values())

    @property
    def wire_nbytes(self) -> int:
        """Bytes of the buffers on the wire in this state's ``kv_format`` (without header or padding)."""
        total = 0
        for name, t in self.named_buffers().items():
            kind, _ = _parse_name(name)
            if self.kv_format == "fp4" and kind in _PACKED:
                total += t.size(0) * _PACKED[kind].bytes_per_entry(t.size(-1))
            else:
                total += _nbytes(t)
        return total

    def wire_buffers(self, host: bool = False) -> dict[str, torch.Tensor]:
        """The buffers as they cross the wire: ``named_buffers`` with ckv/idx packed under ``fp4``
        (codes under the same name, then their scales). Raises PrefixStateError if a value is not
        on its format's grid, naming the buffer. Made once and kept (the buffers are read-only);
        ``host``: every buffer in host memory, copied there on ``pack_stream`` where one is set."""
        with self._wire_lock:
            if self._wire is None:
                with self._on_pack_stream():
                    self._wire = self._make_wire()
            if not host:
                return dict(self._wire)
            if self._wire_host is None:
                with self._on_pack_stream():  # .cpu() waits for this stream's work only
                    self._wire_host = {n: t.cpu() for n, t in self._wire.items()}
            return dict(self._wire_host)

    @contextmanager
    def _on_pack_stream(self) -> Iterator[None]:
        if self.pack_stream is None:
            yield
            return
        with torch.cuda.stream(self.pack_stream):
            yield

    def _make_wire(self) -> dict[str, torch.Tensor]:
        if self.kv_format == "unpacked":
            return self.named_buffers()
        out: dict[str, torch.Tensor] = {}
        for name, t in self.named_buffers().items():
            kind, layer = _parse_name(name)
            if kind not in _PACKED:
                out[name] = t
                continue
            try:
                out[name], out[f"{kind}_scale.{layer}"] = kv_pack.pack(t, _PACKED[kind])
            except kv_pack.KVPackError as e:
                raise PrefixStateError(f"{kind}[{layer}]: {e}") from None
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "num_prompt_tokens": self.num_prompt_tokens,
            "boundary_policy": self.boundary_policy,
            "mode": self.mode,
            "dtype": self.dtype,
            "fingerprint": self.fingerprint,
            "kv_format": self.kv_format,
            "start": self.start,
        }

    def to(self, device: torch.device | str) -> PrefixState:
        moved = {n: t.to(device) for n, t in self.named_buffers().items()}
        tokens = moved.pop("token_ids")
        return self._from_named(moved, {**self.metadata(), "version": self.version}, tokens)

    def equal(self, other: PrefixState) -> bool:
        """Bit-exact equality of metadata and every buffer (NaN payloads included)."""
        a, b = self.named_buffers(), other.named_buffers()
        if self.metadata() != other.metadata() or self.version != other.version or a.keys() != b.keys():
            return False
        return all(
            x.dtype == y.dtype and x.shape == y.shape and np.array_equal(tensor_bytes(x), tensor_bytes(y))
            for x, y in ((a[n], b[n]) for n in a)
        )

    # ---- buffers ---------------------------------------------------------------------------------

    def to_buffers(self, host: bool = False) -> tuple[bytes, list[torch.Tensor]]:
        """(JSON header, contiguous buffers in table order). Offsets lay the buffers out in one
        64-byte-aligned payload, which is how ``serialize`` and the TCP plane ship them. ``host``:
        the buffers in host memory (what hashing and sockets read), else where they were made."""
        table, buffers, offset = [], [], 0
        for name, t in self.wire_buffers(host).items():
            t = t.detach().contiguous()
            n = _nbytes(t)
            table.append(
                {"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape), "nbytes": n, "offset": offset}
            )
            buffers.append(t)
            offset += -(-n // _ALIGN) * _ALIGN
        header = {
            "magic": HEADER_MAGIC,
            "version": self.version,
            "metadata": self.metadata(),
            "payload_nbytes": offset,
            "buffers": table,
        }
        return json.dumps(header, separators=(",", ":")).encode(), buffers

    @classmethod
    def from_buffers(
        cls, header: bytes | Mapping[str, Any], buffers: list[torch.Tensor], device: torch.device | str | None = None
    ) -> PrefixState:
        """Rebuild a state from ``to_buffers`` output. Buffers may be the typed tensors or flat
        uint8 tensors of the right size (what a receiver that allocated raw bytes has). ``device``
        (fp4): move the packed ckv/idx there and unpack them there (D's GPU: 3.6x fewer bytes over
        PCIe than the values, and no CPU time), on the current stream; the rest stays put."""
        parsed = parse_header(header)
        table = parsed["buffers"]
        if len(buffers) != len(table):
            raise PrefixStateError(f"header lists {len(table)} buffers, got {len(buffers)}")
        named: dict[str, torch.Tensor] = {}
        for entry, t in zip(table, buffers, strict=True):
            dt = DTYPES[entry["dtype"]]
            if not isinstance(t, torch.Tensor) or _nbytes(t) != entry["nbytes"]:
                got = _nbytes(t) if isinstance(t, torch.Tensor) else type(t).__name__
                raise PrefixStateError(f"buffer {entry['name']} has {got} bytes, header says {entry['nbytes']}")
            if t.dtype == torch.uint8 and dt != torch.uint8:
                t = t.contiguous().view(dt)
            if t.dtype != dt:
                raise PrefixStateError(f"buffer {entry['name']} is {dtype_name(t.dtype)}, header says {entry['dtype']}")
            named[entry["name"]] = t.reshape(entry["shape"])
        tokens = named.pop("token_ids")
        meta = {k: parsed["metadata"][k] for k in _META_KEYS}
        if meta["kv_format"] == "fp4":
            named = _unpack_named(named, meta["dtype"], device)
        elif any(_parse_name(n)[0] in _SCALE_KINDS for n in named):
            raise PrefixStateError("scale buffers in a state whose kv_format is unpacked")
        return cls._from_named(named, {**meta, "version": parsed["version"]}, tokens)

    # ---- one framed blob --------------------------------------------------------------------------

    def serialize(self) -> bytes:
        """magic | version | header length | header crc32 | payload length | payload crc32 | header |
        payload. The checksums make a corrupted blob (disk, copy) fail loudly instead of loading."""
        header, buffers = self.to_buffers(host=True)
        payload_nbytes = json.loads(header)["payload_nbytes"]
        parts: list[bytes | memoryview] = []
        written, crc = 0, 0
        for t in buffers:
            n = _nbytes(t)
            pad = -(-n // _ALIGN) * _ALIGN - n
            for part in (memoryview(tensor_bytes(t)) if n else b"", bytes(pad)):
                if len(part):
                    parts.append(part)
                    crc = zlib.crc32(part, crc)
            written += n + pad
        assert written == payload_nbytes
        prefix = _PREFIX.pack(BLOB_MAGIC, self.version, len(header), zlib.crc32(header), payload_nbytes, crc)
        return b"".join([prefix, header, *parts])

    @classmethod
    def deserialize(cls, blob: bytes | bytearray | memoryview) -> PrefixState:
        """Inverse of ``serialize``; any corruption raises PrefixStateError. Buffers are copies."""
        view = memoryview(blob).cast("B")
        if len(view) < _PREFIX.size:
            raise PrefixStateError(f"truncated blob: {len(view)} bytes, shorter than the {_PREFIX.size}-byte prefix")
        magic, version, header_len, header_crc, payload_nbytes, payload_crc = _PREFIX.unpack_from(view)
        if magic != BLOB_MAGIC:
            raise PrefixStateError(f"bad magic {bytes(magic)!r}: not a prefix state blob (expected {BLOB_MAGIC!r})")
        _check_version(version)
        if header_len > _MAX_HEADER or len(view) < _PREFIX.size + header_len:
            raise PrefixStateError(f"truncated blob: header of {header_len} bytes does not fit in {len(view)} bytes")
        header = bytes(view[_PREFIX.size : _PREFIX.size + header_len])
        if zlib.crc32(header) != header_crc:
            raise PrefixStateError("header checksum mismatch: the header is corrupted")
        parsed = parse_header(header)
        if parsed["payload_nbytes"] != payload_nbytes:
            raise PrefixStateError(
                f"payload length {payload_nbytes} in the prefix disagrees with {parsed['payload_nbytes']} in the header"
            )
        payload = view[_PREFIX.size + header_len :]
        if len(payload) != payload_nbytes:
            kind = "truncated" if len(payload) < payload_nbytes else "oversized"
            raise PrefixStateError(f"{kind} payload: expected {payload_nbytes} bytes, got {len(payload)}")
        if zlib.crc32(payload) != payload_crc:
            raise PrefixStateError("payload checksum mismatch: the payload is corrupted")
        buffers = []
        for entry in parsed["buffers"]:
            raw = torch.empty(entry["nbytes"], dtype=torch.uint8)
            if entry["nbytes"]:
                raw.numpy()[:] = np.frombuffer(payload, dtype=np.uint8, count=entry["nbytes"], offset=entry["offset"])
            buffers.append(raw)
        state = cls.from_buffers(parsed, buffers)
        state.arrived = (header, buffers)  # a blob is received bytes too: its tag is checked over them
        return state

    # ---- the receiver's check ----------------------------------------------------------------------

    def validate(self, cfg: ModelConfig, expected_fingerprint: str) -> None:
        """Everything D must check before writing this state into its cache; raises
        PrefixStateError naming the first thing that is wrong."""
        _check_version(self.version)
        if self.fingerprint != expected_fingerprint:
            raise PrefixStateError(
                f"fingerprint mismatch: state has {self.fingerprint!r}, receiver expects {expected_fingerprint!r}"
            )
        if self.dtype not in CACHE_DTYPES:
            raise PrefixStateError(f"dtype {self.dtype!r} is not a cache dtype (expected one of {CACHE_DTYPES})")
        for key in ("boundary_policy", "mode"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise PrefixStateError(f"{key} must be a non-empty name")
        if self.split < 0:
            raise PrefixStateError(f"split {self.split} is negative")
        if not 0 <= self.start <= self.split:
            raise PrefixStateError(f"slice start {self.start} is outside [0, split {self.split}]")
        want_tokens = self.num_prompt_tokens if self.start == 0 else 0
        if self.token_ids.dim() != 1 or self.token_ids.numel() != want_tokens:
            why = "(num_prompt_tokens)" if self.start == 0 else "(a slice after the first carries no token ids)"
            raise PrefixStateError(
                f"token_ids has shape {tuple(self.token_ids.shape)}, expected ({want_tokens},) {why}"
            )
        if self.num_prompt_tokens < self.split:
            raise PrefixStateError(f"num_prompt_tokens {self.num_prompt_tokens} is smaller than split {self.split}")
        if self.num_prompt_tokens > cfg.max_seq_len:
            raise PrefixStateError(f"num_prompt_tokens {self.num_prompt_tokens} exceeds max_seq_len {cfg.max_seq_len}")
        expected = expected_buffers(cfg, self.split, self.num_prompt_tokens, self.dtype, self.start)
        have = self.named_buffers()
        for kind in _KINDS:
            if kind in _WINDOW_KINDS:
                continue
            want_layers = sorted(_parse_name(n)[1] for n in expected if n.startswith(kind + "."))
            got_layers = sorted(getattr(self, kind))
            if want_layers != got_layers:
                why = ""
                if kind.startswith("pair"):
                    why = f" (split {self.split}: an open group for each source whose ratio does not divide it)"
                raise PrefixStateError(f"{kind} has layers {got_layers}, expected {want_layers}{why}")
        for name, (dt, shape) in expected.items():
            t = have[name]
            got = str(t.dtype).removeprefix("torch.")
            if got != dt:
                raise PrefixStateError(f"{_display(name)} dtype is {got}, expected {dt}")
            if tuple(t.shape) != shape:
                why = _shape_reason(cfg, name, self.split, self.start)
                raise PrefixStateError(f"{_display(name)} has shape {tuple(t.shape)}, expected {shape}{why}")
        if self.token_ids.numel() and (self.token_ids.min() < 0 or self.token_ids.max() >= cfg.vocab_size):
            raise PrefixStateError(f"token_ids hold ids outside the vocabulary [0, {cfg.vocab_size})")
        if self.swa_kv or self.swa_pos:
            self._validate_windows(cfg)
        if any(getattr(self, n) is not None for n in _IMAGE_NAMES):
            self._validate_images(cfg)

    def _validate_images(self, cfg: ModelConfig) -> None:
        """Image spans ordered, disjoint and inside the prompt (on ``image_token_id`` rows when the
        token ids are here); each shipped row inside a span, positions strictly ascending."""
        spans, pos, rows = self.image_spans, self.image_pos, self.image_rows
        if spans is None or pos is None or rows is None:
            raise PrefixStateError("image_spans, image_pos and image_rows travel together")
        if spans.dtype != torch.int64 or spans.dim() != 2 or spans.size(1) != 2:
            raise PrefixStateError(f"image_spans is {tuple(spans.shape)} {spans.dtype}, expected (n, 2) int64")
        if pos.dtype != torch.int64 or pos.dim() != 1:
            raise PrefixStateError(f"image_pos is {tuple(pos.shape)} {pos.dtype}, expected (k,) int64")
        if str(rows.dtype).removeprefix("torch.") != self.dtype or tuple(rows.shape) != (pos.numel(), cfg.dim):
            raise PrefixStateError(
                f"image_rows is {tuple(rows.shape)} {rows.dtype}, expected ({pos.numel()}, {cfg.dim}) {self.dtype}"
            )
        n, prev = self.num_prompt_tokens, 0
        inside = torch.zeros(n, dtype=torch.bool)
        for start, length in spans.tolist():
            if start < prev or length < 3 or start + length > n:
                raise PrefixStateError(f"image span ({start}, {length}) overlaps another or leaves the prompt")
            inside[start : start + length] = True
            prev = start + length
        if self.token_ids.numel() and not torch.equal(inside, self.token_ids == cfg.image_token_id):
            raise PrefixStateError(f"image spans do not match the prompt's image token {cfg.image_token_id} rows")
        if pos.numel() and (pos[0] < 0 or pos[-1] >= n or (pos.diff() <= 0).any() or not inside[pos].all()):
            raise PrefixStateError("image_pos must ascend strictly and lie inside the image spans")
        if not torch.isfinite(rows.float()).all():
            raise PrefixStateError("image_rows hold a non-finite value")

    def _validate_windows(self, cfg: ModelConfig) -> None:
        """Shipped windows: one per model layer, each holding at least the last min(W, N) prompt rows."""
        layers = list(range(cfg.n_layers))
        for kind in _WINDOW_KINDS:
            if sorted(getattr(self, kind)) != layers:
                raise PrefixStateError(f"{kind} has layers {sorted(getattr(self, kind))}, expected {layers}")
        n = self.num_prompt_tokens
        need = torch.arange(max(n - cfg.window_size, 0), n)
        for layer in layers:
            kv, pos = self.swa_kv[layer], self.swa_pos[layer]
            if str(kv.dtype).removeprefix("torch.") != self.dtype or kv.dim() != 2 or kv.size(1) != cfg.head_dim:
                raise PrefixStateError(
                    f"swa_kv[{layer}] is {tuple(kv.shape)} {kv.dtype}, expected (rows, {cfg.head_dim}) {self.dtype}"
                )
            if pos.dtype != torch.int64 or tuple(pos.shape) != (kv.size(0),):
                raise PrefixStateError(
                    f"swa_pos[{layer}] is {tuple(pos.shape)} {pos.dtype}, expected ({kv.size(0)},) int64"
                )
            if pos.numel() and (pos[0] < 0 or pos[-1] != n - 1 or (pos.diff() <= 0).any()):
                raise PrefixStateError(f"swa_pos[{layer}] must ascend strictly within [0, {n}) and end at {n - 1}")
            if not torch.isin(need, pos).all():
                raise PrefixStateError(f"swa_kv[{layer}] does not hold the last {need.numel()} prompt rows")


def _unpack_named(
    named: dict[str, torch.Tensor], dtype: str, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """The fp4 wire buffers back to cache values in ``dtype``: every packed buffer needs its scales
    and every scale buffer its codes; a mismatch or an invalid scale is a PrefixStateError.

    Each kind's layers are unpacked together, in one batch (one copy to ``device`` and one check
    of the scales for all of them): a D on a GPU shares it with the steps in flight, P's among them
    where they share one, and every kernel and host sync of the unpack waits its turn there."""
    if dtype not in DTYPES:
        raise PrefixStateError(f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})")
    out: dict[str, torch.Tensor] = {}
    batches: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {kind: [] for kind in _PACKED}
    for name, t in named.items():
        kind, layer = _parse_name(name)
        if kind in _SCALE_KINDS:
            if kind.removesuffix("_scale") + f".{layer}" not in named:
                raise PrefixStateError(f"{_display(name)} has no codes buffer")
            continue
        if kind not in _PACKED:
            out[name] = t
            continue
        scales = named.get(f"{kind}_scale.{layer}")
        if scales is None:
            raise PrefixStateError(f"packed {_display(name)} arrived without its scales ({kind}_scale.{layer})")
        if t.dtype != torch.uint8:
            raise PrefixStateError(f"packed {_display(name)} is {dtype_name(t.dtype)}, expected uint8 codes")
        out[name] = t  # replaced below, in this order
        batches[kind].append((name, t, scales))
    for kind, entries in batches.items():
        for name, values in _unpack_batch(entries, _PACKED[kind], DTYPES[dtype], device):
            out[name] = values
    return out


def _unpack_batch(
    entries: list[tuple[str, torch.Tensor, torch.Tensor]],
    fmt: kv_pack.FP4Format,
    dtype: torch.dtype,
    device: torch.device | str | None,
) -> list[tuple[str, torch.Tensor]]:
    """(name, codes, scales) of one format -> (name, values in ``dtype``) on ``device``:
    concatenated when their shapes allow it, the scales checked where they arrived (the host, so
    no device sync), moved once, unpacked once (one kernel on a GPU: ``kv_pack.unpack``), split
    back by rows. A malformed buffer is named."""
    if not entries:
        return []
    codes, scales = [c for _, c, _ in entries], [s for _, _, s in entries]
    batched = len(entries) > 1 and all(
        c.dim() == 2
        and s.dim() == 2
        and c.shape[1:] == codes[0].shape[1:]
        and s.shape[1:] == scales[0].shape[1:]
        and c.size(0) == s.size(0)
        and s.dtype == fmt.scale_dtype
        for c, s in zip(codes, scales, strict=True)
    )
    if batched:
        rows = [c.size(0) for c in codes]
        c, s = torch.cat(codes), torch.cat(scales)
        try:
            kv_pack.check_scales(s, fmt)
        except kv_pack.KVPackError:
            pass  # the buffer-by-buffer pass below names the one at fault
        else:
            if device is not None:
                c, s = c.to(device), s.to(device)
            values = kv_pack.unpack(c, s, fmt, dtype, checked=True)
            return list(zip([n for n, _, _ in entries], values.split(rows), strict=True))
    out = []
    for name, c, s in entries:
        if device is not None:
            c, s = c.to(device), s.to(device)
        try:
            out.append((name, kv_pack.unpack(c, s, fmt, dtype)))
        except kv_pack.KVPackError as e:
            raise PrefixStateError(f"packed {_display(name)}: {e}") from None
    return out


def _display(name: str) -> str:
    kind, layer = _parse_name(name)
    return name if layer is None else f"{kind}[{layer}]"


def _shape_reason(cfg: ModelConfig, name: str, split: int, start: int = 0) -> str:
    kind, layer = _parse_name(name)
    if layer is None:
        return ""
    r = cfg.ratio(layer)
    width = "index_head_dim" if kind == "idx" else "head_dim"
    rows = f"split {split} // ratio {r}" if kind in ("ckv", "idx") else f"split {split} % ratio {r}"
    if start and kind in ("ckv", "idx"):
        rows += f" - start {start} // ratio {r}"
    return f" (rows = {rows}, width = {width})"


def _check_version(version: Any) -> None:
    if version != FORMAT_VERSION:
        raise PrefixStateError(f"unsupported format version {version!r} (this build reads version {FORMAT_VERSION})")


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A uint8 numpy view of a tensor's bytes (any dtype, bf16 included); zero-copy for a
    contiguous CPU tensor, a host copy otherwise."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def parse_header(header: bytes | Mapping[str, Any]) -> dict[str, Any]:
    """Decode and structurally check a header: magic, version, and a buffer table whose sizes,
    dtypes and offsets are self-consistent. Semantic checks against a model live in ``validate``."""
    if isinstance(header, Mapping):
        parsed: Any = dict(header)
    else:
        try:
            parsed = json.loads(bytes(header).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PrefixStateError(f"malformed header: not JSON ({e})") from None
    if not isinstance(parsed, dict) or parsed.get("magic") != HEADER_MAGIC:
        got = parsed.get("magic") if isinstance(parsed, dict) else type(parsed).__name__
        raise PrefixStateError(f"bad header magic {got!r} (expected {HEADER_MAGIC!r})")
    _check_version(parsed.get("version"))
    try:
        meta = parsed["metadata"]
        table = parsed["buffers"]
        payload = parsed["payload_nbytes"]
        for key, kind in (
            ("split", int),
            ("num_prompt_tokens", int),
            ("boundary_policy", str),
            ("mode", str),
            ("dtype", str),
            ("fingerprint", str),
            ("kv_format", str),
            ("start", int),
        ):
            if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
                raise PrefixStateError(f"malformed header: metadata {key} is {meta[key]!r}")
        if meta["kv_format"] not in KV_FORMATS:
            raise PrefixStateError(f"malformed header: kv_format {meta['kv_format']!r} (expected one of {KV_FORMATS})")
        if not isinstance(payload, int) or payload < 0:
            raise PrefixStateError(f"malformed header: payload_nbytes is {payload!r}")
        names = set()
        for entry in table:
            name, dt, shape, n, off = (entry[k] for k in ("name", "dtype", "shape", "nbytes", "offset"))
            _parse_name(name)
            if name in names:
                raise PrefixStateError(f"malformed header: buffer {name} listed twice")
            names.add(name)
            if dt not in DTYPES:
                raise PrefixStateError(f"malformed header: buffer {name} has unknown dtype {dt!r}")
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise PrefixStateError(f"malformed header: buffer {name} has shape {shape!r}")
            want = math.prod(shape) * DTYPES[dt].itemsize
            if n != want:
                raise PrefixStateError(f"malformed header: buffer {name} says {n} bytes, its shape needs {want}")
            if not isinstance(off, int) or off < 0 or off % _ALIGN or off + n > payload:
                raise PrefixStateError(f"malformed header: buffer {name} at offset {off!r} overruns the payload")
        if "token_ids" not in names:
            raise PrefixStateError("malformed header: no token_ids buffer")
    except PrefixStateError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise PrefixStateError(f"malformed header: {type(e).__name__} {e}") from None
    return parsed
