"""Tools and a client's view of streamed deltas, shared by the tool-calling tests."""

from __future__ import annotations

from inference.tools import Delta

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def assemble(deltas: list[Delta]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """What a client rebuilds from the deltas, checking each has OpenAI's shape."""
    content, calls, ids = "", [], []
    for delta in deltas:
        assert (delta.content is None) != (delta.tool_call is None)
        if delta.content is not None:
            assert delta.content and not calls  # no empty pieces; content comes first
            content += delta.content
            continue
        call = delta.tool_call
        if "id" in call:
            assert call["index"] == len(calls) and call["type"] == "function"
            assert call["function"]["arguments"] == ""
            calls.append((call["function"]["name"], ""))
            ids.append(call["id"])
        else:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            assert call["index"] == len(calls) - 1 and call["function"]["arguments"]
            name, arguments = calls[-1]
            calls[-1] = (name, arguments + call["function"]["arguments"])
    return content, calls, ids
