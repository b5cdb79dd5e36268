#!/usr/bin/env python3
"""End-to-end checks of a running tandem cluster with the Python standard library only (the GPU machine has
no `openai` package and no network): completions and chat, streamed and not, logprobs, 64 concurrent
requests each equal to the same request alone, and output equal to `tandem generate` in one process.

    scripts/serve-check.py BASE_URL MODEL [GENERATE_JSON]

GENERATE_JSON is the output of `tandem generate --prompt "The quick brown fox" --max-tokens 12
--ignore-eos --json` on the same checkpoint and device; the cluster's completion of that prompt must equal
its text. Prints one line per check and "ok" at the end; exits non-zero on the first failure.
"""
import json
import sys
import threading
import urllib.error
import urllib.request

BASE, MODEL = sys.argv[1].rstrip("/"), sys.argv[2]
PROMPT = "The quick brown fox"


def post(path, body, stream=False):
    req = urllib.request.Request(BASE + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    if not stream:
        return resp.status, json.loads(resp.read())
    chunks = []
    for line in resp:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return resp.status, chunks


def check(name, cond, detail=""):
    if not cond:
        print(f"FAILED {name}: {detail}")
        sys.exit(1)
    print(f"ok     {name}")


models = json.loads(urllib.request.urlopen(BASE + "/v1/models", timeout=30).read())
check("models lists the served model", MODEL in [m["id"] for m in models["data"]], models)

body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
code, r = post("/v1/completions", body)
check("completion", code == 200 and r["usage"]["completion_tokens"] == 12, r)
text = r["choices"][0]["text"]

code, chunks = post("/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}), stream=True)
check("streamed completion", code == 200, chunks)
streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
check("streamed completion equals the completion", streamed == text, (streamed, text))

if len(sys.argv) > 3:
    gen = json.load(open(sys.argv[3]))
    check("the cluster's completion equals `tandem generate` in one process", gen["text"] == text, (gen["text"], text))

chat = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        "max_tokens": 10, "temperature": 0, "logprobs": True, "top_logprobs": 3}
code, r = post("/v1/chat/completions", chat)
check("chat with logprobs", code == 200 and len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3, r)
content = r["choices"][0]["message"]["content"]
plain = {k: v for k, v in chat.items() if k not in ("logprobs", "top_logprobs")}
code, chunks = post("/v1/chat/completions", dict(plain, stream=True), stream=True)
check("streamed chat", code == 200, chunks)
streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
check("streamed chat equals the chat", streamed == content, (streamed, content))

code, r = post("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
check("bad input is a 400 with a message", code == 400 and "error" in r, (code, r))

# 64 concurrent requests over 8 prompts (greedy and seeded): each equals the same request sent alone.
prompts = [f"Request number {i}: tell me about the number {i * 37 % 101}" for i in range(8)]


def request(i):
    p = {"model": MODEL, "prompt": prompts[i % 8], "max_tokens": 24, "ignore_eos": True}
    if i % 2:
        p.update(temperature=0.9, top_p=0.9, seed=1000 + i % 8)
    else:
        p.update(temperature=0)
    return p


alone = {}
for i in range(16):
    code, r = post("/v1/completions", request(i))
    if code != 200:
        check(f"request {i} alone", False, r)
    alone[i] = r["choices"][0]["text"]
results = [None] * 64


def worker(i):
    results[i] = post("/v1/completions", request(i))


threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
for t in threads:
    t.start()
for t in threads:
    t.join()
bad = [i for i in range(64) if results[i][0] != 200 or results[i][1]["choices"][0]["text"] != alone[i % 16]]
check("64 concurrent requests equal the same requests alone", not bad,
      [(i, results[i][1].get("choices", [{}])[0].get("text"), alone[i % 16]) for i in bad[:3]])
print("ok")
