"""Transport rules on the live server: health, models, request ids, auth, CORS, body limits, errors."""

from __future__ import annotations

import httpx
import pytest


async def test_health_models_and_request_ids(start_server):
    srv = await start_server()
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.get("/health")
        assert (r.status_code, r.json()) == (200, {"status": "ok"})
        r1 = await c.get("/v1/models")
        r2 = await c.get("/v1/models")
        assert r1.status_code == 200
        assert r1.json()["data"] == [{"id": "random-tiny-qwen3", "object": "model", "created": srv.state.created,
                                      "owned_by": "ninfer", "max_model_len": 256}]
        assert r1.headers["x-request-id"] < r2.headers["x-request-id"]  # unique, monotonic in this server
        r = await c.get("/v1/models/random-tiny-qwen3")
        assert r.json()["id"] == "random-tiny-qwen3" and r.json()["max_model_len"] == 256
        r = await c.get("/v1/models/other")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.headers["x-request-id"]
        r = await c.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = await c.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


async def test_model_id_override(start_server):
    srv = await start_server("--model-id", "org/alias")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        assert (await c.get("/v1/models")).json()["data"][0]["id"] == "org/alias"
        assert (await c.get("/v1/models/org/alias")).status_code == 200
        r = await c.post("/v1/chat/completions", json={"model": "random-tiny-qwen3", "messages": []})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


async def test_errors_before_and_after_parsing(start_server):
    srv = await start_server("--max-request-mib", "1")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        r = await c.post("/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert r.headers["x-request-id"]
        # An unpaired surrogate escape parses in Python but is no text: refused as the body, not a 500.
        for body in (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800"}]}',
                     b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "\\uDC00": 1}'):
            r = await c.post("/v1/chat/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        for body in (b"[" * 100_000 + b"]" * 100_000, b'{"n": ' + b"9" * 5000 + b"}"):  # too deep, too many digits
            r = await c.post("/v1/chat/completions", content=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        body = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'  # a pair: one character
        r = await c.post("/v1/chat/completions", content=body)
        assert r.json()["error"]["code"] == "model_not_found"  # parsed, then judged on its fields
        # 413 comes from the byte count alone: the body is not even valid JSON.
        r = await c.post("/v1/chat/completions", content=b"x" * (1024 * 1024 + 1))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["x-request-id"]

        async def chunks():  # no content-length: the limit applies while streaming the body in
            for _ in range(3):
                yield b" " * (512 * 1024)

        r = await c.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413
        r = await c.post("/v1/chat/completions", json={"model": "random-tiny-qwen3", "messages": []})
        assert r.status_code == 400
        err = r.json()["error"]
        assert (err["code"], err["param"], err["type"]) == ("invalid_value", "messages", "invalid_request_error")
        r = await c.post("/v1/chat/completions", json={"model": "random-tiny-qwen3", "messages": [], "n": 2})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "n")


async def test_api_key(start_server):
    srv = await start_server("--api-key", "sekret")
    async with httpx.AsyncClient(base_url=srv.url) as c:
        assert (await c.get("/health")).status_code == 200  # health stays open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "nope"}):
            r = await c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["x-request-id"]
        assert (await c.get("/metrics")).status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        assert (await c.get("/v1/models", headers={"x-api-key": "sekret"})).status_code == 200
        assert (await c.get("/metrics", headers={"x-api-key": "sekret"})).status_code == 200
        for both in ({"Authorization": "Bearer wrong", "x-api-key": "sekret"},
                     {"Authorization": "Bearer sekret", "x-api-key": "wrong"}):  # one match is enough
            assert (await c.get("/v1/models", headers=both)).status_code == 200
        both_wrong = {"Authorization": "Bearer wrong", "x-api-key": "nope"}
        assert (await c.get("/v1/models", headers=both_wrong)).status_code == 401
        # Without the key the route table is not disclosed: unknown paths and wrong methods are 401 too,
        # except on the open /health.
        assert (await c.get("/v1/nothing")).status_code == 401
        assert (await c.get("/v1/chat/completions")).status_code == 401
        assert (await c.get("/v1/nothing", headers={"x-api-key": "sekret"})).status_code == 404
        assert (await c.get("/v1/chat/completions", headers={"x-api-key": "sekret"})).status_code == 405
        assert (await c.post("/health")).status_code == 405


@pytest.mark.parametrize("cors", [True, False])
async def test_cors(start_server, cors):
    srv = await start_server("--api-key", "k", *(["--cors"] if cors else []))
    async with httpx.AsyncClient(base_url=srv.url) as c:
        pre = await c.options("/v1/chat/completions", headers={
            "Origin": "http://page.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        r = await c.get("/v1/models", headers={"Origin": "http://page.example", "x-api-key": "k"})
        anthropic_pre = await c.options("/v1/messages")
    # Each family's request id, as on every other response (no key needed).
    assert pre.headers["x-request-id"].startswith("req-") and anthropic_pre.headers["request-id"].startswith("req_")
    if cors:
        assert pre.status_code == 204  # preflight needs no key
        assert pre.headers["access-control-allow-origin"] == "*"
        assert "POST" in pre.headers["access-control-allow-methods"]
        # A browser's Bearer client: the wildcard alone would not admit Authorization.
        assert "authorization" in pre.headers["access-control-allow-headers"].lower().split(", ")
        assert r.headers["access-control-allow-origin"] == "*"
    else:
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
        assert pre.json()["error"]["code"] == "method_not_allowed"
        assert anthropic_pre.json()["type"] == "error" and anthropic_pre.status_code == 405
        assert "access-control-allow-origin" not in r.headers


def test_serving_doc_lists_every_error_code():
    """docs/serving.md's error table stays the whole code table (protocols/errors.py CODES)."""
    import pathlib

    from protocols.errors import CODES

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text()
    table = doc[doc.index("### Errors"):doc.index("## Authentication")]
    assert [code for code in CODES if f"`{code}`" not in table] == []
