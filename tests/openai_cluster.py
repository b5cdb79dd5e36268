"""Drives a real tandem cluster with the official `openai` Python client (run by tests/cluster.rs)."""
import sys

import openai

base, model = sys.argv[1], sys.argv[2]
c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)

models = [m.id for m in c.models.list()]
assert model in models, models

r = c.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0,
                         extra_body={"ignore_eos": True})
assert r.choices[0].finish_reason == "length", r
assert r.usage.completion_tokens == 12, r.usage
text = r.choices[0].text

streamed, usage = "", None
for ch in c.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, temperature=0,
                               stream=True, stream_options={"include_usage": True},
                               extra_body={"ignore_eos": True}):
    if ch.choices:
        streamed += ch.choices[0].text
    if ch.usage:
        usage = ch.usage
assert streamed == text, (streamed, text)
assert usage is not None and usage.completion_tokens == 12, usage

r = c.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Hi!"}],
                              max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
assert r.choices[0].message.role == "assistant"
assert r.choices[0].logprobs is not None and len(r.choices[0].logprobs.content[0].top_logprobs) == 3
content = r.choices[0].message.content

streamed = ""
for ch in c.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hi!"}],
                                    max_tokens=10, temperature=0, stream=True):
    if ch.choices and ch.choices[0].delta.content:
        streamed += ch.choices[0].delta.content
assert streamed == content, (streamed, content)

try:
    c.completions.create(model=model, prompt="x", max_tokens=10, n=2)
    raise AssertionError("n=2 must be refused")
except openai.BadRequestError as e:
    assert "n" in str(e)
print("ok")
