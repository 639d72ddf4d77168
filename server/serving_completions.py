"""``POST /v1/completions``: prompts in, completions out, whole or streamed (vLLM's ``serving_completion``)."""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from cluster.outputs import RequestOutput
from server import protocol as p
from server.errors import APIError
from server.serving import OpenAIServing
from server.text import completion_logprobs, with_prompt


class ServingCompletions(OpenAIServing):
    async def create(self, body: p.CompletionRequest, request: Request):
        self.check(request, body.model)
        params = self.sampling(body, body.max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens come back with theirs
            params = replace(params, prompt_logprobs=body.logprobs)
        prompts = body.prompts
        echoes = self._echoes(prompts) if body.echo else [""] * len(prompts)
        items = await self.start(prompts, params, body.stream, cache_salt=body.cache_salt)
        rid = p.new_id("cmpl")
        if body.stream:
            return self.sse(self._stream(items, rid, body, echoes))
        done = await self.finals(items, len(prompts))
        for item in done:
            self.failed(item.output)
        choices = [p.CompletionChoice(index=item.index * body.n + c.index, text=echoes[item.index] + c.text,
                                      finish_reason=c.finish_reason,
                                      logprobs=self._logprobs(body, item.output, completion_logprobs(
                                          c.logprobs or (), c.token_texts or {}, len(echoes[item.index])))
                                      if body.logprobs is not None else None)
                   for item in done for c in item.output.outputs]
        return p.CompletionResponse(id=rid, model=self.model_name, choices=choices,
                                    usage=self.usage([i.output for i in done]))

    @staticmethod
    def _logprobs(body: p.CompletionRequest, out: RequestOutput, own: p.CompletionLogprobs) -> p.CompletionLogprobs:
        """A completion's logprobs (or its first streamed piece's), led by the prompt tokens' when it is echoed."""
        return with_prompt(out, own) if body.echo else own

    def _echoes(self, prompts: list) -> list[str]:
        """Each prompt's text, for ``echo``: as given, or its token ids decoded."""
        try:
            return [pr if isinstance(pr, str) else self.collector.detokenize(pr) for pr in prompts]
        except ValueError as exc:
            raise APIError(400, str(exc)) from None

    async def _stream(self, items, rid: str, body: p.CompletionRequest, echoes: list[str]):
        finished: list[RequestOutput | None] = [None] * len(echoes)
        offsets: dict[tuple[int, int], int] = {}  # where each completion's next logprob token starts (past an echo)
        echoed: set[tuple[int, int]] = set()  # completions whose first chunk (with the prompt, for echo) went out
        async for index, out, c, text, entries in self.deltas(items, body.stops):
            if isinstance(text, APIError):
                yield self.event(text)
                break
            if out.finished:
                finished[index] = out
            logprobs = None
            if body.logprobs is not None:
                start = offsets.get((index, c.index), len(echoes[index]))
                logprobs = completion_logprobs(entries, c.token_texts or {}, start)
                offsets[index, c.index] = start + sum(map(len, logprobs.tokens))
                if (index, c.index) not in echoed:
                    logprobs = self._logprobs(body, out, logprobs)
            if (index, c.index) not in echoed:
                echoed.add((index, c.index))
                text = echoes[index] + text
            choice = p.CompletionChoice(index=index * body.n + c.index, text=text, finish_reason=c.finish_reason,
                                        logprobs=logprobs)
            yield self.event(p.CompletionResponse(id=rid, model=self.model_name, choices=[choice]))
        else:
            if body.stream_options and body.stream_options.include_usage:
                yield self.event(p.CompletionResponse(id=rid, model=self.model_name, choices=[],
                                                      usage=self.usage([o for o in finished if o is not None])))
        yield "data: [DONE]\n\n"
