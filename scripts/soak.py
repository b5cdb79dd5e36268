"""Overload and soak (issue 24 item 2): open-loop load above capacity against `tandem up` on the tiny model.

  python3 scripts/soak.py [--seconds S | --minutes M] [--factor F] [--tandem PATH] [--json FILE]

1. Starts `tandem up` (CPU, tiny model) on free ports and waits for it to be ready.
2. Measures capacity: `tandem bench` closed-loop with 128 requests in flight (more than the decode
   worker's slots, so the cluster saturates) -> requests/s.
3. Sends Poisson arrivals at F x capacity (default 2x) for the duration (`tandem bench --request-rate`),
   sampling the resident memory (RSS) of every process of the cluster every 2 s.
4. Checks, and exits non-zero when one fails:
   - every request got a final status: a completed response, or a clean overload answer (HTTP 429 or 503
     with a message); no request hung past the run (the bench is bounded by a timeout), none ended in a
     transport error or a 5xx other than 503;
   - afterwards the cluster is idle again (router metrics: nothing running, queued or in flight, every decode
     block free) and serves the next requests;
   - memory stayed bounded: the cluster's RSS in the run's second half is at most 1.25x its first-half peak
     plus 64 MiB (a leak grows with the number of requests; a warm cache does not).
The CI runs it for 25 seconds (scripts/test.sh); `--minutes 10` is the soak whose result is in
bench/RESULTS.md. JSON: capacity, rates, counts per outcome, the RSS series, the checks.
"""
import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except Exception:  # noqa: BLE001 - not up yet
        return None, ""


def tree(root_pid):
    """[(pid, rss_kib, args)] of `root_pid` and its descendants."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss=,args="], capture_output=True, text=True).stdout
    procs = {}
    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) >= 3:
            procs[int(parts[0])] = (int(parts[1]), int(parts[2]), parts[3] if len(parts) > 3 else "")
    keep, frontier = [], [root_pid]
    while frontier:
        p = frontier.pop()
        if p in procs:
            keep.append((p, procs[p][1], procs[p][2]))
            frontier.extend(c for c, (pp, _, _) in procs.items() if pp == p)
    return keep


def role(args):
    for r in ("router", "prefill-worker", "decode-worker"):
        if f" {r}" in f" {args}":
            return r
    return "up"


def metrics_idle(port):
    """Whether the router reports nothing running, queued or in flight and every decode block free."""
    status, text = http_get(f"http://127.0.0.1:{port}/metrics")
    if status != 200:
        return False, "no metrics"
    load = {}
    for m in re.finditer(r'^tandem_router_worker_load\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        load[(labels.get("role"), labels.get("worker"), labels.get("metric"))] = float(m.group(2))
    queue = re.search(r"^tandem_router_queue_depth (\S+)$", text, re.M)
    busy = [k for k, v in load.items() if k[2] in ("running", "queued", "router_in_flight") and v != 0]
    free = {(r, w): v for (r, w, m), v in load.items() if m == "kv_blocks_free"}
    total = {(r, w): v for (r, w, m), v in load.items() if m == "kv_blocks_total"}
    held = [k for k in total if k[0] == "decode" and free.get(k) != total[k]]
    if queue and float(queue.group(1)) != 0:
        busy.append(("router", "-", "queue_depth"))
    if not load:
        return False, "no worker load reported"
    return not busy and not held, f"busy {busy}, decode blocks held {held}"


def bench(tandem, port, out_json, extra, timeout):
    cmd = [tandem, "bench", "--base-url", f"http://127.0.0.1:{port}", "--input-len", "64", "--output-len", "16",
           "--disable-progress", "--json", out_json] + extra
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        with open(out_json) as f:
            return p.returncode, json.load(f), p.stdout + p.stderr
    except (OSError, json.JSONDecodeError):
        return p.returncode, None, p.stdout + p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--minutes", type=float)
    ap.add_argument("--factor", type=float, default=2.0, help="offered load over the measured capacity")
    ap.add_argument("--tandem", help="the tandem binary (default: target/release, else target/debug)")
    ap.add_argument("--json")
    a = ap.parse_args()
    seconds = a.seconds if a.seconds is not None else 60 * (a.minutes if a.minutes is not None else 10)
    tandem = a.tandem or next((p for p in (os.path.join(ROOT, "target", d, "tandem") for d in ("release", "debug"))
                               if os.path.exists(p)), None)
    if not tandem or not os.path.exists(tandem):
        sys.exit("soak.py: no tandem binary (cargo build --release, or --tandem PATH)")
    tandem = os.path.abspath(tandem)
    port, grpc = free_port(), free_port()
    work = tempfile.mkdtemp(prefix="tandem-soak-")
    log = open(os.path.join(work, "up.log"), "w")
    up = subprocess.Popen([tandem, "up", "--port", str(port), "--grpc-port", str(grpc)], stdout=log,
                          stderr=subprocess.STDOUT, cwd=work)
    result = {"duration_s": seconds, "factor": a.factor, "checks": {}}
    failures = []
    try:
        deadline = time.time() + 180
        while http_get(f"http://127.0.0.1:{port}/ready")[0] != 200:
            if up.poll() is not None or time.time() > deadline:
                sys.exit(f"soak.py: tandem up did not become ready (log: {log.name})")
            time.sleep(0.5)
        # Capacity: closed loop with more requests in flight than the decode worker has slots (it saturates).
        rc, cap, out = bench(tandem, port, os.path.join(work, "capacity.json"),
                             ["--max-concurrency", "128", "--num-prompts", "384", "--seed", "1"], 900)
        if rc != 0 or not cap:
            sys.exit(f"soak.py: the capacity run failed:\n{out[-2000:]}")
        capacity = cap["request_throughput"]
        rate = a.factor * capacity
        n = max(1, int(rate * seconds))
        result.update(capacity_rps=capacity, offered_rps=rate, requests=n)
        print(f"capacity {capacity:.2f} req/s (closed loop, 128 in flight); offering {rate:.2f} req/s "
              f"({a.factor}x) for {seconds:.0f} s: {n} requests", flush=True)
        # Open loop, RSS sampled alongside.
        samples, stop = [], threading.Event()

        def sample():
            t0 = time.time()
            while not stop.is_set():
                procs = tree(up.pid)
                samples.append({"t": round(time.time() - t0, 1),
                                "rss_mib": {f"{role(args)}:{pid}": round(rss / 1024, 1) for pid, rss, args in procs}})
                stop.wait(2.0)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        start = time.time()
        try:
            rc, run, out = bench(tandem, port, os.path.join(work, "run.json"),
                                 ["--request-rate", f"{rate:.4f}", "--num-prompts", str(n), "--seed",
                                  str(random.randrange(1 << 30)), "--warmup-requests", "0", "--output-details"],
                                 seconds * 3 + 300)
        except subprocess.TimeoutExpired:
            rc, run, out = None, None, "the bench did not finish: some request hung"
        stop.set()
        th.join()
        result["wall_s"] = round(time.time() - start, 1)
        if run is None:
            failures.append(f"no bench result (rc {rc}): {out[-1500:]}")
        else:
            errors = run.get("request_errors") or []
            done = run.get("completed", 0) + run.get("failed", 0)
            clean = re.compile(r"^HTTP (429|503): \S")
            kinds = {}
            for e in errors:
                k = "completed" if not e else (e.split(":")[0] if clean.match(e) else "other: " + e[:120])
                kinds[k] = kinds.get(k, 0) + 1
            result.update(completed=run.get("completed"), failed=run.get("failed"), outcomes=kinds,
                          output_throughput=run.get("output_throughput"), mean_ttft_ms=run.get("mean_ttft_ms"),
                          p99_ttft_ms=run.get("p99_ttft_ms"))
            result["checks"]["every_request_final"] = done == n and len(errors) == n
            result["checks"]["only_clean_errors"] = not any(k.startswith("other") for k in kinds)
            if done != n or len(errors) != n:
                failures.append(f"{done} of {n} requests ended ({len(errors)} outcomes recorded)")
            bad = {k: v for k, v in kinds.items() if k.startswith("other")}
            if bad:
                failures.append(f"requests ended without a clean status: {bad}")
            print(f"outcomes: {kinds}", flush=True)
        # Idle again, and serving.
        deadline, idle, why = time.time() + 60, False, ""
        while time.time() < deadline and not idle:
            idle, why = metrics_idle(port)
            if not idle:
                time.sleep(1.0)
        result["checks"]["idle_after"] = idle
        if not idle:
            failures.append(f"not idle 60 s after the run: {why}")
        rc, after, out = bench(tandem, port, os.path.join(work, "after.json"),
                               ["--max-concurrency", "4", "--num-prompts", "8", "--warmup-requests", "0"], 300)
        serves = rc == 0 and after is not None and after.get("failed", 1) == 0
        result["checks"]["serves_after"] = serves
        if not serves:
            failures.append(f"the next requests failed: {out[-1500:]}")
        # Memory: the second half's peak against the first half's.
        totals = [(s["t"], sum(s["rss_mib"].values())) for s in samples]
        result["rss_mib"] = samples
        if len(totals) >= 4:
            half = totals[len(totals) // 2][0]
            first = max(v for t, v in totals if t < half)
            second = max(v for t, v in totals if t >= half)
            bounded = second <= 1.25 * first + 64
            result.update(rss_first_half_peak_mib=round(first, 1), rss_second_half_peak_mib=round(second, 1),
                          rss_start_mib=round(totals[0][1], 1), rss_end_mib=round(totals[-1][1], 1))
            result["checks"]["memory_bounded"] = bounded
            print(f"cluster RSS: start {totals[0][1]:.0f} MiB, first-half peak {first:.0f}, second-half peak "
                  f"{second:.0f}, end {totals[-1][1]:.0f}", flush=True)
            if not bounded:
                failures.append(f"RSS grew: first-half peak {first:.0f} MiB, second-half {second:.0f} MiB")
        if up.poll() is not None:
            failures.append(f"tandem up exited during the run (rc {up.returncode})")
    finally:
        up.send_signal(signal.SIGINT)  # tandem up stops its processes on Ctrl-C
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()
    result["failures"] = failures
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rss_mib"}, indent=1))
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
