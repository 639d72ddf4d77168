"""``POST /v1/chat/completions``: messages through the model's chat template, the assistant's answers out, whole or
streamed (vLLM's ``serving_chat``)."""

from __future__ import annotations

import json

from fastapi import Request

from server import protocol as p
from server.errors import APIError
from server.serving import OpenAIServing
from server.text import chat_logprobs


class ServingChat(OpenAIServing):
    async def create(self, body: p.ChatCompletionRequest, request: Request):
        self.check(request, body.model)
        params = self.sampling(body, body.output_limit, (body.top_logprobs or 0) if body.logprobs else None)
        messages = [m.for_template() for m in body.messages]
        items = await self.start([], params, body.stream, messages, body.cache_salt)
        rid = p.new_id("chatcmpl")
        if body.stream:
            return self.sse(self._stream(items, rid, body))
        (item,) = await self.finals(items, 1)
        self.failed(item.output)
        choices = [p.ChatChoice(index=c.index, message=p.AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                                logprobs=chat_logprobs(c.logprobs or (), c.token_texts or {}) if body.logprobs else None)
                   for c in item.output.outputs]
        return p.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=self.usage([item.output]))

    async def _stream(self, items, rid: str, body: p.ChatCompletionRequest):
        final = None
        yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[
            p.ChatChunkChoice(index=k, delta=p.Delta(role="assistant", content="")) for k in range(body.n)]))
        async for _, out, c, text, entries in self.deltas(items, body.stops):
            if isinstance(text, APIError):
                yield self.event(json.loads(text.response().body))
                break
            final = out if out.finished else final
            choice = p.ChatChunkChoice(index=c.index, delta=p.Delta(content=text or None), finish_reason=c.finish_reason,
                                       logprobs=chat_logprobs(entries, c.token_texts or {}) if body.logprobs else None)
            yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[choice]))
        else:
            if body.stream_options and body.stream_options.include_usage and final is not None:
                yield self.event(p.ChatCompletionChunk(id=rid, model=self.model_name, choices=[],
                                                       usage=self.usage([final])))
        yield "data: [DONE]\n\n"
