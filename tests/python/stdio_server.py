"""A stdio MCP server built with the official Python SDK (`MCPServer.run()`'s default transport),
for the tests of `toolgate-register --stdio`.

usage: stdio_server.py

It reads JSON-RPC on stdin and writes it on stdout, one client per process, and speaks what the
SDK speaks over stdio: the `initialize` handshake of 2025-era clients, or 2026-07-28 requests
that each carry their envelope (the first request decides).

Tools:
  echo(text)             returns the text
  pid()                  the process id, so a test sees which child answered
  remember(x), recall()  keep and tell a value in this process: per-session state when the
                         bridge runs one child per session
  progress(steps)        reports `steps` progress notifications, then returns
  ask(question)          asks the client for an answer (elicitation) and returns it
  slow(seconds)          sleeps, then returns
  complain(text)         writes the text on its stderr
  until_cancelled(marker, seconds)
                         writes `marker`.started, sleeps; if the call is cancelled, writes
                         `marker` before it ends
  garbage()              writes a line that is not JSON-RPC on its stdout, then returns
  huge_line(mib)         writes one line of `mib` MiB on its stdout, then returns
"""

import asyncio
import os
import sys

from pydantic import BaseModel

import mcp.server.stdio as stdio
from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("toolgate-test-stdio")
NOTES: dict[str, str] = {}


@server.tool()
def echo(text: str = "") -> str:
    return text


@server.tool()
def pid() -> str:
    return str(os.getpid())


@server.tool()
def remember(x: str) -> str:
    NOTES["x"] = x
    return f"process {os.getpid()} keeps {x!r}"


@server.tool()
def recall() -> str:
    if "x" in NOTES:
        return f"process {os.getpid()} holds {NOTES['x']!r}"
    return f"process {os.getpid()} holds nothing"


@server.tool()
async def progress(steps: int, ctx: Context) -> str:
    for i in range(steps):
        await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
        await asyncio.sleep(0.05)
    return f"{steps} steps done"


class Answer(BaseModel):
    answer: str


@server.tool()
async def ask(question: str, ctx: Context) -> str:
    result = await ctx.elicit(question, Answer)
    if result.action == "accept" and result.data is not None:
        return f"the client answered {result.data.answer!r}"
    return f"the client did not answer ({result.action})"


@server.tool()
async def slow(seconds: float = 1.0) -> str:
    await asyncio.sleep(seconds)
    return f"slept {seconds} s"


@server.tool()
def complain(text: str) -> str:
    print(text, file=sys.stderr, flush=True)
    return "said it on stderr"


@server.tool()
async def until_cancelled(marker: str, seconds: float = 30.0) -> str:
    with open(marker + ".started", "w") as f:
        f.write(str(os.getpid()))
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        with open(marker, "w") as f:
            f.write("cancelled")
        raise
    return f"slept {seconds} s"


def wire() -> int:
    """The descriptor the SDK writes JSON-RPC to: it moves fd 1 to stderr while it serves."""
    claim = stdio._claims.get(1)
    return claim.private_fd if claim is not None and claim.private_fd is not None else 1


def write_all(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(wire(), view):]


@server.tool()
def garbage() -> str:
    write_all(b"this is not JSON-RPC\n")
    return "wrote garbage"


@server.tool()
def huge_line(mib: int = 100) -> str:
    chunk = b"x" * (1 << 20)
    write_all(b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"')
    for _ in range(mib):
        write_all(chunk)
    write_all(b'"}}\n')
    return f"wrote a line of {mib} MiB"


if __name__ == "__main__":
    server.run()
