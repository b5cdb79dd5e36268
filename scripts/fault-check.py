#!/usr/bin/env python3
"""A worker hit while it serves: concurrent streamed completions of one prompt must all finish with the text
`tandem generate` gives, whatever happens to the worker (Python standard library only).

    scripts/fault-check.py BASE_URL MODEL GENERATE_JSON PATTERN SIGNAL [STREAMS]

GENERATE_JSON: `tandem generate --prompt "The quick brown fox" --max-tokens N --ignore-eos --json` on the same
checkpoint and device. Once every stream has received 10 tokens, the process whose command line contains every
word of PATTERN (e.g. "decode-worker --ep 1/2@") gets SIGNAL: KILL, or STOP followed by CONT 6 s later.
Prints how long the streams took after the signal and the longest pause of each, then "ok"; exits non-zero
when a stream fails or its text differs.
"""
import json
import os
import signal
import sys
import threading
import time
import urllib.request

BASE, MODEL, GEN, PATTERN, SIG = sys.argv[1].rstrip("/"), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
STREAMS = int(sys.argv[6]) if len(sys.argv) > 6 else 8
PROMPT = "The quick brown fox"
gen = json.load(open(GEN))
want, n = gen["text"], len(gen["generated_token_ids"])


def find_pid():
    words = PATTERN.split()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
        except OSError:
            continue
        line = " ".join(cmd)
        if all(w in line for w in words) and "fault-check" not in line:
            return int(pid), line
    return None, None


def lines(resp):
    """The response's lines as they arrive (iterating the response itself waits for its buffer to fill)."""
    buf = b""
    while True:
        chunk = resp.read1(65536)
        if not chunk:
            break
        buf += chunk
        *done, buf = buf.split(b"\n")
        for line in done:
            yield line.decode().strip()
    if buf:
        yield buf.decode().strip()


class Stream(threading.Thread):
    def __init__(self, i):
        super().__init__(daemon=True)
        self.i, self.text, self.tokens, self.error, self.gaps, self.done = i, "", 0, None, [], None

    def run(self):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                "stream": True}
        req = urllib.request.Request(BASE + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            last = time.time()
            with urllib.request.urlopen(req, timeout=600) as resp:
                for line in lines(resp):
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    c = json.loads(line[6:])
                    if "error" in c:
                        self.error = c["error"]
                        continue
                    for ch in c.get("choices", []):
                        if ch.get("text"):
                            now = time.time()
                            self.gaps.append(now - last)
                            last = now
                            self.text += ch["text"]
                            self.tokens += 1
        except Exception as e:  # noqa: BLE001 - reported as the stream's failure
            self.error = repr(e)
        self.done = time.time()


pid, cmd = find_pid()
if pid is None:
    sys.exit(f"FAILED no process matches {PATTERN!r}")
print(f"target: pid {pid}: {cmd[:160]}")
streams = [Stream(i) for i in range(STREAMS)]
for s in streams:
    s.start()
deadline = time.time() + 120
while min(s.tokens for s in streams) < 10:
    if time.time() > deadline or any(s.done for s in streams):
        sys.exit(f"FAILED the streams did not all run before the signal: {[(s.tokens, s.error) for s in streams]}")
    time.sleep(0.01)
hit = time.time()
if SIG == "KILL":
    os.kill(pid, signal.SIGKILL)
elif SIG == "STOP":
    os.kill(pid, signal.SIGSTOP)
    time.sleep(6)
    os.kill(pid, signal.SIGCONT)
else:
    sys.exit(f"unknown signal {SIG}")
print(f"SIG{SIG} at {[s.tokens for s in streams]} tokens per stream")
for s in streams:
    s.join(600)
bad = 0
for s in streams:
    ok = s.error is None and s.text == want
    bad += not ok
    print(f"{'ok    ' if ok else 'FAILED'} stream {s.i}: {s.tokens} chunks, finished {(s.done or hit) - hit:.1f} s after the "
          f"signal, longest pause {max(s.gaps, default=0):.2f} s" + ("" if ok else f", error {s.error}, text equal {s.text == want}"))
if bad:
    sys.exit(f"FAILED {bad} of {STREAMS} streams")
print("ok")
