// The official TypeScript MCP SDK client running a live command on a real machine through a
// running Dispatch (tests/mcp/test_mcp_live_clients.py).
//
// Usage: node mcp_live_client.mjs <mcp url> <bearer token> <mode> <tool arguments as JSON>
//   mode "progress": local_pc_execute_command with onprogress (and resetTimeoutOnProgress, a
//     raised timeout and maxTotalTimeout, as the README says a long command needs); prints
//     each notifications/progress ("progress") and the result ("result").
//   mode "cancel": the same call with an AbortSignal, aborted once the first progress
//     arrived: the SDK then POSTs notifications/cancelled for the request and rejects the
//     call ("aborted"); the test checks the command stopped on the machine.
// Prints one JSON object per line on stdout ({"step": ...}). Exits 0 when every step passed.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, token, mode, toolArgs] = process.argv.slice(2);
const started = performance.now();
const say = (step, fields = {}) =>
  process.stdout.write(JSON.stringify({ step, ms: Math.round(performance.now() - started), ...fields }) + "\n");

async function main() {
  const client = new Client({ name: "dispatch-live-suite", version: "1.0.0" });
  const posted = [];
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
    // Record what the SDK POSTs (to see its notifications/cancelled), then send it on.
    fetch: async (input, init) => {
      if (init?.method === "POST" && typeof init.body === "string") {
        try {
          posted.push(JSON.parse(init.body).method ?? "(response)");
        } catch {
          posted.push("(unparsed)");
        }
      }
      return fetch(input, init);
    },
  });
  transport.onerror = (error) => say("transport_error", { message: String(error?.message ?? error) });
  await client.connect(transport);
  say("initialized", { protocolVersion: transport.protocolVersion ?? null });

  const controller = new AbortController();
  let progressCount = 0;
  const options = {
    // A command may run for minutes: without these the SDK cancels the call at 60 s, and
    // progress does not extend that unless resetTimeoutOnProgress is set.
    timeout: 120_000,
    resetTimeoutOnProgress: true,
    maxTotalTimeout: 600_000,
    onprogress: (progress) => {
      progressCount += 1;
      say("progress", { progress: progress.progress, total: progress.total ?? null, message: progress.message ?? null });
      if (mode === "cancel" && progressCount === 1) {
        say("aborting");
        controller.abort("the test cancels the command");
      }
    },
  };
  if (mode === "cancel") options.signal = controller.signal;

  try {
    const result = await client.callTool(
      { name: "local_pc_execute_command", arguments: JSON.parse(toolArgs) },
      undefined,
      options,
    );
    say("result", { isError: result.isError ?? false, text: result.content?.[0]?.text ?? null });
  } catch (error) {
    if (mode !== "cancel") throw error;
    say("aborted", { message: String(error?.message ?? error) });
    // Give the notifications/cancelled POST time to be sent before the posted list is read.
    await new Promise((resolve) => setTimeout(resolve, 300));
  }
  say("posted", { methods: posted });
  await client.close();
  say("done");
}

main().then(
  () => process.exit(0),
  (error) => {
    say("failed", { message: String(error?.stack ?? error) });
    process.exit(1);
  },
);
