"""``POST /v1/chat/completions``: messages (and tools) through the model's chat template, the assistant's answers --
text or tool calls (``server.tool_calls``) -- out, whole or streamed (vLLM's ``serving_chat``)."""

from __future__ import annotations

from fastapi import Request

from server import protocol as p
from server.errors import APIError
from server.serving import OpenAIServing
from server.text import chat_logprobs
from server.tool_calls import PARSERS, CallPiece, CallStream, ToolCall, forced_calls


class ServingChat(OpenAIServing):
    async def create(self, body: p.ChatCompletionRequest, request: Request):
        self.check(request, body.model)
        if body.tools and body.tool_choice in (None, "auto") and self.settings.tool_call_parser is None:
            raise APIError(400, "tool_choice 'auto' needs the server started with --tool-call-parser (hermes or "
                                "llama3_json); 'required', a named function or 'none' work without", param="tool_choice")
        params = self.sampling(body, body.output_limit, (body.top_logprobs or 0) if body.logprobs else None)
        messages = [m.for_template() for m in body.messages]
        items = await self.start([], params, body.stream, messages, body.cache_salt, body.template_tools)
        rid = p.new_id("chatcmpl")
        if body.stream:
            return self.sse(self._stream(items, rid, body))
        (item,) = await self.finals(items, 1)
        self.failed(item.output)
        choices = []
        for c in item.output.outputs:
            content, calls = self._calls(body, c.text, c.finish_reason)
            choices.append(p.ChatChoice(
                index=c.index, message=p.AssistantMessage(content=content, tool_calls=[_message(t) for t in calls]),
                finish_reason="tool_calls" if calls else c.finish_reason,
                logprobs=chat_logprobs(c.logprobs or (), c.token_texts or {}) if body.logprobs else None))
        return p.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=self.usage([item.output]))

    def _calls(self, body: p.ChatCompletionRequest, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of an answer: grammar-forced calls, or those the server's parser finds under 'auto'."""
        if (forced := body.forced_tool) is not None:
            calls = forced_calls(text, forced) if finish_reason == "stop" else []
            return (None, calls) if calls else (text, [])
        if body.tools and body.tool_choice != "none":
            return PARSERS[self.settings.tool_call_parser]().parse(text)
        return text, []

    def _holds(self, body: p.ChatCompletionRequest) -> bool:
        """Whether streamed text may be a tool call, held back from the content (``CallStream``)."""
        return body.forced_tool is not None or bool(body.tools and body.tool_choice != "none")

    async def _stream(self, items, rid: str, body: p.ChatCompletionRequest):
        final = None
        holds = self._holds(body)
        calls: dict[int, CallStream] = {}  # choice -> its tool calls so far
        sent: dict[int, int] = {}  # choice -> characters of its text sent as content
        yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[
            p.ChatChunkChoice(index=k, delta=p.Delta(role="assistant", content="")) for k in range(body.n)]))
        async for _, out, c, text, entries in self.deltas(items, body.stops):
            if isinstance(text, APIError):
                yield self.event(text)
                break
            final = out if out.finished else final
            delta, finish = p.Delta(content=text or None), c.finish_reason
            if holds:  # content only up to where a call may start; each call's pieces as they come
                whole, done = c.text, sent.get(c.index, 0)
                stream = calls.setdefault(c.index, CallStream(body.forced_tool, None if body.forced_tool else
                                                              PARSERS[self.settings.tool_call_parser]()))
                pieces = [_piece(piece) for piece in stream.pieces(whole, finish is not None)] or None
                if finish is None:
                    upto = stream.content(whole)
                    delta = p.Delta(content=whole[done:upto] or None, tool_calls=pieces)
                    sent[c.index] = max(done, upto)
                else:  # the rest of the content, as the whole answer's parse gives it
                    content = None if body.forced_tool and stream.calls else self._calls(body, whole, finish)[0]
                    delta = p.Delta(content=_unsent(content or "", whole[:done]) or None, tool_calls=pieces)
                    # as whole: a grammar-forced call cut short is none, a parsed one stands
                    finish = "tool_calls" if stream.calls and (finish == "stop" or not body.forced_tool) else finish
            choice = p.ChatChunkChoice(index=c.index, delta=delta, finish_reason=finish,
                                       logprobs=chat_logprobs(entries, c.token_texts or {}) if body.logprobs else None)
            yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[choice]))
        else:
            if body.stream_options and body.stream_options.include_usage and final is not None:
                yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[],
                                                       usage=self.usage([final])))
        yield "data: [DONE]\n\n"


def _piece(piece: CallPiece) -> p.ToolCallDelta:
    if piece.call is None:
        return p.ToolCallDelta(index=piece.index, function=p.FunctionCallDelta(arguments=piece.arguments))
    return p.ToolCallDelta(index=piece.index, id=piece.call.id, type="function",
                           function=p.FunctionCallDelta(name=piece.call.name, arguments=piece.arguments))


def _message(call: ToolCall) -> p.ToolCallMessage:
    return p.ToolCallMessage(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))


def _unsent(content: str, sent: str) -> str:
    """What of ``content`` the stream has not sent yet (the parser strips the whitespace before a call)."""
    for done in (sent, sent.rstrip()):
        if content.startswith(done):
            return content[len(done):]
    return content
