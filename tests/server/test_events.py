"""A streamed chunk's server-sent event (``OpenAIServing.event``): strict JSON in one ``data:`` line, whatever it holds."""

from __future__ import annotations

import json

import server.protocol as p
from server.errors import APIError
from server.serving import OpenAIServing


def strict(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n") and "\n" not in event[:-2]

    def refuse(constant: str):
        raise ValueError(f"{constant} is no JSON")

    return json.loads(event[len("data: "):], parse_constant=refuse)


def test_an_event_is_strict_json_with_text_as_given_and_a_non_finite_logprob_as_null():
    logprobs = p.CompletionLogprobs(tokens=["é"], token_logprobs=[float("-inf")], top_logprobs=[{"é": -0.5}],
                                    text_offset=[0])
    chunk = p.CompletionResponse(id="cmpl-1", model="m", choices=[
        p.CompletionChoice(index=0, text="naïve\n“q”", finish_reason=None, logprobs=logprobs)])
    data = strict(OpenAIServing.event(chunk))
    assert data["choices"][0]["text"] == "naïve\n“q”" and data["choices"][0]["logprobs"]["token_logprobs"] == [None]
    assert data["choices"][0]["logprobs"]["top_logprobs"] == [{"é": -0.5}] and data["usage"] is None
    assert (data["id"], data["object"], data["model"]) == ("cmpl-1", "text_completion", "m")
    error = strict(OpenAIServing.event(APIError(503, "engine gone", "service_unavailable")))
    assert error["error"]["message"] == "engine gone" and error["error"]["code"] == 503
