// The official TypeScript MCP SDK client against a running Dispatch (tests/mcp/test_mcp_typescript_client.py).
//
// Usage: node mcp_client.mjs <mcp url> <bearer token> <remote tool name> <remote tool arguments as JSON>
// Prints one JSON object per line on stdout ({"step": ...}); the test reads them as they come.
// Steps: initialize (the SDK then opens its GET stream after the notifications/initialized
// POST got 202), the list_changed every (re)connect of that stream brings, tools/list, the
// launch tool as listed ("launch_tool": its description and input schema) and a launch without
// a type ("launch_without_type"), a machine tool (list_machines), then "waiting_for_remote":
// the test connects a remote now,
// and the client waits for notifications/tools/list_changed, lists again and calls the
// remote's function. Exits 0 when every step passed, 1 otherwise.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";
import { ToolListChangedNotificationSchema } from "@modelcontextprotocol/sdk/types.js";

const [url, token, remoteTool, remoteArgs] = process.argv.slice(2);
const started = performance.now();
const say = (step, fields = {}) =>
  process.stdout.write(JSON.stringify({ step, ms: Math.round(performance.now() - started), ...fields }) + "\n");

// list_changed notifications as they arrive, for nextChange() to take in order.
const changes = [];
let wakeUp = null;
function nextChange(timeoutMs) {
  if (changes.length) return Promise.resolve(changes.shift());
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no notifications/tools/list_changed within ${timeoutMs} ms`)), timeoutMs);
    wakeUp = () => {
      clearTimeout(timer);
      wakeUp = null;
      resolve(changes.shift());
    };
  });
}

async function main() {
  const client = new Client({ name: "dispatch-suite", version: "1.0.0" });
  client.setNotificationHandler(ToolListChangedNotificationSchema, (notification) => {
    changes.push(notification);
    say("list_changed", { method: notification.method });
    wakeUp?.();
  });
  const transport = new StreamableHTTPClientTransport(new URL(url), {
    requestInit: { headers: { Authorization: `Bearer ${token}` } },
  });
  transport.onerror = (error) => say("transport_error", { message: String(error?.message ?? error) });
  await client.connect(transport);
  say("initialized", {
    protocolVersion: transport.protocolVersion ?? null,
    capabilities: client.getServerCapabilities(),
  });

  await nextChange(10000); // the one every (re)connect of the GET stream brings
  say("stream_open");

  const before = await client.listTools();
  say("tools", { names: before.tools.map((tool) => tool.name) });

  const launch = before.tools.find((tool) => tool.name === "dispatch_launch_agent");
  say("launch_tool", { description: launch?.description ?? null, inputSchema: launch?.inputSchema ?? null });
  const untyped = await client.callTool({
    name: "dispatch_launch_agent",
    arguments: { name: "helper", prompt: "summarise the repository" },
  });
  say("launch_without_type", { isError: untyped.isError ?? false, text: untyped.content?.[0]?.text ?? null });

  const machines = await client.callTool({ name: "list_machines", arguments: {} });
  say("machine_tool", { isError: machines.isError ?? false, text: machines.content?.[0]?.text ?? null });

  say("waiting_for_remote");
  await nextChange(20000);
  const after = await client.listTools();
  say("tools_after", { names: after.tools.map((tool) => tool.name) });

  const result = await client.callTool({ name: remoteTool, arguments: JSON.parse(remoteArgs) });
  say("remote_tool", { isError: result.isError ?? false, text: result.content?.[0]?.text ?? null });

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
