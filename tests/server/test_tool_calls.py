"""The tool-call parsers (``server.tool_calls``) on the formats Hermes / Qwen 2.5 and Llama 3.1 write."""

from __future__ import annotations

import json

from server.tool_calls import CallStream, HermesParser, Llama3JsonParser, _complete_elements, forced_calls


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


def grow(stream: CallStream, text: str, step: int = 3) -> list[list]:
    """Feed ``text`` a few characters at a time, then whole and finished: the pieces each time."""
    cuts = [*range(step, len(text), step), len(text)]
    return [stream.pieces(text[:k], False) for k in cuts[:-1]] + [stream.pieces(text, True)]


def test_a_named_functions_arguments_stream_as_they_are_written():
    text = '{"zone":"UTC","x":[1,2]}'
    pieces = [p for step in grow(CallStream("get_time", None), text) for p in step]
    assert pieces[0].call.name == "get_time" and all(p.call is None for p in pieces[1:]) and {p.index for p in pieces} == {0}
    assert "".join(p.arguments for p in pieces) == text


def test_requireds_calls_stream_each_once_its_element_is_whole():
    text = '[{"name":"a","parameters":{"s":"]}\\"x"}},{"name":"b","parameters":{}}]'
    steps = grow(CallStream("required", None), text, step=1)
    got = [(k, p.index, p.call.name, json.loads(p.arguments)) for k, step in enumerate(steps) for p in step]
    first_done = text.index("}},") + 2  # the first element ends here: its call goes out with that character
    assert got == [(first_done - 1, 0, "a", {"s": ']}"x'}), (len(text) - 2, 1, "b", {})]
    assert _complete_elements('[{"a":"[{"},{"b') == [{"a": "[{"}]


def test_parsers_calls_stream_per_block_or_at_the_end():
    hermes = 'ok <tool_call>{"name": "a", "arguments": {}}</tool_call> <tool_call>{"name": "b", "arguments": {"y": 2}'
    stream = CallStream(None, HermesParser())
    assert [p.call.name for p in stream.pieces(hermes, False)] == ["a"] and stream.content(hermes) == 3
    assert [p.call.name for p in stream.pieces(hermes + "}</tool_call>", True)] == ["b"]
    llama = '{"name": "a", "parameters": {"x": 1}}'
    stream = CallStream(None, Llama3JsonParser())
    assert stream.pieces(llama, False) == [] and [p.call.name for p in stream.pieces(llama, True)] == ["a"]
