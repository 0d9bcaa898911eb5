// A real MCP client for the end-to-end tests: the official TypeScript SDK, either
// `@modelcontextprotocol/sdk` 1.x or `@modelcontextprotocol/client` 2.x, over
// StreamableHTTPClientTransport. It connects (the SDK's handshake), runs the steps it is given and
// prints what the SDK handed the application, as one JSON object on stdout.
//
// usage: node call.mjs [--sdk 1|2] [--protocol-version V] [--timeout-ms N] URL [STEP [PARAMS_JSON]]...
//
//   STEP is an MCP method (tools/list, tools/call, ping, prompts/list, prompts/get,
//   resources/list, resources/templates/list, resources/read, server/discover, or any other method name, sent as a generic request); a JSON object
//   after it is its params, e.g. tools/call '{"name":"echo","arguments":{"text":"hi"}}'.
//   --protocol-version: the version the client offers. 2.x offers 2025-era versions in its
//   `initialize` and pins 2026-era ones through `server/discover`; 1.x always offers its
//   latest in Client.connect, so for another version this script runs the same handshake
//   itself. Without it each SDK does what it does by default.
//   The pseudo-step toolgate/wait-file '{"path": P}' sends nothing: it writes the file
//   P.waiting (every step before it is done) and waits until the file P exists, so a test can
//   act (kill an instance) between two calls of one session.
//   The pseudo-step toolgate/notified '{"method": M}' sends nothing either: it waits for a
//   notification of method M from the server (one the SDK has no handler of its own for, seen
//   since connect and not reported by an earlier such step) and reports it.
//
// stdout: {"sdk", "sdkVersion", "protocolVersion", "sessionId", "steps": [{"method", "ok",
// "result"} | {"method", "ok": false, "error": {"name", "message", "code", "status", "data"}}]}
// The first step is always `connect` (the SDK's handshake); when it fails nothing else runs.
// Exit 0 when every step succeeded, 1 when one failed (the error is in the output), 2 on a
// usage error.

import { readFileSync } from 'node:fs';

// The installed version of a package (its package.json is not among its exports).
function installedVersion(name) {
    const file = new URL(`./node_modules/${name}/package.json`, import.meta.url);
    return JSON.parse(readFileSync(file, 'utf8')).version;
}

function usage(message) {
    process.stderr.write(`call.mjs: ${message}\n`);
    process.stderr.write('usage: node call.mjs [--sdk 1|2] [--protocol-version V] [--timeout-ms N] URL [STEP [PARAMS_JSON]]...\n');
    process.exit(2);
}

function parseArgs(argv) {
    const opts = { sdk: '2', protocolVersion: undefined, timeoutMs: 20000, url: undefined, steps: [] };
    let i = 0;
    for (; i < argv.length && argv[i].startsWith('--'); i += 2) {
        const [flag, value] = [argv[i], argv[i + 1]];
        if (value === undefined) usage(`${flag} needs a value`);
        if (flag === '--sdk') opts.sdk = value;
        else if (flag === '--protocol-version') opts.protocolVersion = value;
        else if (flag === '--timeout-ms') opts.timeoutMs = Number(value);
        else usage(`unknown flag ${flag}`);
    }
    if (!['1', '2'].includes(opts.sdk)) usage(`--sdk must be 1 or 2, not ${opts.sdk}`);
    if (!(opts.timeoutMs > 0)) usage('--timeout-ms must be a positive number');
    opts.url = argv[i++];
    if (!opts.url) usage('URL missing');
    for (; i < argv.length; i++) {
        const method = argv[i];
        if (method.startsWith('{')) usage(`params ${method} follow no method`);
        let params;
        if (argv[i + 1]?.startsWith('{')) {
            try {
                params = JSON.parse(argv[++i]);
            } catch (e) {
                usage(`params of ${method} are not JSON (${e.message}): ${argv[i]}`);
            }
        }
        opts.steps.push({ method, params });
    }
    return opts;
}

// A Standard Schema (https://standardschema.dev) that accepts any result: 2.x validates the
// results of methods outside the spec against the schema it is given.
const anyResult = { '~standard': { version: 1, vendor: 'toolgate-tests', validate: value => ({ value }) } };

function isModern(version) {
    return version !== undefined && version >= '2026';
}

const clientInfo = { name: 'toolgate-tests-node', version: '0' };

async function sdk2(opts) {
    const { Client, StreamableHTTPClientTransport } = await import('@modelcontextprotocol/client');
    const options = {};
    if (isModern(opts.protocolVersion)) options.versionNegotiation = { mode: { pin: opts.protocolVersion } };
    else if (opts.protocolVersion) options.supportedProtocolVersions = [opts.protocolVersion];
    const client = new Client(clientInfo, options);
    const notified = noteNotifications(client);
    const transport = new StreamableHTTPClientTransport(new URL(opts.url));
    const requestOptions = { timeout: opts.timeoutMs };
    return {
        sdk: '@modelcontextprotocol/client',
        notified,
        sdkVersion: installedVersion('@modelcontextprotocol/client'),
        connect: async () => {
            await client.connect(transport, requestOptions);
            return {
                serverInfo: client.getServerVersion(),
                capabilities: client.getServerCapabilities(),
                instructions: client.getInstructions()
            };
        },
        protocolVersion: () => client.getNegotiatedProtocolVersion(),
        sessionId: () => transport.sessionId,
        run: ({ method, params }) => {
            switch (method) {
                case 'tools/list':
                    return client.listTools(params, requestOptions);
                case 'tools/call':
                    return client.callTool(params ?? {}, requestOptions);
                case 'ping':
                    return client.ping(requestOptions);
                case 'server/discover':
                    return client.discover(requestOptions);
                case 'prompts/list':
                    return client.listPrompts(params, requestOptions);
                case 'resources/list':
                    return client.listResources(params, requestOptions);
                case 'resources/templates/list':
                    return client.listResourceTemplates(params, requestOptions);
                case 'resources/read':
                    return client.readResource(params, requestOptions);
                case 'prompts/get':
                    return client.getPrompt(params, requestOptions);
                default:
                    return client.request({ method, params }, anyResult, requestOptions);
            }
        },
        close: () => client.close()
    };
}

async function sdk1(opts) {
    const { Client } = await import('@modelcontextprotocol/sdk/client/index.js');
    const { StreamableHTTPClientTransport } = await import('@modelcontextprotocol/sdk/client/streamableHttp.js');
    const { Protocol } = await import('@modelcontextprotocol/sdk/shared/protocol.js');
    const { InitializeResultSchema, ResultSchema } = await import('@modelcontextprotocol/sdk/types.js');
    const client = new Client(clientInfo, { capabilities: {} });
    const notified = noteNotifications(client);
    const transport = new StreamableHTTPClientTransport(new URL(opts.url));
    const requestOptions = { timeout: opts.timeoutMs };
    let negotiated;
    return {
        sdk: '@modelcontextprotocol/sdk',
        notified,
        sdkVersion: installedVersion('@modelcontextprotocol/sdk'),
        connect: async () => {
            if (opts.protocolVersion === undefined) {
                await client.connect(transport, requestOptions);
            } else {
                // Client.connect with another offered version: the base class connects the
                // transport, then the handshake Client.connect would run, with this version.
                await Protocol.prototype.connect.call(client, transport);
                const result = await client.request(
                    {
                        method: 'initialize',
                        params: { protocolVersion: opts.protocolVersion, capabilities: {}, clientInfo }
                    },
                    InitializeResultSchema,
                    requestOptions
                );
                client._serverCapabilities = result.capabilities;
                client._serverVersion = result.serverInfo;
                client._instructions = result.instructions;
                transport.setProtocolVersion(result.protocolVersion);
                await client.notification({ method: 'notifications/initialized' });
            }
            negotiated = transport.protocolVersion;
            return {
                serverInfo: client.getServerVersion(),
                capabilities: client.getServerCapabilities(),
                instructions: client.getInstructions()
            };
        },
        protocolVersion: () => negotiated,
        sessionId: () => transport.sessionId,
        run: ({ method, params }) => {
            switch (method) {
                case 'tools/list':
                    return client.listTools(params, requestOptions);
                case 'tools/call':
                    return client.callTool(params ?? {}, undefined, requestOptions);
                case 'ping':
                    return client.ping(requestOptions);
                case 'prompts/list':
                    return client.listPrompts(params, requestOptions);
                case 'resources/list':
                    return client.listResources(params, requestOptions);
                case 'resources/templates/list':
                    return client.listResourceTemplates(params, requestOptions);
                case 'resources/read':
                    return client.readResource(params, requestOptions);
                case 'prompts/get':
                    return client.getPrompt(params, requestOptions);
                default:
                    return client.request({ method, params }, ResultSchema, requestOptions);
            }
        },
        close: () => client.close()
    };
}

// What an application sees of an error: its class, text, JSON-RPC or HTTP code, data.
function describeError(e) {
    const out = { name: e?.constructor?.name ?? typeof e, message: String(e?.message ?? e) };
    if (e?.code !== undefined) out.code = e.code;
    if (typeof e?.status === 'number') out.status = e.status;
    if (e?.data !== undefined) out.data = e.data;
    if (e?.cause !== undefined) out.cause = String(e.cause?.message ?? e.cause);
    return out;
}

// The notifications the SDK hands the application without a handler of its own, in order.
function noteNotifications(client) {
    const notified = [];
    client.fallbackNotificationHandler = async (notification) => {
        notified.push({ notification, taken: false });
    };
    return notified;
}

async function waitNotified(notified, method) {
    if (!method) throw new Error('toolgate/notified needs {"method": ...}');
    for (;;) {
        const seen = notified.find(n => !n.taken && n.notification.method === method);
        if (seen) {
            seen.taken = true;
            return seen.notification;
        }
        await new Promise(r => setTimeout(r, 50));
    }
}

async function waitFile(path) {
    const { existsSync, writeFileSync } = await import('node:fs');
    if (!path) throw new Error('toolgate/wait-file needs {"path": ...}');
    // Tells the test that every step before this one is done, its answer received: a server
    // killed only then cannot cut off a call still in flight.
    writeFileSync(`${path}.waiting`, '');
    while (!existsSync(path)) await new Promise(r => setTimeout(r, 50));
}

async function main() {
    const opts = parseArgs(process.argv.slice(2));
    const client = opts.sdk === '1' ? await sdk1(opts) : await sdk2(opts);
    const report = { sdk: client.sdk, sdkVersion: client.sdkVersion, steps: [] };
    let failed = false;
    // Read before close(), which forgets the negotiated version and the session.
    const snapshot = () => {
        report.protocolVersion = client.protocolVersion() ?? null;
        report.sessionId = client.sessionId() ?? null;
    };
    const print = () => process.stdout.write(JSON.stringify(report) + '\n');
    // A deadline for the whole run, so a hung SDK still reports what it did.
    const deadline = setTimeout(() => {
        report.steps.push({ method: 'deadline', ok: false, error: { name: 'Timeout', message: `not done after ${opts.timeoutMs} ms` } });
        snapshot();
        print();
        process.exit(1);
    }, opts.timeoutMs);
    // `connect` is the SDK's handshake: initialize (or server/discover for a 2026-era pin).
    try {
        report.steps.push({ method: 'connect', ok: true, result: await client.connect() });
        for (const step of opts.steps) {
            try {
                if (step.method === 'toolgate/notified') {
                    const notification = await waitNotified(client.notified, step.params?.method);
                    report.steps.push({ method: step.method, ok: true, result: notification });
                    continue;
                }
                if (step.method === 'toolgate/wait-file') {
                    await waitFile(step.params?.path);
                    report.steps.push({ method: step.method, ok: true, result: null });
                    continue;
                }
                report.steps.push({ method: step.method, ok: true, result: (await client.run(step)) ?? null });
            } catch (e) {
                failed = true;
                report.steps.push({ method: step.method, ok: false, error: describeError(e) });
            }
        }
    } catch (e) {
        failed = true;
        report.steps.push({ method: 'connect', ok: false, error: describeError(e) });
    }
    clearTimeout(deadline);
    snapshot();
    // No DELETE of the session: what the tests look at is the calls, not the teardown.
    await client.close().catch(() => {});
    print();
    process.exit(failed ? 1 : 0);
}

main().catch(e => {
    process.stderr.write(`call.mjs: ${e?.stack ?? e}\n`);
    process.exit(2);
});
