"""Small endpoints: /health, /metrics, /v1/models, and the route table of the whole server."""

from __future__ import annotations

from ninfer.observability.metrics import CONTENT_TYPE
from ninfer.server import messages, responses
from ninfer.server.app import App, Exchange
from ninfer.server.chat import chat_completions
from protocols.errors import ProtocolError


async def health(ex: Exchange) -> None:
    # Queue saturation is not unavailability: only an engine-wide failure turns this to 503.
    if ex.state.engine.ready:
        await ex.send_json(200, {"status": "ok"})
    else:
        await ex.send_json(503, {"status": "unavailable"})


async def metrics(ex: Exchange) -> None:
    await ex.send_text(200, ex.state.metrics.render(), CONTENT_TYPE)


def _model_object(state) -> dict:
    return {"id": state.model_id, "object": "model", "created": state.created, "owned_by": "ninfer",
            "max_model_len": state.engine.max_context}


async def list_models(ex: Exchange) -> None:
    await ex.send_json(200, {"object": "list", "data": [_model_object(ex.state)]})


async def get_model(ex: Exchange) -> None:
    if ex.params["model_id"] != ex.state.model_id:
        raise ProtocolError("model_not_found", f"The model '{ex.params['model_id']}' does not exist.", "model")
    await ex.send_json(200, _model_object(ex.state))


def install(app: App) -> None:
    app.route("GET", "/health", health, public=True)
    app.route("GET", "/metrics", metrics)
    app.route("GET", "/v1/models", list_models)
    app.route("GET", "/v1/models/{model_id:path}", get_model)
    app.route("POST", "/v1/chat/completions", chat_completions)
    responses.install(app)
    messages.install(app)
