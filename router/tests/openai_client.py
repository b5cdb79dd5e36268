"""Drives the router with the official `openai` Python client (run by openai_client.rs)."""
import sys

import openai

base, model, reply = sys.argv[1], sys.argv[2], sys.argv[3]
c = openai.OpenAI(base_url=base + "/v1", api_key="k", max_retries=0)

r = c.completions.create(model=model, prompt="Say hi", max_tokens=40)
assert r.choices[0].text == reply, r
assert r.choices[0].finish_reason == "stop", r
assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

text, usage = "", None
for ch in c.completions.create(model=model, prompt="Say hi", max_tokens=40, stream=True,
                               stream_options={"include_usage": True}):
    if ch.choices:
        text += ch.choices[0].text
    if ch.usage:
        usage = ch.usage
assert text == reply, text
assert usage is not None and usage.completion_tokens > 0, usage

r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                              logprobs=True, top_logprobs=2)
assert r.choices[0].message.content == reply, r
assert len(r.choices[0].logprobs.content) > 0
assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2

text, role = "", None
for ch in c.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
                                    stop=["The answer"]):
    if ch.choices:
        role = role or ch.choices[0].delta.role
        text += ch.choices[0].delta.content or ""
assert role == "assistant"
assert reply.startswith(text) and "The answer" not in text and text, text

try:
    c.completions.create(model=model, prompt="x", n=2)
    raise SystemExit("n=2 should have been refused")
except openai.BadRequestError as e:
    assert "n must be 1" in str(e), e

try:
    openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0).models.list()
    raise SystemExit("a wrong key should have been refused")
except openai.AuthenticationError:
    pass

assert c.models.list().data[0].id == model
print("OK")
