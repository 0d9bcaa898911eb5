"""An MCP server built with the official Python SDK, for end-to-end tests behind the gateway.

usage: server.py PORT [--stateless] [--json-response] [--no-health] [--notes] [--legacy-only]
                      [--session-idle-timeout SECONDS] [--max-sessions N] [--gzip]
                      [--any-method] [--links] [--mrtr] [--require-authorization VALUE]
                      [--require-bearer-jwt-aud AUD]

It is the server a hostile client would aim at: pydantic's JSON reader is lenient (duplicate keys,
the last one wins; NaN and Infinity accepted), so whatever the gateway lets through, this server
executes. Every tool counts its calls, and `GET /calls` returns the counts as JSON, so a test can
tell whether a tool ran. `GET /health` answers 200 for toolgate-xds's probes, unless `--no-health`
leaves the route out (a 404, as on most MCP servers, which only an MCP-level probe can check).

Tools: `read_order`, `write_order` (return text), `fail_order` (raises: an `isError` result),
`slow_order` (sleeps `seconds`, default 3). A resource `secret://report` and a prompt `greeting`,
each counted under its name. With `--notes`, also `remember` (keeps `x` in the MCP session it
is called on) and `recall` (says what the session keeps): per-session state, so a test sees
whether two clients share a session. `GET /calls` also counts the sessions the server opened
(`initialize`). `--session-idle-timeout` ends a session unused that long (the SDK's default is
30 minutes); `--max-sessions` refuses new ones beyond N with HTTP 503. `--legacy-only` refuses
requests of the 2026-07-28 revision (which has no sessions), as a server built before it does:
clients must `initialize` a session.

`--gzip` compresses answers for clients that accept it (Starlette's GZipMiddleware), as many
deployed servers do; `--any-method` serves a request of any HTTP method that has a body as a
POST, as a lenient framework might: what a gateway lets through, this server runs. `--links`
adds `report_links`, whose result carries a resource link to `secret://report` and the report
embedded, for a gateway that must show those URIs as it lists them.

`--mrtr` adds `ask_colour`, which asks its client for a colour and answers
"favourite colour of <who>: <answer> (...)". On 2026-07-28 it asks with a multi-round-trip result:
the first call returns `"resultType": "input_required"` with `inputRequests` {"colour": an
`elicitation/create` whose schema has a string `answer`} and `requestState`; the client calls
the tool again with `inputResponses` and the echoed `requestState` (sealed by the SDK, which
rejects an altered one), and that round answers "(... after input_required)". Each round is a
call of the tool, counted, so a test sees two. On earlier revisions it asks with an
`elicitation/create` request during the call, one call, and answers "(... after
elicitation/create)". A declined or missing answer gives an `isError` result.

What credentials reach it, for a gateway that adds, swaps or strips them: every request to the
MCP endpoint (`/mcp`, any method) has its `Authorization` header recorded, and `GET /calls` has
`"authorizations"`, each distinct value (literal; several header lines joined by ", "; "" for
none) with the number of requests that carried it. Of the `Bearer` credentials that are JWTs,
whose payloads it reads without verifying them, `"bearer_subjects"` maps each `sub` ("" for
none) to the distinct `aud` values (as sent: a string or a list) seen with it, and
`"bearer_tokens"` counts the distinct token strings (a gateway reusing one exchanged token, or
getting one per call). `--require-authorization VALUE` answers HTTP 401 to an MCP request whose
`Authorization` is not exactly VALUE, and `--require-bearer-jwt-aud AUD` to one without a
`Bearer` JWT whose `aud` is AUD or a list holding it: the request is not executed (`/health` and
`/calls` stay open).
"""

import argparse
import asyncio
import base64
import binascii
import collections
import json

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from mcp.server.mcpserver import Context, MCPServer
from mcp_types import (
    ElicitRequest,
    ElicitRequestFormParams,
    EmbeddedResource,
    InputRequiredResult,
    ResourceLink,
    TextResourceContents,
)
from mcp_types.version import is_version_at_least
from pydantic import BaseModel

CALLS: collections.Counter = collections.Counter()

server = MCPServer("toolgate-test-python")


@server.tool()
def read_order(order_id: str = "o-1") -> str:
    CALLS["read_order"] += 1
    return f"order {order_id}: 1 item"


@server.tool()
def write_order(order_id: str = "o-1") -> str:
    CALLS["write_order"] += 1
    return f"order {order_id} written"


@server.tool()
def fail_order(order_id: str = "o-1") -> str:
    CALLS["fail_order"] += 1
    raise RuntimeError(f"order {order_id} cannot be processed")


@server.tool()
async def slow_order(seconds: float = 3.0) -> str:
    CALLS["slow_order"] += 1
    await asyncio.sleep(seconds)
    return f"slept {seconds} s"


@server.resource("secret://report")
def secret_report() -> str:
    CALLS["secret_report"] += 1
    return "TOP-SECRET-RESOURCE-CONTENT"


@server.prompt()
def greeting(name: str = "you") -> str:
    CALLS["greeting"] += 1
    return f"Say hello to {name}."


def report_links() -> list[ResourceLink | EmbeddedResource]:
    CALLS["report_links"] += 1
    return [
        ResourceLink(name="report", uri="secret://report"),
        EmbeddedResource(
            type="resource",
            resource=TextResourceContents(uri="secret://report", text="TOP-SECRET-RESOURCE-CONTENT"),
        ),
    ]


class Colour(BaseModel):
    answer: str


# What `ask_colour` asks, and the state its first round hands the client to echo.
COLOUR_QUESTION = "Which colour?"
COLOUR_STATE = "asked-colour"


# Registered in main() with --mrtr.
async def ask_colour(ctx: Context, who: str = "you") -> str | InputRequiredResult:
    CALLS["ask_colour"] += 1
    version = ctx.protocol_version
    if version is None or not is_version_at_least(version, "2026-07-28"):
        asked = await ctx.elicit(f"{COLOUR_QUESTION} ({who})", Colour)
        if asked.action != "accept":
            raise RuntimeError(f"no colour: the client chose {asked.action}")
        return f"favourite colour of {who}: {asked.data.answer} (after elicitation/create)"
    if ctx.request_state is None:
        question = ElicitRequestFormParams(
            message=f"{COLOUR_QUESTION} ({who})",
            requested_schema=Colour.model_json_schema(),
        )
        return InputRequiredResult(
            input_requests={"colour": ElicitRequest(params=question)},
            request_state=COLOUR_STATE,
        )
    if ctx.request_state != COLOUR_STATE:
        raise RuntimeError(f"unexpected requestState {ctx.request_state!r}")
    response = (ctx.input_responses or {}).get("colour")
    content = getattr(response, "content", None) or {}
    if getattr(response, "action", None) != "accept" or not isinstance(content.get("answer"), str):
        raise RuntimeError(f"no colour in the inputResponses: {response!r}")
    return f"favourite colour of {who}: {content['answer']} (after input_required)"


# The MCP endpoint's path (the SDK's default, passed to it explicitly).
MCP_PATH = "/mcp"

# The `Authorization` values requests to the MCP endpoint carried ("" for none), counted.
AUTHORIZATIONS: collections.Counter = collections.Counter()
# Of the Bearer JWTs among them: the `aud` values seen for each `sub`, and the tokens.
BEARER_SUBJECTS: dict[str, list] = {}
BEARER_TOKENS: set[str] = set()


@server.custom_route("/calls", methods=["GET"])
async def calls(_: Request) -> JSONResponse:
    return JSONResponse(
        {
            **CALLS,
            "authorizations": dict(AUTHORIZATIONS),
            "bearer_subjects": BEARER_SUBJECTS,
            "bearer_tokens": len(BEARER_TOKENS),
        }
    )


# What each MCP session keeps, by its session id (`--notes`).
NOTES: dict[str, str] = {}


def session_of(ctx: Context) -> str:
    request = ctx.request_context.request
    sid = request.headers.get("mcp-session-id") if request is not None else None
    return sid or f"object-{id(ctx.session)}"


# Registered in main() with --notes.
def remember(x: str, ctx: Context) -> str:
    CALLS["remember"] += 1
    sid = session_of(ctx)
    NOTES[sid] = x
    return f"session {sid} keeps {x!r}"


def recall(ctx: Context) -> str:
    CALLS["recall"] += 1
    sid = session_of(ctx)
    if sid in NOTES:
        return f"session {sid} holds {NOTES[sid]!r}"
    return f"session {sid} holds nothing"


class CountSessions:
    """Counts the sessions the server opens: answers to a POST without a session id that
    carry one (an `initialize` the server accepted)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        opening = (
            scope["type"] == "http"
            and scope["method"] == "POST"
            and not any(k == b"mcp-session-id" for k, _ in scope["headers"])
        )
        if not opening:
            return await self.app(scope, receive, send)

        async def counting(message):
            if message["type"] == "http.response.start" and any(
                k.lower() == b"mcp-session-id" for k, _ in message.get("headers", [])
            ):
                CALLS["initialize"] += 1
            await send(message)

        return await self.app(scope, receive, counting)


class LegacyOnly:
    """Refuses requests in a revision without sessions (2026-07-28 on), as an older server
    would, so that every client initializes a session."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            version = dict(scope["headers"]).get(b"mcp-protocol-version", b"")
            if version >= b"2026":
                body = b'{"jsonrpc":"2.0","id":null,"error":{"code":-32600,"message":"Bad Request: Unsupported protocol version"}}'
                await send(
                    {
                        "type": "http.response.start",
                        "status": 400,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        return await self.app(scope, receive, send)


def bearer_jwt_claims(authorization: str) -> tuple[str, dict] | None:
    """The token and payload of `Bearer <JWT>`, the payload unverified (the gateway is what
    verifies: this server only reports what it was sent); None if it is anything else."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or token.count(".") != 2:
        return None
    part = token.split(".")[1]
    try:
        payload = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (binascii.Error, ValueError):
        return None
    return (token, payload) if isinstance(payload, dict) else None


class Credentials:
    """Records the `Authorization` of every request to the MCP endpoint, then refuses it with
    HTTP 401, unexecuted, if it is not the one required (`--require-authorization`) or not a
    Bearer JWT for the required audience (`--require-bearer-jwt-aud`). Outermost, so that
    nothing of a refused request runs."""

    def __init__(self, app, required: str | None, audience: str | None):
        self.app = app
        self.required = required
        self.audience = audience

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == MCP_PATH or path.startswith(MCP_PATH + "/")):
            return await self.app(scope, receive, send)
        # Header bytes as sent (latin-1 maps each byte to one character).
        values = [v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"]
        authorization = ", ".join(values)
        AUTHORIZATIONS[authorization] += 1
        bearer = bearer_jwt_claims(authorization) if len(values) == 1 else None
        if bearer is not None:
            token, claims = bearer
            BEARER_TOKENS.add(token)
            sub = claims.get("sub")
            seen = BEARER_SUBJECTS.setdefault(sub if isinstance(sub, str) else "", [])
            if claims.get("aud") not in seen:
                seen.append(claims.get("aud"))

        refusal = None
        if self.required is not None and (len(values) != 1 or values[0] != self.required):
            refusal = "missing or wrong Authorization"
        elif self.audience is not None:
            aud = bearer[1].get("aud") if bearer is not None else None
            if bearer is None:
                refusal = "no Bearer JWT"
            elif not (aud == self.audience or (isinstance(aud, list) and self.audience in aud)):
                refusal = f"the token's aud is not {self.audience}"
        if refusal is None:
            return await self.app(scope, receive, send)
        body = json.dumps({"error": "unauthorized", "error_description": refusal}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


# Registered in main(), not by decorator, so that --no-health can leave it out.
async def health(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def any_method_as_post(app):
    """Serves a request of any method that carries a body as a POST."""

    async def lenient(scope, receive, send):
        if scope["type"] == "http" and scope["method"] != "POST":
            headers = dict(scope.get("headers") or [])
            length = headers.get(b"content-length", b"0")
            chunked = b"chunked" in headers.get(b"transfer-encoding", b"")
            if chunked or (length.isdigit() and int(length) > 0):
                scope = dict(scope, method="POST")
        await app(scope, receive, send)

    return lenient


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--stateless", action="store_true")
    parser.add_argument("--json-response", action="store_true")
    parser.add_argument("--no-health", action="store_true")
    parser.add_argument("--notes", action="store_true")
    parser.add_argument("--legacy-only", action="store_true")
    parser.add_argument("--session-idle-timeout", type=float, default=None)
    parser.add_argument("--max-sessions", type=int, default=None)
    parser.add_argument("--gzip", action="store_true")
    parser.add_argument("--any-method", action="store_true")
    parser.add_argument("--links", action="store_true")
    parser.add_argument("--mrtr", action="store_true")
    parser.add_argument("--require-authorization", metavar="VALUE", default=None)
    parser.add_argument("--require-bearer-jwt-aud", metavar="AUD", default=None)
    args = parser.parse_args()
    if not args.no_health:
        server.custom_route("/health", methods=["GET"])(health)
    if args.notes:
        server.tool()(remember)
        server.tool()(recall)
    if args.links:
        server.tool()(report_links)
    if args.mrtr:
        server.tool()(ask_colour)
    options = {}
    if args.session_idle_timeout is not None:
        options["session_idle_timeout"] = args.session_idle_timeout
    if args.max_sessions is not None:
        options["max_sessions"] = args.max_sessions
    app = server.streamable_http_app(
        streamable_http_path=MCP_PATH,
        stateless_http=args.stateless,
        json_response=args.json_response,
        # Behind the gateway the Host header is Envoy's listener, not this server's address.
        host="0.0.0.0",
        **options,
    )
    app = CountSessions(app)
    if args.legacy_only:
        app = LegacyOnly(app)
    if args.gzip:
        from starlette.middleware.gzip import GZipMiddleware

        app = GZipMiddleware(app, minimum_size=0)
    if args.any_method:
        app = any_method_as_post(app)
    app = Credentials(app, args.require_authorization, args.require_bearer_jwt_aud)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
