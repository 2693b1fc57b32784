// The official TypeScript MCP SDK as an OAuth client of Dispatch's /mcp/oauth
// (tests/oauth/test_oauth_clients.py, docs/mcp.md#oauth): the SDK's own auth() does the
// discovery (RFC 9728 from the 401, then RFC 8414), the registration (DCR, or a Client ID
// Metadata Document when a URL is given and the server supports it), PKCE, the code
// exchange and every refresh; this script only plays the application around it.
//
// Usage: node mcp_oauth_client.mjs <mcp url> <callback port> [<client metadata document url>]
//
// Prints one JSON object per line on stdout ({"step": ...}), as things happen:
//   authorize {url}            the SDK asked to send the user to this URL (the test opens it)
//   registered {client_id}     the SDK saved client information (after DCR, or the CIMD URL)
//   tokens {access_token, refresh_token, count}  the SDK saved tokens (count: how many times)
//   invalidated {scope}        the SDK threw stored credentials away (a refused refresh)
//   callback {iss, state_ok}   the browser came back to the loopback redirect URI
//   connected {protocolVersion}
//   stream_open / stream_closed {error}   the GET event stream (the SDK opens it after initialize)
//   tools {names}, called {isError, text}, call_failed {name, message}
//   transport_error {message}, ready (waiting for a command), failed {message}
// Commands on stdin, one a line: "call <tool name>" (calls it with {}), "parallel <tool name>"
// (two such calls at once: a "parallel" line with both outcomes), "quit".
// The tokens are printed because the test checks the token endpoint with them (reuse
// detection, revocation); nothing here is a real secret.
import http from "node:http";
import readline from "node:readline";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { UnauthorizedError } from "@modelcontextprotocol/sdk/client/auth.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [mcpUrl, callbackPort, clientMetadataUrl] = process.argv.slice(2);
const redirectUrl = `http://127.0.0.1:${callbackPort}/callback`;
const started = performance.now();
const say = (step, fields = {}) =>
  process.stdout.write(JSON.stringify({ step, ms: Math.round(performance.now() - started), ...fields }) + "\n");

// An application's OAuthClientProvider, kept in memory (a desktop app would use its keychain).
class MemoryProvider {
  constructor() {
    this.savedClient = undefined;
    this.savedTokens = undefined;
    this.verifier = undefined;
    this.discovery = undefined;
    this.lastState = undefined;
    this.tokenCount = 0;
    if (clientMetadataUrl) this.clientMetadataUrl = clientMetadataUrl;
  }
  get redirectUrl() {
    return redirectUrl;
  }
  get clientMetadata() {
    return {
      client_name: "Dispatch suite (TypeScript SDK)",
      redirect_uris: [redirectUrl],
      grant_types: ["authorization_code", "refresh_token"],
      response_types: ["code"],
      token_endpoint_auth_method: "none",
    };
  }
  state() {
    this.lastState = crypto.randomUUID();
    return this.lastState;
  }
  clientInformation() {
    return this.savedClient;
  }
  saveClientInformation(information) {
    this.savedClient = information;
    say("registered", { client_id: information.client_id });
  }
  tokens() {
    return this.savedTokens;
  }
  saveTokens(tokens) {
    this.savedTokens = tokens;
    this.tokenCount += 1;
    say("tokens", {
      access_token: tokens.access_token,
      refresh_token: tokens.refresh_token ?? null,
      expires_in: tokens.expires_in ?? null,
      scope: tokens.scope ?? null,
      count: this.tokenCount,
    });
  }
  redirectToAuthorization(url) {
    say("authorize", { url: url.toString() });
  }
  saveCodeVerifier(verifier) {
    this.verifier = verifier;
  }
  codeVerifier() {
    return this.verifier;
  }
  saveDiscoveryState(discovery) {
    this.discovery = discovery;
  }
  discoveryState() {
    return this.discovery;
  }
  invalidateCredentials(scope) {
    if (scope === "all" || scope === "client") this.savedClient = undefined;
    if (scope === "all" || scope === "tokens") this.savedTokens = undefined;
    if (scope === "all" || scope === "verifier") this.verifier = undefined;
    say("invalidated", { scope });
  }
}

const provider = new MemoryProvider();

// The loopback redirect URI (RFC 8252 §7.3): the first callback's code, once its state and
// iss (RFC 9207) are the ones this flow expects.
function callbackServer() {
  let deliver, refuse;
  const code = new Promise((resolve, reject) => {
    deliver = resolve;
    refuse = reject;
  });
  const server = http.createServer((request, response) => {
    const url = new URL(request.url, redirectUrl);
    if (url.pathname !== "/callback") {
      response.writeHead(404).end();
      return;
    }
    const iss = url.searchParams.get("iss");
    const issuer = provider.discoveryState()?.authorizationServerMetadata?.issuer;
    const stateOk = url.searchParams.get("state") === provider.lastState;
    say("callback", { iss, issuer, state_ok: stateOk, error: url.searchParams.get("error") });
    if (!stateOk || iss !== issuer || !url.searchParams.get("code")) {
      response.writeHead(400, { "Content-Type": "text/plain" }).end("Authorization failed.");
      refuse(new Error(`bad callback: ${url.search}`));
      return;
    }
    response.writeHead(200, { "Content-Type": "text/html" }).end("<p id=done>Signed in. You can close this window.</p>");
    deliver(url.searchParams.get("code"));
  });
  server.listen(Number(callbackPort), "127.0.0.1");
  return { code, server };
}

// fetch that reports the GET event stream opening and ending (the SDK keeps it to itself).
async function observingFetch(url, init) {
  const response = await fetch(url, init);
  const isStream = (init?.method ?? "GET") === "GET" && response.headers.get("content-type")?.startsWith("text/event-stream");
  if (!isStream || !response.body) return response;
  say("stream_open", { status: response.status });
  const reader = response.body.getReader();
  const body = new ReadableStream({
    async pull(controller) {
      try {
        const { value, done } = await reader.read();
        if (done) {
          say("stream_closed", { error: null });
          controller.close();
        } else {
          controller.enqueue(value);
        }
      } catch (error) {
        say("stream_closed", { error: String(error?.message ?? error) });
        controller.error(error);
      }
    },
    cancel(reason) {
      return reader.cancel(reason);
    },
  });
  return new Response(body, { status: response.status, statusText: response.statusText, headers: response.headers });
}

function connection() {
  const client = new Client({ name: "dispatch-suite-oauth", version: "1.0.0" });
  const transport = new StreamableHTTPClientTransport(new URL(mcpUrl), { authProvider: provider, fetch: observingFetch });
  transport.onerror = (error) => say("transport_error", { name: error?.constructor?.name, message: String(error?.message ?? error) });
  return { client, transport };
}

async function main() {
  const callback = callbackServer();
  let { client, transport } = connection();
  try {
    await client.connect(transport);
    throw new Error("connected without signing in");
  } catch (error) {
    if (!(error instanceof UnauthorizedError)) throw error;
  }
  const code = await callback.code;
  callback.server.close();
  await transport.finishAuth(code);
  await transport.close();

  ({ client, transport } = connection());
  await client.connect(transport);
  say("connected", { protocolVersion: transport.protocolVersion ?? null });
  const listed = await client.listTools();
  say("tools", { names: listed.tools.map((tool) => tool.name) });

  const commands = readline.createInterface({ input: process.stdin });
  say("ready");
  for await (const line of commands) {
    const [command, argument] = line.trim().split(/\s+/);
    if (command === "quit") break;
    if (command === "parallel") {
      // Two tool calls at once, as agents' clients send them: after an expiry both get a
      // 401 and each runs the SDK's auth(), so two refreshes race with one refresh token.
      const results = await Promise.allSettled([0, 1].map(() => client.callTool({ name: argument, arguments: {} })));
      say("parallel", {
        results: results.map((outcome) =>
          outcome.status === "fulfilled"
            ? { ok: true, isError: outcome.value.isError ?? false }
            : { ok: false, name: outcome.reason?.constructor?.name, message: String(outcome.reason?.message ?? outcome.reason) },
        ),
      });
    }
    if (command === "call") {
      try {
        const result = await client.callTool({ name: argument, arguments: {} });
        say("called", { isError: result.isError ?? false, text: result.content?.[0]?.text ?? null });
      } catch (error) {
        say("call_failed", { name: error?.constructor?.name, message: String(error?.message ?? error) });
      }
    }
    say("ready");
  }
  await client.close();
  say("done");
  process.exit(0);
}

main().catch((error) => {
  say("failed", { message: String(error?.stack ?? error) });
  process.exit(1);
});
