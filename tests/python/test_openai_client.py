"""`lily serve` driven by the official `openai` Python package: chat (streamed and not), completions, responses,
tools, logprobs, structured outputs and the error cases. The model is the bundled lily-tiny-shakespeare: it writes
Shakespearean English and never calls tools by itself, so the free tool tests check the request/response plumbing
(the exact tool-call shapes are tested in Rust with a scripted backend); with `tool_choice` `required` the
constraint makes it call one."""

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def ask(text="What light through yonder window breaks?"):
    return [{"role": "user", "content": text}]


def test_models(client, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert client.models.retrieve(model).id == model


def test_chat_non_streaming(client, model):
    r = client.chat.completions.create(model=model, messages=ask(), max_tokens=12, temperature=0, extra_body=NO_THINKING)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == model
    choice = r.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 12
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_streaming_matches_non_streaming(client, model):
    kwargs = dict(model=model, messages=ask(), max_tokens=12, temperature=0, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    # Without include_usage there is no usage chunk.
    plain = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.choices for c in plain)


def test_reasoning_content_field(client, model):
    # Thinking on (the template's default): the reasoning goes to reasoning_content, apart from the content.
    r = client.chat.completions.create(model=model, messages=ask(), max_tokens=24, temperature=0)
    message = r.choices[0].message.model_dump()
    assert "reasoning_content" in message
    r2 = client.chat.completions.create(
        model=model, messages=ask(), max_tokens=24, temperature=0, reasoning_effort="none"
    )
    assert r2.choices[0].message.model_dump().get("reasoning_content") is None
    assert r2.choices[0].message.content


def test_sampling_seed_n_and_stop(client, model):
    kwargs = dict(model=model, messages=ask("Speak, Romeo."), max_tokens=16, temperature=1.0, top_p=0.95,
                  presence_penalty=0.3, frequency_penalty=0.3, extra_body={"top_k": 40, **NO_THINKING})
    a = client.chat.completions.create(seed=1234, **kwargs)
    b = client.chat.completions.create(seed=1234, **kwargs)
    assert a.choices[0].message.content == b.choices[0].message.content
    r = client.chat.completions.create(seed=5, n=3, **kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]

    greedy = client.chat.completions.create(model=model, messages=ask(), max_tokens=24, temperature=0, extra_body=NO_THINKING)
    text = greedy.choices[0].message.content
    words = text.split()
    assert len(words) >= 3
    stopped = client.chat.completions.create(model=model, messages=ask(), max_tokens=24, temperature=0, stop=[words[2]],
                                             extra_body=NO_THINKING)
    assert stopped.choices[0].message.content == text[: text.find(words[2])]
    assert stopped.choices[0].finish_reason == "stop"
    one = client.chat.completions.create(model=model, messages=ask(), max_completion_tokens=1, extra_body=NO_THINKING)
    assert one.choices[0].finish_reason == "length" and one.usage.completion_tokens == 1
    # A top_p of 0 keeps only the most likely token: the greedy answer at any temperature.
    nucleus = client.chat.completions.create(model=model, messages=ask(), max_tokens=24, temperature=1.0, top_p=0,
                                             seed=5, extra_body=NO_THINKING)
    assert nucleus.choices[0].message.content == text


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=ask(), max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body=NO_THINKING)
    content = r.choices[0].logprobs.content
    assert content
    for entry in content:
        assert entry.logprob <= 0
        assert isinstance(entry.bytes, list)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
    streamed = []
    for chunk in client.chat.completions.create(model=model, messages=ask(), max_tokens=6, temperature=0, logprobs=True,
                                                top_logprobs=2, stream=True, extra_body=NO_THINKING):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in content]


@pytest.mark.parametrize(
    "tool_choice", ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_tools_are_accepted(client, model, tool_choice):
    r = client.chat.completions.create(model=model, messages=ask("What is the weather in Verona?"), tools=[WEATHER_TOOL],
                                       tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.tool_calls is None or all(c.type == "function" for c in choice.message.tool_calls)
    chunks = list(client.chat.completions.create(model=model, messages=ask("Weather?"), tools=[WEATHER_TOOL],
                                                 tool_choice=tool_choice, max_tokens=8, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_results_in_the_conversation(client, model):
    messages = [
        {"role": "system", "content": "You are a herald."},
        {"role": "user", "content": "What is the weather in Verona?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Verona", "days": 1})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C."},
    ]
    r = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    text = r.choices[0].text
    assert text and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="ROMEO.\n", max_tokens=8, temperature=0, stream=True))
    assert streamed == text
    lp = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=4, temperature=0, logprobs=2)
    assert len(lp.choices[0].logprobs.tokens) == 4
    assert all(len(t) == 2 for t in lp.choices[0].logprobs.top_logprobs)


def test_completions_logprobs_and_echo(client, model):
    # top_logprobs holds the sampled token: logprobs=0 gives exactly that entry.
    r = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=4, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert [list(top) for top in lp.top_logprobs] == [[token] for token in lp.tokens]
    # echo with logprobs: the prompt's tokens come first, the first without a logprob.
    e = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=2, temperature=0, logprobs=1, echo=True)
    lp = e.choices[0].logprobs
    assert e.choices[0].text.startswith("ROMEO.\n")
    assert len(lp.tokens) > 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


def test_completions_score_a_prompt_with_max_tokens_zero(client, model):
    # Evaluation harnesses score text with echo, logprobs and max_tokens=0: the prompt alone comes back, with the
    # logprobs the same echo gives before a generated token.
    scored = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=0, temperature=0, logprobs=1, echo=True)
    choice = scored.choices[0]
    assert choice.text == "ROMEO.\n" and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert "".join(choice.logprobs.tokens) == "ROMEO.\n" and choice.logprobs.token_logprobs[0] is None
    longer = client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=1, temperature=0, logprobs=1,
                                       echo=True).choices[0].logprobs
    n = len(choice.logprobs.tokens)
    assert all(abs(a - b) < 1e-4 for a, b in zip(choice.logprobs.token_logprobs[1:], longer.token_logprobs[1:n]))
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="ROMEO.\n", max_tokens=0)


def test_health_names_the_device(base_url):
    health = json.loads(urllib.request.urlopen(base_url + "/health").read())
    assert health["status"] == "ok"
    assert health["device"].startswith(("cpu", "cuda"))


def test_json_object_is_enforced(client, model):
    r = client.chat.completions.create(model=model, messages=ask("Answer in JSON."), max_tokens=300, temperature=0,
                                       response_format={"type": "json_object"}, extra_body=NO_THINKING)
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    cut = client.chat.completions.create(model=model, messages=ask("Answer in JSON."), max_tokens=2, temperature=0,
                                         response_format={"type": "json_object"}, extra_body=NO_THINKING)
    assert cut.choices[0].finish_reason == "length"


class Character(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    house: Literal["Montague", "Capulet", "Escalus"]
    lines: list[Annotated[str, Field(max_length=10)]] = Field(min_length=1, max_length=3)
    nickname: Optional[Annotated[str, Field(max_length=8)]]


SCHEMAS = [
    {"type": "object",
     "properties": {"play": {"type": "string", "maxLength": 10},
                    "act": {"type": "object",
                            "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "title": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
                            "required": ["number", "title"], "additionalProperties": False}},
     "required": ["play", "act"], "additionalProperties": False},
    {"type": "object",
     "properties": {"words": {"type": "array", "items": {"enum": ["thee", "thou", "thy"]}, "minItems": 2,
                              "maxItems": 4},
                    "mood": {"anyOf": [{"type": "integer", "minimum": -3, "maximum": 3}, {"type": "null"}]},
                    "date": {"type": "string", "format": "date"}},
     "required": ["words", "mood", "date"], "additionalProperties": False},
    {"type": "object",
     "properties": {"a": {"type": "boolean"}, "b": {"type": "number", "minimum": 0, "maximum": 1},
                    "c": {"type": "string", "maxLength": 4}},
     "required": ["a"], "additionalProperties": False},
]


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(client, model, schema):
    for seed in range(3):
        r = client.chat.completions.create(
            model=model, messages=ask("Tell me of the play."), max_tokens=200, temperature=0.8, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                                    "strict": True}},
            extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema,
                            format_checker=jsonschema.FormatChecker())


def test_parse_with_a_pydantic_model(client, model):
    r = client.chat.completions.parse(model=model, messages=ask("Who is Romeo?"), max_tokens=200, temperature=0,
                                      response_format=Character, extra_body=NO_THINKING)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Character)
    assert parsed.house in ("Montague", "Capulet", "Escalus") and 1 <= len(parsed.lines) <= 3


def test_streaming_gives_the_same_structured_text(client, model):
    kwargs = dict(model=model, messages=ask("Who is Juliet?"), max_tokens=200, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[0]}},
                  extra_body=NO_THINKING)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(whole), SCHEMAS[0])


def test_tool_choice_required_returns_tool_calls(client, model):
    tool = {"type": "function", "function": {
        "name": "get_weather",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 12},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                       "required": ["city", "days"]}}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=model, messages=ask("Weather in Verona?"), max_tokens=120,
                                           temperature=0, tools=[tool], tool_choice=choice,
                                           parallel_tool_calls=False, extra_body=NO_THINKING)
        assert r.choices[0].finish_reason == "tool_calls", r
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), tool["function"]["parameters"])


def test_vllm_structured_outputs(client, model):
    r = client.chat.completions.create(model=model, messages=ask(), max_tokens=20, temperature=0,
                                       extra_body={**NO_THINKING, "structured_outputs": {"choice": ["aye", "nay"]}})
    assert r.choices[0].message.content in ("aye", "nay")
    r = client.chat.completions.create(model=model, messages=ask(), max_tokens=30, temperature=0,
                                       extra_body={**NO_THINKING, "structured_outputs": {"regex": "[A-Z][a-z]{2,8}!"}})
    assert re.fullmatch("[A-Z][a-z]{2,8}!", r.choices[0].message.content)


def expect_error(kind, fn, param=None, code=None):
    with pytest.raises(kind) as info:
        fn()
    error = info.value
    assert isinstance(error.body, dict) and error.body.get("message")
    assert error.type
    if param is not None:
        assert error.param == param
    if code is not None:
        assert error.code == code
    return error


def test_errors(client, model, base_url):
    chat = client.chat.completions.create
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=[]), param="messages")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=[{"role": "wizard", "content": "hi"}]),
                 param="messages[0].role")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), temperature=-1), param="temperature")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), max_tokens=0), param="max_tokens")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), max_tokens=10**6),
                 param="max_tokens", code="context_length_exceeded")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask("Speak! " * 3000), max_tokens=1),
                 code="context_length_exceeded")
    expect_error(openai.BadRequestError, lambda: chat(
        model=model, messages=ask(),
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}),
        param="response_format")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), tool_choice="auto"),
                 param="tool_choice")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), tool_choice="required"),
                 param="tool_choice")
    expect_error(openai.BadRequestError, lambda: chat(model=model, messages=ask(), extra_body={"temperature": "hot"}),
                 param="temperature")
    expect_error(openai.NotFoundError, lambda: chat(model="gpt-4o", messages=ask()), param="model")
    expect_error(openai.BadRequestError, lambda: client.completions.create(model=model, prompt="", max_tokens=2))
    wrong_key = openai.OpenAI(base_url=base_url + "/v1", api_key="wrong", max_retries=0)
    expect_error(openai.AuthenticationError, lambda: wrong_key.models.list(), code="invalid_api_key")
    # Still healthy afterwards.
    assert urllib.request.urlopen(base_url + "/health").status == 200
    assert chat(model=model, messages=ask(), max_tokens=2).choices


def test_tokenize_detokenize_and_metrics(base_url, api_key):
    def post(path, body):
        request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST",
                                         headers={"content-type": "application/json",
                                                  "authorization": f"Bearer {api_key}"})
        return json.loads(urllib.request.urlopen(request).read())

    text = "The quick brown fox jumps over the lazy dog."
    tokens = post("/tokenize", {"prompt": text})["tokens"]
    assert tokens == [760, 3841, 13477, 37550, 33075, 888, 279, 15217, 5388, 13]
    assert post("/detokenize", {"tokens": tokens})["prompt"] == text
    metrics = urllib.request.urlopen(base_url + "/metrics").read().decode()
    for name in ("lily_requests_total", "lily_prompt_tokens_total", "lily_generation_tokens_total",
                 "lily_time_to_first_token_seconds_bucket", "lily_time_per_output_token_seconds_bucket",
                 "lily_queue_depth", "lily_requests_running"):
        assert name in metrics, name


def test_concurrent_requests_each_get_their_own_answer(client, model, base_url):
    # Several requests at once run together in the engine's batch; each must get the text it gets alone.
    with urllib.request.urlopen(base_url + "/health", timeout=10) as response:
        health = json.load(response)
    assert health["max_seqs"] >= 2, health
    prompts = [
        "ROMEO:",
        "First Citizen:\nBefore we proceed any further, hear me speak.",
        "KING RICHARD III:\nNow is the winter of our discontent",
        "To be",
        "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name;",
        "MENENIUS:",
    ]
    lengths = [24, 40, 16, 32, 28, 20]

    def complete(i):
        r = client.completions.create(
            model=model, prompt=prompts[i], max_tokens=lengths[i], temperature=0, logprobs=5
        )
        return r.choices[0].text, r.usage.completion_tokens, r.choices[0].logprobs

    alone = [complete(i) for i in range(len(prompts))]
    # Twice over, in an order that differs from the one above, so that sequences join a running batch.
    order = list(reversed(range(len(prompts)))) * 2
    with ThreadPoolExecutor(max_workers=len(order)) as pool:
        together = list(pool.map(complete, order))
    if health["device"].startswith("cpu"):
        for i, got in zip(order, together):
            assert got[:2] == alone[i][:2], (prompts[i], got[:2], alone[i][:2])
    else:
        # On a GPU a sequence alone runs the single-sequence step (f32 activations into the products) and in a
        # batch of many rows the batched one (bf16 activations, sums split by the row count): logits agree within
        # the end-to-end tolerance of `lily selftest` (5e-2 of the largest at the full shape, whose random 40
        # layers amplify rounding), so the greedy choice may differ where two candidates are that close. Where an
        # answer first differs from the one alone, the token chosen alone must be among the batched row's top five
        # and within 1 nat of its choice; another sequence's state leaking in would give other candidates.
        for i, got in zip(order, together):
            ours, theirs = got[2], alone[i][2]
            at = next((j for j, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)) if a != b), None)
            if at is None:
                assert got[:2] == alone[i][:2], (prompts[i], got[:2], alone[i][:2])
                continue
            top = ours.top_logprobs[at]
            assert theirs.tokens[at] in top, (prompts[i], at, top, theirs.tokens[at])
            gap = ours.token_logprobs[at] - top[theirs.tokens[at]]
            assert gap < 1.0, (prompts[i], at, gap)
    # Seeded sampling too: the same seed draws the same tokens whatever runs beside it.
    def sampled(seed):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Speak, friend."}],
            max_tokens=24,
            temperature=1.0,
            seed=seed,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        return r.choices[0].message.content

    seeds = [11, 12, 13, 14]
    one_by_one = [sampled(s) for s in seeds]
    with ThreadPoolExecutor(max_workers=len(seeds)) as pool:
        assert list(pool.map(sampled, seeds)) == one_by_one


RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"],
    },
}


def test_responses_text_streamed_and_whole(client, model):
    kwargs = dict(model=model, input="What light through yonder window breaks?", instructions="Speak as Romeo.",
                  max_output_tokens=12, temperature=0, reasoning={"effort": "none"})
    r = client.responses.create(**kwargs)
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.model == model
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert r.output_text
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 1 <= r.usage.output_tokens <= 12
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.instructions == "Speak as Romeo." and r.max_output_tokens == 12

    events = list(client.responses.create(stream=True, **kwargs))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if r.status == "completed" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == r.output_text
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens


def test_responses_logprobs_of_the_message(client, model):
    kwargs = dict(model=model, input="Speak, Romeo.", max_output_tokens=6, temperature=0, top_logprobs=2,
                  include=["message.output_text.logprobs"], reasoning={"effort": "none"})
    r = client.responses.create(**kwargs)
    text = r.output[0].content[0]
    assert text.type == "output_text" and text.text == r.output_text
    assert 1 <= len(text.logprobs) <= r.usage.output_tokens
    assert "".join(lp.token for lp in text.logprobs) == text.text
    for lp in text.logprobs:
        assert lp.logprob <= 0 and len(lp.top_logprobs) == 2
        # Greedy: each token is the most likely one.
        assert lp.top_logprobs[0].token == lp.token and abs(lp.top_logprobs[0].logprob - lp.logprob) < 1e-6
    events = list(client.responses.create(stream=True, **kwargs))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, round(lp.logprob, 5)) for lp in streamed] == \
        [(lp.token, round(lp.logprob, 5)) for lp in text.logprobs]
    plain = client.responses.create(**{k: v for k, v in kwargs.items() if k not in ("include", "top_logprobs")})
    assert plain.output[0].content[0].logprobs in (None, [])


def test_responses_stream_names_each_event(base_url, api_key, model):
    # As OpenAI's server does, every `data:` line follows an `event:` line naming its type, for SSE clients that
    # dispatch on the event name rather than on the payload.
    body = dict(model=model, input="Speak.", max_output_tokens=4, stream=True, reasoning={"effort": "none"})
    request = urllib.request.Request(base_url + "/v1/responses", data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json",
                                              "authorization": f"Bearer {api_key}"})
    blocks = urllib.request.urlopen(request).read().decode().split("\n\n")
    events = [dict(line.split(": ", 1) for line in b.splitlines() if ": " in line) for b in blocks]
    events = [e for e in events if "data" in e]  # not keep-alive comments
    assert len(events) >= 4
    for e in events:
        assert e["event"] == json.loads(e["data"])["type"], e
    assert events[0]["event"] == "response.created"


def test_responses_function_calls_and_their_outputs(client, model):
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = client.responses.create(model=model, input="Weather in Verona?", tools=[RESPONSES_TOOL],
                                    tool_choice=choice, parallel_tool_calls=False, max_output_tokens=120,
                                    temperature=0, reasoning={"effort": "none"})
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", r.output
        jsonschema.validate(json.loads(calls[0].arguments), RESPONSES_TOOL["parameters"])
        assert calls[0].call_id and calls[0].status == "completed"
    events = list(client.responses.create(model=model, input="Weather in Verona?", tools=[RESPONSES_TOOL],
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=120,
                                          temperature=0, reasoning={"effort": "none"}, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == calls[0].arguments
    # The call and its output go back as input items, and the model answers.
    follow = client.responses.create(model=model, tools=[RESPONSES_TOOL], max_output_tokens=8, temperature=0,
                                     reasoning={"effort": "none"}, input=[
                                         {"role": "user", "content": "Weather in Verona?"},
                                         {"type": "function_call", "call_id": calls[0].call_id,
                                          "name": "get_weather", "arguments": calls[0].arguments},
                                         {"type": "function_call_output", "call_id": calls[0].call_id,
                                          "output": "Sunny, 24 C."}])
    assert follow.status in ("completed", "incomplete") and follow.output


def test_responses_are_kept_continued_listed_and_deleted(client, model, base_url, api_key):
    question, follow = "What light through yonder window breaks?", "Speak again, bright angel."
    kwargs = dict(model=model, max_output_tokens=8, temperature=0, reasoning={"effort": "none"})
    first = client.responses.create(input=question, instructions="Speak as Romeo.", **kwargs)
    assert first.store
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.status == first.status
    assert got.usage.input_tokens == first.usage.input_tokens

    # A continuation reads as the whole conversation sent again (the instructions are not carried over).
    chained = client.responses.create(previous_response_id=first.id, input=follow, **kwargs)
    assert chained.previous_response_id == first.id
    whole = ([{"role": "user", "content": question}] + [o.model_dump(exclude_none=True) for o in first.output]
             + [{"role": "user", "content": follow}])
    sent = client.responses.create(input=whole, store=False, **kwargs)
    assert chained.usage.input_tokens == sent.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == sent.output_text
    # A streamed continuation is kept once its last event is out.
    events = list(client.responses.create(previous_response_id=chained.id, input="Once more.", stream=True,
                                          **kwargs))
    streamed = events[-1].response
    assert streamed.previous_response_id == chained.id
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text

    # Its input items: every item that led to it, newest first unless asked otherwise, page by page.
    items = list(client.responses.input_items.list(streamed.id, order="asc", limit=2))
    assert [i.type for i in items] == ["message", "message", "message", "message", "message"]
    assert [i.role for i in items] == ["user", "assistant", "user", "assistant", "user"]
    assert items[1].content[0].text == first.output_text and items[3].content[0].text == chained.output_text
    assert len({i.id for i in items}) == 5
    newest = client.responses.input_items.list(streamed.id, limit=2)
    assert [i.id for i in newest.data] == [items[4].id, items[3].id] and newest.has_more
    expect_error(openai.BadRequestError, lambda: client.responses.input_items.list(streamed.id, limit=101),
                 param="limit")

    # Deleted: gone, but the responses that continued it keep their whole conversation.
    client.responses.delete(first.id)
    expect_error(openai.NotFoundError, lambda: client.responses.retrieve(first.id), code="not_found")
    expect_error(openai.NotFoundError, lambda: client.responses.delete(first.id), code="not_found")
    expect_error(openai.NotFoundError, lambda: client.responses.input_items.list(first.id))
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        previous_response_id=first.id, input=follow, **kwargs), param="previous_response_id",
        code="previous_response_not_found")
    assert len(list(client.responses.input_items.list(chained.id))) == 3
    # Not kept where the client says so.
    unkept = client.responses.create(input=question, store=False, **kwargs)
    assert not unkept.store
    expect_error(openai.NotFoundError, lambda: client.responses.retrieve(unkept.id))
    metrics = urllib.request.urlopen(base_url + "/metrics").read().decode()
    stored = re.search(r"^lily_responses_stored (\S+)$", metrics, re.M)
    assert stored and float(stored.group(1)) >= 2, metrics[-2000:]
    assert re.search(r"^lily_response_store_bytes [1-9]", metrics, re.M)
    # The routes ask for the API key like the others.
    if api_key:
        request = urllib.request.Request(base_url + "/v1/responses/" + chained.id)
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request)
        assert info.value.code == 401


def poll(client, response_id, seconds=60):
    """A background response once it has ended."""
    deadline = time.monotonic() + seconds
    while True:
        r = client.responses.retrieve(response_id)
        if r.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_responses_in_the_background_are_polled_and_cancelled(client, model):
    kwargs = dict(model=model, input="What light through yonder window breaks?", max_output_tokens=8,
                  temperature=0, reasoning={"effort": "none"})
    accepted = client.responses.create(background=True, **kwargs)
    assert accepted.background and accepted.status in ("queued", "in_progress") and not accepted.output
    done = poll(client, accepted.id)
    assert done.status in ("completed", "incomplete") and done.background
    assert done.output_text == client.responses.create(store=False, **kwargs).output_text
    assert client.responses.cancel(done.id).status == done.status  # ended already: answered as it is

    # A long one, cancelled while it runs.
    long = client.responses.create(background=True, extra_body={"ignore_eos": True},
                                   **{**kwargs, "max_output_tokens": 3000})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"

    # Deleted while it runs: it stops, and its end does not bring it back.
    deleted = client.responses.create(background=True, extra_body={"ignore_eos": True},
                                      **{**kwargs, "max_output_tokens": 3000})
    client.responses.delete(deleted.id)
    time.sleep(0.3)
    expect_error(openai.NotFoundError, lambda: client.responses.retrieve(deleted.id))

    plain = client.responses.create(**kwargs)
    expect_error(openai.BadRequestError, lambda: client.responses.cancel(plain.id))
    expect_error(openai.NotFoundError, lambda: client.responses.cancel("resp_unknown"))
    expect_error(openai.BadRequestError, lambda: client.responses.create(background=True, store=False, **kwargs),
                 param="background")


def test_streamed_background_responses_resume_from_any_event(client, model):
    kwargs = dict(model=model, input="What light through yonder window breaks?", max_output_tokens=24,
                  temperature=0, reasoning={"effort": "none"})
    expected = client.responses.create(store=False, **kwargs).output_text
    stream = client.responses.create(background=True, stream=True, **kwargs)
    events = []
    for event in stream:
        events.append(event)
        if len(events) == 5:
            break  # the client leaves: the response goes on in the background
    stream.close()
    response_id = events[0].response.id
    assert events[0].type == "response.created" and events[0].response.background
    assert [e.sequence_number for e in events] == list(range(5))
    done = poll(client, response_id)
    assert done.status in ("completed", "incomplete") and done.output_text == expected

    # Resumed after the fourth event: the rest, numbered on, ending with the response as kept.
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=3))
    assert [e.sequence_number for e in rest] == list(range(4, 4 + len(rest)))
    assert rest[0].type == events[4].type
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert rest[-1].response.output_text == expected
    text = "".join(e.delta for e in events[:4] + rest if e.type == "response.output_text.delta")
    assert text == expected
    # From the start, and past the end.
    assert len(list(client.responses.retrieve(response_id, stream=True))) == 4 + len(rest)
    assert list(client.responses.retrieve(response_id, stream=True, starting_after=10_000)) == []

    # Followed live while it runs, then cancelled: the stream ends, the response is kept as cancelled.
    long = client.responses.create(background=True, stream=True, extra_body={"ignore_eos": True},
                                   **{**kwargs, "max_output_tokens": 3000})
    first = next(iter(long))
    long.close()
    follower = client.responses.retrieve(first.response.id, stream=True, starting_after=0)
    assert next(iter(follower)).sequence_number == 1
    assert client.responses.cancel(first.response.id).status == "cancelled"
    # The follower's stream ends with the cancel, long before the 3000 tokens' events.
    followed = list(follower)
    assert all(e.sequence_number > 1 for e in followed) and len(followed) < 1000
    assert client.responses.retrieve(first.response.id).status == "cancelled"

    # Deleted while it runs: its events are gone with it.
    deleted = client.responses.create(background=True, stream=True, extra_body={"ignore_eos": True},
                                      **{**kwargs, "max_output_tokens": 3000})
    deleted_id = next(iter(deleted)).response.id
    deleted.close()
    client.responses.delete(deleted_id)
    expect_error(openai.NotFoundError, lambda: list(client.responses.retrieve(deleted_id, stream=True)))

    # Only a streamed background response streams again; `starting_after` goes with `stream`.
    plain = client.responses.create(**kwargs)
    expect_error(openai.BadRequestError, lambda: list(client.responses.retrieve(plain.id, stream=True)),
                 param="stream")
    expect_error(openai.NotFoundError, lambda: list(client.responses.retrieve("resp_unknown", stream=True)))
    expect_error(openai.BadRequestError, lambda: client.responses.retrieve(plain.id, starting_after=2),
                 param="starting_after")


def test_conversations_hold_the_items_their_responses_add(client, model, base_url):
    question = "What light through yonder window breaks?"
    conv = client.conversations.create(items=[{"role": "user", "content": question}], metadata={"topic": "verona"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "verona"}
    kwargs = dict(model=model, max_output_tokens=8, temperature=0, reasoning={"effort": "none"})
    first = client.responses.create(conversation=conv.id, input="Speak again.", **kwargs)
    assert first.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, i.role) for i in items] == [("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].content[0].text == first.output_text
    # It reads as the conversation sent whole.
    whole = [{"role": "user", "content": question}, {"role": "user", "content": "Speak again."}]
    sent = client.responses.create(input=whole, store=False, **kwargs)
    assert sent.usage.input_tokens == first.usage.input_tokens and sent.output_text == first.output_text
    second = client.responses.create(conversation={"id": conv.id}, input="Once more.", **kwargs)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert len(list(client.conversations.items.list(conv.id, limit=2))) == 5

    added = client.conversations.items.create(
        conv.id, items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hark!"}]}])
    item_id = added.data[0].id
    assert client.conversations.items.retrieve(item_id, conversation_id=conv.id).content[0].text == "Hark!"
    assert client.conversations.items.delete(item_id, conversation_id=conv.id).id == conv.id
    expect_error(openai.NotFoundError, lambda: client.conversations.items.retrieve(item_id, conversation_id=conv.id))
    assert client.conversations.update(conv.id, metadata={"topic": "mantua"}).metadata == {"topic": "mantua"}
    assert client.conversations.retrieve(conv.id).metadata == {"topic": "mantua"}
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        conversation=conv.id, previous_response_id=first.id, input="x", **kwargs), param="conversation")
    metrics = urllib.request.urlopen(base_url + "/metrics").read().decode()
    kept = re.search(r"^lily_conversations (\S+)$", metrics, re.M)
    assert kept and float(kept.group(1)) >= 1, metrics[-2000:]
    deleted = client.conversations.delete(conv.id)
    assert deleted.deleted and deleted.id == conv.id
    expect_error(openai.NotFoundError, lambda: client.conversations.retrieve(conv.id))
    expect_error(openai.NotFoundError, lambda: client.responses.create(conversation=conv.id, input="x", **kwargs),
                 param="conversation")
    expect_error(openai.BadRequestError, lambda: client.conversations.create(items=[{"type": "input_image"}]),
                 param="items[0].type")
    expect_error(openai.BadRequestError, lambda: client.conversations.create(metadata={"k": "v" * 513}),
                 param="metadata")


def test_responses_json_schema_and_errors(client, model):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"], "additionalProperties": False}
    r = client.responses.create(model=model, input="Name a lord.", max_output_tokens=60, temperature=0,
                                reasoning={"effort": "none"},
                                text={"format": {"type": "json_schema", "name": "lord", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        model=model, input="hi", previous_response_id="resp_123"), param="previous_response_id",
        code="previous_response_not_found")
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        model=model, input="hi", tools=[{"type": "custom", "name": "apply_patch"}]), param="tools[0]")
    expect_error(openai.BadRequestError, lambda: client.responses.create(
        model=model, input="hi", max_output_tokens=0), param="max_output_tokens")
