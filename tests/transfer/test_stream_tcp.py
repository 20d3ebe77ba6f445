"""A streamed prefix over the TCP transport: D reads each slice while P is still computing the
next, writes it into its cache, and ends with the bits of the unstreamed handover."""

from __future__ import annotations

import threading

import pytest

from asympd import LLM, SamplingParams
from asympd.engine.scheduler import SchedulerConfig
from asympd.transfer import PrefixStateError, TcpTransport, TransferError
from asympd.transfer.seal import new_transfer_id
from tests.transfer.test_kv_pack import packed_state
from tests.transfer.transfer_peer import make_state
from tests.util import random_prompts

SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=7)


def test_d_reads_slices_while_p_computes(tiny_ckpt):
    prompt = random_prompts([70], seed=21)[0]  # split 54: eight chunks of 7 rows, the last 5
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=-1)
    want = LLM(tiny_ckpt, "asymmetric", scheduler=SCHED).generate(prompt_token_ids=prompt, sampling_params=params)
    llm = LLM(tiny_ckpt, "asymmetric", scheduler=SCHED, stream_prefix=True)
    p, d = llm.prefill, llm.engine
    tid = new_transfer_id()
    with TcpTransport(p.fingerprint) as tp_p, TcpTransport(d.fingerprint) as tp_d:
        kv_params = tp_p.open_stream(tid)  # before P computed anything: D connects at once
        got, first_in, errors = [], threading.Event(), []

        def decode_worker() -> None:
            try:
                d.add_request("r", prompt, params, prefix_stream=True)
                for piece in tp_d.fetch_stream(kv_params, d.fingerprint, timeout=10):
                    got.append((piece.start, piece.split, "r" in p.requests))  # P still computing?
                    d.import_slice("r", piece)
                    first_in.set()
            except Exception as e:  # reported by the main thread
                errors.append(e)
                first_in.set()

        worker = threading.Thread(target=decode_worker)
        worker.start()
        p.add_request("r", prompt, params)
        pushed = 0
        while "r" in p.requests:
            for out in p.step():
                tp_p.push(tid, out.prefix_state, last=out.finished)
                pushed += 1
                if pushed == 1:
                    assert first_in.wait(10)  # D has slice 0 before P computes the next chunk
        worker.join(10)
        assert not errors, errors
        assert tid not in tp_p.server.leases  # acked after the last slice
    assert got[0] == (0, 7, True) and got[-1][:2] == (49, 54) and len(got) == pushed == 8
    assert all(a[1] == b[0] for a, b in zip(got, got[1:], strict=False))
    while d.has_unfinished_requests():
        outs = d.step()
    out = outs[-1].outputs[0]
    assert out.token_ids == want[0].outputs[0].token_ids and out.logprobs == want[0].outputs[0].logprobs


def test_stream_failures_are_named():
    state = packed_state()
    with TcpTransport(state.fingerprint) as tp:
        params = tp.open_stream("xfer-a")
        tp.push("xfer-a", state)
        with pytest.raises(PrefixStateError, match=r"slice \[0, 21\) does not continue \[0, 21\)"):
            tp.push("xfer-a", state)
        with pytest.raises(TransferError, match="no open stream 'xfer-b'"):
            tp.push("xfer-b", state)
        stream = tp.fetch_stream(params, state.fingerprint, timeout=0.3)
        assert next(stream).equal(state)
        with pytest.raises(TransferError, match="slice 1 of 'xfer-a': not pushed within 0.3 s"):
            next(stream)
        with pytest.raises(TransferError, match="unknown streamed transfer id 'xfer-c'"):
            next(tp.fetch_stream({**params, "transfer_id": "xfer-c"}, state.fingerprint, timeout=1))
        with pytest.raises(TransferError, match="is streamed: read it with get_slice"):
            tp.fetch(params, state.fingerprint, timeout=1)
        off_grid = make_state(21, 37)  # random bits: no fp4 packing for them
        off_grid.kv_format = "fp4"
        bad = tp.publish("xfer-d", off_grid)
        with pytest.raises(TransferError, match=r"'xfer-d' cannot be sent: ckv\[1\]: row 0, .* not on the nvfp4 grid"):
            tp.fetch(bad, state.fingerprint, timeout=1)
