"""Calls one MCP tool with the official Python SDK and prints the CallToolResult as JSON.

usage: call_tool.py URL TOOL [ARGUMENTS_JSON]
Exit 0 with {"isError": ..., "text": ..., "meta": ...} on stdout when the SDK returned a
CallToolResult; exit 1 with the exception when the SDK raised one instead.
"""

import asyncio
import json
import sys

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client


async def main(url: str, tool: str, arguments: dict) -> dict:
    # No DELETE on close: rmcp answers it 202, which this SDK version reports as an error at
    # exit; session teardown is not what the test is about.
    async with streamable_http_client(url, terminate_on_close=False) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool(tool, arguments)
            text = "".join(c.text for c in result.content if getattr(c, "type", "") == "text")
            # The SDK's models name fields in snake case; older releases used camel case.
            is_error = getattr(result, "is_error", getattr(result, "isError", None))
            return {
                "isError": bool(is_error),
                "text": text,
                "meta": getattr(result, "meta", None),
            }


if __name__ == "__main__":
    try:
        out = asyncio.run(
            asyncio.wait_for(
                main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}),
                timeout=20,
            )
        )
    except BaseException as e:  # noqa: BLE001 - the test wants to see any failure
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out, default=str))
