// A preload that keeps a Node server on 127.0.0.1: the tests may bind nothing else, and servers
// in the wild (the reference `@modelcontextprotocol/server-everything` among them) call
// `app.listen(PORT)`, which binds every interface. Used unmodified as
//
//   node --import /abs/path/tests/node/loopback.mjs .../dist/index.js streamableHttp
//
// Every TCP listen with no host, or with a wildcard host (`::`, `0.0.0.0`), binds 127.0.0.1
// instead. Listens on a named host, a pipe path, a handle or a file descriptor are left alone.
// Express's `app.listen` and `http.createServer().listen` both end in `net.Server.prototype.listen`,
// so patching it covers them.

import net from "node:net";

const LOOPBACK = "127.0.0.1";

// Hosts that mean "every interface", as Node reads them.
function isWildcard(host) {
  return host === undefined || host === null || host === "" || host === "::" ||
    host === "0.0.0.0" || host === "::0";
}

// A port as listen's first argument: a number, or a string of digits (`process.env.PORT`).
// Any other string is a pipe path to Node.
function isPort(value) {
  return typeof value === "number" || (typeof value === "string" && /^\d+$/.test(value));
}

// listen({port, host, ...}) as opposed to listen(handle) or listen({path}) / listen({fd}).
function isTcpOptions(value) {
  return typeof value === "object" && value !== null && value.path === undefined &&
    value.fd === undefined && value.handle === undefined && value._handle === undefined;
}

function note(shape) {
  process.stderr.write(`loopback.mjs: ${shape} binds ${LOOPBACK} only\n`);
}

const listen = net.Server.prototype.listen;

net.Server.prototype.listen = function (...args) {
  const [first] = args;
  if (args.length === 0 || typeof first === "function") {
    // listen() or listen(cb): a random port on every interface.
    note("listen()");
    return listen.call(this, 0, LOOPBACK, ...args);
  }
  if (isPort(first)) {
    // listen(port, [host], [backlog], [cb]): a string second argument is the host; anything
    // else (backlog, callback, nothing) means no host was given.
    if (typeof args[1] === "string") {
      if (isWildcard(args[1])) {
        note(`listen(${first}, "${args[1]}")`);
        args[1] = LOOPBACK;
      }
    } else {
      note(`listen(${first})`);
      args.splice(1, 0, LOOPBACK);
    }
    return listen.apply(this, args);
  }
  if (isTcpOptions(first) && isWildcard(first.host)) {
    note(`listen({port: ${first.port}})`);
    args[0] = { ...first, host: LOOPBACK };
    return listen.apply(this, args);
  }
  return listen.apply(this, args);
};
