"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: the token ids the engine would see for a prompt or
for chat messages, and the text of token ids (vLLM's ``serving_tokenization``)."""

from __future__ import annotations

from fastapi import Request

from server import protocol as p
from server.errors import engine_error
from server.serving import OpenAIServing


class ServingTokenization(OpenAIServing):
    async def tokenize(self, body: p.TokenizeRequest, request: Request) -> p.TokenizeResponse:
        self.check(request, body.model)
        chat = None if body.messages is None else [m.for_template() for m in body.messages]
        try:
            ids, strs = await self.collector.engine.tokenize.remote(body.prompt, chat, body.return_token_strs)
        except Exception as exc:
            raise engine_error(exc) from None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: p.DetokenizeRequest, request: Request) -> p.DetokenizeResponse:
        self.check(request, body.model)
        try:
            return p.DetokenizeResponse(prompt=await self.collector.engine.detokenize.remote(body.tokens))
        except Exception as exc:
            raise engine_error(exc) from None
