"""An OpenAI-compatible server on the continuous-batching manager: `/v1/completions`, `/v1/chat/completions` (both
streaming over server-sent events) and `/v1/models`, on FastAPI and uvicorn (the `[serve]` extra).

    hf-hybrid-spec-serve --model Qwen/Qwen3.5-0.8B --assistant-config '{"drafter": "suffix"}' --port 8000
    # or: python -m hf_hybrid_spec.serving.cli --model ... --help   (the command line: `serving.cli`)

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
    client.chat.completions.create(model="Qwen/Qwen3.5-0.8B", messages=[{"role": "user", "content": "hi"}])

Why not `transformers serve`: it has no extension point for another decoding engine (its continuous-batching path
calls transformers' own manager, which refuses hybrid models), so this is a thin server of our own with the same API.

Per request: `max_tokens` / `max_completion_tokens` (omitted: 16 for completions, as OpenAI's; chat runs to eos or the
context's end), `temperature` (0: greedy, exact), `top_p`, `stop` (up to 4 non-empty strings, cut from the text as
OpenAI does), `stream` with `stream_options.include_usage`, `presence_penalty` / `frequency_penalty` (OpenAI's and
vLLM's: over the generated tokens), and vLLM's sampling extensions (`extra_body` in OpenAI's client): `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`, `stop_token_ids`; `logprobs` (completions: alternatives per token;
chat: `logprobs` and `top_logprobs`), the target's raw log-probabilities as vLLM gives them. Bodies are typed
(pydantic): a value of the wrong type or out of range is a 400 naming the field, never coerced; `n` > 1, `echo` and
tools are refused by name. Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`); an unknown
model is a 404, a body over `--max-body-mb` a 413, a missing or wrong key a 401 under `--api-key`. Nothing waits on a
thread: outputs reach the event loop from the engine's thread (`add_request(on_output=...)`), and tokenizing runs off
the loop. `/health`, `/metrics` (Prometheus text: running, waiting, finished, failed, tokens, steps, mean accepted
length) and `/v1/models/{id}` as vLLM's and SGLang's servers.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import NamedTuple

from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.utils import logging

from .clients import SAMPLING_DEFAULTS, EngineClient, LocalEngine
from .manager import ContinuousBatchingManager

logger = logging.get_logger(__name__)

__all__ = ["create_app", "load_served"]

# Fields of OpenAI requests the server does not implement: a request that sets them gets a 400 naming them.
_UNSUPPORTED = ("tools", "tool_choice", "functions", "response_format", "suffix", "echo", "best_of", "logit_bias")
# The most alternatives per token `logprobs` / `top_logprobs` take (OpenAI's chat bound; vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# OpenAI's default for /v1/completions when max_tokens is omitted (chat runs until eos or the context's end).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The largest request body taken (a prompt of ~250k tokens); past it a 413, before anything is parsed.
DEFAULT_MAX_BODY_BYTES = 1 << 20


# Names pydantic puts in an error's location for the branch of a union it tried (not fields of the request).
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


class Stops(NamedTuple):
    """What ends a request early: stop strings (cut from the text) and token ids (eos and `stop_token_ids`)."""

    strings: list[str]
    ids: frozenset[int]


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` (400 unless said), OpenAI's error shape, `param` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def _request_models():
    """The typed request bodies (pydantic, imported with the server): values are checked, never coerced."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr, field_validator

    Number = Annotated[float, Strict(), Field(allow_inf_nan=False)]

    class StreamOptions(BaseModel):
        include_usage: StrictBool = False

    class Sampling(BaseModel):
        # Fields OpenAI defines that this server ignores (user, metadata, ...) pass; _UNSUPPORTED ones are refused.
        model_config = ConfigDict(extra="allow")

        model: StrictStr | None = None
        max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
        max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
        temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
        top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
        n: Annotated[StrictInt, Field(ge=1)] | None = None
        stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
        stream: StrictBool = False
        stream_options: StreamOptions | None = None
        presence_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
        frequency_penalty: Annotated[Number, Field(ge=-2.0, le=2.0)] | None = None
        # vLLM's sampling extensions (a client's `extra_body`; Qwen3.5's model card asks for top_k and min_p so):
        # top_k (-1 or 0: off), min_p, repetition_penalty (HF's and vLLM's: over the prompt and the completion),
        # min_tokens (eos and stop_token_ids held back until then), ignore_eos, stop_token_ids (more eos ids).
        top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
        min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
        repetition_penalty: Annotated[Number, Field(gt=0.0, le=2.0)] | None = None
        min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
        ignore_eos: StrictBool = False
        stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=64)] | None = None
        # OpenAI's and vLLM's per-request seed: the same request samples the same reply (`serving.engine`).
        seed: Annotated[StrictInt, Field(ge=0, lt=1 << 63)] | None = None
        # vLLM's extension: the prompt's and the completion's token ids in the answer (each chunk's when streaming).
        return_token_ids: StrictBool = False
        # OpenAI's end-user id and SGLang's session id: either keys an agent's session (a cluster's routing).
        user: StrictStr | None = None
        session_id: StrictStr | None = None

        @field_validator("stop")
        @classmethod
        def _stop_strings_not_empty(cls, value):
            if value is not None and any(not s for s in ([value] if isinstance(value, str) else value)):
                raise ValueError("stop strings must be non-empty")
            return value

    class Completion(Sampling):
        # Log-probabilities of the generated tokens with this many alternatives each (OpenAI's legacy field).
        logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
        prompt: StrictStr | Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)] | \
            Annotated[list[StrictStr], Field(min_length=1, max_length=1)] | \
            Annotated[list[Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]],
                      Field(min_length=1, max_length=1)]

    class TextPart(BaseModel):
        type: Literal["text"]
        text: StrictStr

    class Message(BaseModel):
        model_config = ConfigDict(extra="allow")
        role: Literal["system", "developer", "user", "assistant", "tool"]
        content: StrictStr | list[TextPart] | None = None

    class Chat(Sampling):
        messages: Annotated[list[Message], Field(min_length=1)]
        # OpenAI's chat fields: the generated tokens' log-probabilities, with `top_logprobs` alternatives each.
        logprobs: StrictBool = False
        top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    return Completion, Chat


def create_app(engine: EngineClient | ContinuousBatchingManager, tokenizer, model_name: str,
               request_timeout: float = 600.0, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, model_defaults: bool = True):
    """The FastAPI app serving `engine` (a `clients.EngineClient`, or a manager in this process: `LocalEngine`;
    started by the app's lifespan, stopped at shutdown) with `tokenizer`'s text and chat template, under the model
    id `model_name`. `api_key`: the Bearer token every /v1 request must carry (None: open). Request bodies over
    `max_body_bytes` get a 413. `model_defaults`: a request that omits a sampling setting gets the model generation
    config's value (`clients.sampling_defaults`, vLLM's `--generation-config auto`); False: OpenAI's defaults."""
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Header
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    Completion, Chat = _request_models()
    if isinstance(engine, ContinuousBatchingManager):
        engine = LocalEngine(engine, tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="hf_hybrid_spec", lifespan=lifespan)
    app.add_middleware(_BodyLimit, limit=max_body_bytes)
    eos = engine.eos_token_id
    defaults = dict(getattr(engine, "sampling_defaults", None) or {}) if model_defaults else {}
    max_total = engine.max_total_tokens
    served = {"requests": 0}

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        return JSONResponse(status_code=status, content=_error_body(message, kind, param, status))

    @app.exception_handler(RequestError)
    async def refused(request, exc: RequestError):
        return error(exc.status, str(exc), exc.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            return error(400, "the request body is not valid JSON")
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        # A union's branch names (str, list[...]) are pydantic's, not the request's: the field is what precedes them.
        field = ".".join(part for part in loc if not (part in _TYPE_NAMES or "[" in part or part.startswith(
            ("function-", "constrained-"))))
        return error(400, f"{field or 'body'}: {first.get('msg', 'invalid value')}", field or None)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        return error(exc.status_code, str(exc.detail), kind="not_found_error" if exc.status_code == 404 else
                     "invalid_request_error")

    # (annotations are strings here, under `from __future__ import annotations`: the header comes by its default)
    async def authorized(authorization: str | None = Header(None)) -> None:
        if api_key is not None and authorization != f"Bearer {api_key}":
            raise RequestError("invalid or missing API key (Authorization: Bearer ...)", status=401)

    def settings(body, prompt_tokens: int, default_new: int | None,
                 logprobs: int | None) -> tuple[int, GenerationConfig, Stops]:
        extra = body.model_extra or {}
        bad = [k for k in _UNSUPPORTED if extra.get(k) not in (None, False, [], {})]
        if bad:
            raise RequestError(f"not supported by this server: {', '.join(bad)}", bad[0])
        if (body.n or 1) != 1:
            raise RequestError("n > 1 is not supported", "n")
        if body.model not in (None, model_name):
            raise RequestError(f"model {body.model!r} is not served here (this server serves {model_name!r})",
                               "model", 404)
        new = body.max_completion_tokens or body.max_tokens or default_new or max(1, max_total - prompt_tokens)
        if body.min_tokens is not None and body.min_tokens > new:
            raise RequestError(f"min_tokens ({body.min_tokens}) must be at most max_tokens ({new})", "min_tokens")
        given = {k: getattr(body, k) for k in SAMPLING_DEFAULTS if getattr(body, k) is not None}
        chosen = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                  **defaults, **given}
        temperature, top_p, top_k = chosen["temperature"], chosen["top_p"], chosen["top_k"]
        sample = temperature > 0
        stops = [] if eos is None or body.ignore_eos else ([eos] if isinstance(eos, int) else list(eos))
        stops += [t for t in body.stop_token_ids or [] if t not in stops]  # (they stop even with ignore_eos)
        gen = GenerationConfig(do_sample=sample, temperature=temperature if sample else 1.0,
                               top_p=top_p if sample else 1.0, top_k=max(top_k or 0, 0) if sample else None,
                               min_p=chosen["min_p"] if sample and chosen["min_p"] else None,
                               repetition_penalty=chosen["repetition_penalty"] or 1.0,
                               min_new_tokens=body.min_tokens or None,
                               eos_token_id=stops or None,
                               pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
        # Read by the engine (`serving.engine._processors`): OpenAI's penalties over the generated tokens.
        gen.presence_penalty, gen.frequency_penalty = body.presence_penalty or 0.0, body.frequency_penalty or 0.0
        gen.seed = body.seed
        gen.logprobs = logprobs  # (read by the engine: `SpecGenerationOutput.logprobs`)
        strings = [] if body.stop is None else ([body.stop] if isinstance(body.stop, str) else list(body.stop))
        return int(new), gen, Stops(strings, frozenset(stops))

    def submit(ids: list[int], body, default_new: int | None,
               logprobs: int | None = None) -> tuple[str, Stops, asyncio.Queue]:
        """Queue the request; its outputs arrive on the returned asyncio queue (no thread waits for them).
        `logprobs`: alternatives per generated token whose log-probabilities the answer carries (None: none)."""
        new, gen, stop = settings(body, len(ids), default_new, logprobs)
        loop, outputs = asyncio.get_running_loop(), asyncio.Queue()
        # An agent's session: a cluster routes its calls to the replica that holds its prefix.
        session = body.session_id or body.user or None
        rid = engine.submit(ids, new, gen, stop.strings, body.stream,
                            lambda output: loop.call_soon_threadsafe(outputs.put_nowait, output), session)
        served["requests"] += 1
        return rid, stop, outputs

    def cut(text: str, stop: Stops) -> tuple[str, bool]:
        """`text` up to the first stop string (excluded, as OpenAI returns it) and whether one was found."""
        hits = [text.find(s) for s in stop.strings if s in text]
        return (text[: min(hits)], True) if hits else (text, False)

    def finish_reason(output, stopped: bool, stop: Stops) -> str:
        if stopped or (output.generated_tokens and output.generated_tokens[-1] in stop.ids):
            return "stop"
        return "length"

    async def result(rid: str, outputs: asyncio.Queue):
        try:
            output = await asyncio.wait_for(outputs.get(), request_timeout)
        except TimeoutError:
            engine.cancel(rid)
            raise RequestError(f"request {rid} timed out after {request_timeout} s", status=504) from None
        if output.status == RequestStatus.FAILED:
            raise RequestError(output.error or "the request failed")
        return output

    def usage(output) -> dict:
        """OpenAI's usage, with the prompt tokens taken from the prefix store as its `cached_tokens`."""
        prompt, completion = len(output.prompt_ids), len(output.generated_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": int(getattr(output, "reused_prefix_tokens", 0))}}

    def extras(answer: dict, output, token_ids: list[int] | None, prompt_ids: bool) -> dict:
        """`answer` with the replica that served it (`system_fingerprint`, in a cluster) and, with vLLM's
        `return_token_ids`, its choice's `token_ids` (and `prompt_token_ids` where `prompt_ids`)."""
        replica = getattr(output, "replica", None)
        if replica is not None:
            answer["system_fingerprint"] = replica
        if token_ids is not None and answer["choices"]:
            answer["choices"][0]["token_ids"] = list(token_ids)
            if prompt_ids:
                answer["choices"][0]["prompt_token_ids"] = list(output.prompt_ids)
        return answer

    def token_text(token: int) -> str:
        return tokenizer.decode([token])

    def logprobs_of(entries: list, chat: bool, start: int = 0) -> tuple[dict, int]:
        """OpenAI's `logprobs` object of generated tokens' `entries` (`serving.engine.TokenLogprob`): chat's
        `{"content": [...]}`, or the legacy completions' (tokens, token_logprobs, top_logprobs with the chosen token
        beside the alternatives, as vLLM gives them, text_offset counted from `start`); and the offset after them."""
        texts = [token_text(e.token) for e in entries]
        if chat:
            def item(text: str, logprob: float) -> dict:
                return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**item(text, e.logprob), "top_logprobs": [item(token_text(t), lp) for t, lp in e.top]}
                                for e, text in zip(entries, texts)]}, start
        offsets = []
        for text in texts:
            offsets.append(start)
            start += len(text)
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{token_text(t): lp for t, lp in e.top}, text: e.logprob}
                                 for e, text in zip(entries, texts)],
                "text_offset": offsets}, start

    def kept_logprobs(output, text: str, stopped: bool, chat: bool) -> dict | None:
        """A finished answer's `logprobs` (None where the request asked for none): the tokens of its text (those
        before a stop string that cut it)."""
        if output.logprobs is None:
            return None
        entries = output.logprobs
        if stopped:
            ends = logprobs_of(entries, False)[0]["text_offset"]
            entries = entries[: sum(1 for offset in ends if offset < len(text))]
        return logprobs_of(entries, chat)[0]

    async def stream_text(rid: str, stop: Stops, outputs: asyncio.Queue, chunk, include_usage: bool,
                          token_ids: bool = False, chat: bool = False):
        """SSE events of a streaming request: each new piece of text (decoded from every token so far, so a
        multi-token character arrives whole), then the finish reason, the usage when asked, then [DONE]. With
        `token_ids` each chunk carries the tokens generated since the last one (the first also the prompt's), and
        where the request asked for log-probabilities those of the tokens generated since the last chunk (`chat`:
        in chat's form). A client that goes away cancels its request (the slot is freed)."""
        sent, stopped, output, finished = "", False, None, False
        ids_sent = -1  # tokens whose ids went out (-1: not even the prompt's)
        logprobs_sent, offset = 0, 0  # tokens whose log-probabilities went out; the completions' text offset

        def event(text: str, reason: str | None) -> str:
            nonlocal ids_sent, logprobs_sent, offset
            ids, first = None, False
            if token_ids and output is not None:
                ids, first = output.generated_tokens[max(ids_sent, 0):], ids_sent < 0
                ids_sent = len(output.generated_tokens)
            answer = chunk(text, reason)
            if output is not None and output.logprobs is not None and answer["choices"]:
                entries = output.logprobs[logprobs_sent:]
                logprobs_sent = len(output.logprobs)
                answer["choices"][0]["logprobs"], offset = logprobs_of(entries, chat, offset)
            return f"data: {json.dumps(extras(answer, output, ids, first))}\n\n"

        try:
            while True:
                try:
                    output = await asyncio.wait_for(outputs.get(), request_timeout)
                except TimeoutError:
                    break
                if output.status == RequestStatus.FAILED:
                    finished = True
                    yield f"data: {json.dumps(_error_body(output.error or 'the request failed'))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if not stopped:  # past a stop string nothing more is sent; its criterion ends the request this step
                    text, stopped = cut(await asyncio.to_thread(tokenizer.decode, output.generated_tokens,
                                                                skip_special_tokens=True), stop)
                    # Hold back what may start a stop string, and an incomplete character.
                    done = stopped or output.is_finished()
                    safe = len(text) if done else len(text) - max((len(s) - 1 for s in stop.strings), default=0)
                    if text.endswith("\ufffd") and not done:
                        safe = min(safe, len(text) - 1)
                    if safe > len(sent):
                        yield event(text[len(sent) : safe], None)
                        sent = text[:safe]
                if output.is_finished():
                    finished = True
                    break
            yield event("", finish_reason(output, stopped, stop) if output else "stop")
            if include_usage and output is not None:
                yield f"data: {json.dumps({**chunk('', None), 'choices': [], 'usage': usage(output)})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                engine.cancel(rid)

    @app.get("/health")
    async def health():
        problem = engine.health()
        if problem is not None:
            return error(503, problem, kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        rows = [("requests_received_total", "counter", served["requests"]), *engine.metrics()]
        text = "".join(f"# TYPE hf_hybrid_spec_{name} {kind}\nhf_hybrid_spec_{name} {value}\n"
                       for name, kind, value in rows)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "hf_hybrid_spec"}

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorized)])
    async def model(model_id: str):
        if model_id != model_name:
            raise RequestError(f"model {model_id!r} is not served here (this server serves {model_name!r})",
                               "model", 404)
        return model_card()

    async def completions(body: Completion):
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        ids = (await asyncio.to_thread(tokenizer, prompt)).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt: the prompt is empty", "prompt")
        rid, stop, outputs = submit(ids, body, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"

        def chunk(text, reason):
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}

        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_text(rid, stop, outputs, chunk, include, body.return_token_ids),
                                     media_type="text/event-stream")
        output = await result(rid, outputs)
        text, stopped = cut(await asyncio.to_thread(tokenizer.decode, output.generated_tokens,
                                                    skip_special_tokens=True), stop)
        out = extras(chunk(text, finish_reason(output, stopped, stop)), output,
                     output.generated_tokens if body.return_token_ids else None, True)
        out["choices"][0]["logprobs"] = kept_logprobs(output, text, stopped, chat=False)
        return {**out, "usage": usage(output)}

    async def chat(body: Chat):
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError("the tokenizer has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.content if not isinstance(m.content, list)
                     else "".join(part.text for part in m.content)} for m in body.messages]
        ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                      tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")
        rid, stop, outputs = submit(list(ids), body, None, (body.top_logprobs or 0) if body.logprobs else None)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            first = [True]

            def chunk(text, reason):
                delta = {"content": text} if text or reason is None else {}
                if first[0]:
                    delta["role"], first[0] = "assistant", False
                return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                        "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

            include = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_text(rid, stop, outputs, chunk, include, body.return_token_ids, chat=True),
                                     media_type="text/event-stream")
        output = await result(rid, outputs)
        text, stopped = cut(await asyncio.to_thread(tokenizer.decode, output.generated_tokens,
                                                    skip_special_tokens=True), stop)
        answer = extras({"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                         "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": kept_logprobs(output, text, stopped, chat=True),
                                      "finish_reason": finish_reason(output, stopped, stop)}]}, output,
                        output.generated_tokens if body.return_token_ids else None, True)
        return {**answer, "usage": usage(output)}

    # The bodies' types are local classes, and annotations are strings in this module: FastAPI reads them from here.
    completions.__annotations__["body"], chat.__annotations__["body"] = Completion, Chat
    app.post("/v1/completions", dependencies=[Depends(authorized)])(completions)
    app.post("/v1/chat/completions", dependencies=[Depends(authorized)])(chat)
    return app


def _error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
                code: int | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 in OpenAI's error shape, from its Content-Length
    before anything is read, or, for a body without one (chunked), as soon as what arrived passes the limit (such a
    body is read here, up to the limit, and handed to the app whole: FastAPI turns any error raised while it reads a
    body into its own 400).

    The rest of a refused body is read and dropped (up to `DRAIN_FACTOR` times the limit) before the answer goes out:
    a server that answers and closes while the client is still sending makes the client's kernel see a reset, and the
    client gets "connection reset" instead of the 413 (nginx's lingering close does the same). A body past that bound
    is cut off unread."""

    DRAIN_FACTOR = 16

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) <= self.limit:
                return await self.app(scope, receive, send)  # the server holds the body to its declared length
            if int(declared) <= self.DRAIN_FACTOR * self.limit:
                await self._drain(receive, 0)
            return await self._refuse(send)
        pieces, received = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body ended
            pieces.append(message.get("body", b""))
            received += len(pieces[-1])
            if received > self.limit:
                if message.get("more_body", False):
                    await self._drain(receive, received)
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(pieces), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _drain(self, receive, received: int) -> None:
        """Read and drop the body's rest, up to DRAIN_FACTOR x the limit in all (`received` bytes already read)."""
        while received <= self.DRAIN_FACTOR * self.limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def _refuse(self, send) -> None:
        body = json.dumps(_error_body(f"the request body is larger than {self.limit} bytes", code=413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def load_served(model: str, assistant_config: str | dict | None = None, dtype: str = "auto", device: str = "auto",
                draft_model: str | None = None):
    """What a server (or a cluster's replica) serves, loaded: (model, tokenizer, draft model or None, the
    `AssistantConfig` or None). `assistant_config`: a JSON object (text or dict), or a folder / Hub id with
    assistant_config.json; `draft_model`: a causal LM or an EAGLE-3 drafter folder / Hub id."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from ..cli import resolve_device
    from ..config import AssistantConfig
    from ..generate import _resolve_config

    device = resolve_device(device)
    config = None
    if isinstance(assistant_config, dict):
        config = AssistantConfig.from_dict(assistant_config)
    elif assistant_config is not None:
        text = assistant_config.strip()
        config = AssistantConfig.from_dict(json.loads(text)) if text.startswith("{") else _resolve_config(text, None)
    dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model)
    draft = None
    if draft_model is not None:
        if AutoConfig.from_pretrained(draft_model).model_type == "hf_hybrid_spec_eagle3":
            from ..eagle import EagleDrafter

            draft = EagleDrafter.from_pretrained(draft_model)
        else:
            draft = AutoModelForCausalLM.from_pretrained(draft_model, dtype=dtype)
        draft = draft.to(device).eval()
    return target, tokenizer, draft, config
