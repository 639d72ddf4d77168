"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes: the token ids the engine would see for a prompt or
for chat messages, and the text of token ids (vLLM's ``serving_tokenization``), with the engine's tokenizer the ingress
holds."""

from __future__ import annotations

from fastapi import Request

from server import protocol as p
from server.errors import APIError
from server.serving import OpenAIServing


class ServingTokenization(OpenAIServing):
    async def tokenize(self, body: p.TokenizeRequest, request: Request) -> p.TokenizeResponse:
        self.check(request, body.model)
        chat = None if body.messages is None else [m.for_template() for m in body.messages]
        try:
            ids = (await self.collector.tokenized([body.prompt], chat))[0]  # what a completion or a chat computes
        except ValueError as exc:  # a chat template that refused the messages
            raise APIError(400, str(exc)) from None
        strs = [self.collector.tokenizer.decode([i]) for i in ids] if body.return_token_strs else None
        return p.TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, body: p.DetokenizeRequest, request: Request) -> p.DetokenizeResponse:
        self.check(request, body.model)
        try:
            return p.DetokenizeResponse(prompt=self.collector.detokenize(body.tokens))
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
