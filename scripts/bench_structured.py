#!/usr/bin/env python3
"""Decode speed of one constrained request against an unconstrained one, on a running `lily serve`.

    python3 scripts/bench_structured.py http://127.0.0.1:8000

Streams three greedy `/v1/completions` requests of at most 300 tokens with the same prompt: unconstrained
(`ignore_eos`), `response_format: json_object`, and `response_format: json_schema`; prints each one's time to first
token, tokens, rate between the first and the last streamed token, and its share of the unconstrained rate.
Standard library only.
"""

import json
import sys
import time
import urllib.request

base = sys.argv[1]
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
plain = run({"ignore_eos": True})
print("unconstrained", plain)
for name, extra in [("json_object", {"response_format": {"type": "json_object"}}),
                    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}})]:
    r = run(extra)
    print(name, r, "ratio %.3f" % (r["tok_s"] / plain["tok_s"]))
