#!/usr/bin/env python3
"""Prefix-cache benchmark for a running `lily serve`: how much of each prompt is reused, and what it saves.

Two workloads, each a subcommand:

  chat    A multi-turn chat replay: the first user message carries a long document, every turn adds a question of
          --user-tokens and a streamed reply of --reply-tokens (`ignore_eos`, greedy). Per turn it reports the
          prompt's tokens, `usage.prompt_tokens_details.cached_tokens`, the reusable prefix (the tokens the prompt
          shares with the previous turn's prompt and reply, from `/tokenize`), the time to first token (TTFT), and
          the TTFT of a reference prompt of random ids as long as the tokens that were not cached (what prefilling
          only the new tokens costs), at depth 0 and after a random prefix as long as the cached part (sent first,
          so the server caches it: the new tokens' cost at their depth). `--thinking` keeps the chat template's thinking on, and `--tools` adds a tool
          list to every request.
  shared  --requests requests at once sharing a system prompt of --system-tokens, each with its own question:
          reports wall time, TTFT percentiles, and from `/metrics` the prompt tokens prefilled versus taken from the
          cache.

Run it once against a server with the cache and once against one started with `--no-prefix-cache` to compare.
Only the Python standard library is used. The last line of output is one JSON object with every figure.

    python3 scripts/bench_prefix.py --base-url http://127.0.0.1:8000 chat --doc-tokens 16000 --turns 10
    python3 scripts/bench_prefix.py --base-url http://127.0.0.1:8000 shared --system-tokens 8000 --requests 64
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

# Common English words, most of which are one token each in this model's tokenizer.
WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they which one you "
    "were all we her she there been their if has will more when would who so no out up into than them can only "
    "other new some could time these two may then first any my now such like our over man me even most made "
    "after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both "
    "life being under never day same another know while last might us great old year off come since against go "
    "came right used take three"
).split()


def words(rng, count):
    return " ".join(rng.choice(WORDS) for _ in range(count))


class Client:
    def __init__(self, base_url, api_key, timeout):
        url = urllib.parse.urlparse(base_url)
        if url.scheme != "http":
            raise SystemExit("only http:// base URLs are supported")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def request(self, method, path, body=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request(method, self.prefix + path, body=None if body is None else json.dumps(body),
                         headers=self.headers())
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {data[:300]!r}")
            return data
        finally:
            conn.close()

    def json(self, method, path, body=None):
        return json.loads(self.request(method, path, body))

    def metrics(self):
        """The server's counters and gauges as a dict (lines without labels only)."""
        out = {}
        for line in self.request("GET", "/metrics").decode().splitlines():
            if line.startswith("#") or "{" in line:
                continue
            parts = line.split()
            if len(parts) == 2:
                try:
                    out[parts[0]] = float(parts[1])
                except ValueError:
                    pass
        return out

    def stream(self, path, body):
        """One streamed request: (TTFT in seconds, the text, usage)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        start = time.perf_counter()
        # The first chunk with text; failing that (one token whose bytes are not whole text yet, which the server
        # holds back), the first chunk with a choice.
        first = None
        first_choice = None
        text = []
        usage = None
        try:
            conn.request("POST", self.prefix + path, body=json.dumps(body), headers=self.headers())
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"POST {path}: HTTP {resp.status}: {resp.read()[:300]!r}")
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
                    raise RuntimeError(f"POST {path}: {event['error']}")
                for choice in event.get("choices") or []:
                    if first_choice is None:
                        first_choice = time.perf_counter() - start
                    piece = choice.get("text")
                    if piece is None:
                        delta = choice.get("delta") or {}
                        piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - start
                        text.append(piece)
                if event.get("usage"):
                    usage = event["usage"]
        finally:
            conn.close()
        return (first if first is not None else first_choice), "".join(text), usage


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')}: " + " ".join(WORDS[i : i + 40]),
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for i, name in enumerate(["search_documents", "read_file", "run_query", "send_message"])
]


def reference_ttft(client, model, rng, tokens):
    """TTFT of a prompt of `tokens` random ids that no cache holds: the cost of prefilling that many tokens."""
    prompt = [rng.randrange(1000, 150000) for _ in range(max(tokens, 1))]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    ttft, _, _ = client.stream("/v1/completions", body)
    return ttft


def reference_at_depth_ttft(client, model, rng, depth, tokens):
    """TTFT of `tokens` random ids after a `depth`-token random prefix that the server has just cached (sent first as
    a request of its own): what prefilling only the new tokens costs at the depth where a chat turn prefills them.
    Returns the TTFT and the tokens the server took from its cache."""
    prefix = [rng.randrange(1000, 150000) for _ in range(depth)]
    new = [rng.randrange(1000, 150000) for _ in range(max(tokens, 1))]
    base = {"model": model, "max_tokens": 1, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    client.stream("/v1/completions", {**base, "prompt": prefix})
    ttft, _, usage = client.stream("/v1/completions", {**base, "prompt": prefix + new})
    return ttft, usage["prompt_tokens_details"]["cached_tokens"]


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat(args, client, model):
    rng = random.Random(args.seed)
    kwargs = {"enable_thinking": bool(args.thinking)}
    document = words(rng, args.doc_tokens)
    messages = [{"role": "system", "content": "You answer questions about the document the user gives."}]
    extra = {"tools": TOOLS} if args.tools else {}
    turns = []
    for turn in range(args.turns):
        question = words(rng, args.user_tokens)
        content = f"Document:\n{document}\n\nQuestion: {question}" if turn == 0 else question
        messages.append({"role": "user", "content": content})
        body = {"model": model, "messages": messages, "max_tokens": args.reply_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "chat_template_kwargs": kwargs, **extra}
        ttft, reply, usage = client.stream("/v1/chat/completions", body)
        # Tokenized only after the turn, so that the server's token cache has not seen the turn's new text (the
        # previous reply and the question) before it: what the cache could hold for this turn is the previous
        # prompt and reply as the template renders them.
        def tokenize(conversation, generation_prompt):
            return client.json("POST", "/tokenize", {"model": model, "messages": conversation,
                                                     "add_generation_prompt": generation_prompt,
                                                     "chat_template_kwargs": kwargs, **extra})["tokens"]
        rendered = tokenize(messages, True)
        reusable = common_prefix(tokenize(messages[:-1], False), rendered) if turn > 0 else 0
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        prompt = usage["prompt_tokens"]
        reference = reference_ttft(client, model, rng, prompt - cached) if turn > 0 else None
        at_depth, at_depth_cached = (reference_at_depth_ttft(client, model, rng, cached, prompt - cached)
                                     if turn > 0 and cached > 0 else (None, None))
        turns.append({"turn": turn + 1, "prompt_tokens": prompt, "reusable": reusable, "cached_tokens": cached,
                      "ttft_s": ttft, "reference_ttft_s": reference, "reference_at_depth_ttft_s": at_depth,
                      "reference_at_depth_cached": at_depth_cached})
        print(f"turn {turn + 1}: prompt {prompt}, reusable {reusable}, cached {cached}, TTFT {ttft * 1000:.1f} ms"
              + (f", prefilling only the {prompt - cached} new tokens {reference * 1000:.1f} ms" if reference else "")
              + (f" at depth 0, {at_depth * 1000:.1f} ms after {at_depth_cached} cached" if at_depth else ""),
              flush=True)
        messages.append({"role": "assistant", "content": reply})
    later = turns[1:]
    summary = {
        "workload": "chat",
        "turns": turns,
        "ttft_later_turns_s": sum(t["ttft_s"] for t in later),
        "reference_later_turns_s": sum(t["reference_ttft_s"] for t in later),
        "ttft_all_turns_s": sum(t["ttft_s"] for t in turns),
        "cached_of_reusable": (sum(t["cached_tokens"] for t in later) / max(1, sum(t["reusable"] for t in later))),
        "cached_of_prompt": sum(t["cached_tokens"] for t in turns) / sum(t["prompt_tokens"] for t in turns),
    }
    summary["ttft_over_reference"] = summary["ttft_later_turns_s"] / max(1e-9, summary["reference_later_turns_s"])
    if all(t["reference_at_depth_ttft_s"] is not None for t in later):
        summary["reference_at_depth_later_turns_s"] = sum(t["reference_at_depth_ttft_s"] for t in later)
        summary["ttft_over_reference_at_depth"] = (summary["ttft_later_turns_s"]
                                                   / max(1e-9, summary["reference_at_depth_later_turns_s"]))
    return summary


def shared(args, client, model):
    rng = random.Random(args.seed)
    system = words(rng, args.system_tokens)
    questions = [words(rng, args.question_tokens) for _ in range(args.requests)]
    before = client.metrics()

    def one(question):
        body = {"model": model, "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": question}],
                "max_tokens": args.reply_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
        ttft, _, usage = client.stream("/v1/chat/completions", body)
        return ttft, usage

    begin = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        results = list(pool.map(one, questions))
    wall = time.perf_counter() - begin
    after = client.metrics()

    def delta(name):
        return after.get(name, 0.0) - before.get(name, 0.0)

    ttfts = sorted(r[0] for r in results)
    summary = {
        "workload": "shared",
        "requests": args.requests,
        "wall_s": wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": ttfts[-1],
        "prompt_tokens": sum(r[1]["prompt_tokens"] for r in results),
        "cached_tokens": sum(r[1]["prompt_tokens_details"]["cached_tokens"] for r in results),
        "prefilled_tokens": delta("lily_prompt_tokens_total") - delta("lily_prefix_cache_hit_tokens_total"),
        "system_prompt_tokens": results[0][1]["prompt_tokens"] - args.question_tokens,
    }
    print(f"{args.requests} requests: wall {wall:.2f} s, TTFT p50 {summary['ttft_p50_s'] * 1000:.0f} ms, "
          f"prompt tokens {summary['prompt_tokens']}, cached {summary['cached_tokens']}, "
          f"prefilled {summary['prefilled_tokens']:.0f}", flush=True)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0)
    sub = ap.add_subparsers(dest="workload", required=True)
    c = sub.add_parser("chat", help="a multi-turn chat replay on a long document")
    c.add_argument("--doc-tokens", type=int, default=16000)
    c.add_argument("--turns", type=int, default=10)
    c.add_argument("--user-tokens", type=int, default=200)
    c.add_argument("--reply-tokens", type=int, default=200)
    c.add_argument("--thinking", action="store_true", help="leave the template's thinking on")
    c.add_argument("--tools", action="store_true", help="send a tool list with every request")
    s = sub.add_parser("shared", help="many requests at once sharing a system prompt")
    s.add_argument("--system-tokens", type=int, default=8000)
    s.add_argument("--question-tokens", type=int, default=200)
    s.add_argument("--requests", type=int, default=64)
    s.add_argument("--concurrency", type=int, default=64)
    s.add_argument("--reply-tokens", type=int, default=16)
    args = ap.parse_args()
    client = Client(args.base_url, args.api_key, args.timeout)
    model = args.model or client.json("GET", "/v1/models")["data"][0]["id"]
    summary = chat(args, client, model) if args.workload == "chat" else shared(args, client, model)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
