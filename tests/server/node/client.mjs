// Sends each request of a JSON list on stdin through the official openai Node client (whole or streamed, as the
// request says) and prints one JSON line per request: what the client read back. The caller checks it.
import OpenAI from "openai";

const client = new OpenAI({ baseURL: process.env.VATTN_URL, apiKey: process.env.VATTN_KEY, maxRetries: 0 });
const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const requests = JSON.parse(Buffer.concat(chunks).toString());

async function run({ endpoint, body }) {
  const api = endpoint === "chat" ? client.chat.completions : client.completions;
  try {
    if (!body.stream) {
      const r = await api.create(body);
      const c = r.choices[0];
      const message = c.message ?? {};
      return { text: endpoint === "chat" ? message.content : c.text, finish_reason: c.finish_reason,
               tool_calls: (message.tool_calls ?? []).map((t) => [t.function.name, t.function.arguments]) };
    }
    let text = "", finish_reason = null;
    const calls = [];
    for await (const chunk of await api.create(body)) {
      const c = chunk.choices[0];
      if (!c) continue;
      text += (endpoint === "chat" ? c.delta?.content : c.text) ?? "";
      // A call's first piece names it; the later ones add to its arguments (OpenAI's streamed shape).
      for (const t of c.delta?.tool_calls ?? []) {
        if (calls[t.index] === undefined) calls[t.index] = [t.function.name, ""];
        calls[t.index][1] += t.function.arguments ?? "";
      }
      finish_reason = c.finish_reason ?? finish_reason;
    }
    return { text, finish_reason, tool_calls: calls };
  } catch (err) {
    return { error: { status: err.status ?? null, message: err.error?.message ?? String(err) } };
  }
}

for (const request of requests) console.log(JSON.stringify(await run(request)));
