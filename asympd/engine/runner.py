"""The model runner executes what the scheduler decided: it builds the ragged chunks, runs one
forward, and moves prefix state between the paged cache and contiguous ``PrefixState`` buffers."""

from __future__ import annotations

import torch

from asympd.engine import modes
from asympd.engine.cuda_graphs import DecodeGraphs, PrefillPieces
from asympd.engine.export import PendingExport, PrefixExporter
from asympd.engine.request import Request
from asympd.engine.scheduler import ScheduledChunk
from asympd.kv.block_manager import BlockManager
from asympd.kv.paged_cache import PagedKVCache
from asympd.model.transformer import Chunk, ChunkImages, Depth, Transformer
from asympd.model.vision import span_mask
from asympd.transfer.prefix_state import PrefixState
from asympd.transfer.stream import PrefixStream


class ModelRunner:
    def __init__(self, model: Transformer, cache: PagedKVCache, blocks: BlockManager):
        self.model, self.cache, self.blocks = model, cache, blocks
        self.cfg = model.cfg
        self.graphs: DecodeGraphs | PrefillPieces | None = (
            None  # decode steps replayed as CUDA graphs (the engine sets it)
        )
        self.exporter = PrefixExporter(cache.device)  # prefix exports on a side stream (engine/export.py)

    def _view(self, req: Request):
        rid = req.request_id
        return self.cache.view(rid, self.blocks.block_table(rid), self.blocks.slot(rid))

    def view(self, req: Request):
        """The request's SequenceKV (paged groups through its live block table, plus its slot)."""
        return self._view(req)

    def prepare(self, req: Request) -> None:
        """A newly admitted request: clear its slot (windows, open groups), then import its prefix."""
        self.cache.reset_slot(self.blocks.slot(req.request_id))
        if req.imported is not None:
            self.import_prefix(req)

    def execute(self, chunks: list[ScheduledChunk], wants_logits: list[str]) -> list[torch.Tensor | None]:
        """One forward over every scheduled chunk; logits per chunk as ``wants_logits`` asks."""
        batch = []
        hashes = self.model.hasher is not None and bool(self.cfg.engram_layer_ids)
        # a decode chunk verifies the request's drafts: its rows are [newest token, drafts]
        drafts = [sc.request.spec_draft if sc.phase is None else None for sc in chunks]
        # every chunk's rows from one host tensor (views of it), not one small tensor per request;
        # only the rows' positions are copied, never a request's whole history
        flat = [t for sc, d in zip(chunks, drafts, strict=True) for t in sc.request.token_slice(sc.lo, sc.hi, d)]
        rows = torch.tensor(flat, dtype=torch.long).split([sc.hi - sc.lo for sc in chunks])
        for sc, want, d, token_ids in zip(chunks, wants_logits, drafts, rows, strict=True):
            req = sc.request
            ph = sc.phase
            # only Engram looks back, and only max_ngram - 1 tokens (the whole history with images)
            first = 0 if req.images else max(0, sc.lo - self.cfg.engram_max_ngram_size + 1)
            history = torch.tensor(req.token_slice(first, sc.hi, d), dtype=torch.long) if hashes else None
            batch.append(
                Chunk(
                    kv=self._view(req),
                    token_ids=token_ids,
                    start=sc.lo,
                    history=history,
                    history_start=first if hashes else 0,
                    depth=ph.depth if ph else Depth.ALL,
                    floor=ph.floor if ph else 0,
                    encoder_floor=ph.encoder_floor if ph else 0,
                    write_global=ph.write_global if ph else True,
                    logits=want,
                    images=self._chunk_images(req, sc.lo, sc.hi, req.num_tokens + len(d or [])) if req.images else None,
                )
            )
        out = self.model(batch) if self.graphs is None else self.model(batch, graphs=self.graphs)
        self.last_draft_hidden = out.draft_hidden
        self.last_argmax = out.argmax
        return out.logits

    # ---- images ------------------------------------------------------------------------------

    def _chunk_images(self, req: Request, lo: int, hi: int, n: int) -> ChunkImages:
        """The image rows of rows [lo, hi) and the text mask of the request's n-token history."""
        rows, embeds = [], []
        for i, im in enumerate(req.images):
            a, b = max(lo, im.start), min(hi, im.end)
            if a < b:
                rows.append(torch.arange(a - lo, b - lo))
                embeds.append(self.image_rows(req, i, a, b))
        if not rows:
            empty = torch.empty(0, self.cfg.dim, dtype=self.model.dtype)
            return ChunkImages(~span_mask(n, req.images), torch.empty(0, dtype=torch.long), empty)
        return ChunkImages(~span_mask(n, req.images), torch.cat(rows), torch.cat(embeds))

    def image_rows(self, req: Request, i: int, a: int, b: int) -> torch.Tensor:
        """Rows [a, b) of image i's span: as P shipped them, else encoded here (once per request)."""
        if all(q in req.imported_rows for q in range(a, b)):
            return torch.stack([req.imported_rows[q] for q in range(a, b)]).to(self.model.device, self.model.dtype)
        if i not in req.image_embeds:
            if self.model.vision is None:
                raise RuntimeError("this engine's model has no vision tower to encode the image")
            req.image_embeds[i] = self.model.vision.span_rows(req.images[i])
        im = req.images[i]
        return req.image_embeds[i][a - im.start : b - im.start]

    def _image_export(self, req: Request, mode: str, policy: str) -> dict[str, torch.Tensor]:
        """The PrefixState's image buffers: every span, and the rows D takes from P's encoding."""
        if not req.images:
            return {}
        spans = req.image_spans
        pos = modes.image_rows_shipped(self.cfg, req.num_prompt_tokens, mode, policy, spans)
        rows = [
            self.image_rows(req, i, q, q + 1) for q in pos for i, im in enumerate(req.images) if im.start <= q < im.end
        ]
        return {
            "image_spans": torch.tensor([[lo, hi - lo] for lo, hi in spans], dtype=torch.int64),
            "image_pos": torch.tensor(pos, dtype=torch.int64),
            "image_rows": torch.cat(rows) if rows else torch.empty(0, self.cfg.dim, dtype=self.model.dtype),
        }

    # ---- prefix state ------------------------------------------------------------------------

    def export_prefix(
        self,
        req: Request,
        *,
        fingerprint: str,
        mode: str,
        policy: str,
        windows: bool = False,
        kv_format: str = "unpacked",
        start: int = 0,
        upto: int | None = None,
    ) -> PendingExport:
        """Copy the global KV of positions [0, s) and the open compressor groups at s into
        contiguous buffers (the one copy P makes; transports move them as they are); with
        ``windows``, every model layer's sliding window too (rows and their positions). With
        ``start``/``upto``: the slice of a streamed prefix, entries of [start, upto) only.

        On CUDA the copy is enqueued on the exporter's side stream and this returns at once
        (engine/export.py): read the state after ``wait()``, free the blocks after ``ready()``."""
        s = req.export_upto if upto is None else upto
        images = self._image_export(req, mode, policy) if upto is None else {}  # on the compute stream
        bt = self.blocks.block_table(req.request_id)
        view = self._view(req)
        ckv, idx, pair_kv, pair_score = {}, {}, {}, {}
        swa_kv, swa_pos = {}, {}
        # slot rows (open pairs, windows) change as the request computes on: snapshot them on the
        # compute stream (small, asynchronous); paged entries of [start, s) are final, read in place
        pairs, wins = {}, {}
        for layer in self.cfg.kv_source_layers:
            r = self.cfg.ratio(layer)
            if r > 1 and s % r:
                lo = s // r * r
                rows = view.pending_tail(layer, lo, s) or _masked(view.pending(layer), lo, s)
                pairs[layer] = [t.float().clone() for t in rows[:2]]
        if windows:  # the last W rows of each model layer (not the draft blocks': P never drafts)
            n = req.num_prompt_tokens
            for layer in range(self.cfg.n_layers):
                lo = n - self.cfg.window_size
                rows = view.window_tail(layer, lo, n) or _masked(view.window(layer), lo, None)
                wins[layer] = [t.clone() for t in rows]
        copy = self.exporter.begin()
        # fp4: the entries stay on the cache's device, where to_buffers packs them on the exporter's
        # pack stream (the host gets the packed bytes, 3.6x fewer than bf16); unpacked: the host copy
        # is made here
        entries = copy.keep if kv_format == "fp4" else copy.host
        with copy:
            for layer in self.cfg.kv_source_layers:
                r = self.cfg.ratio(layer)
                n, first = s // r, start // r
                ckv[layer] = entries(self.cache.read_entries(f"ckv.{layer}", bt, n - first, first))
                idx[layer] = entries(self.cache.read_entries(f"idx.{layer}", bt, n - first, first))
            for layer, (kv, score) in pairs.items():
                pair_kv[layer], pair_score[layer] = copy.host(kv), copy.host(score)
            for layer, (kv, pos) in wins.items():
                swa_kv[layer], swa_pos[layer] = copy.host(kv), copy.host(pos)
            if "image_rows" in images:
                images["image_rows"] = copy.host(images["image_rows"])
        return copy.finish(
            PrefixState(
                split=s,
                token_ids=torch.tensor(req.prompt_token_ids if start == 0 else [], dtype=torch.long),
                ckv=ckv,
                idx=idx,
                pair_kv=pair_kv,
                pair_score=pair_score,
                swa_kv=swa_kv,
                swa_pos=swa_pos,
                fingerprint=fingerprint,
                dtype=self.cache.spec.dtype,
                boundary_policy=policy,
                mode=mode,
                num_prompt_tokens=req.num_prompt_tokens,
                kv_format=kv_format,
                start=start,
                pack_stream=self.exporter.pack_stream,
                **images,
            )
        )

    def import_prefix(self, req: Request) -> None:
        """Write a validated PrefixState (or the slices of a PrefixStream received so far) into this
        request's blocks. Blocks already holding the same prefix (a prefix-cache hit) are shared,
        not rewritten."""
        pieces = req.imported.slices if isinstance(req.imported, PrefixStream) else [req.imported]
        for ps in pieces:
            self.import_slice(req, ps)

    def import_slice(self, req: Request, ps: PrefixState) -> None:
        """Write one slice (entries of [ps.start, ps.split)); its open pairs only if it is the
        last one, ending at the request's split."""
        s = ps.split
        bt = self.blocks.block_table(req.request_id)
        view = self._view(req)
        device = self.cache.device
        for layer in self.cfg.kv_source_layers:
            r = self.cfg.ratio(layer)
            base = ps.start // r
            first = max(req.num_cached_import // r, base)
            if s // r > first:
                self.cache.import_compressed(bt, layer, ps.ckv[layer][first - base :].to(device), first)
                self.cache.import_index_keys(bt, layer, ps.idx[layer][first - base :].to(device), first)
            if layer in ps.pair_kv and s == req.import_len:
                rows = ps.pair_kv[layer].size(0)
                view.append_pending(
                    layer, torch.arange(s - rows, s), ps.pair_kv[layer].to(device), ps.pair_score[layer].to(device)
                )
        if ps.image_pos is not None:  # the image rows P encoded for D's rows
            req.imported_rows.update(zip(ps.image_pos.tolist(), ps.image_rows, strict=True))
        for layer, kv in ps.swa_kv.items():  # P's windows: D starts decoding without a replay
            view.append_window(layer, ps.swa_pos[layer].to(device), kv.to(device))


def _masked(rows: tuple[torch.Tensor, ...], lo: int, hi: int | None) -> tuple[torch.Tensor, ...]:
    """The rows at positions [lo, hi) by a mask (one device sync): for a slot whose host mirror
    cannot place them (``_SlotRows.tail``)."""
    pos = rows[-1]
    keep = (pos >= lo) & (pos < hi) if hi is not None else pos >= lo
    return tuple(t[keep] for t in rows)
