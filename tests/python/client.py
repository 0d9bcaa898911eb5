"""Drives one MCP session with the official Python SDK and prints what the SDK handed back.

usage: client.py [--mode MODE] [--elicit-answer TEXT] [--sample-answer TEXT] [--go-on] URL STEP [STEP ...]
  STEP: "initialize" | "list" | "call:TOOL[:ARGUMENTS_JSON]" | "progress-call:TOOL[:ARGUMENTS_JSON]"
        | "ping" | "wait:PATH" | "resources" | "templates" | "read:URI" | "prompts"
        | "prompt:NAME[:ARGUMENTS_JSON]" | "complete:PROMPT:ARGUMENT:VALUE" | "set-level:LEVEL"
        | "subscribe:URI" | "unsubscribe:URI" | "notified:METHOD"
        ("wait:PATH" sends nothing: it writes PATH.waiting, every step before it done, and
        waits until PATH exists, so a test can act between two steps of one session;
        "notified:METHOD" sends nothing either: it waits (up to 20 s) for a notification of
        METHOD from the server, seen since the session began, and reports the first
        {"method", "params"} not reported yet (a ClientSession only);
        "progress-call" is "call" with a progress callback: it reports
        {"result", "progress": [{"progress", "total", "message"}, ...]})
  --go-on: go on after a step that got an MCP error (a transport failure still stops)
  --elicit-answer TEXT: the client supports elicitation and accepts every request of the
        server with {"answer": TEXT} (without it the SDK declines)
  --sample-answer TEXT: the client supports sampling and answers every sampling request of
        the server with an assistant message TEXT from model "toolgate-test"
  MODE: the SDK's `Client(mode=...)`: "auto" (probe `server/discover`, fall back to
        `initialize`) or a 2026-era version such as "2026-07-28". Without it, a
        `ClientSession` does the legacy `initialize` handshake itself (step "initialize").
        With it, the handshake is the `Client`'s, and step "initialize" reports what it
        negotiated: {"protocolVersion", "serverInfo"}. In a mode, a "call:" the server
        answers with a 2026-07-28 multi-round-trip result ("resultType": "input_required")
        is finished by the SDK: it answers the `inputRequests` with the callbacks above
        (`--elicit-answer`, `--sample-answer`), calls the tool again with `inputResponses`
        and the echoed `requestState`, and the step reports the final result.

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
from mcp_types import CreateMessageResult, ElicitResult, PromptReference, TextContent


def dump(model) -> dict:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)


async def wait_for_file(path: str) -> dict:
    with open(path + ".waiting", "w"):
        pass
    while not os.path.exists(path):
        await asyncio.sleep(0.05)
    return {}


async def call_with_progress(call, what: str) -> dict:
    _, tool, *rest = what.split(":", 2)
    arguments = json.loads(rest[0]) if rest else {}
    seen: list[dict] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append({"progress": progress, "total": total, "message": message})

    result = await call(tool, arguments, progress_callback=on_progress)
    return {"result": dump(result), "progress": seen}


def elicitation_callback(answer: str | None):
    if answer is None:
        return None

    async def answer_it(context, params):
        return ElicitResult(action="accept", content={"answer": answer})

    return answer_it


def sampling_callback(answer: str | None):
    if answer is None:
        return None

    async def answer_it(context, params):
        return CreateMessageResult(
            role="assistant", content=TextContent(type="text", text=answer), model="toolgate-test"
        )

    return answer_it


async def surface_step(api, what: str):
    """Resources and prompts, the same calls on a `ClientSession` and on a `Client`."""
    if what == "resources":
        return await api.list_resources()
    if what == "templates":
        return await api.list_resource_templates()
    if what.startswith("read:"):
        return await api.read_resource(what[len("read:"):])
    if what == "prompts":
        return await api.list_prompts()
    if what.startswith("prompt:"):
        _, name, *rest = what.split(":", 2)
        arguments = json.loads(rest[0]) if rest else None
        return await api.get_prompt(name, arguments)
    if what.startswith("complete:"):
        _, prompt, argument, value = what.split(":", 3)
        ref = PromptReference(type="ref/prompt", name=prompt)
        return await api.complete(ref, {"name": argument, "value": value})
    if what.startswith("set-level:"):
        return await api.set_logging_level(what[len("set-level:"):])
    if what.startswith("subscribe:"):
        return await api.subscribe_resource(what[len("subscribe:"):])
    if what.startswith("unsubscribe:"):
        return await api.unsubscribe_resource(what[len("unsubscribe:"):])
    return None


async def step(session: ClientSession, what: str):
    surface = await surface_step(session, what)
    if surface is not None:
        return surface
    if what.startswith("progress-call:"):
        return await call_with_progress(session.call_tool, what)
    if what.startswith("wait:"):
        return await wait_for_file(what[len("wait:"):])
    if what.startswith("notified:"):
        return await wait_notified(what[len("notified:"):])
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
    surface = await surface_step(client, what)
    if surface is not None:
        return surface
    if what.startswith("progress-call:"):
        return await call_with_progress(client.call_tool, what)
    if what.startswith("wait:"):
        return await wait_for_file(what[len("wait:"):])
    if what == "initialize":
        info = client.server_info
        return {
            "protocolVersion": client.protocol_version,
            "serverInfo": dump(info) if info is not None else None,
            "capabilities": dump(client.server_capabilities),
        }
    if what == "list":
        return await client.list_tools()
    if what.startswith("call:"):
        _, tool, *rest = what.split(":", 2)
        arguments = json.loads(rest[0]) if rest else {}
        return await client.call_tool(tool, arguments)
    raise ValueError(f"unknown step {what!r}")


GO_ON = False

# Every notification the session surfaced, in order, and how many `notified:` steps took.
NOTIFIED: list[dict] = []
TAKEN: set[int] = set()


async def note_notification(message) -> None:
    if isinstance(message, Exception):
        return
    NOTIFIED.append(dump(message))


async def wait_notified(method: str) -> dict:
    while True:
        for i, seen in enumerate(NOTIFIED):
            if i not in TAKEN and seen.get("method") == method:
                TAKEN.add(i)
                return seen
        await asyncio.sleep(0.05)


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
            if not GO_ON:
                return
        except BaseException as e:  # noqa: BLE001 - the test wants to see any failure
            print(json.dumps({"step": what, "exception": repr(e)}), flush=True)
            return


async def main(url: str, steps: list[str], mode: str | None, answers: dict) -> None:
    callbacks = {
        "elicitation_callback": elicitation_callback(answers.get("--elicit-answer")),
        "sampling_callback": sampling_callback(answers.get("--sample-answer")),
    }
    if mode is not None:
        async with Client(url, mode=mode, **callbacks) as client:
            await run_steps(lambda what: client_step(client, what), steps)
        return
    async with streamable_http_client(url, terminate_on_close=False) as streams:
        read, write = streams[0], streams[1]
        async with ClientSession(read, write, message_handler=note_notification, **callbacks) as session:
            await run_steps(lambda what: step(session, what), steps)


if __name__ == "__main__":
    args = sys.argv[1:]
    mode = None
    answers: dict = {}
    while args[:1] in (["--mode"], ["--elicit-answer"], ["--sample-answer"], ["--go-on"]):
        if args[0] == "--go-on":
            GO_ON = True
            args = args[1:]
            continue
        if args[0] == "--mode":
            mode = args[1]
        else:
            answers[args[0]] = args[1]
        args = args[2:]
    try:
        asyncio.run(asyncio.wait_for(main(args[0], args[1:], mode, answers), timeout=85))
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"step": "session", "exception": repr(e)}), flush=True)
