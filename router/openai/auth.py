"""The API key: every route needs it except an explicit allow-list of probes.

The decision is made on the route a request will reach, found by the app's own
router (``Route.matches``, which strips ``root_path`` and sees the decoded path
exactly as routing does), never by comparing path strings. So a route prefix
(multi-app Serve, KubeRay ingress), case, percent-encoding, extra slashes or a
forwarded-path header cannot reach an API route without the key: either the
request routes to a guarded route, or to nothing (401 too, so routes cannot be
probed without the key). The key is compared as SHA-256 digests with
``hmac.compare_digest``: constant time, and no length to leak.
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from pagefleet.router.openai.errors import OpenAIError, error_response

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # liveness and scrape probes carry no key


class APIKeyMiddleware:
    """Plain ASGI middleware (streams pass through untouched)."""

    def __init__(self, app: ASGIApp, *, api_key: str, routes_of: ASGIApp) -> None:
        self.app = app
        self.routes_of = routes_of  # the Starlette/FastAPI app whose router decides where a request goes
        self._digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        error = OpenAIError("invalid or missing API key: send 'Authorization: Bearer <key>'", status_code=401,
                            code="invalid_api_key")
        response = error_response(error)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        route = routed_to(self.routes_of, scope)
        if route is not None and getattr(route, "path", None) in OPEN_PATHS:
            return True
        return self._key_matches(scope)

    def _key_matches(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        return hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)


def routed_to(app: ASGIApp, scope: Scope):
    """The route ``app``'s router sends this request to (whatever its method), or None."""
    partial = None
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route
        if match is Match.PARTIAL and partial is None:
            partial = route  # the path matches, the method does not: still that route's resource
    return partial
