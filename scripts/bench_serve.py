#!/usr/bin/env python3
"""Serving benchmark for a running `lily serve` (or any OpenAI-compatible server), after `vllm bench serve`.

Sends random-token prompts of a fixed input length to `/v1/completions` (streamed, `ignore_eos`, a fixed number of
output tokens), either at a fixed concurrency or at a Poisson request rate, after a few warm-up requests, and
reports request and token throughput, time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL) and errors. Only the Python standard library is used, so it runs on any host.

    python3 scripts/bench_serve.py --base-url http://127.0.0.1:8000 --input-len 1000 --output-len 1000 \
        --concurrency 64 --num-prompts 256

With --no-max-tokens the requests leave out `max_tokens` and honour end-of-sequence tokens, as the OpenAI client's
do by default: each ends at a --stop string (say a newline, with --temperature 1 on random weights), an
end-of-sequence token or the end of the context. That measures how a server admits requests whose length it cannot
know in advance.

The last line of output is one JSON object with every figure (also written to --json-out when given).
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor


def percentile(values, q):
    """The q-th percentile (0..100) by linear interpolation; None for no values."""
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


class Client:
    def __init__(self, base_url, api_key, timeout):
        url = urllib.parse.urlparse(base_url)
        if url.scheme != "http":
            raise SystemExit("only http:// base URLs are supported")
        self.host = url.hostname
        self.port = url.port or 80
        self.prefix = url.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get_json(self, path):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("GET", self.prefix + path, headers=self.headers())
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET {path}: HTTP {resp.status}: {body[:200]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def stream_completion(self, body):
        """Sends one streamed completion; returns a dict with timings (seconds) and token counts, or an error."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        start = time.perf_counter()
        result = {"start": start, "ok": False, "chunks": [], "output_tokens": 0, "prompt_tokens": 0}
        try:
            conn.request("POST", self.prefix + "/v1/completions", body=json.dumps(body), headers=self.headers())
            resp = conn.getresponse()
            if resp.status != 200:
                result["error"] = f"HTTP {resp.status}: {resp.read()[:200]!r}"
                return result
            while True:
                line = resp.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result["error"] = json.dumps(event["error"])[:200]
                    return result
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text"):
                    result["chunks"].append(now)
                usage = event.get("usage")
                if usage:
                    result["output_tokens"] = usage.get("completion_tokens", 0)
                    result["prompt_tokens"] = usage.get("prompt_tokens", 0)
            result["end"] = time.perf_counter()
            # A reply cut at a stop string before any text is a success without chunks.
            result["ok"] = result["output_tokens"] > 0
            if not result["ok"]:
                result["error"] = "the stream ended without output or usage"
        except Exception as e:  # a failed request is counted, never fatal to the run
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            conn.close()
        return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--input-len", type=int, default=1000, help="prompt tokens per request")
    ap.add_argument("--output-len", type=int, default=1000, help="output tokens per request (ignore_eos)")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests to send (default: 4 x concurrency)")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight at most")
    ap.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (default: all at once, limited by --concurrency)")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent (one at a time) before measuring")
    ap.add_argument("--vocab-low", type=int, default=1000, help="random prompt ids are drawn from [low, high)")
    ap.add_argument("--vocab-high", type=int, default=150000)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=None, help="top_p of every request (default: left out)")
    ap.add_argument("--top-k", type=int, default=None, help="top_k of every request (default: left out)")
    ap.add_argument("--no-max-tokens", action="store_true",
                    help="send no max_tokens and honour end-of-sequence, as clients that leave it out do: requests "
                         "then end at a --stop string, an end-of-sequence token or the end of the context")
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds a request may take")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    if args.concurrency < 1 or args.input_len < 1 or args.output_len < 1:
        raise SystemExit("--concurrency, --input-len and --output-len must be at least 1")
    num = args.num_prompts if args.num_prompts is not None else 4 * args.concurrency

    client = Client(args.base_url, args.api_key, args.timeout)
    model = args.model or client.get_json("/v1/models")["data"][0]["id"]
    rng = random.Random(args.seed)

    def request_body(i):
        prompt = [rng.randrange(args.vocab_low, args.vocab_high) for _ in range(args.input_len)]
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": args.output_len,
            "temperature": args.temperature,
            "seed": args.seed + i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if args.top_p is not None:
            body["top_p"] = args.top_p
        if args.top_k is not None:
            body["top_k"] = args.top_k
        if args.stop:
            body["stop"] = args.stop
        if args.no_max_tokens:
            del body["max_tokens"]
            body["ignore_eos"] = False
        return body

    for i in range(args.warmup):
        r = client.stream_completion(dict(request_body(-1 - i), max_tokens=min(args.output_len, 16)))
        if not r["ok"]:
            raise SystemExit(f"warm-up request failed: {r.get('error')}")

    bodies = [request_body(i) for i in range(num)]
    arrivals = []
    t = 0.0
    for _ in range(num):
        arrivals.append(t)
        if args.request_rate != float("inf"):
            t += rng.expovariate(args.request_rate)

    results = []
    lock = threading.Lock()
    begin = time.perf_counter()

    def one(i):
        delay = begin + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        r = client.stream_completion(bodies[i])
        with lock:
            results.append(r)

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        list(pool.map(one, range(num)))
    duration = time.perf_counter() - begin

    ok = [r for r in results if r["ok"]]
    errors = [r.get("error", "?") for r in results if not r["ok"]]
    ttft = [r["chunks"][0] - r["start"] for r in ok if r["chunks"]]
    tpot = [(r["end"] - r["chunks"][0]) / (r["output_tokens"] - 1) for r in ok if r["chunks"] and r["output_tokens"] > 1]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    out_tokens = sum(r["output_tokens"] for r in ok)
    in_tokens = sum(r["prompt_tokens"] for r in ok)
    ms = lambda v: None if v is None else round(v * 1000.0, 2)  # noqa: E731
    report = {
        "model": model,
        "input_len": args.input_len,
        "output_len": None if args.no_max_tokens else args.output_len,
        "stop": args.stop or None,
        "concurrency": args.concurrency,
        "request_rate": None if args.request_rate == float("inf") else args.request_rate,
        "requests": num,
        "completed": len(ok),
        "failed": len(errors),
        "duration_s": round(duration, 3),
        "request_throughput": round(len(ok) / duration, 3),
        "output_tok_s": round(out_tokens / duration, 1),
        "total_tok_s": round((out_tokens + in_tokens) / duration, 1),
        "ttft_ms_mean": ms(statistics.mean(ttft)) if ttft else None,
        "ttft_ms_p50": ms(percentile(ttft, 50)),
        "ttft_ms_p99": ms(percentile(ttft, 99)),
        "tpot_ms_mean": ms(statistics.mean(tpot)) if tpot else None,
        "tpot_ms_p50": ms(percentile(tpot, 50)),
        "tpot_ms_p99": ms(percentile(tpot, 99)),
        "itl_ms_p50": ms(percentile(itl, 50)),
        "itl_ms_p99": ms(percentile(itl, 99)),
        "itl_ms_max": ms(max(itl)) if itl else None,
        "stream_tok_s_per_request_p50": round(1000.0 / ms(percentile(tpot, 50)), 1) if tpot else None,
    }
    print(f"requests: {len(ok)} completed, {len(errors)} failed in {duration:.2f} s (concurrency {args.concurrency})")
    print(f"output {report['output_tok_s']} tok/s, total {report['total_tok_s']} tok/s")
    print(f"TTFT ms p50 {report['ttft_ms_p50']} p99 {report['ttft_ms_p99']}; "
          f"TPOT ms p50 {report['tpot_ms_p50']} p99 {report['tpot_ms_p99']}; "
          f"ITL ms p99 {report['itl_ms_p99']} max {report['itl_ms_max']}")
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    line = json.dumps(report)
    print(line)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
