"""The API key: every route walked with and without it, behind a route prefix, and through the
tricks that have bypassed path-prefix checks elsewhere (case, percent-encoding, double slashes,
forwarded-path headers)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from starlette.routing import Route

from pagefleet.router.openai.app import build_openai_app
from pagefleet.router.openai.auth import OPEN_PATHS

KEY = "s3cret-key-42"
GOOD = {"Authorization": f"Bearer {KEY}"}
# A body each POST route accepts, so "with the key" shows the route really answers.
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
}


def _routes(app):
    """Every route of the app, FastAPI's own (/openapi.json, /docs, ...) included."""
    out = []
    for route in app.router.routes:
        if isinstance(route, Route) or hasattr(route, "methods"):
            for method in sorted(route.methods - {"HEAD"}):
                out.append((method, route.path))
    return out


@pytest.fixture(params=["", "/pagefleet"], ids=["no-prefix", "route-prefix"])
def keyed(request, service):
    """The app under a route prefix as Serve runs it (root_path set, path the full URL path)."""
    prefix = request.param
    app = build_openai_app(service, api_key=KEY)
    with TestClient(app, root_path=prefix) as client:
        yield app, client, prefix


def _call(client, method, url, headers=None):
    path = url.split("?")[0].rsplit("/pagefleet", 1)[-1]
    if method == "POST":
        return client.post(url, json=BODIES.get(path, {}), headers=headers or {})
    return client.request(method, url, headers=headers or {})


def test_every_route_needs_the_key_but_the_probes(keyed, fake):
    app, client, prefix = keyed
    routes = _routes(app)
    paths = {p for _, p in routes}
    # the walk covers the API, FastAPI's schema and docs, and the three open probes
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize",
            "/openapi.json", "/docs", "/health", "/version", "/metrics"} <= paths
    for method, path in routes:
        url = prefix + path
        without = _call(client, method, url)
        wrong = _call(client, method, url, {"Authorization": f"Bearer {KEY}x"})
        with_key = _call(client, method, url, GOOD)
        if path in OPEN_PATHS:
            assert without.status_code == 200, (method, url, without.text)
            continue
        for r in (without, wrong):
            assert r.status_code == 401, (method, url, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["WWW-Authenticate"] == "Bearer"
        assert with_key.status_code == 200, (method, url, with_key.text)
    assert len(fake.requests) == 3  # one completions, one chat and one responses request, each with the key


@pytest.mark.parametrize("path", [
    "/V1/models", "/v1/Models", "//v1/models", "/v1//models", "/v1/models/", "/%76%31/models",
    "/v1/%6dodels", "/v1/models%2F", "/./v1/models", "/health/../v1/models", "/v1/models;x",
    "/tokenize/", "/TOKENIZE", "/docs", "/openapi.json", "/redoc", "/nothing-here",
])
def test_no_path_trick_gets_in_without_the_key(keyed, path):
    _, client, prefix = keyed
    r = client.get(prefix + path)
    assert r.status_code == 401, (path, r.status_code, r.text)


@pytest.mark.parametrize("headers", [
    {"X-Forwarded-Prefix": "/health"}, {"X-Original-URL": "/health"}, {"X-Rewrite-URL": "/health"},
    {"X-Forwarded-Path": "/health"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
    {"Authorization": "Bearer"}, {"Authorization": f"Bearer  {KEY[:-1]}"}, {"X-API-Key": KEY},
    {"Authorization": f"Bearer {KEY.upper()}"},
])
def test_no_header_trick_gets_in_without_the_key(keyed, headers):
    _, client, prefix = keyed
    assert client.get(prefix + "/v1/models", headers=headers).status_code == 401


def test_the_bearer_scheme_is_case_insensitive(keyed):
    _, client, prefix = keyed
    assert client.get(prefix + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_a_wrong_key_is_refused_before_the_body_is_read(keyed, fake):
    _, client, prefix = keyed
    r = client.post(prefix + "/v1/completions", content=b"x" * 100, headers={"Content-Type": "text/plain"})
    assert r.status_code == 401  # not 415: nothing about the request is looked at without the key
    assert fake.requests == []


def test_without_a_key_configured_everything_is_open(client):
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    assert client.get("/v1/models").status_code == 200
