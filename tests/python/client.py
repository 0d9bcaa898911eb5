"""Drives one MCP session with the official Python SDK and prints what the SDK handed back.

usage: client.py [--mode MODE] URL STEP [STEP ...]
  STEP: "initialize" | "list" | "call:TOOL[:ARGUMENTS_JSON]" | "ping" | "wait:PATH"
        ("wait:PATH" sends nothing: it writes PATH.waiting, every step before it done, and
        waits until PATH exists, so a test can act between two steps of one session)
  MODE: the SDK's `Client(mode=...)`: "auto" (probe `server/discover`, fall back to
        `initialize`) or a 2026-era version such as "2026-07-28". Without it, a
        `ClientSession` does the legacy `initialize` handshake itself (step "initialize").
        With it, the handshake is the `Client`'s, and step "initialize" reports what it
        negotiated: {"protocolVersion", "serverInfo"}.

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
import os
import sys

from mcp import Client, ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError


def dump(model) -> dict:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def wait_for_file(path: str) -> dict:
    with open(path + ".waiting", "w"):
        pass
    while not os.path.exists(path):
        await asyncio.sleep(0.05)
    return {}


async def step(session: ClientSession, what: str):
    if what.startswith("wait:"):
        return await wait_for_file(what[len("wait:"):])
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


async def client_step(client: Client, what: str):
    if what.startswith("wait:"):
        return await wait_for_file(what[len("wait:"):])
    if what == "initialize":
        info = client.server_info
        return {
            "protocolVersion": client.protocol_version,
            "serverInfo": dump(info) if info is not None else None,
        }
    if what == "list":
        return await client.list_tools()
    if what.startswith("call:"):
        _, tool, *rest = what.split(":", 2)
        arguments = json.loads(rest[0]) if rest else {}
        return await client.call_tool(tool, arguments)
    raise ValueError(f"unknown step {what!r}")


async def run_steps(run, steps: list[str]) -> None:
    for what in steps:
        try:
            result = await asyncio.wait_for(run(what), timeout=60 if what.startswith("wait:") else 20)
            print(json.dumps({"step": what, "ok": result if isinstance(result, dict) else dump(result)}), flush=True)
        except MCPError as e:
            print(
                json.dumps({"step": what, "mcp_error": {"code": e.code, "message": e.message}}),
                flush=True,
            )
            return
        except BaseException as e:  # noqa: BLE001 - the test wants to see any failure
            print(json.dumps({"step": what, "exception": repr(e)}), flush=True)
            return


async def main(url: str, steps: list[str], mode: str | None) -> None:
    if mode is not None:
        async with Client(url, mode=mode) as client:
            await run_steps(lambda what: client_step(client, what), steps)
        return
    async with streamable_http_client(url, terminate_on_close=False) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await run_steps(lambda what: step(session, what), steps)


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = None
    if args[:1] == ["--mode"]:
        mode, args = args[1], args[2:]
    try:
        asyncio.run(asyncio.wait_for(main(args[0], args[1:], mode), timeout=85))
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"step": "session", "exception": repr(e)}), flush=True)
