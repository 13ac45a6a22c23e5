"""An OpenAI-compatible server on the continuous-batching manager: `/v1/completions`, `/v1/chat/completions` (both
streaming over server-sent events) and `/v1/models`, on FastAPI and uvicorn (the `[serve]` extra).

    hf-hybrid-spec-serve --model Qwen/Qwen3.5-0.8B --assistant-config '{"drafter": "suffix"}' --port 8000
    # or: python -m hf_hybrid_spec.serving.server --model ... --help

    from openai import OpenAI
    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
    client.chat.completions.create(model="Qwen/Qwen3.5-0.8B", messages=[{"role": "user", "content": "hi"}])

Why not `transformers serve`: it has no extension point for another decoding engine (its continuous-batching path
calls transformers' own manager, which refuses hybrid models), so this is a thin server of our own with the same API.
Per request: `max_tokens` / `max_completion_tokens`, `temperature` (0: greedy, exact), `top_p`, `stop` (strings, cut
from the text as OpenAI does), `stream`; `n` > 1, `logprobs`, tools and `seed` are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.utils import logging

from .manager import ContinuousBatchingManager

logger = logging.get_logger(__name__)

__all__ = ["create_app", "main"]

# Fields of OpenAI requests the server does not implement: a request that sets them gets a 400 naming them.
_UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "tool_choice", "functions", "seed", "response_format", "suffix",
                "echo", "best_of", "logit_bias")


class RequestError(ValueError):
    """A request the server refuses (HTTP 400)."""


def create_app(manager: ContinuousBatchingManager, tokenizer, model_name: str, request_timeout: float = 600.0):
    """The FastAPI app serving `manager` (started by the app's lifespan, stopped at shutdown) with `tokenizer`'s
    text and chat template, under the model id `model_name`."""
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse

    @asynccontextmanager
    async def lifespan(app):
        manager.start()
        try:
            yield
        finally:
            manager.stop(timeout=30)

    app = FastAPI(title="hf_hybrid_spec", lifespan=lifespan)
    eos = manager.engine.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id

    def error(status: int, message: str):
        return JSONResponse(status_code=status, content={"error": {"message": message, "type": "invalid_request_error"}})

    def settings(body: dict) -> tuple[int, GenerationConfig, list[str]]:
        bad = [k for k in _UNSUPPORTED if body.get(k) not in (None, False, [], {})]
        if bad:
            raise RequestError(f"not supported by this server: {', '.join(bad)}")
        if int(body.get("n") or 1) != 1:
            raise RequestError("n > 1 is not supported")
        if body.get("model") not in (None, model_name):
            raise RequestError(f"model {body.get('model')!r} is not served here (this server serves {model_name!r})")
        new = body.get("max_completion_tokens") or body.get("max_tokens") or 256
        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        top_p = float(body.get("top_p") if body.get("top_p") is not None else 1.0)
        if temperature < 0 or not 0 < top_p <= 1:
            raise RequestError("temperature must be >= 0 and top_p in (0, 1]")
        sample = temperature > 0
        gen = GenerationConfig(do_sample=sample, temperature=temperature if sample else 1.0,
                               top_p=top_p if sample else 1.0, top_k=0 if sample else None, eos_token_id=eos,
                               pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        return int(new), gen, stop

    def submit(ids: list[int], body: dict, stream: bool) -> tuple[str, list[str]]:
        new, gen, stop = settings(body)
        criteria = [StopStringCriteria(tokenizer=tokenizer, stop_strings=stop)] if stop else []
        rid = manager.add_request(ids, max_new_tokens=new, generation_config=gen, stopping_criteria=criteria,
                                  streaming=stream)
        return rid, stop

    def cut(text: str, stop: list[str]) -> tuple[str, bool]:
        """`text` up to the first stop string (excluded, as OpenAI returns it) and whether one was found."""
        hits = [text.find(s) for s in stop if s and s in text]
        return (text[: min(hits)], True) if hits else (text, False)

    def finish_reason(output, stopped: bool) -> str:
        if stopped or (output.generated_tokens and eos is not None and output.generated_tokens[-1] in
                       ([eos] if isinstance(eos, int) else list(eos))):
            return "stop"
        return "length"

    async def result(rid: str):
        output = await asyncio.to_thread(manager.get_result, rid, request_timeout)
        if output is None:
            manager.cancel_request(rid)
            raise RequestError(f"request {rid} timed out after {request_timeout} s")
        if output.status == RequestStatus.FAILED:
            raise RequestError(output.error or "the request failed")
        return output

    def usage(output) -> dict:
        prompt, completion = len(output.prompt_ids), len(output.generated_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    async def stream_text(rid: str, stop: list[str], chunk):
        """SSE events of a streaming request: each new piece of text (decoded from every token so far, so a
        multi-token character arrives whole), then the finish reason, then [DONE]. A client that goes away cancels
        its request (the slot is freed)."""
        updates = manager.request_id_iter(rid, timeout=request_timeout)
        sent, stopped, output, finished = "", False, None, False
        try:
            while True:
                output = await asyncio.to_thread(next, updates, None)
                if output is None:
                    break
                if output.status == RequestStatus.FAILED:
                    finished = True
                    yield f"data: {json.dumps({'error': {'message': output.error}})}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if not stopped:  # past a stop string nothing more is sent; its criterion ends the request this step
                    text, stopped = cut(tokenizer.decode(output.generated_tokens, skip_special_tokens=True), stop)
                    # Hold back what may start a stop string, and an incomplete character.
                    done = stopped or output.is_finished()
                    safe = len(text) if done else len(text) - max((len(s) - 1 for s in stop), default=0)
                    if text.endswith("\ufffd") and not done:
                        safe = min(safe, len(text) - 1)
                    if safe > len(sent):
                        yield f"data: {json.dumps(chunk(text[len(sent) : safe], None))}\n\n"
                        sent = text[:safe]
                if output.is_finished():
                    finished = True
                    break
            yield f"data: {json.dumps(chunk('', finish_reason(output, stopped) if output else 'stop'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                manager.cancel_request(rid)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "hf_hybrid_spec"}]}

    @app.post("/v1/completions")
    async def completions(body: dict):
        try:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tokenizer(prompt).input_ids
            elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                ids = prompt
            else:
                raise RequestError("prompt must be one string or one list of token ids")
            stream = bool(body.get("stream"))
            rid, stop = submit(ids, body, stream)
            created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
            if stream:
                def chunk(text, reason):
                    return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}]}

                return StreamingResponse(stream_text(rid, stop, chunk), media_type="text/event-stream")
            output = await result(rid)
            text, stopped = cut(tokenizer.decode(output.generated_tokens, skip_special_tokens=True), stop)
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish_reason(output, stopped),
                                 "logprobs": None}], "usage": usage(output)}
        except RequestError as e:
            return error(400, str(e))

    @app.post("/v1/chat/completions")
    async def chat(body: dict):
        try:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise RequestError("messages must be a non-empty list")
            if getattr(tokenizer, "chat_template", None) is None:
                raise RequestError("the tokenizer has no chat template: use /v1/completions")
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            stream = bool(body.get("stream"))
            rid, stop = submit(list(ids), body, stream)
            created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
            if stream:
                first = [True]

                def chunk(text, reason):
                    delta = {"content": text} if text or reason is None else {}
                    if first[0]:
                        delta["role"], first[0] = "assistant", False
                    return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}]}

                return StreamingResponse(stream_text(rid, stop, chunk), media_type="text/event-stream")
            output = await result(rid)
            text, stopped = cut(tokenizer.decode(output.generated_tokens, skip_special_tokens=True), stop)
            return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                 "finish_reason": finish_reason(output, stopped)}], "usage": usage(output)}
        except RequestError as e:
            return error(400, str(e))

    return app


def main(argv: list[str] | None = None) -> None:
    """`hf-hybrid-spec-serve`: load a model and serve it (see the module docstring)."""
    from ..cli import argument_parser, resolve_device
    from .engine import ServingConfig

    parser = argument_parser("OpenAI-compatible server with speculative continuous batching for hybrid models "
                             "(hf_hybrid_spec)")
    parser.add_argument("--model", required=True, help="a Hub id or a local checkpoint")
    parser.add_argument("--assistant-config", default=None,
                        help="an AssistantConfig: a JSON object, or a folder / Hub id with assistant_config.json")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-slots", type=int, default=ServingConfig.max_slots, help="requests decoded at once")
    parser.add_argument("--max-total-tokens", type=int, default=ServingConfig.max_total_tokens,
                        help="the longest request (prompt and new tokens)")
    parser.add_argument("--prefix-cache-mb", type=int, default=ServingConfig.prefix_cache_bytes >> 20,
                        help="the bound on prefix-reuse states (0: off)")
    parser.add_argument("--lanes", type=int, default=ServingConfig.lanes,
                        help="engines the slots are split between, stepped in turn (ServingConfig.lanes)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    parser.add_argument("--device", default="auto", help="'auto': cuda where a GPU is seen, else cpu")
    parser.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    args = parser.parse_args(argv)

    import torch
    import uvicorn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..config import AssistantConfig

    args.device = resolve_device(args.device)

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config = None
    if args.assistant_config is not None:
        text = args.assistant_config.strip()
        config = AssistantConfig.from_dict(json.loads(text)) if text.startswith("{") else \
            AssistantConfig.from_pretrained(text)
    serving = ServingConfig(max_slots=args.max_slots, max_total_tokens=args.max_total_tokens,
                            prefix_cache_bytes=args.prefix_cache_mb << 20, lanes=args.lanes)
    manager = ContinuousBatchingManager(model, config, serving)
    uvicorn.run(create_app(manager, tokenizer, args.served_model_name or args.model), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
