#!/usr/bin/env python3
"""Decode speed of constrained requests against unconstrained ones, on a running `lily serve`.

    python3 scripts/bench_structured.py http://127.0.0.1:8000 [CONCURRENCY]

Streams greedy `/v1/completions` requests of at most 300 tokens with the same prompt: unconstrained (`ignore_eos`),
`response_format: json_object`, `json_schema` with a short schema, and `json_schema` with a schema whose 40 required
list items keep the output going to the 300 tokens. With CONCURRENCY (default 1) that many copies of each run at
once. Prints the first request's time to first token, the tokens, each request's rate between its first and last
streamed token (median), the aggregate output rate over the wall time, and the shares of the unconstrained ones.
Standard library only.
"""

import json
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

base = sys.argv[1]
concurrency = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model = json.loads(urllib.request.urlopen(base + "/v1/models").read())["data"][0]["id"]
def run(extra, n=300):
    body = dict(model=model, prompt="Write a JSON object about the weather:", max_tokens=n, temperature=0, stream=True,
                stream_options={"include_usage": True}, **extra)
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter(); first = last = None; usage = None; text = ""; finish = None
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            ev = json.loads(line[5:])
            now = time.perf_counter()
            if ev.get("choices"):
                c = ev["choices"][0]
                if c.get("text"):
                    first = first or now; last = now; text += c["text"]
                finish = c.get("finish_reason") or finish
            if ev.get("usage"):
                usage = ev["usage"]
    toks = usage["completion_tokens"]
    rate = (toks - 1) / (last - first) if last and last > first else float("nan")
    return dict(ttft_ms=round((first - t0) * 1000, 1), tokens=toks, tok_s=round(rate, 1), finish=finish, text=text[:120])
schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "array", "items": {
    "type": "object", "properties": {"day": {"type": "integer"}, "summary": {"type": "string"}},
    "required": ["day", "summary"]}}}, "required": ["city", "days"]}
long_schema = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"},
    "minItems": 40}}, "required": ["notes"]}
def batch(extra):
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        rs = list(pool.map(lambda _: run(extra), range(concurrency)))
    wall = time.perf_counter() - t0
    out = dict(rs[0])
    out["tok_s"] = statistics.median(r["tok_s"] for r in rs)
    out["aggregate_tok_s"] = round(sum(r["tokens"] for r in rs) / wall, 1)
    return out
plain = batch({"ignore_eos": True})
print("unconstrained", plain)
for name, extra in [("json_object", {"response_format": {"type": "json_object"}}),
                    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}}),
                    ("json_schema_long", {"response_format": {"type": "json_schema",
                                                              "json_schema": {"name": "notes", "schema": long_schema}}})]:
    r = batch(extra)
    print(name, r, "ratio %.3f aggregate ratio %.3f" % (r["tok_s"] / plain["tok_s"],
                                                         r["aggregate_tok_s"] / plain["aggregate_tok_s"]))
