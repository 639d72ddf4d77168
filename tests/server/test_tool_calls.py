"""The tool-call parsers (``server.tool_calls``) on the formats Hermes / Qwen 2.5 and Llama 3.1 write."""

from __future__ import annotations

import json

from server.tool_calls import HermesParser, Llama3JsonParser, forced_calls


def test_hermes_finds_every_block_and_keeps_the_text_around_them():
    text = ('Let me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    content, calls = HermesParser().parse(text)
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert len({c.id for c in calls}) == 2
    assert HermesParser().parse("just text") == ("just text", [])
    broken = '<tool_call>{"name": "a", "arguments": </tool_call>'
    assert HermesParser().parse(broken) == (broken, [])  # malformed: all of it is content
    assert HermesParser().held_from("abc <tool") == 4 and HermesParser().held_from("abc") == 3
    assert HermesParser().held_from("x <tool_call>{") == 2


def test_llama3_json_reads_one_or_several_calls_and_nothing_else():
    content, calls = Llama3JsonParser().parse('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert Llama3JsonParser().parse("Paris is sunny.") == ("Paris is sunny.", [])
    assert Llama3JsonParser().parse('{"no": "name"}') == ('{"no": "name"}', [])


def test_forced_calls_read_a_named_functions_arguments_or_requireds_array():
    (call,) = forced_calls('{"zone": "UTC"}', "get_time")
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "UTC"})
    calls = forced_calls('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"y": 2}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {}), ("b", {"y": 2})]
    assert forced_calls('[{"name": "a", "param', "required") == []
