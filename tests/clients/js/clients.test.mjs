// The client-conformance suite for JavaScript: the `openai` npm package, the Vercel AI
// SDK (`ai` with `@ai-sdk/openai-compatible`, `@ai-sdk/openai` on the Responses API with
// its defaults (store on) and `@ai-sdk/anthropic` on the Messages API) and the Anthropic
// SDK (`@anthropic-ai/sdk`) against a real edge and simulated node. `make clients-js`
// starts both and sets EDGE_BASE_URL (".../v1"); the node models a KV cache, so a prompt
// sent twice is partly cached the second time.
// The scripts are the simulated model's answers, turn by turn (see docs/simulated-node.md);
// every case is one or two small requests.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { randomUUID } from "node:crypto";

import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import Anthropic from "@anthropic-ai/sdk";
import { ChatAnthropic } from "@langchain/anthropic";
import { APICallError, generateObject, generateText, stepCountIs, streamText, tool } from "ai";
import OpenAI from "openai";
import { zodResponseFormat } from "openai/helpers/zod";
import { z } from "zod";

const BASE_URL = process.env.EDGE_BASE_URL;
if (!BASE_URL) throw new Error("EDGE_BASE_URL is not set: run `make clients-js`");

const USAGE = { input_tokens: 11, output_tokens: 7, reasoning_tokens: 3, cached_input_tokens: 0 };
const WEATHER_ANSWER = "It is sunny in Paris.";

const say = (text, reasoning = "") => [
  ...(reasoning ? [{ type: "reasoning_delta", delta: reasoning }] : []),
  ...text.split(" ").map((w, i) => ({ type: "delta", delta: i === 0 ? w : " " + w })),
  { type: "complete", usage: USAGE, metadata: { finish_reason: "stop" } },
];
const call = (name, args, id = "call_1") => [
  { type: "complete", usage: USAGE, tool_calls: [{ id, name, arguments: args }] },
];
const failMidway = (text, error) => [
  { type: "delta", delta: text },
  { type: "error", error },
];
const script = (events) => JSON.stringify({ events });
const turns = (...answers) => JSON.stringify({ turns: answers.map((events) => ({ events })) });

const WEATHER_TOOL = {
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

describe("openai (npm)", () => {
  const client = new OpenAI({ baseURL: BASE_URL, apiKey: "unused", maxRetries: 0 });

  test("streaming text, usage and reasoning", async () => {
    const stream = await client.chat.completions.create({
      model: "sim-script",
      messages: [{ role: "user", content: script(say("Hello there", "Hmm.")) }],
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let reasoning = "";
    let finish = null;
    let usage = null;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices[0];
      if (!choice) continue;
      text += choice.delta.content ?? "";
      reasoning += choice.delta.reasoning_content ?? "";
      finish = choice.finish_reason ?? finish;
    }
    assert.equal(text, "Hello there");
    assert.equal(reasoning, "Hmm.");
    assert.equal(finish, "stop");
    assert.equal(usage.prompt_tokens, 11);
    assert.equal(usage.completion_tokens, 7);
    assert.equal(usage.completion_tokens_details.reasoning_tokens, 3);
  });

  test("tool loop of two turns", async () => {
    const messages = [
      {
        role: "user",
        content: turns(call("get_weather", { city: "Paris" }), say(WEATHER_ANSWER)),
      },
    ];
    const first = await client.chat.completions.create({
      model: "sim-script",
      messages,
      tools: [WEATHER_TOOL],
    });
    assert.equal(first.choices[0].finish_reason, "tool_calls");
    const [toolCall] = first.choices[0].message.tool_calls;
    assert.equal(toolCall.function.name, "get_weather");
    assert.deepEqual(JSON.parse(toolCall.function.arguments), { city: "Paris" });
    messages.push(first.choices[0].message, {
      role: "tool",
      tool_call_id: toolCall.id,
      content: "22 C, sunny",
    });
    const second = await client.chat.completions.create({
      model: "sim-script",
      messages,
      tools: [WEATHER_TOOL],
    });
    assert.equal(second.choices[0].message.content, WEATHER_ANSWER);
  });

  test("structured output with zodResponseFormat", async () => {
    const City = z.object({ name: z.string(), population: z.number() });
    const answer = JSON.stringify({ name: "Paris", population: 2100000 });
    const completion = await client.chat.completions.parse({
      model: "sim-script",
      messages: [{ role: "user", content: script(say(answer)) }],
      response_format: zodResponseFormat(City, "city"),
    });
    assert.deepEqual(completion.choices[0].message.parsed, { name: "Paris", population: 2100000 });
  });

  test("a mid-stream error is thrown", async () => {
    const stream = await client.chat.completions.create({
      model: "sim-script",
      messages: [{ role: "user", content: script(failMidway("partial ", "GPU fell over")) }],
      stream: true,
    });
    let text = "";
    await assert.rejects(
      async () => {
        for await (const chunk of stream) text += chunk.choices[0]?.delta.content ?? "";
      },
      (err) => err instanceof OpenAI.APIError && /GPU fell over/.test(err.message),
    );
    assert.equal(text, "partial ");
  });

  test("an unknown model is a 404", async () => {
    await assert.rejects(
      client.chat.completions.create({
        model: "no-such-model",
        messages: [{ role: "user", content: "hi" }],
      }),
      (err) => err instanceof OpenAI.NotFoundError && err.status === 404,
    );
  });
});

describe("ai SDK (@ai-sdk/openai-compatible)", () => {
  const provider = createOpenAICompatible({
    name: "iop-edge",
    baseURL: BASE_URL,
    apiKey: "unused",
    includeUsage: true,
    supportsStructuredOutputs: true,
  });
  const model = provider.chatModel("sim-script");
  const cities = [];
  const getWeather = tool({
    description: "Current weather for a city.",
    inputSchema: z.object({ city: z.string() }),
    execute: async ({ city }) => {
      cities.push(city);
      return `22 C, sunny in ${city}`;
    },
  });

  test("streamText: text, usage and reasoning", async () => {
    const result = streamText({
      model,
      prompt: script(say("Hello there", "Hmm.")),
      maxRetries: 0,
    });
    let text = "";
    for await (const piece of result.textStream) text += piece;
    assert.equal(text, "Hello there");
    assert.equal(await result.reasoningText, "Hmm.");
    assert.equal(await result.finishReason, "stop");
    const usage = await result.usage;
    assert.equal(usage.inputTokens, 11);
    assert.equal(usage.outputTokens, 7);
  });

  test("tool loop of two turns (script in the system message)", async () => {
    cities.length = 0;
    const result = await generateText({
      model,
      system: turns(call("get_weather", { city: "Paris" }), say(WEATHER_ANSWER)),
      prompt: "Weather in Paris?",
      tools: { get_weather: getWeather },
      stopWhen: stepCountIs(3),
      maxRetries: 0,
    });
    assert.deepEqual(cities, ["Paris"]);
    assert.equal(result.text, WEATHER_ANSWER);
    assert.equal(result.steps.length, 2);
  });

  test("a repaired bad call", async () => {
    cities.length = 0;
    const result = await generateText({
      model,
      system: turns(
        call("get_weather", { city: 123 }, "call_1"),
        call("get_weather", { city: "Paris" }, "call_2"),
        say(WEATHER_ANSWER),
      ),
      prompt: "Weather in Paris?",
      tools: { get_weather: getWeather },
      stopWhen: stepCountIs(4),
      maxRetries: 0,
    });
    assert.deepEqual(cities, ["Paris"]);
    assert.equal(result.text, WEATHER_ANSWER);
  });

  test("generateObject: structured output", async () => {
    const answer = JSON.stringify({ name: "Paris", population: 2100000 });
    const { object } = await generateObject({
      model,
      schema: z.object({ name: z.string(), population: z.number() }),
      prompt: script(say(answer)),
      maxRetries: 0,
    });
    assert.deepEqual(object, { name: "Paris", population: 2100000 });
  });

  test("a mid-stream error reaches the caller", async () => {
    const errors = [];
    const result = streamText({
      model,
      prompt: script(failMidway("partial ", "GPU fell over")),
      maxRetries: 0,
      onError: ({ error }) => errors.push(error),
    });
    const parts = [];
    for await (const part of result.fullStream) parts.push(part);
    const error = parts.find((p) => p.type === "error");
    assert.ok(error, `no error part in ${JSON.stringify(parts.map((p) => p.type))}`);
    assert.match(JSON.stringify(error.error), /GPU fell over/);
    assert.equal(errors.length, 1);
  });

  test("an unknown model is a 404", async () => {
    await assert.rejects(
      generateText({ model: provider.chatModel("no-such-model"), prompt: "hi", maxRetries: 0 }),
      (err) => APICallError.isInstance(err) && err.statusCode === 404,
    );
  });
});

describe("ai SDK (@ai-sdk/openai, the Responses API)", () => {
  const model = createOpenAI({ baseURL: BASE_URL, apiKey: "unused" })("sim-script");
  // An unknown model is not a reasoning model to the provider: it is told it is one, or
  // it sends no `reasoning` at all.
  const summary = { openai: { forceReasoning: true, reasoningSummary: "auto" } };

  test("streamText: the reasoning summary is the reasoning", async () => {
    const result = streamText({
      model,
      prompt: script(say("Hello there", "Hmm.")),
      providerOptions: summary,
      maxRetries: 0,
    });
    let text = "";
    for await (const piece of result.textStream) text += piece;
    assert.equal(text, "Hello there");
    assert.equal(await result.reasoningText, "Hmm.");
    const reasoning = (await result.content).filter((p) => p.type === "reasoning");
    assert.deepEqual(reasoning.map((p) => p.text), ["Hmm."]);
  });

  test("generateText: the reasoning summary is the reasoning", async () => {
    const result = await generateText({
      model,
      prompt: script(say("Hello there", "Hmm.")),
      providerOptions: summary,
      maxRetries: 0,
    });
    assert.equal(result.text, "Hello there");
    assert.equal(result.reasoningText, "Hmm.");
  });
});

describe("ai SDK (@ai-sdk/anthropic, the Messages API)", () => {
  const model = createAnthropic({ baseURL: BASE_URL, apiKey: "unused" })("sim-echo");
  // Several of the node's 256-character cache blocks, new to this run of the suite.
  const system = `${randomUUID()} ${"You are a helpful assistant. ".repeat(60)}`;
  const ask = { model, system, prompt: "hi there", maxOutputTokens: 64, maxRetries: 0 };

  test("usage.inputTokens is the run's prompt tokens, cached ones counted once", async () => {
    const cold = await generateText(ask);
    assert.equal(cold.text, "hi there");
    const prompt = cold.usage.inputTokens;
    assert.ok(prompt > 256, `prompt tokens ${prompt}`);
    assert.equal(cold.usage.inputTokenDetails.cacheReadTokens, 0);
    const warm = streamText(ask);
    let text = "";
    for await (const piece of warm.textStream) text += piece;
    assert.equal(text, "hi there");
    const usage = await warm.usage;
    assert.equal(usage.inputTokens, prompt);
    const cached = usage.inputTokenDetails.cacheReadTokens;
    assert.ok(cached > 0, `cached tokens ${cached}`);
    assert.equal(usage.inputTokenDetails.noCacheTokens, prompt - cached);
    const again = await generateText(ask);
    assert.equal(again.usage.inputTokens, prompt);
    assert.ok(again.usage.inputTokenDetails.cacheReadTokens > 0);
  });
});

describe("Anthropic SDK (@anthropic-ai/sdk)", () => {
  // The SDK appends /v1/... itself: its base URL is the edge's root.
  const client = new Anthropic({
    baseURL: BASE_URL.replace(/\/v1$/, ""),
    apiKey: "unused",
    maxRetries: 0,
  });
  const messages = [{ role: "user", content: "What is the weather like in Paris?" }];

  test("messages.countTokens estimates the prompt, system and tools counted", async () => {
    const plain = await client.messages.countTokens({ model: "sim-echo", messages });
    assert.ok(plain.input_tokens > 0, JSON.stringify(plain));
    const more = await client.messages.countTokens({
      model: "sim-echo",
      system: "You are a weather assistant. Answer in one short sentence.",
      tools: [{ name: "get_weather", input_schema: { type: "object" } }],
      messages,
    });
    assert.ok(more.input_tokens > plain.input_tokens, JSON.stringify(more));
  });

  test("a stream's message_start carries the prompt's input tokens (as LangChain reads them)", async () => {
    // @langchain/anthropic takes a stream's input tokens from message_start only; the
    // node's cache model counts the prompt as the edge estimates it (characters / 4), so
    // message_start's count is the prompt's as message_delta gives it (input + cached).
    const stream = await client.messages.create({
      model: "sim-echo",
      max_tokens: 64,
      system: `${randomUUID()} ${"You are a helpful assistant. ".repeat(20)}`,
      messages,
      stream: true,
    });
    let started = null;
    let final = null;
    for await (const event of stream) {
      if (event.type === "message_start") started = event.message.usage;
      if (event.type === "message_delta") final = event.usage;
    }
    assert.ok(started.input_tokens > 100, JSON.stringify(started));
    assert.equal(started.output_tokens, 0);
    assert.equal(started.input_tokens, final.input_tokens + final.cache_read_input_tokens);
  });

  test("LangChain's ChatAnthropic counts a stream's input tokens (from message_start)", async () => {
    const chat = new ChatAnthropic({
      model: "sim-echo",
      anthropicApiUrl: BASE_URL.replace(/\/v1$/, ""),
      apiKey: "unused",
      maxRetries: 0,
      maxTokens: 64,
      streaming: true,
    });
    let usage = null;
    for await (const chunk of await chat.stream([["human", "What is the weather like in Paris?"]])) {
      if (chunk.usage_metadata && chunk.usage_metadata.input_tokens) usage = chunk.usage_metadata;
    }
    assert.ok(usage !== null && usage.input_tokens > 0, JSON.stringify(usage));
  });

  test("models.retrieve gives the model; an unknown one is NotFoundError", async () => {
    const model = await client.models.retrieve("sim-echo");
    assert.equal(model.type, "model");
    assert.equal(model.id, "sim-echo");
    await assert.rejects(client.models.retrieve("no-such-model"), Anthropic.NotFoundError);
  });
});

describe("ai SDK (@ai-sdk/openai, Responses, store on by default)", () => {
  // Every request body the provider sends, to see what it refers to by id.
  const sent = [];
  const recording = async (url, init) => {
    if (init?.body) sent.push(JSON.parse(init.body));
    return fetch(url, init);
  };
  const openai = createOpenAI({ baseURL: BASE_URL, apiKey: "unused", fetch: recording });
  const model = openai("sim-script");
  const references = (body) => body.input.filter((item) => item.type === "item_reference");

  test("a two-message chat: the first answer goes back as an item_reference", async () => {
    sent.length = 0;
    const system = turns(say("First answer."), say("Second answer."));
    const first = streamText({ model, system, prompt: "Hello?", maxRetries: 0 });
    assert.equal(await first.text, "First answer.");
    const history = [{ role: "user", content: "Hello?" }, ...(await first.response).messages];
    const second = await generateText({
      model,
      system,
      messages: [...history, { role: "user", content: "And then?" }],
      maxRetries: 0,
    });
    assert.equal(second.text, "Second answer.");
    assert.equal(sent.length, 2);
    assert.notEqual(sent[0].store, false);
    assert.equal(references(sent[1]).length, 1);
  });

  test("a tool loop where the model writes text before its call", async () => {
    sent.length = 0;
    const cities = [];
    const getWeather = tool({
      description: "Current weather for a city.",
      inputSchema: z.object({ city: z.string() }),
      execute: async ({ city }) => {
        cities.push(city);
        return `22 C, sunny in ${city}`;
      },
    });
    const textThenCall = [
      { type: "delta", delta: "Let me check." },
      ...call("get_weather", { city: "Paris" }),
    ];
    const result = await generateText({
      model,
      system: turns(textThenCall, say(WEATHER_ANSWER)),
      prompt: "Weather in Paris?",
      tools: { get_weather: getWeather },
      stopWhen: stepCountIs(3),
      maxRetries: 0,
    });
    assert.deepEqual(cities, ["Paris"]);
    assert.equal(result.steps.length, 2);
    assert.equal(result.steps[0].text, "Let me check.");
    assert.equal(result.text, WEATHER_ANSWER);
    assert.equal(references(sent[1]).length, 1);
  });
});
