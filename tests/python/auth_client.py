"""The official Python SDK client against a gateway that requires a bearer token (issue 20).

usage: auth_client.py URL TOOL [TOKEN]
With TOKEN: connects with `Authorization: Bearer TOKEN`, lists the tools and calls TOOL;
prints {"tools": [...], "isError": ..., "text": ...}.
Without: connects without a token, which the gateway refuses; prints {"status": ...,
"resource_metadata": ...}, the URL read from WWW-Authenticate by the SDK's own helper (the
one its OAuth flow starts from), and {"sdk_error": ...}, what the SDK raised.
"""

import asyncio
import json
import sys

import httpx2
from mcp import ClientSession
from mcp.client.auth.utils import extract_resource_metadata_from_www_auth
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client


async def with_token(url: str, tool: str, token: str) -> dict:
    client = create_mcp_http_client(headers={"Authorization": f"Bearer {token}"})
    async with client:
        async with streamable_http_client(url, http_client=client, terminate_on_close=False) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                listed = await session.list_tools()
                result = await session.call_tool(tool, {})
                text = "".join(c.text for c in result.content if getattr(c, "type", "") == "text")
                is_error = getattr(result, "is_error", getattr(result, "isError", None))
                return {
                    "tools": sorted(t.name for t in listed.tools),
                    "isError": bool(is_error),
                    "text": text,
                }


async def without_token(url: str) -> dict:
    out: dict = {}
    try:
        async with streamable_http_client(url, terminate_on_close=False) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await asyncio.wait_for(session.initialize(), timeout=10)
        out["sdk_error"] = None
    except BaseException as e:  # noqa: BLE001 - the test wants what the SDK raised
        out["sdk_error"] = repr(e)
    async with httpx2.AsyncClient() as http:
        response = await http.post(
            url,
            json={
                "jsonrpc": "2.0",
                "id": 1,
                "method": "initialize",
                "params": {
                    "protocolVersion": "2025-06-18",
                    "capabilities": {},
                    "clientInfo": {"name": "auth-client", "version": "0"},
                },
            },
            headers={"Accept": "application/json, text/event-stream"},
        )
        out["status"] = response.status_code
        out["resource_metadata"] = extract_resource_metadata_from_www_auth(response)
        if out["resource_metadata"]:
            metadata = await http.get(out["resource_metadata"])
            out["metadata"] = metadata.json()
    return out


if __name__ == "__main__":
    url, tool = sys.argv[1], sys.argv[2]
    token = sys.argv[3] if len(sys.argv) > 3 else None
    try:
        coro = with_token(url, tool, token) if token else without_token(url)
        out = asyncio.run(asyncio.wait_for(coro, timeout=30))
    except BaseException as e:  # noqa: BLE001
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out, default=str))
