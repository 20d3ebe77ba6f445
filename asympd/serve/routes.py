"""A worker's HTTP routes: the public OpenAI API, probes, and the internal routes the router uses."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from asympd.serve import protocol as P
from asympd.serve.http import has_internal, install_error_handlers, listen_url
from asympd.serve.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from asympd.serve.api_server import WorkerServer


def build_app(server: WorkerServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.startup()
        c = server.cfg
        print(
            f"asympd {c.role} worker (mode {c.mode}, transport {server.transport_name}) ready on "
            f"{listen_url(c.host, server.port)}",
            flush=True,
        )
        try:
            yield
        finally:
            await server.shutdown()

    app = FastAPI(title="asympd worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app, server.metrics.request_errors)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.handle("completion", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await server.handle("chat", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return await server.tokenizer_route(request, detokenizing=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return await server.tokenizer_route(request, detokenizing=True)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        server.check_auth(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": server.model_name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "asympd",
                        "root": server.cfg.checkpoint,
                        "parent": None,
                        "max_model_len": server.model_cfg.max_seq_len,
                        "asympd": {
                            "role": server.cfg.role,
                            "mode": server.cfg.mode,
                            "resident_bytes": server.resident_bytes,
                        },
                    }
                ],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        if not server.aengine.alive:
            return P.error_response(f"engine is not running: {server.aengine.error}", 503)
        return JSONResponse({"status": "ok", "role": server.cfg.role, "mode": server.cfg.mode})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await server.aengine.stats()
        except Exception:
            stats = None
        return Response(server.metrics.render(stats, server.transfer_snapshots()), media_type=CONTENT_TYPE)

    @app.get("/asympd/info")
    async def info(request: Request) -> JSONResponse:
        return JSONResponse(server.info(internal=has_internal(request, server.secret)))

    @app.get("/asympd/stats")
    async def stats(request: Request) -> JSONResponse:
        try:
            engine = await server.aengine.stats()
        except Exception as e:
            raise P.APIError(f"engine did not answer: {e}", 503) from None
        transfers = server.transfer_snapshots()
        for snap in transfers.values():
            snap.pop("recent", None)
        return JSONResponse(
            {**server.info(internal=has_internal(request, server.secret)), "engine": engine, "transfers": transfers}
        )

    @app.get("/asympd/steps")
    async def steps(since: float = 0.0) -> JSONResponse:
        """The engine's recent steps from wall-clock time ``since``: [start, seconds, prompt rows,
        decode sequences, and once known seconds to the step's GPU end] each, so a calibration can
        line up two processes' steps on one GPU."""
        return JSONResponse({"steps": server.aengine.steps_since(since)})

    @app.get("/asympd/tokenizer.json")
    async def tokenizer() -> Response:
        path = Path(server.cfg.checkpoint) / "tokenizer.json"
        if not path.exists():
            raise P.APIError("this checkpoint has no tokenizer.json", 404)
        return FileResponse(path, media_type="application/json")

    @app.post("/asympd/abort")
    async def abort(request: Request) -> JSONResponse:
        return await server.abort(request)

    return app
