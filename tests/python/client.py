"""Drives one MCP session with the official Python SDK and prints what the SDK handed back.

usage: client.py URL STEP [STEP ...]
  STEP: "initialize" | "list" | "call:TOOL[:ARGUMENTS_JSON]" | "ping"

Prints one JSON object per step on its own line:
  {"step": ..., "ok": {...}}                       the SDK returned a result
  {"step": ..., "mcp_error": {"code", "message"}}  the SDK raised an MCP error (a JSON-RPC
                                                    error it read, or one it made up)
  {"step": ..., "exception": "..."}                anything else (a transport failure)
and stops at the first step that did not return a result. Exit status 0 unless the script
itself broke.
"""

import asyncio
import json
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


def dump(model) -> dict:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def step(session: ClientSession, what: str):
    if what == "initialize":
        return await session.initialize()
    if what == "list":
        return await session.list_tools()
    if what == "ping":
        return await session.send_ping()
    if what.startswith("call:"):
        _, tool, *rest = what.split(":", 2)
        arguments = json.loads(rest[0]) if rest else {}
        return await session.call_tool(tool, arguments)
    raise ValueError(f"unknown step {what!r}")


async def main(url: str, steps: list[str]) -> None:
    async with streamable_http_client(url, terminate_on_close=False) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            for what in steps:
                try:
                    result = await asyncio.wait_for(step(session, what), timeout=20)
                    print(json.dumps({"step": what, "ok": dump(result)}), flush=True)
                except MCPError as e:
                    print(
                        json.dumps({"step": what, "mcp_error": {"code": e.code, "message": e.message}}),
                        flush=True,
                    )
                    return
                except BaseException as e:  # noqa: BLE001 - the test wants to see any failure
                    print(json.dumps({"step": what, "exception": repr(e)}), flush=True)
                    return


if __name__ == "__main__":
    try:
        asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2:]), timeout=60))
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"step": "session", "exception": repr(e)}), flush=True)
