#!/usr/bin/env python3
# Golden chat-template renderings for lily-chat, produced by Hugging Face transformers' own apply_chat_template.
#
# Regenerate (from the repository root; needs ../shared and `pip install jinja2 transformers`, no torch):
#     python3 scripts/chat_golden.py
# This writes crates/lily-chat/tests/golden/chat_templates.json, which `cargo test -p lily-chat` compares byte for
# byte with lily's minijinja rendering of the same conversations.
#
# Each case holds the conversation exactly as lily receives it (OpenAI style) and either the expected prompt text
# with its token ids, or the message of the exception the template raises. Where a client sends tool-call
# arguments as a JSON string (as OpenAI clients do), lily decodes them to an object before rendering, because the
# template iterates over them as a mapping; this script does the same before calling transformers.

import copy
import json
import pathlib
import re

import jinja2
import transformers
from transformers import PreTrainedTokenizerFast

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "qwen3.6"
OUT = ROOT / "crates" / "lily-chat" / "tests" / "golden" / "chat_templates.json"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Température en °C.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current local time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": []},
    },
}
THERMOSTAT_TOOL = {
    "type": "function",
    "function": {
        "name": "set_thermostat",
        "description": 'Set the "target" temperature <safely> & quickly\n(a\ttab)',
        "parameters": {
            "type": "object",
            "properties": {
                "target": {"type": "number", "minimum": 0.5, "maximum": 1e20, "default": 21.0, "step": 1e-05},
                "eco": {"type": "boolean", "default": False},
                "schedule": {"type": ["array", "null"], "items": {"type": "object"}, "default": None},
            },
            "required": ["target"],
            "additionalProperties": False,
        },
    },
}


def call(name, arguments, call_id):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def case(name, messages, tools=None, add_generation_prompt=True, **kwargs):
    return {
        "name": name,
        "messages": messages,
        "tools": tools,
        "add_generation_prompt": add_generation_prompt,
        "kwargs": kwargs,
    }


CASES = [
    case("single_user", [{"role": "user", "content": "Hello!"}]),
    case(
        "system_prompt",
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 2+2?"},
        ],
    ),
    case(
        "multi_turn",
        [
            {"role": "system", "content": "  Be brief.  "},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
            {"role": "user", "content": "Thanks!\n"},
        ],
    ),
    case(
        "reasoning_in_history",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "reasoning_content": "Two plus two.", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ),
    case(
        "reasoning_in_history_preserve_thinking",
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "reasoning_content": "Two plus two.", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "reasoning_content": "\nThree plus three.\n", "content": "6"},
        ],
        add_generation_prompt=False,
        preserve_thinking=True,
    ),
    case(
        "think_block_inside_content",
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello! How can I help?"},
        ],
        add_generation_prompt=False,
    ),
    case(
        "reasoning_field_alias",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "reasoning": "I should call the tool.",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Paris"}, "call_1")],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C, cloudy"},
        ],
        tools=[WEATHER_TOOL],
    ),
    case(
        "tools_parallel_calls",
        [
            {"role": "system", "content": "You are a weather bot."},
            {"role": "user", "content": "Weather in Paris and Tokyo, and the time in Tokyo?"},
            {
                "role": "assistant",
                "reasoning_content": "Three lookups, all independent.",
                "content": None,
                "tool_calls": [
                    call("get_weather", {"city": "Paris", "unit": "celsius"}, "call_a"),
                    call("get_weather", {"city": "Tokyo", "days": 2}, "call_b"),
                    call("get_time", {"timezone": "Asia/Tokyo"}, "call_c"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_a", "content": "18°C"},
            {"role": "tool", "tool_call_id": "call_b", "content": "25°C, then rain"},
            {"role": "tool", "tool_call_id": "call_c", "content": "21:04"},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
    ),
    case(
        "tool_arguments_as_json_string",
        [
            {"role": "user", "content": "Weather in Oslo for 3 days?"},
            {
                "role": "assistant",
                "content": "Let me check.",
                "tool_calls": [call("get_weather", '{"city": "Oslo", "days": 3, "unit": "celsius"}', "call_x")],
            },
            {"role": "tool", "tool_call_id": "call_x", "content": "-2°C, snow"},
            {"role": "assistant", "content": "It is -2°C with snow."},
            {"role": "user", "content": "And Bergen?"},
        ],
        tools=[WEATHER_TOOL],
    ),
    case(
        "tool_argument_value_types",
        [
            {"role": "user", "content": "Set it up."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call(
                        "set_thermostat",
                        {
                            "target": 21.5,
                            "whole": 20.0,
                            "count": 3,
                            "huge": 1e16,
                            "eco": True,
                            "away": False,
                            "schedule": None,
                            "days": ["mon", "tue"],
                            "limits": {"low": 16, "high": 24.5, "label": "nuit é"},
                            "note": "multi\nline",
                        },
                        "call_t",
                    )
                ],
            },
            {"role": "tool", "tool_call_id": "call_t", "content": "ok"},
        ],
        tools=[THERMOSTAT_TOOL],
    ),
    case(
        "multi_step_tools",
        [
            {"role": "user", "content": "Is it warmer in Rome or Madrid?"},
            {
                "role": "assistant",
                "reasoning_content": "First Rome.",
                "content": "",
                "tool_calls": [call("get_weather", {"city": "Rome"}, "call_r")],
            },
            {"role": "tool", "tool_call_id": "call_r", "content": "24°C"},
            {
                "role": "assistant",
                "reasoning_content": "Now Madrid.",
                "content": "Rome is 24°C.",
                "tool_calls": [call("get_weather", {"city": "Madrid"}, "call_m")],
            },
            {"role": "tool", "tool_call_id": "call_m", "content": "27°C"},
            {"role": "assistant", "reasoning_content": "27 > 24.", "content": "Madrid is warmer."},
        ],
        tools=[WEATHER_TOOL],
        add_generation_prompt=False,
    ),
    case(
        "tool_response_sent_as_user_message",
        [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_time", "arguments": {}}]},
            {"role": "user", "content": "<tool_response>\n09:30\n</tool_response>"},
        ],
        tools=[TIME_TOOL],
    ),
    case(
        "enable_thinking_false",
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a prime."},
        ],
        enable_thinking=False,
    ),
    case(
        "enable_thinking_true",
        [{"role": "user", "content": "Name a prime."}],
        enable_thinking=True,
    ),
    case(
        "content_as_text_parts",
        [
            {"role": "system", "content": [{"type": "text", "text": "You read carefully."}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "First part. "}, {"type": "text", "text": "Second part."}],
            },
        ],
    ),
    case(
        "no_generation_prompt",
        [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ],
        add_generation_prompt=False,
    ),
    case(
        "tools_without_system",
        [{"role": "user", "content": "What time is it in Lima?"}],
        tools=[TIME_TOOL],
    ),
    case(
        "tools_with_system_unicode_and_schema_numbers",
        [
            {"role": "system", "content": "Réponds en français 🇫🇷"},
            {"role": "user", "content": "把温度设为二十一度。"},
        ],
        tools=[THERMOSTAT_TOOL, WEATHER_TOOL],
    ),
    case("empty_tools_list", [{"role": "user", "content": "Hi"}], tools=[]),
    case(
        "emoji_cjk_and_special_text",
        [{"role": "user", "content": "Café ☕, 日本語, 한국어, emoji 👩‍👩‍👧 and a literal <think> tag."}],
    ),
    case("error_no_user_query", [{"role": "system", "content": "You are a helpful assistant."}]),
    case(
        "error_system_not_first",
        [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Late system prompt."},
        ],
    ),
    case(
        "error_unexpected_role",
        [
            {"role": "user", "content": "Hi"},
            {"role": "critic", "content": "Meh."},
        ],
    ),
    case(
        "error_only_tool_responses",
        [{"role": "user", "content": "<tool_response>\nstale\n</tool_response>"}],
    ),
    case("error_no_messages", []),
]


def decode_json_string_arguments(messages):
    """lily decodes tool-call arguments sent as a JSON string before rendering (see the header)."""
    messages = copy.deepcopy(messages)
    for message in messages:
        for tool_call in message.get("tool_calls") or []:
            function = tool_call.get("function", tool_call)
            if isinstance(function.get("arguments"), str):
                function["arguments"] = json.loads(function["arguments"])
    return messages


def render(tokenizer, template, entry):
    # An empty conversation is refused by transformers before the template runs; the template's own check is
    # what lily reports, so render it with the template directly (still transformers' Jinja environment).
    messages = decode_json_string_arguments(entry["messages"])
    try:
        if not messages:
            compiled = transformers.utils.chat_template_utils._compile_jinja_template(template)
            return compiled.render(messages=messages, tools=entry["tools"], documents=None,
                                   add_generation_prompt=entry["add_generation_prompt"], **entry["kwargs"]), None
        text = tokenizer.apply_chat_template(
            messages,
            tools=entry["tools"],
            chat_template=template,
            add_generation_prompt=entry["add_generation_prompt"],
            tokenize=False,
            **entry["kwargs"],
        )
        return text, None
    except jinja2.exceptions.TemplateError as error:
        return None, str(error)


def main():
    template = (SHARED / "chat_template.jinja").read_text(encoding="utf-8")
    # No tokenizer_config.json ships with the shared tokenizer; the template reads no special-token variables.
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(SHARED / "tokenizer.json"))
    cases = []
    for entry in CASES:
        text, error = render(tokenizer, template, entry)
        result = dict(entry)
        if error is None:
            result["expected"] = text
            result["expected_ids"] = tokenizer.encode(text, add_special_tokens=False)
        else:
            result["expected_error"] = error
        cases.append(result)
    document = {
        "generator": f"scripts/chat_golden.py with transformers {transformers.__version__}, jinja2 {jinja2.__version__}",
        "template": "../shared/qwen3.6/chat_template.jinja",
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, ensure_ascii=False, indent=1)
    # Token id lists on one line each, to keep the file readable.
    text = re.sub(r"\[\s*(\d+(?:,\s*\d+)*)\s*\]", lambda m: "[" + ", ".join(re.findall(r"\d+", m.group(1))) + "]", text)
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} cases to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
