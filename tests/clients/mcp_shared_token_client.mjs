// Two official TypeScript MCP SDK clients on one bearer token, as Claude Code and Cursor
// started from one .mcp.json are (tests/mcp/test_mcp_live_clients.py). Each SDK client
// numbers its requests from 0, so both send their tools/call with the same JSON-RPC id.
//
// Usage: node mcp_shared_token_client.mjs <mcp url> <bearer token> <B's arguments as JSON> <A's arguments as JSON>
// Steps printed (one JSON object per line on stdout, {"step": ...}):
//   "connected"   both initialized: their Mcp-Session-Id values;
//   "b_running"   B's local_pc_execute_command sent its first progress (it is running);
//   "a_running"   A's call, started only then, sent its first progress: A aborts it, and
//                 the SDK POSTs notifications/cancelled naming A's request id;
//   "a_cancelled" that POST was answered (status), with the ids both tools/call used;
//   "b_result"    B's call answered (the test lets B's command finish after "a_cancelled").
// Exits 0 when every step passed, 1 otherwise.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, token, argsB, argsA] = process.argv.slice(2);
const started = performance.now();
const say = (step, fields = {}) =>
  process.stdout.write(JSON.stringify({ step, ms: Math.round(performance.now() - started), ...fields }) + "\n");

// The JSON-RPC ids of each client's tools/call, and a promise per client resolved with the
// HTTP status of its notifications/cancelled POST.
function connect(name) {
  const seen = { callIds: [], cancelStatus: null };
  let cancelAnswered;
  seen.cancelled = new Promise((resolve) => (cancelAnswered = resolve));
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
    fetch: async (input, init) => {
      let message = null;
      if (init?.method === "POST" && typeof init.body === "string") message = JSON.parse(init.body);
      if (message?.method === "tools/call") seen.callIds.push(message.id);
      const response = await fetch(input, init);
      if (message?.method === "notifications/cancelled") cancelAnswered(response.status);
      return response;
    },
  });
  transport.onerror = (error) => say("transport_error", { client: name, message: String(error?.message ?? error) });
  const client = new Client({ name: `dispatch-suite-${name}`, version: "1.0.0" });
  return { client, transport, seen };
}

function firstProgress() {
  let resolve;
  const promise = new Promise((r) => (resolve = r));
  return { promise, resolve };
}

async function main() {
  const a = connect("a");
  const b = connect("b");
  await a.client.connect(a.transport);
  await b.client.connect(b.transport);
  say("connected", { sessionA: a.transport.sessionId ?? null, sessionB: b.transport.sessionId ?? null });

  const options = { timeout: 120_000, resetTimeoutOnProgress: true, maxTotalTimeout: 600_000 };
  const bRunning = firstProgress();
  const bCall = b.client.callTool({ name: "local_pc_execute_command", arguments: JSON.parse(argsB) }, undefined, {
    ...options,
    onprogress: () => bRunning.resolve(),
  });
  await bRunning.promise;
  say("b_running");

  const controller = new AbortController();
  const aCall = a.client.callTool({ name: "local_pc_execute_command", arguments: JSON.parse(argsA) }, undefined, {
    ...options,
    signal: controller.signal,
    onprogress: () => {
      if (!controller.signal.aborted) {
        say("a_running");
        controller.abort("the test cancels A's command");
      }
    },
  });
  try {
    await aCall;
    throw new Error("A's call was answered though it was aborted");
  } catch (error) {
    if (!controller.signal.aborted) throw error;
  }
  const status = await a.seen.cancelled;
  say("a_cancelled", { status, idsA: a.seen.callIds, idsB: b.seen.callIds });

  const result = await bCall;
  say("b_result", { isError: result.isError ?? false, text: result.content?.[0]?.text ?? null });
  await a.client.close();
  await b.client.close();
  say("done");
}

main().then(
  () => process.exit(0),
  (error) => {
    say("failed", { message: String(error?.stack ?? error) });
    process.exit(1);
  },
);
