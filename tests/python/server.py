"""An MCP server built with the official Python SDK, for end-to-end tests behind the gateway.

usage: server.py PORT [--stateless] [--json-response] [--no-health]

It is the server a hostile client would aim at: pydantic's JSON reader is lenient (duplicate keys,
the last one wins; NaN and Infinity accepted), so whatever the gateway lets through, this server
executes. Every tool counts its calls, and `GET /calls` returns the counts as JSON, so a test can
tell whether a tool ran. `GET /health` answers 200 for toolgate-xds's probes, unless `--no-health`
leaves the route out (a 404, as on most MCP servers, which only an MCP-level probe can check).

Tools: `read_order`, `write_order` (return text), `fail_order` (raises: an `isError` result),
`slow_order` (sleeps `seconds`, default 3).
"""

import argparse
import asyncio
import collections

import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from mcp.server.mcpserver import MCPServer

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


@server.custom_route("/calls", methods=["GET"])
async def calls(_: Request) -> JSONResponse:
    return JSONResponse(dict(CALLS))


# Registered in main(), not by decorator, so that --no-health can leave it out.
async def health(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--stateless", action="store_true")
    parser.add_argument("--json-response", action="store_true")
    parser.add_argument("--no-health", action="store_true")
    args = parser.parse_args()
    if not args.no_health:
        server.custom_route("/health", methods=["GET"])(health)
    app = server.streamable_http_app(
        stateless_http=args.stateless,
        json_response=args.json_response,
        # Behind the gateway the Host header is Envoy's listener, not this server's address.
        host="0.0.0.0",
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
