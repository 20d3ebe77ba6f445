#!/usr/bin/env python3
"""Check numerically that asympd's model computes what the DeepSeek-V4.1-Flash reference does.

The reference is the released ``inference/model.py`` (with CPU ports of its kernels), as vendored in
tenstorrent/tt-metal ``models/demos/deepseek_v3_d_p/reference/deepseek_v41/``. This script does not
contain any of that code: it imports it from ``--reference-dir`` (a directory that holds the
``deepseek_v41`` package) and only wraps it. See docs/reference-check.md for how to obtain it.

What it does, on one checkpoint written in the released layout (e.g. by ``make-checkpoint``):

1. builds the reference ``Transformer(ModelArgs(...))`` from the checkpoint's config.json under a
   bf16 default dtype (as upstream ``generate.py`` does), loads the checkpoint's tensors into it by
   name -- converting where the reference keeps a weight in another dtype than the file (listed in
   the output) -- and gives it the checkpoint's tokenizer.json for the Engram token map;
2. builds ours with ``asympd.model.loader.load_model(..., role="full")`` in bf16 (and in fp32 for
   context) and runs it with one ``Chunk`` per call over a ``DenseSequenceKV`` (``Depth.ALL``,
   floors 0: the ``full`` semantics);
3. for each prompt length: (a) one-shot prefill, comparing the logits of every position;
   (b) then ``--decode-steps`` single-token decode steps (each side fed the same token: the
   reference's greedy choice), comparing each step's logits;
4. to localize differences: the residual stream after every layer, and after prefill and after the
   last decode step the caches -- each KV source's compressed KV, its indexer keys, and every
   layer's sliding-window KV -- read from both;
5. resynchronised decode and the DSpark drafter (``--resync-lengths``, ``--resync-steps``): at every
   decode position p both sides start again from the same one-shot prefill of ``hist[:p]``, decode p,
   and draft the block at p+1 (ours: ``DSpark.draft``; the reference: ``Transformer.forward_spec``),
   comparing the drafts, their Markov-biased logits and the confidence logits -- once from each
   side's own target states, once with our drafter fed the reference's (the drafter alone).

Two known, non-mathematical differences can be removed on the reference side, without touching its
files, to see what remains (see docs/reference-check.md):

- ``--stable-reference-topk``: the reference's ``topk`` leaves the order of ties implementation-
  defined, ours gives ties to the lowest index; bf16 index scores tie often (relu zeros);
- ``--patch-reference-index-keys``: as released, on a decode step that completes no ratio-2 group, a
  ratio-2 key owner's indexer reads the key cache another layer left in the shared slot.

Run from the repository root:

    .venv/bin/python tools/check_against_reference.py --reference-dir /tmp/refcheck --checkpoint CKPT
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from asympd.kv.dense import DenseSequenceKV  # noqa: E402
from asympd.model.dspark import Draft, DraftSegment  # noqa: E402
from asympd.model.loader import load_model  # noqa: E402
from asympd.model.transformer import Chunk, Depth  # noqa: E402

BLOCK = 32  # the checkpoint's FP8 tile edge


# ---- the reference side ---------------------------------------------------------------------------


def import_reference(reference_dir: Path) -> types.ModuleType:
    """The reference ``model`` module, imported as ``deepseek_v41.model`` from ``reference_dir``."""
    pkg = reference_dir / "deepseek_v41"
    if not (pkg / "model.py").is_file():
        raise SystemExit(f"{pkg}/model.py not found: --reference-dir must hold the deepseek_v41 package")
    sys.path.insert(0, str(reference_dir))
    return importlib.import_module("deepseek_v41.model")


class TokenizerShim:
    """What the reference's Engram token map reads of a HF fast tokenizer: ``backend_tokenizer``
    (the Rust tokenizer) and ``len()`` (which counts added tokens too)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(path))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)


def reference_args(ref: types.ModuleType, config: dict[str, Any], max_seq_len: int) -> tuple[Any, dict[str, Any]]:
    """ModelArgs from config.json (field names are the JSON keys), plus what was not mapped."""
    fields = {f.name: f for f in dataclasses.fields(ref.ModelArgs)}
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in fields}
    kwargs.update(max_batch_size=1, max_seq_len=max_seq_len, temperature=0.0)
    notes = {
        "config keys the reference does not take": sorted(set(config) - set(fields)),
        "reference fields left at their defaults": {
            k: f.default for k, f in fields.items() if k not in kwargs and f.default is not dataclasses.MISSING
        },
    }
    return ref.ModelArgs(**kwargs), notes


def dequant_fp8_tiles(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [R, C] with one scale per 32x32 tile [ceil(R/32), ceil(C/32)] -> fp32 (written here
    independently of asympd.model.quant, so a bug there cannot hide in both sides)."""
    rows, cols = weight.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return weight.float() * s


def read_checkpoint(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = ckpt / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    )
    out: dict[str, torch.Tensor] = {}
    for fname in files:
        with safe_open(str(ckpt / fname), framework="pt") as f:
            for name in f.keys():
                out[name] = f.get_tensor(name)
    return out


@torch.no_grad()
def load_reference_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Copy checkpoint tensors into the reference's parameters by name. Returns which conversions
    were needed (kind -> parameter names), and any parameter or tensor left unmatched."""
    conversions: dict[str, list[str]] = {}
    used: set[str] = set()

    def note(kind: str, name: str) -> None:
        conversions.setdefault(kind, []).append(name)

    params = dict(model.named_parameters())
    missing = []
    for name, p in params.items():
        t = tensors.get(name)
        if t is None:
            missing.append(name)
            continue
        used.add(name)
        if p.dtype == torch.float4_e2m1fn_x2 and t.dtype == torch.int8:
            # packed e2m1 pairs, even K element in the low nibble in both: a reinterpretation
            assert p.shape == t.shape, (name, p.shape, t.shape)
            p.view(torch.uint8).copy_(t.view(torch.uint8))
            note("int8 packed FP4 -> float4_e2m1fn_x2 (same bytes, viewed)", name)
        elif t.dtype == torch.float8_e4m3fn and p.dtype != torch.float8_e4m3fn:
            scale_name = name.removesuffix(".weight") + ".scale"
            w = dequant_fp8_tiles(t, tensors[scale_name])
            used.add(scale_name)
            assert p.shape == w.shape, (name, p.shape, w.shape)
            p.copy_(w.to(p.dtype))
            note(f"FP8 + 32x32 UE8M0 tiles -> dequantized {str(p.dtype).removeprefix('torch.')} (exact)", name)
        elif t.dtype == p.dtype:
            assert p.shape == t.shape, (name, p.shape, t.shape)
            p.view(torch.uint8).copy_(t.contiguous().view(torch.uint8))
        elif t.dtype == torch.bfloat16 and p.dtype == torch.float32:
            assert p.shape == t.shape, (name, p.shape, t.shape)
            p.copy_(t.float())
            note("bf16 -> fp32 (exact)", name)
        else:
            raise SystemExit(f"no conversion for {name}: checkpoint {t.dtype} -> reference {p.dtype}")
    unused = sorted(set(tensors) - used)
    return {"conversions": conversions, "missing_in_checkpoint": missing, "unused_checkpoint_tensors": unused}


class IndexKeyWatch:
    """Watches which key cache each reference indexer reads from the shared ``index_k`` slot.

    As released, an index-key owner publishes its keys only when its compressor produced a new
    entry, so on a decode step that completes no group (ratio 2, even positions) its indexer reads
    whatever the slot still holds from the previous forward: the keys of the last owner that
    published, a ratio-1 source. With
    ``fix=True`` every owner publishes its own cache first (the file itself is untouched).
    Counts, per layer, the reads of a cache other than its KV source's, and how many of those had
    more candidates than index_topk (only those can change what is selected)."""

    def __init__(self, ref: types.ModuleType, model: torch.nn.Module, args: Any, fix: bool):
        self.foreign: dict[int, int] = {}
        self.foreign_effective: dict[int, int] = {}
        layer_of = {id(b.attn.indexer): i for i, b in enumerate(model.layers) if b.attn.indexer is not None}
        ratios, sources = args.compress_ratios, args.kv_source_layers
        expected = {
            lid: model.layers[max(s for s in sources if s <= lid and ratios[s] == ratios[lid])].attn.indexer.k_cache
            for lid in layer_of.values()
        }
        original = ref.Indexer.forward
        watch = self

        def forward(self, x, qr, latent, start_pos, offset):
            if fix and self.owns_k:
                ref.shared_attn.index_k = self.k_cache
            out = original(self, x, qr, latent, start_pos, offset)
            lid = layer_of[id(self)]
            if ref.shared_attn.index_k is not expected[lid]:
                watch.foreign[lid] = watch.foreign.get(lid, 0) + 1
                if (start_pos + x.size(1)) // self.compress_ratio > self.index_topk:
                    watch.foreign_effective[lid] = watch.foreign_effective.get(lid, 0) + 1
            return out

        ref.Indexer.forward = forward


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):
    """Tensor.topk with ties going to the lowest index (as asympd's ``stable_topk``)."""
    idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((self.gather(dim, idx), idx))


class Reference:
    def __init__(self, ref: types.ModuleType, args: Any, tokenizer: TokenizerShim, stable_topk: bool = False):
        self.ref = ref
        self.stable_topk = stable_topk
        with ref.set_dtype(torch.bfloat16):
            self.model = ref.Transformer(args, tokenizer).eval()
        # every position's logits, not only the last one (a prefill's other rows are compared too)
        head = self.model.head
        head.forward = types.MethodType(lambda h, x, full_logits=False: ref.ParallelHead.forward(h, x, True), head)
        self.hidden: list[torch.Tensor] = []
        for layer in self.model.layers:
            layer.register_forward_hook(lambda mod, inp, out: self.hidden.append(out[0][0].detach().clone()))
        self.main_hidden: torch.Tensor | None = None  # [rows, n_targets * dim] of the last run
        self.draft_hidden: list[torch.Tensor] = []  # each draft block's output of the last spec()
        for block in self.model.mtp:
            block.register_forward_hook(lambda mod, inp, out: self.draft_hidden.append(out[0][0].detach().clone()))

    @torch.inference_mode()
    def reset(self) -> None:
        """Clear every cache so one prompt cannot see the last (the reference overwrites what a
        start_pos-0 prefill reads anyway; this only makes that independent of it)."""
        for name, buf in self.model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "score_state":
                buf.fill_(float("-inf"))
            elif leaf in ("window_kv_cache", "compress_kv_cache", "k_cache", "kv_state", "cache"):
                buf.zero_()

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        """fp32 logits [len(ids), vocab] of positions start_pos.. (prefill when start_pos == 0)."""
        self.hidden = []
        original = torch.Tensor.topk
        if self.stable_topk:  # the reference's topk calls: MoE gate, indexer, candidate blocks
            torch.Tensor.topk = _stable_topk
        try:
            with self.ref.set_dtype(torch.bfloat16):
                _, logits, main_hidden = self.model(ids.view(1, -1), start_pos)
        finally:
            torch.Tensor.topk = original
        self.main_hidden = None if main_hidden is None else main_hidden[0]
        return logits[0].float()

    @torch.inference_mode()
    def spec(self, token: int, main_hidden: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, ...] | None:
        """``Transformer.forward_spec``: with start_pos 0 it only seeds the draft windows with the
        main rows 0..; otherwise ``main_hidden`` is position start_pos's row, ``token`` the one after it
        (the block's first row). Returns (drafts [B], Markov-biased logits [B, vocab] fp32, confidence
        logits [B] fp32), or None when seeding."""
        self.draft_hidden = []
        original = torch.Tensor.topk
        if self.stable_topk:  # the draft blocks' MoE gates
            torch.Tensor.topk = _stable_topk
        try:
            with self.ref.set_dtype(torch.bfloat16):
                out = self.model.forward_spec(torch.tensor([token]), main_hidden.unsqueeze(0), start_pos)
        finally:
            torch.Tensor.topk = original
        if out is None:
            return None
        ids, logits, confidence = out
        return ids[0, 1:].clone(), logits[0].float().clone(), confidence[0].float().clone()

    def caches(self, n_tokens: int, cfg: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for layer, block in enumerate(self.model.layers):
            a = block.attn
            if a.is_kv_source:
                n = n_tokens // a.compress_ratio
                out[f"compressed_kv.{layer}"] = a.compress_kv_cache[0, :n].float().clone()
                out[f"index_keys.{layer}"] = a.indexer.k_cache[0, :n].float().clone()
            # the ring holds position p at slot p % window_size; list the live ones oldest first
            w = cfg.window_size
            pos = torch.arange(max(0, n_tokens - w), n_tokens)
            out[f"window.{layer}"] = a.window_kv_cache[0, pos % w].float().clone()
        return out


# ---- our side -------------------------------------------------------------------------------------


class Ours:
    def __init__(self, ckpt: Path, dtype: torch.dtype):
        self.dtype = dtype
        self.model = load_model(ckpt, role="full", device="cpu", dtype=dtype)
        self.cfg = self.model.cfg
        self.hidden: list[torch.Tensor] = []
        for block in self.model.blocks:
            if block is not None:
                block.register_forward_hook(lambda mod, inp, out: self.hidden.append(out[0].detach().clone()))
        self.kv: DenseSequenceKV | None = None
        self.draft_hidden: torch.Tensor | None = None  # [rows, n_targets * dim] of the last run
        self.drafter = self.model.drafter
        self.drafter_hidden: list[torch.Tensor] = []
        for block in self.drafter.blocks:
            block.register_forward_hook(lambda mod, inp, out: self.drafter_hidden.append(out[0].detach().clone()))

    def reset(self) -> None:
        self.kv = DenseSequenceKV(self.cfg, dtype=self.dtype)

    def spec(
        self, kv: DenseSequenceKV, main_hidden: torch.Tensor, main_start: int, token: int | None = None
    ) -> Draft | None:
        """Seed the draft windows with main rows main_start..; with ``token``, then draft the block
        after them (at main_start + rows) greedily: the first maximum of each Markov-biased row, as the
        reference's ``sample`` at temperature 0 and the engine's greedy proposer pick."""
        self.drafter_hidden = []
        block = None if token is None else main_start + main_hidden.size(0)
        seg = DraftSegment(kv, main_hidden.to(self.dtype), main_start, block, token or 0)
        k = 0 if token is None else self.cfg.dspark_block_size
        return self.drafter.draft([seg], k, lambda i, logits: logits.argmax(-1))

    def run(self, history: torch.Tensor, start: int, count: int) -> torch.Tensor:
        """fp32 logits [count, vocab] of positions start..start+count-1 (history holds them all)."""
        self.hidden = []
        chunk = Chunk(
            self.kv,
            history[start : start + count],
            start,
            history[: start + count],
            depth=Depth.ALL,
            floor=0,
            encoder_floor=0,
            logits="all",
        )
        out = self.model([chunk])
        self.draft_hidden = out.draft_hidden[0]
        return out.logits[0].float()

    def caches(self, n_tokens: int) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        cfg = self.cfg
        for layer in range(cfg.n_layers):
            if layer in cfg.kv_source_layers:
                n = n_tokens // cfg.ratio(layer)
                out[f"compressed_kv.{layer}"] = self.kv.read_compressed(layer, n).float()
                out[f"index_keys.{layer}"] = self.kv.read_index_keys(layer, n).float()
            kv, pos = self.kv.window(layer)
            live = pos >= n_tokens - cfg.window_size
            out[f"window.{layer}"] = kv[live].float()
        return out


# ---- metrics --------------------------------------------------------------------------------------


def logit_metrics(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """ours/ref: [rows, vocab] fp32. rel = max|diff| / max|ref|; top5 = mean overlap fraction."""
    d = (ours - ref).abs()
    top_o, top_r = ours.topk(5, dim=-1).indices, ref.topk(5, dim=-1).indices
    overlap = torch.tensor([len(set(a.tolist()) & set(b.tolist())) / 5 for a, b in zip(top_o, top_r, strict=True)])
    return {
        "rows": ref.size(0),
        "max_abs": d.max().item(),
        "rel": (d.max() / ref.abs().max()).item(),
        "rms_rel": (d.square().mean().sqrt() / ref.square().mean().sqrt()).item(),
        "argmax_agree": int((ours.argmax(-1) == ref.argmax(-1)).sum()),
        "top5_overlap": overlap.mean().item(),
        "top5_min": overlap.min().item(),
        "ref_std": ref.std().item(),
    }


def tensor_metrics(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    if ours.shape != ref.shape:
        return {"shape_mismatch": f"{tuple(ours.shape)} vs {tuple(ref.shape)}"}
    if ref.numel() == 0:
        return {"n": 0, "max_abs": 0.0, "rel": 0.0, "exact": 1.0}
    d = (ours.float() - ref.float()).abs()
    return {
        "n": ref.numel(),
        "max_abs": d.max().item(),
        "rel": (d.max() / ref.abs().max().clamp_min(1e-30)).item(),
        "exact": (d == 0).float().mean().item(),
    }


def hidden_metrics(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> list[dict[str, float]]:
    return [tensor_metrics(o, r) for o, r in zip(ours, ref, strict=True)]


def fmt_logits(tag: str, m: dict[str, float]) -> str:
    return (
        f"  {tag:<22} max|d|={m['max_abs']:.3e}  rel={m['rel']:.2e}  rms_rel={m['rms_rel']:.2e}  "
        f"argmax {m['argmax_agree']}/{m['rows']}  top5 {m['top5_overlap']:.3f} (min {m['top5_min']:.1f})  "
        f"|ref| std {m['ref_std']:.2f}"
    )


def fmt_tensors(tag: str, ms: dict[str, dict[str, float]]) -> list[str]:
    lines = [f"  {tag}:"]
    for name, m in ms.items():
        if "shape_mismatch" in m:
            lines.append(f"    {name:<18} SHAPE MISMATCH {m['shape_mismatch']}")
        else:
            lines.append(
                f"    {name:<18} n={m['n']:<6} max|d|={m['max_abs']:.3e}  rel={m['rel']:.2e}  exact={m['exact']:.3f}"
            )
    return lines


# ---- resynchronised decode and the DSpark drafter ---------------------------------------------------


def _exact(ms: list[dict[str, float]] | dict[str, dict[str, float]]) -> bool:
    vals = ms.values() if isinstance(ms, dict) else ms
    return all(m.get("max_abs", 1.0) == 0 for m in vals)


def _draft_metrics(ours: Draft, ref: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Ours vs the reference's forward_spec for one block: drafts, their logits, confidence logits.
    For a draft that differs, ``ref_gap`` is the reference's logit margin between the two tokens."""
    r_tok, r_logits, r_conf = ref
    o_tok, o_logits, o_conf = ours.tokens[0].cpu(), ours.logits[0].float().cpu(), ours.confidence[0].float().cpu()
    same = (o_tok == r_tok).tolist()
    first = next((i for i, ok in enumerate(same) if not ok), None)
    return {
        "drafts_ref": r_tok.tolist(),
        "drafts_ours": o_tok.tolist(),
        "equal": sum(same),
        "first_diff": first,
        "ref_gap": None if first is None else (r_logits[first, r_tok[first]] - r_logits[first, o_tok[first]]).item(),
        "logits_max_abs": (o_logits - r_logits).abs().max().item(),
        "logits_rel": ((o_logits - r_logits).abs().max() / r_logits.abs().max()).item(),
        "logits_exact": bool(torch.equal(o_logits, r_logits)),
        "confidence_max_abs": (o_conf - r_conf).abs().max().item(),
    }


def resync_check(
    reference: Reference, ours: Ours, ours_fp32: Ours | None, ids: torch.Tensor, steps: int
) -> dict[str, Any]:
    """Decode and drafting checked at every position, each from the same one-shot prefill.

    The tokens are the reference's own greedy continuation of ``ids``. For each decode position p:
    both sides prefill ``hist[:p]`` from empty caches (and seed their draft windows with its main
    rows), run one decode step at p, and draft the block at p+1 whose first token is ``hist[p+1]``.
    Entering state = every prefill layer output and every cache read bit-identical. The drafter is
    run twice on our side: from our own target states, and from the reference's (``isolated``: the
    drafter alone, whatever the target did)."""
    cfg = ours.cfg
    n = ids.numel()
    reference.reset()
    tok = int(reference.run(ids, 0)[-1].argmax())
    hist = ids.tolist()
    for p in range(n, n + steps):
        hist.append(tok)
        tok = int(reference.run(torch.tensor(hist[p : p + 1]), p)[0].argmax())
    hist.append(tok)
    h = torch.tensor(hist)
    out: list[dict[str, Any]] = []
    for p in range(n, n + steps):
        nxt = hist[p + 1]
        # the reference: prefill, seed, decode step p, draft the block at p+1
        reference.reset()
        reference.run(h[:p], 0)
        r_pre_hidden, r_pre_main = reference.hidden, reference.main_hidden
        r_caches = reference.caches(p, cfg)
        reference.spec(hist[p], r_pre_main, 0)
        r_logits = reference.run(h[p : p + 1], p)
        r_hidden, r_main = reference.hidden, reference.main_hidden
        r_draft = reference.spec(nxt, r_main, p)
        r_draft_hidden = reference.draft_hidden
        # ours, the same
        ours.reset()
        ours.run(h, 0, p)
        o_pre_hidden, o_pre_main = ours.hidden, ours.draft_hidden
        o_caches = ours.caches(p)
        ours.spec(ours.kv, o_pre_main, 0)
        o_logits = ours.run(h, p, 1)
        o_hidden, o_main = ours.hidden, ours.draft_hidden
        o_draft = ours.spec(ours.kv, o_main, p, nxt)
        o_draft_hidden = ours.drafter_hidden
        # the drafter alone, from the reference's target states
        iso_kv = DenseSequenceKV(cfg, dtype=ours.dtype)
        ours.spec(iso_kv, r_pre_main, 0)
        iso = ours.spec(iso_kv, r_main, p, nxt)
        iso_hidden = ours.drafter_hidden

        pre_layers = hidden_metrics(o_pre_hidden, r_pre_hidden)
        caches = {k: tensor_metrics(o_caches[k], v) for k, v in r_caches.items()}
        dec_layers = hidden_metrics(o_hidden, r_hidden)
        first = next((j for j, m in enumerate(dec_layers) if m["max_abs"] > 0), None)
        step: dict[str, Any] = {
            "pos": p,
            "entered_exact": _exact(pre_layers) and _exact(caches),
            "prefill_main_hidden_exact": bool(torch.equal(o_pre_main, r_pre_main)),
            "decode": logit_metrics(o_logits, r_logits),
            "decode_first_layer_differing": first,
            "decode_main_hidden_exact": bool(torch.equal(o_main, r_main)),
            "draft": _draft_metrics(o_draft, r_draft),
            "draft_blocks_exact": _exact(hidden_metrics(o_draft_hidden, r_draft_hidden)),
            "isolated": _draft_metrics(iso, r_draft),
            "isolated_blocks_exact": _exact(hidden_metrics(iso_hidden, r_draft_hidden)),
        }
        if ours_fp32 is not None:
            ours_fp32.reset()
            ours_fp32.run(h, 0, p)
            ours_fp32.spec(ours_fp32.kv, ours_fp32.draft_hidden, 0)
            f_logits = ours_fp32.run(h, p, 1)
            step["fp32_decode"] = logit_metrics(f_logits, r_logits)
            step["fp32_draft"] = _draft_metrics(ours_fp32.spec(ours_fp32.kv, ours_fp32.draft_hidden, p, nxt), r_draft)
        out.append(step)
    return {"tokens": hist, "steps": out}


def print_resync(n: int, res: dict[str, Any]) -> None:
    print(f"\n=== resynchronised: prompt length {n}, decode positions {n}..{n + len(res['steps']) - 1} ===")
    print("  pos: entered exact | decode max|d| argmax first-layer-differing | drafts ref / ours (= equal),")
    print("  draft logits max|d| (exact?) confidence max|d| | isolated drafter (reference's target states)")
    for s_ in res["steps"]:
        d, dr, iso = s_["decode"], s_["draft"], s_["isolated"]
        first = "-" if s_["decode_first_layer_differing"] is None else f"L{s_['decode_first_layer_differing']}"
        f32 = ""
        if "fp32_draft" in s_:
            ok = "ok" if s_["fp32_decode"]["argmax_agree"] else "DIFF"
            f32 = f"  [fp32: argmax {ok} drafts {s_['fp32_draft']['equal']}]"
        print(
            f"    {s_['pos']:<4} {'yes' if s_['entered_exact'] else 'no '} | {d['max_abs']:.2e} "
            f"{'ok ' if d['argmax_agree'] else 'DIFF'} {first:<3} | {dr['drafts_ref']} / {dr['drafts_ours']} "
            f"({dr['equal']})  {dr['logits_max_abs']:.2e} ({'exact' if dr['logits_exact'] else 'no'}) "
            f"{dr['confidence_max_abs']:.2e} | iso {iso['equal']} {iso['logits_max_abs']:.2e} "
            f"({'exact' if iso['logits_exact'] else 'no'}){f32}"
        )


def resync_summary(results: dict[int, dict[str, Any]], block: int) -> None:
    print("\n=== summary, resynchronised decode and drafts (ours bf16 vs reference bf16) ===")
    print(
        f"{'len':>4} {'steps':>5} {'entered exact':>13} {'dec exact':>9} {'dec argmax':>10} | "
        f"{'drafts =':>9} {'blocks exact':>12} {'logits exact':>12} {'max|d|':>9} {'conf max|d|':>11} | "
        f"{'iso drafts =':>12} {'iso exact':>9} {'iso max|d|':>10} | {'fp32 argmax':>11} {'fp32 drafts':>11}"
    )
    for n, res in results.items():
        st = res["steps"]
        k = len(st)
        dec_exact = sum(s_["decode_first_layer_differing"] is None for s_ in st)
        f32 = [s_ for s_ in st if "fp32_draft" in s_]
        print(
            f"{n:>4} {k:>5} {sum(s_['entered_exact'] for s_ in st):>9}/{k:<3} {dec_exact:>5}/{k:<3} "
            f"{sum(s_['decode']['argmax_agree'] for s_ in st):>6}/{k:<3} | "
            f"{sum(s_['draft']['equal'] for s_ in st):>5}/{k * block:<3} "
            f"{sum(s_['draft_blocks_exact'] for s_ in st):>8}/{k:<3} "
            f"{sum(s_['draft']['logits_exact'] for s_ in st):>8}/{k:<3} "
            f"{max(s_['draft']['logits_max_abs'] for s_ in st):>9.2e} "
            f"{max(s_['draft']['confidence_max_abs'] for s_ in st):>11.2e} | "
            f"{sum(s_['isolated']['equal'] for s_ in st):>8}/{k * block:<3} "
            f"{sum(s_['isolated']['logits_exact'] for s_ in st):>5}/{k:<3} "
            f"{max(s_['isolated']['logits_max_abs'] for s_ in st):>10.2e} | "
            + (
                f"{sum(s_['fp32_decode']['argmax_agree'] for s_ in f32):>7}/{k:<3} "
                f"{sum(s_['fp32_draft']['equal'] for s_ in f32):>7}/{k * block:<3}"
                if f32
                else ""
            )
        )


def check_golden_drafts(reference: Reference, path: Path) -> dict[str, Any]:
    """The reference drafts every block of the committed bf16 golden drafts (tests/model/
    golden_drafts.json) from a one-shot prefill up to the block's main rows plus one decode step;
    the blocks at position 1 are skipped (the reference cannot draft before its first decode step)."""
    doc = json.loads(path.read_text())
    vocab = reference.model.embed.vocab_size
    g = torch.Generator().manual_seed(doc["prompts"]["seed"])
    out: dict[str, Any] = {}
    for run in doc["outputs"]["bfloat16"]:
        n = run["n"]
        prompt = torch.randint(3, vocab, (n,), generator=g).tolist()  # as tests.util.random_prompts
        hist = prompt + run["target_tokens"]
        h = torch.tensor(hist)
        rows = []
        for i, b in enumerate(range(n, n + len(run["drafts"]))):
            if b < 2:
                continue
            reference.reset()
            reference.run(h[: b - 1], 0)
            reference.spec(hist[b - 1], reference.main_hidden, 0)
            target = int(reference.run(h[b - 1 : b], b - 1)[0].argmax())
            drafts = reference.spec(hist[b], reference.main_hidden, b - 1)[0].tolist()
            rows.append({"block": b, "target_agrees": target == hist[b], "ref": drafts, "golden": run["drafts"][i]})
        out[str(n)] = rows
        same = sum(r["ref"] == r["golden"] for r in rows)
        tokens = sum(a == b for r in rows for a, b in zip(r["ref"], r["golden"], strict=True))
        print(
            f"  golden bf16 drafts, prompt length {n}: blocks equal {same}/{len(rows)}, draft tokens equal "
            f"{tokens}/{sum(len(r['ref']) for r in rows)}, reference greedy = golden target "
            f"{sum(r['target_agrees'] for r in rows)}/{len(rows)}"
        )
    return out


# ---- driver ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", type=Path, required=True, help="directory holding the deepseek_v41 package")
    ap.add_argument("--checkpoint", type=Path, required=True, help="checkpoint directory (released layout)")
    ap.add_argument("--lengths", default="1,7,16,17,40,100", help="prompt lengths, comma separated")
    ap.add_argument("--decode-steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    ap.add_argument(
        "--patch-reference-index-keys",
        action="store_true",
        help="wrap the reference's Indexer so each key owner reads its own keys on every decode step",
    )
    ap.add_argument(
        "--stable-reference-topk",
        action="store_true",
        help="break the reference's top-k ties toward the lowest index, as ours does (upstream leaves "
        "tie order implementation-defined)",
    )
    ap.add_argument("--no-fp32", action="store_true", help="skip our fp32 run")
    ap.add_argument(
        "--resync-lengths",
        default="1,17,100",
        help="prompt lengths of the resynchronised decode + DSpark check (empty: skip it)",
    )
    ap.add_argument("--resync-steps", type=int, default=32, help="decode positions per resynchronised prompt")
    ap.add_argument("--golden-drafts", type=Path, help="also have the reference draft tests/model/golden_drafts.json")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (fixed, so runs repeat exactly)")
    ap.add_argument("--json", type=Path, help="also write every number here")
    a = ap.parse_args()

    torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.lengths.split(",")]
    flat = a.checkpoint / "inference" / "config.json"  # the reference's own key set
    config = json.loads((flat if flat.is_file() else a.checkpoint / "config.json").read_text())
    resync_lengths = [int(x) for x in a.resync_lengths.split(",") if x]
    block = int(config.get("dspark_block_size", 0))
    need = max([max(lengths) + a.decode_steps] + [n + a.resync_steps for n in resync_lengths])
    if a.golden_drafts:
        gd = json.loads(a.golden_drafts.read_text())
        need = max([need] + [n + gd["steps"] for n in gd["prompts"]["lengths"]])
    need += block + 1
    max_seq_len = max(64, -(-need // 64) * 64)

    ref_mod = import_reference(a.reference_dir)
    args, arg_notes = reference_args(ref_mod, config, max_seq_len)
    t0 = time.time()
    reference = Reference(ref_mod, args, TokenizerShim(a.checkpoint / "tokenizer.json"), a.stable_reference_topk)
    watch = IndexKeyWatch(ref_mod, reference.model, args, fix=a.patch_reference_index_keys)
    load = load_reference_weights(reference.model, read_checkpoint(a.checkpoint))
    print(f"reference built and loaded in {time.time() - t0:.1f}s (max_seq_len={max_seq_len})")
    print(
        "config -> ModelArgs:",
        json.dumps(arg_notes["config keys the reference does not take"]),
        "| left at defaults:",
        {
            k: v
            for k, v in arg_notes["reference fields left at their defaults"].items()
            if k in ("gate_temp", "norm_topk_prob", "dspark_block_size") or not k.startswith("vision")
        },
    )
    print("checkpoint -> reference conversions:")
    for kind, names in load["conversions"].items():
        short = sorted({n.split(".", 2)[-1] if n.startswith(("layers.", "mtp.")) else n for n in names})
        print(f"  {kind}: {len(names)} tensors ({', '.join(short[:8])}{', ...' if len(short) > 8 else ''})")
    print(f"  reference params missing from checkpoint: {load['missing_in_checkpoint']}")
    print(
        f"  checkpoint tensors not used: {load['unused_checkpoint_tensors'] or 'none'} "
        "(the scale of a weight dequantized for the reference counts as used)"
    )
    if a.patch_reference_index_keys:
        print("NOTE: reference Indexer wrapped so each key owner reads its own keys (--patch-reference-index-keys)")
    if a.stable_reference_topk:
        print("NOTE: reference top-k ties broken toward the lowest index (--stable-reference-topk)")

    ours_bf16 = Ours(a.checkpoint, torch.bfloat16)
    ours_fp32 = None if a.no_fp32 else Ours(a.checkpoint, torch.float32)
    cfg = ours_bf16.cfg
    gen = torch.Generator().manual_seed(a.seed)
    results: dict[str, Any] = {
        "options": {k: str(v) for k, v in vars(a).items()},
        "load": load,
        "args": {k: str(v) for k, v in vars(args).items()},
        "prompts": {},
    }

    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        print(f"\n=== prompt length {n} ===")
        reference.reset()
        ours_bf16.reset()
        rl = reference.run(ids, 0)
        rh = reference.hidden
        ol = ours_bf16.run(ids, 0, n)
        oh = ours_bf16.hidden
        res: dict[str, Any] = {"prefill": {"bf16": logit_metrics(ol, rl), "bf16_last": logit_metrics(ol[-1:], rl[-1:])}}
        print(fmt_logits("prefill, all rows", res["prefill"]["bf16"]))
        print(fmt_logits("prefill, last row", res["prefill"]["bf16_last"]))
        res["prefill"]["hidden"] = hidden_metrics(oh, rh)
        print(
            "  residual stream after each layer, rel max|d|: "
            + " ".join(f"{m['rel']:.1e}" for m in res["prefill"]["hidden"])
        )
        res["prefill"]["caches"] = {
            k: tensor_metrics(ours_bf16.caches(n)[k], v) for k, v in reference.caches(n, cfg).items()
        }
        print("\n".join(fmt_tensors("caches after prefill (ours bf16 vs reference)", res["prefill"]["caches"])))
        if ours_fp32 is not None:
            ours_fp32.reset()
            fl = ours_fp32.run(ids, 0, n)
            res["prefill"]["fp32_vs_ref"] = logit_metrics(fl, rl)
            res["prefill"]["fp32_vs_bf16"] = logit_metrics(ol, fl)
            print(fmt_logits("ours fp32 vs ref", res["prefill"]["fp32_vs_ref"]))
            print(fmt_logits("ours bf16 vs ours fp32", res["prefill"]["fp32_vs_bf16"]))

        # decode: both fed the reference's greedy token
        history = ids.tolist()
        steps, steps32, info = [], [], []
        # the state is identical while every layer's output so far (prefill and decode) was
        # bit-identical and so were the caches after prefill (logits themselves go through an fp32
        # head whose batching differs, so they can differ by an fp32 ulp with identical inputs)
        exact_so_far = all(m["max_abs"] == 0 for m in res["prefill"]["hidden"]) and all(
            m.get("exact") == 1.0 for m in res["prefill"]["caches"].values()
        )
        tok = int(rl[-1].argmax())
        for i in range(a.decode_steps):
            pos = n + i
            history.append(tok)
            hist = torch.tensor(history)
            before = sum(watch.foreign_effective.values())
            r = reference.run(hist[pos : pos + 1], pos)
            o = ours_bf16.run(hist, pos, 1)
            steps.append(logit_metrics(o, r))
            hm = hidden_metrics(ours_bf16.hidden, reference.hidden)
            first = next((j for j, m in enumerate(hm) if m["max_abs"] > 0), None)
            info.append(
                {
                    "entered_exact": exact_so_far,  # every earlier output of this prompt was bit-identical
                    "first_layer_differing": first,
                    "first_layer_max_abs": None if first is None else hm[first]["max_abs"],
                    "ref_foreign_index_key_reads": sum(watch.foreign_effective.values()) - before,
                }
            )
            exact_so_far = exact_so_far and first is None
            if ours_fp32 is not None:
                steps32.append(logit_metrics(ours_fp32.run(hist, pos, 1), r))
            tok = int(r[0].argmax())
        res["decode"] = {"bf16": steps, "fp32_vs_ref": steps32, "steps": info}
        if steps:
            print("  decode steps (ours bf16 vs reference); 'first' = first layer whose output differs, its max|d|;")
            print("  'foreign' = reference indexer reads of another layer's keys that could change the top-k:")
            for i, m in enumerate(steps):
                s_ = info[i]
                first = (
                    "-"
                    if s_["first_layer_differing"] is None
                    else f"L{s_['first_layer_differing']} {s_['first_layer_max_abs']:.1e}"
                )
                extra = (
                    f"  [fp32 vs ref: max|d|={steps32[i]['max_abs']:.2e} "
                    f"argmax {'ok' if steps32[i]['argmax_agree'] else 'DIFF'}]"
                    if steps32
                    else ""
                )
                print(
                    f"    pos {n + i:<4} max|d|={m['max_abs']:.3e}  rel={m['rel']:.2e}  argmax "
                    f"{'ok ' if m['argmax_agree'] else 'DIFF'}  top5 {m['top5_overlap']:.1f}  entered exact "
                    f"{'yes' if s_['entered_exact'] else 'no '}  first {first:<12} "
                    f"foreign {s_['ref_foreign_index_key_reads']}{extra}"
                )
            end = n + a.decode_steps
            res["decode"]["caches"] = {
                k: tensor_metrics(ours_bf16.caches(end)[k], v) for k, v in reference.caches(end, cfg).items()
            }
            print("\n".join(fmt_tensors(f"caches after decoding to {end} tokens", res["decode"]["caches"])))
        results["prompts"][n] = res

    # summary
    print("\n=== summary (ours bf16 vs reference bf16) ===")
    print("prefill: all rows; 'pf exact' = every layer's output bit-identical. decode: worst over the steps;")
    print("'dec exact' = steps whose every layer output was bit-identical; 'first div.' = first step that was not,")
    print("entered from an identical state (+) or not (-), and the first layer that differed there.")
    print(
        f"{'len':>4} {'prefill max|d|':>15} {'rel':>9} {'argmax':>8} {'top5':>6} {'pf exact':>8} | "
        f"{'decode max|d|':>14} {'rel':>9} {'argmax':>7} {'top5':>6} {'dec exact':>9} {'first div.':>13} | "
        f"{'fp32 pf max|d|':>14} {'fp32 dec max|d|':>15}"
    )
    worst = 0.0
    for n, res in results["prompts"].items():
        p, d = res["prefill"]["bf16"], res["decode"]["bf16"]
        dmax = max((m["max_abs"] for m in d), default=0.0)
        drel = max((m["rel"] for m in d), default=0.0)
        dag = sum(m["argmax_agree"] for m in d)
        dt5 = sum(m["top5_overlap"] for m in d) / max(1, len(d))
        f = res["prefill"].get("fp32_vs_ref", {}).get("max_abs", float("nan"))
        fd = max((m["max_abs"] for m in res["decode"]["fp32_vs_ref"]), default=float("nan"))
        worst = max(worst, p["rel"], drel)
        pf_exact = "yes" if all(m["max_abs"] == 0 for m in res["prefill"]["hidden"]) else "no"
        info = res["decode"]["steps"]
        n_exact = sum(s_["first_layer_differing"] is None for s_ in info)
        div = next((i for i, s_ in enumerate(info) if s_["first_layer_differing"] is not None), None)
        div_s = (
            "-"
            if div is None
            else (f"{n + div}{'+' if info[div]['entered_exact'] else '-'} L{info[div]['first_layer_differing']}")
        )
        print(
            f"{n:>4} {p['max_abs']:>15.3e} {p['rel']:>9.2e} {p['argmax_agree']:>4}/{p['rows']:<3} "
            f"{p['top5_overlap']:>6.3f} "
            f"{pf_exact:>8} | {dmax:>14.3e} {drel:>9.2e} {dag:>3}/{len(d):<3} {dt5:>6.3f} {n_exact:>5}/{len(d):<3} "
            f"{div_s:>13} | {f:>14.3e} {fd:>15.3e}"
        )
    print(
        f"reference indexer reads of another layer's keys (per layer, all / able to change the top-k): "
        f"{dict(sorted(watch.foreign.items()))} / {dict(sorted(watch.foreign_effective.items()))}"
    )
    results["reference_foreign_index_key_reads"] = {"all": watch.foreign, "effective": watch.foreign_effective}

    if resync_lengths:
        resynced: dict[int, dict[str, Any]] = {}
        for n in resync_lengths:
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            resynced[n] = resync_check(reference, ours_bf16, ours_fp32, ids, a.resync_steps)
            print_resync(n, resynced[n])
        resync_summary(resynced, block)
        results["resynced"] = resynced
    if a.golden_drafts:
        print(f"\n=== the reference on {a.golden_drafts} ===")
        results["golden_drafts"] = check_golden_drafts(reference, a.golden_drafts)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))
    print(f"\nworst relative logit difference: {worst:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
