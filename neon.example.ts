/**
 * neon.example.ts: the `openai` npm SDK, unchanged, talking to an aigw gateway.
 *
 * The SDK reads OPENAI_BASE_URL and OPENAI_API_KEY from the environment. A Neon project whose
 * `neon.ts` turns the AI gateway on injects exactly those two variables into its functions:
 *
 *   // neon.ts
 *   import { defineConfig } from "@neondatabase/config/v1";
 *   export default defineConfig({
 *     preview: {
 *       aiGateway: true, // injects OPENAI_BASE_URL and OPENAI_API_KEY
 *     },
 *   });
 *
 * Against your own gateway, set them yourself:
 *
 *   aigw serve                                   # prints an API key on first start
 *   export OPENAI_BASE_URL=http://127.0.0.1:8000/v1
 *   export OPENAI_API_KEY=<the key>               # or: aigw keys create --project default ...
 *   npm install openai tsx                        # once, next to this file
 *   npx tsx neon.example.ts
 *
 * OPENAI_MODEL picks the model; without it, the first model the gateway lists is used.
 * The script makes a chat call, a streamed call with usage, a tool-calling turn, and a two-turn
 * agent loop with one long system prompt; the second turn's prompt starts with the first turn's,
 * so the gateway's replica serves it from its prefix cache and reports
 * `usage.prompt_tokens_details.cached_tokens`.
 */
import OpenAI from "openai";
import type {
  ChatCompletionMessageParam,
  ChatCompletionTool,
} from "openai/resources/chat/completions";

const client = new OpenAI(); // OPENAI_BASE_URL + OPENAI_API_KEY
const MAX_TOKENS = 24; // small answers keep the example quick on a CPU replica

async function pickModel(): Promise<string> {
  if (process.env.OPENAI_MODEL) return process.env.OPENAI_MODEL;
  for await (const model of client.models.list()) return model.id;
  throw new Error("the gateway lists no models");
}

async function chat(model: string): Promise<void> {
  const completion = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: "Say hello in five words." }],
    max_tokens: MAX_TOKENS,
    temperature: 0,
  });
  console.log("chat:", JSON.stringify(completion.choices[0].message.content));
}

async function streamWithUsage(model: string): Promise<void> {
  const stream = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: "Count from one to five." }],
    max_tokens: MAX_TOKENS,
    temperature: 0,
    stream: true,
    stream_options: { include_usage: true }, // the last chunk carries usage, with no choices
  });
  let text = "";
  let usage: OpenAI.CompletionUsage | undefined;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  if (!usage) throw new Error("the stream ended without a usage chunk");
  console.log("stream:", JSON.stringify(text));
  console.log(`stream usage: prompt=${usage.prompt_tokens} completion=${usage.completion_tokens}`);
}

const weatherTool: ChatCompletionTool = {
  type: "function",
  function: {
    name: "get_weather",
    description: "Current weather for a city.",
    parameters: {
      type: "object",
      properties: { city: { type: "string" } },
      required: ["city"],
    },
  },
};

async function toolTurn(model: string): Promise<void> {
  const messages: ChatCompletionMessageParam[] = [
    { role: "user", content: "What is the weather in Paris? Use the tool." },
  ];
  const first = await client.chat.completions.create({
    model,
    messages,
    tools: [weatherTool],
    max_tokens: 64,
    temperature: 0,
  });
  const reply = first.choices[0].message;
  const calls = reply.tool_calls ?? [];
  if (calls.length === 0) {
    // A small model may answer in prose instead; the request shape is what this shows.
    console.log("tools: the model answered without a call:", JSON.stringify(reply.content));
    return;
  }
  messages.push(reply);
  for (const call of calls) {
    if (call.type !== "function") continue;
    console.log(`tools: ${call.function.name}(${call.function.arguments})`);
    messages.push({ role: "tool", tool_call_id: call.id, content: '{"celsius": 18, "sky": "clear"}' });
  }
  const second = await client.chat.completions.create({
    model,
    messages,
    tools: [weatherTool],
    max_tokens: MAX_TOKENS,
    temperature: 0,
  });
  console.log("tools: final answer:", JSON.stringify(second.choices[0].message.content));
}

// An agent's instructions: long, and the same on every turn (the prefix the cache keeps).
const SYSTEM_PROMPT = [
  "You are Ledger, a careful assistant for a small bookshop.",
  "Rules you always follow:",
  ...Array.from({ length: 12 }, (_, i) =>
    `${i + 1}. When a customer asks about order ${1000 + i}, check the shelf list, the supplier ` +
    `notes and the returns book before you answer, and never promise a delivery date.`),
  "Answer in one short sentence.",
].join("\n");

async function agentLoop(model: string): Promise<number> {
  const messages: ChatCompletionMessageParam[] = [{ role: "system", content: SYSTEM_PROMPT }];
  const questions = ["Is order 1003 in stock?", "And when will it arrive?"];
  let cachedTokens = 0;
  for (const [turn, question] of questions.entries()) {
    messages.push({ role: "user", content: question });
    const completion = await client.chat.completions.create({
      model,
      messages,
      max_tokens: MAX_TOKENS,
      temperature: 0,
    });
    const answer = completion.choices[0].message.content ?? "";
    messages.push({ role: "assistant", content: answer });
    const usage = completion.usage;
    cachedTokens = usage?.prompt_tokens_details?.cached_tokens ?? 0;
    console.log(`agent turn ${turn + 1}: prompt=${usage?.prompt_tokens} cached=${cachedTokens} ` +
      `answer=${JSON.stringify(answer)}`);
  }
  return cachedTokens; // of the second turn
}

async function main(): Promise<void> {
  const model = await pickModel();
  console.log("model:", model);
  await chat(model);
  await streamWithUsage(model);
  await toolTurn(model);
  const cached = await agentLoop(model);
  console.log(`cached tokens (turn 2): ${cached}`);
}

main().catch((error: unknown) => {
  console.error(error);
  process.exit(1);
});
