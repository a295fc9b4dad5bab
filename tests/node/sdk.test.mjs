// The official OpenAI Node SDK against a Sluice gateway on a simulated engine.
// Run by tests/test_node_sdk.py, which starts the gateway and sets:
//   SLUICE_URL          the gateway's base URL (no /v1)
//   SLUICE_KEY          a key with no limits
//   SLUICE_LIMITED_KEY  a key of 60 requests a minute, of its own
//   SLUICE_MODEL        the model the simulator serves
import assert from "node:assert/strict";
import { test } from "node:test";

import OpenAI from "openai";

const baseURL = `${process.env.SLUICE_URL}/v1`;
const model = process.env.SLUICE_MODEL;
const client = new OpenAI({ baseURL, apiKey: process.env.SLUICE_KEY, maxRetries: 0 });
const hello = [{ role: "user", content: "hello" }];

test("chat.completions.create", async () => {
  const answer = await client.chat.completions.create({ model, messages: hello, max_tokens: 7 });
  assert.match(answer.id, /^chatcmpl-/);
  assert.equal(answer.object, "chat.completion");
  assert.equal(answer.model, model);
  assert.equal(answer.choices[0].message.role, "assistant");
  assert.ok(answer.choices[0].message.content.length > 0);
  assert.equal(answer.usage.completion_tokens, 7);
  assert.equal(answer.usage.total_tokens, answer.usage.prompt_tokens + 7);
});

test("chat.completions.create with stream: true", async () => {
  const stream = await client.chat.completions.create({
    model,
    messages: hello,
    max_tokens: 9,
    stream: true,
    stream_options: { include_usage: true },
  });
  const pieces = [];
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, "chat.completion.chunk");
    usage = chunk.usage ?? usage;
    for (const choice of chunk.choices) {
      if (choice.delta.content) pieces.push(choice.delta.content);
      finish = choice.finish_reason ?? finish;
    }
  }
  assert.equal(pieces.length, 9);
  assert.equal(finish, "length");
  assert.equal(usage.completion_tokens, 9);
});

test("completions.create", async () => {
  const answer = await client.completions.create({ model, prompt: "once upon a time", max_tokens: 5 });
  assert.equal(answer.object, "text_completion");
  assert.ok(answer.choices[0].text.length > 0);
  assert.equal(answer.usage.completion_tokens, 5);
});

test("models.list", async () => {
  const ids = [];
  for await (const m of client.models.list()) ids.push(m.id);
  assert.deepEqual(ids, [model]);
});

test("responses.create", async () => {
  const response = await client.responses.create({ model, input: "hello", max_output_tokens: 6 });
  assert.match(response.id, /^resp_/);
  assert.equal(response.object, "response");
  assert.equal(response.status, "incomplete"); // cut at max_output_tokens
  assert.equal(response.incomplete_details.reason, "max_output_tokens");
  assert.ok(response.output_text.length > 0);
  assert.equal(response.usage.output_tokens, 6);
});

test("responses.create with stream: true", async () => {
  const stream = await client.responses.create({
    model,
    input: [{ role: "user", content: "hello" }],
    instructions: "Be brief.",
    max_output_tokens: 5,
    stream: true,
  });
  const types = [];
  const numbers = [];
  let text = "";
  let last = null;
  for await (const event of stream) {
    types.push(event.type);
    numbers.push(event.sequence_number);
    if (event.type === "response.output_text.delta") text += event.delta;
    last = event;
  }
  assert.equal(types[0], "response.created");
  assert.ok(types.includes("response.output_text.delta"));
  assert.equal(types.at(-1), "response.incomplete"); // cut at max_output_tokens
  assert.deepEqual(numbers, [...numbers.keys()]); // 0, 1, 2, ... in order
  const message = last.response.output.find((item) => item.type === "message");
  assert.equal(message.content[0].text, text);
  assert.equal(last.response.usage.output_tokens, 5);
});

test("an unknown model is a NotFoundError", async () => {
  await assert.rejects(
    client.chat.completions.create({ model: "no-such-model", messages: hello }),
    (err) => {
      assert.ok(err instanceof OpenAI.NotFoundError, `${err}`);
      assert.equal(err.status, 404);
      assert.equal(err.code, "model_not_found");
      assert.equal(err.param, "model");
      return true;
    },
  );
});

test("a 429's retry-after-ms is honoured", async () => {
  // Every attempt the SDK makes, with when it was sent and when its answer came.
  const attempts = [];
  const recording = async (url, init) => {
    const sent = performance.now();
    const response = await fetch(url, init);
    attempts.push({ sent, answered: performance.now(), status: response.status, headers: response.headers });
    return response;
  };
  const limited = new OpenAI({
    baseURL,
    apiKey: process.env.SLUICE_LIMITED_KEY,
    maxRetries: 3,
    fetch: recording,
  });
  // 60 requests a minute: the bucket empties after about 60, and the SDK waits on the 429.
  for (let i = 0; i < 200 && !attempts.some((a) => a.status === 429); i++) {
    await limited.chat.completions.create({ model, messages: hello, max_tokens: 1 });
  }
  const first = attempts.findIndex((a) => a.status === 429);
  assert.ok(first >= 0, "no request was refused with 429");
  const refused = attempts[first];
  const waitMs = Number(refused.headers.get("retry-after-ms"));
  assert.ok(waitMs > 0 && waitMs <= 1000, `retry-after-ms ${waitMs}`);
  assert.ok(Number(refused.headers.get("retry-after")) >= 1);
  const retry = attempts[first + 1];
  assert.ok(retry, "the SDK did not retry");
  // The SDK slept what the header said (timers may fire a little late, never early), then the
  // retry was let in: the bucket had refilled as the header promised.
  assert.ok(retry.sent - refused.answered >= waitMs - 2, `retried after ${retry.sent - refused.answered} ms`);
  assert.equal(attempts.at(-1).status, 200);
});
