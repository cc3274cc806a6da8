// The Vercel AI SDK's default provider call, `openai(model)`, which speaks the
// Responses API, against switchyard's /v1/responses: generateText, streamText
// and a function tool round trip. Run by test_front_door.py (VercelAiSdk);
// prints one JSON line of what each call returned, or exits 1 with the error.
import { createOpenAI } from "@ai-sdk/openai";
import { generateText, streamText, tool, jsonSchema, stepCountIs } from "ai";

const openai = createOpenAI({
  baseURL: `${process.env.SWITCHYARD_URL}/v1`,
  apiKey: "sk-client-key-not-forwarded",
});
const model = openai(process.env.VERCEL_MODEL ?? "gpt-4o-mini");

const plain = await generateText({ model, prompt: "hello", maxRetries: 0 });

const streamed = streamText({ model, prompt: "hello", maxRetries: 0 });
let streamedText = "";
for await (const part of streamed.textStream) streamedText += part;
const streamedFinish = await streamed.finishReason;

const weather = tool({
  description: "Weather at a place",
  inputSchema: jsonSchema({
    type: "object",
    properties: { location: { type: "string" }, unit: { type: "string" }, call: { type: "number" } },
    required: ["location"],
  }),
  execute: async ({ location }) => ({ location, temperature: 21 }),
});
const withTool = await generateText({
  model,
  prompt: "What is the weather in Paris?",
  tools: { get_weather: weather },
  stopWhen: stepCountIs(2),
  maxRetries: 0,
});

console.log(
  JSON.stringify({
    plain: { text: plain.text, finishReason: plain.finishReason, outputTokens: plain.usage.outputTokens },
    stream: { text: streamedText, finishReason: streamedFinish },
    tool: {
      steps: withTool.steps.length,
      calls: withTool.steps[0].toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
      results: withTool.steps[0].toolResults.length,
      text: withTool.text,
    },
  }),
);
