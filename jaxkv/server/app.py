"""The OpenAI-compatible server: a FastAPI app over one ``AsyncLLM``, served by uvicorn.

Design notes: docs/server.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import jaxkv
from jaxkv.config import EngineConfig
from jaxkv.config.checks import check_token_ids
from jaxkv.engine.async_llm import AsyncLLM, AsyncRequestStream, EngineDeadError, freeze_gc_heap
from jaxkv.engine.outputs import RequestOutput
from jaxkv.server import protocol, tool_calls, tools
from jaxkv.server.gate import DEFAULT_MAX_BODY, Gate
from jaxkv.server.metrics import ServerMetrics
from jaxkv.server.prompts import PromptTokenizer

if TYPE_CHECKING:
    from jaxkv.engine.multihost import StepFeed

logger = logging.getLogger("uvicorn.error")
# The grace uvicorn gives responses after the drain (their engine requests are aborted by then).
_AFTER_DRAIN_S = 5.0


class APIError(Exception):
    """An error answered in OpenAI's schema with an HTTP status."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def response(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, self.kind, self.status, self.param),
                            status_code=self.status)


def bad_request(e: Exception) -> APIError:
    """A 400 of a refused value (``param``: the field a ``protocol.FieldError`` names)."""
    return APIError(400, str(e), "BadRequestError", getattr(e, "param", None))


class Server:
    """The routes' shared state: the engine, the served name and the metrics.

    Args:
      engine: the ``AsyncLLM`` (the server shuts it down on exit).
      served_model_name: the ``model`` clients send and ``/v1/models`` lists.
      tool_call_parser: the format ``tool_choice="auto"`` reads calls in
        (``tool_calls.PARSERS``; None: ``auto`` is refused).
    """

    def __init__(self, engine: AsyncLLM, served_model_name: str,
                 tool_call_parser: str | None = None):
        self.engine = engine
        self.core = engine.engine
        self.name = served_model_name
        self.max_model_len = self.core.sched_config.max_model_len
        self.metrics = ServerMetrics(served_model_name, engine.stats_now)
        self.prompts = PromptTokenizer(self.core.tokenizer, self.max_model_len)
        if tool_call_parser is not None and tool_call_parser not in tool_calls.PARSERS:
            raise ValueError(f"--tool-call-parser {tool_call_parser}: choose one of "
                             f"{', '.join(tool_calls.PARSERS)}")
        self.tool_parser = tool_call_parser
        self.renders_tools = tools.template_renders_tools(self.core.tokenizer.chat_template)

    # ------------------------------------------------------------------ requests

    def check(self, req: protocol._Strict) -> None:
        """404 for another model, 400 for a lone surrogate in any of the request's text."""
        model = getattr(req, "model", None)
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        protocol.check_unicode(req.model_dump())

    async def tokenize(self, prompt: str | dict) -> dict:
        """A prompt as the engine's ``{"prompt": text, "prompt_token_ids": ids}`` (text
        tokenized in a worker thread), refused first if it leaves no room to generate.

        Raises:
          ValueError: an empty prompt, or one too long for max_model_len.
        """
        if isinstance(prompt, dict):
            self.prompts.check_length(len(prompt["prompt_token_ids"]))
            return prompt
        if not prompt:
            raise protocol.FieldError("prompt", "prompt must not be empty")
        return await asyncio.to_thread(self.prompts.prompt, prompt)

    async def add(self, prompt, params, cache_salt, priority) -> AsyncRequestStream:
        """Queues one prompt; a refused field is a 400, a dead engine a 503."""
        try:
            return await self.engine.add_request(prompt, params, priority=priority,
                                                  cache_salt=cache_salt)
        except (TypeError, ValueError) as e:
            raise bad_request(e) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), "ServiceUnavailableError") from None

    async def add_all(self, prompts: list, req: protocol._SamplingRequest, *,
                      max_tokens: int | None, logprobs: int | None,
                      tool_plan: tools.ToolPlan | None = None) -> list[AsyncRequestStream]:
        """Queues every prompt of a request, or none: all are tokenized and checked first, and
        an engine's refusal of a later one aborts the earlier."""
        constraint = tool_plan.constraint if tool_plan else None
        try:
            tokenized = [await self.tokenize(p) for p in prompts]
            params = [req.sampling_params(len(p["prompt_token_ids"]), self.max_model_len,
                                          max_tokens=max_tokens, logprobs=logprobs,
                                          constraint=constraint)
                      for p in tokenized]
        except (TypeError, ValueError) as e:
            raise bad_request(e) from None
        spec = params[0].structured_outputs if params else None
        if spec is not None:   # compiled in a worker thread: the loop and the engine go on
            try:
                await asyncio.to_thread(self.core.compile_structured_outputs, spec)
            except ValueError as e:
                field = "tools" if constraint is not None else req.constraint_field
                message = str(e) if field == "structured_outputs" else str(e).replace(
                    "structured_outputs.json", "tools[].function.parameters" if constraint
                    else "response_format.json_schema.schema")
                raise bad_request(protocol.FieldError(field, message)) from None
        streams: list[AsyncRequestStream] = []
        try:
            for prompt, p in zip(tokenized, params):
                streams.append(await self.add(prompt, p, req.cache_salt, req.priority))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def abort(self, streams: list[AsyncRequestStream]) -> None:
        """Aborts the unfinished requests of ``streams`` (their client went away), counting
        each under ``vllm:request_success{finished_reason="abort"}``."""
        for s in streams:
            if not s.finished:
                s.abort()
                self.metrics.observe_aborted()

    async def follow(self, stream: AsyncRequestStream) -> AsyncIterator[RequestOutput]:
        """A request's outputs, observed by the metrics on the way."""
        previous = None
        async for out in stream:
            self.metrics.observe_step(previous, out)
            if out.finished:
                self.metrics.observe_finished(out)
            previous = out
            yield out

    async def final(self, request: Request, streams: list[AsyncRequestStream]
                    ) -> list[RequestOutput]:
        """The finished outputs of non-streamed requests; aborts them all if the client
        disconnects first."""
        async def last(stream):
            out = None
            async for out in self.follow(stream):
                pass
            return out

        gathered = asyncio.gather(*(last(s) for s in streams))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if gathered not in done:
                raise APIError(499, "client disconnected", "ClientDisconnected")
            outs = gathered.result()
        except EngineDeadError as e:
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        finally:
            watcher.cancel()
            gathered.cancel()
            self.abort(streams)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise APIError(500, failed[0], "InternalServerError")
        return outs


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone away: the body has been read, so the next ASGI message
    is the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _merged(server: Server, streams: list[AsyncRequestStream]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) of several requests, in the order the outputs arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncRequestStream):
        try:
            async for out in server.follow(stream):
                await queue.put((i, out))
        except BaseException as e:   # surfaced by the consumer
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        pending = len(streams)
        while pending:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                pending -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        server.abort(streams)


class _ChoiceCursor:
    """What of one choice has been sent: text characters and tokens."""

    def __init__(self, tool_parser=None):
        self.text = 0
        self.tokens = 0
        self.started = False
        self.done = False
        self.calls = None if tool_parser is None else tool_calls.CallStream(tool_parser)

    def chat_delta(self, c, text: str) -> dict:
        """The chat delta of a step's new ``text`` (with tools: the content and calls it
        settles)."""
        if self.calls is not None:
            delta = self.calls.delta(c.text, c.finished)
        else:
            delta = {"content": text} if text or not self.started else {}
        return delta if self.started else {"role": "assistant", **delta}

    def finish_reason(self, c) -> str | None:
        return tool_calls.finish_reason(c.finish_reason,
                                        self.calls is not None and self.calls.has_calls)


async def _stream_events(server: Server, streams: list[AsyncRequestStream], *, kind: str,
                         request_id: str, include_usage: bool, n: int,
                         fmt: protocol.LogprobFormatter | None,
                         echo_texts: list[str] | None = None,
                         tool_parser=None) -> AsyncIterator[str]:
    """The SSE events of a streamed (chat) completion: one chunk per step per choice (with a
    ``tool_parser``, its content and calls as deltas)."""
    created = int(time.time())
    cursors: dict[int, _ChoiceCursor] = {}
    prompt_tokens: dict[int, int] = {}
    completion_tokens: dict[int, int] = {}
    try:
        async for p, out in _merged(server, streams):
            prompt_tokens[p] = len(out.prompt_token_ids)
            choices = []
            for c in out.outputs:
                index = p * n + c.index
                cur = cursors.setdefault(index, _ChoiceCursor(tool_parser))
                completion_tokens[index] = len(c.token_ids)
                text, tokens = c.text[cur.text:], c.token_ids[cur.tokens:]
                entries = (c.logprobs or [])[cur.tokens:]
                if cur.done or not (text or tokens or c.finished or not cur.started):
                    continue
                if kind == "chat":
                    choice = {"index": index, "delta": cur.chat_delta(c, text),
                              "logprobs": fmt.chat(tokens, entries) if fmt and tokens else None}
                else:
                    prefix = echo_texts[p] if echo_texts and not cur.started else ""
                    choice = {"index": index, "text": prefix + text,
                              "logprobs": fmt.completion(tokens, entries, cur.text)
                              if fmt and tokens else None}
                cur.started = True
                cur.text += len(text)
                cur.tokens += len(tokens)
                if c.finished:
                    cur.done = True
                    choice |= {"finish_reason": cur.finish_reason(c),
                               "stop_reason": c.stop_reason}
                    if out.error:
                        yield _sse(protocol.error_body(out.error, "InternalServerError", 500))
                        continue
                else:
                    choice["finish_reason"] = None
                choices.append(choice)
            if choices:
                yield _sse(protocol.chunk(request_id, server.name, created, kind, choices))
        if include_usage:
            yield _sse(protocol.chunk(request_id, server.name, created, kind, [],
                                      protocol.usage(sum(prompt_tokens.values()),
                                                     sum(completion_tokens.values()))))
    except EngineDeadError as e:
        yield _sse(protocol.error_body(str(e), "ServiceUnavailableError", 503))
    yield _sse("[DONE]")


def build_app(engine: AsyncLLM, *, served_model_name: str, api_key: str | None = None,
              model_path: str | None = None, max_request_bytes: int = DEFAULT_MAX_BODY,
              tool_call_parser: str | None = None) -> Gate:
    """The ASGI app over ``engine`` (module docstring): a ``Gate`` in front of the FastAPI app
    (``gate.app``, its ``Server`` at ``gate.app.state.server``); it shuts the engine down on exit.

    Args:
      engine: a started ``AsyncLLM``.
      served_model_name: the model id of the API.
      api_key: the bearer token the API routes require (None: none).
      model_path: shown as ``root`` in ``/v1/models``.
      max_request_bytes: the largest request body accepted (413 above).
      tool_call_parser: the format ``tool_choice="auto"`` reads calls in (None: refused).
    """
    server = Server(engine, served_model_name, tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="jaxkv", version=jaxkv.__version__, lifespan=lifespan)
    app.state.server = server

    _add_error_handlers(app)
    _add_info_routes(app, server, model_path)
    _add_generation_routes(app, server)
    return Gate(app, api_key=api_key, max_body=max_request_bytes)


def _add_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's error body: ours, a bad field, a route's HTTP error, a body
    that does not validate (400 naming the field)."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(protocol.FieldError)
    async def field_error(_: Request, e: protocol.FieldError):
        return bad_request(e).response()

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(e.status_code,
                                                                       "BadRequestError")
        return APIError(e.status_code, str(e.detail), kind).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        message, param = protocol.validation_error(list(e.errors()))
        return APIError(400, message, "BadRequestError", param).response()


def _add_info_routes(app: FastAPI, server: Server, model_path: str | None) -> None:
    """``/health``, ``/version``, ``/metrics``, ``/v1/models``, ``/tokenize``, ``/detokenize``."""

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": jaxkv.__version__}

    @app.get("/metrics")
    async def metrics():
        body = await asyncio.to_thread(server.metrics.exposition)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": server.name, "object": "model", "created": int(time.time()),
            "owned_by": "jaxkv", "root": model_path or server.name, "parent": None,
            "max_model_len": server.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: protocol.TokenizeRequest):
        server.check(req)
        tok = server.core.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "BadRequestError")
        try:
            if req.messages is not None:
                text = tok.apply_chat_template([m.as_dict() for m in req.messages],
                                               add_generation_prompt=req.add_generation_prompt)
                ids = await asyncio.to_thread(tok.encode, text, False)
            else:
                ids = await asyncio.to_thread(tok.encode, req.prompt,
                                              req.add_special_tokens)
        except ValueError as e:
            raise bad_request(e) from None
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: protocol.DetokenizeRequest):
        server.check(req)
        try:
            ids = check_token_ids("tokens", req.tokens, server.core.model_config.vocab_size)
        except (TypeError, ValueError) as e:
            raise bad_request(e) from None
        return {"prompt": server.core.tokenizer.decode(ids, skip_special_tokens=False)}


def _add_generation_routes(app: FastAPI, server: Server) -> None:
    """``/v1/completions`` and ``/v1/chat/completions``, streamed by SSE or whole."""

    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, request: Request):
        server.check(req)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo with logprobs needs prompt logprobs, which this server "
                                "does not compute", "BadRequestError", "echo")
        try:
            prompts = req.prompts()
        except (TypeError, ValueError) as e:
            raise bad_request(e) from None
        streams = await server.add_all(prompts, req, max_tokens=req.max_tokens,
                                       logprobs=req.logprobs)
        echo_texts = [_prompt_text(server, p) for p in prompts] if req.echo else None
        fmt = (None if req.logprobs is None
               else protocol.LogprobFormatter(server.core.tokenizer, req.logprobs))
        rid = protocol.new_id("cmpl")
        if req.stream:
            return StreamingResponse(_stream_events(
                server, streams, kind="completion", request_id=rid,
                include_usage=req.include_usage, n=req.n, fmt=fmt, echo_texts=echo_texts),
                media_type="text/event-stream")
        outs = await server.final(request, streams)
        return protocol.completion_body(rid, server.name, outs, echo_texts or [""] * len(outs),
                                        fmt)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatCompletionRequest, request: Request):
        server.check(req)
        try:
            num_logprobs = req.num_logprobs()
            tool_plan = tools.plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                                   server.tool_parser)
            messages, variables = tools.render(tool_plan, [m.as_dict() for m in req.messages],
                                               server.renders_tools, server.tool_parser)
            prompt = await asyncio.to_thread(server.prompts.chat, messages,
                                             req.add_generation_prompt, **variables)
        except (TypeError, ValueError) as e:
            raise bad_request(e) from None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        streams = await server.add_all([prompt], req, max_tokens=max_tokens,
                                       logprobs=num_logprobs, tool_plan=tool_plan)
        fmt = (None if num_logprobs is None
               else protocol.LogprobFormatter(server.core.tokenizer, num_logprobs))
        parser = tool_plan.parser if tool_plan else None
        rid = protocol.new_id("chatcmpl")
        if req.stream:
            return StreamingResponse(_stream_events(
                server, streams, kind="chat", request_id=rid, include_usage=req.include_usage,
                n=req.n, fmt=fmt, tool_parser=parser), media_type="text/event-stream")
        outs = await server.final(request, streams)
        return protocol.chat_body(rid, server.name, outs[0], fmt, parser)


def _prompt_text(server: Server, prompt) -> str:
    """The text ``echo`` puts before a completion: the prompt as given, or its decoded ids."""
    if isinstance(prompt, str):
        return prompt
    return server.core.tokenizer.decode(prompt["prompt_token_ids"], skip_special_tokens=False)


class _DrainingServer(uvicorn.Server):
    """uvicorn's server with jaxkv's drain: the first SIGTERM / SIGINT keeps the listener open
    while the gate answers 503; once the requests it let through have ended, or ``timeout``
    seconds have passed, the engine is shut down (aborting what is left) and uvicorn stops. A
    second signal ends the drain at once; after it, uvicorn's own handling (SIGINT forces the
    exit).

    uvicorn re-raises a captured signal once it has shut down, so the process would die of it
    (status -15 for SIGTERM); a drained server exits 0 instead, so the captured list is kept
    empty."""

    def __init__(self, config: uvicorn.Config, gate: Gate, engine: AsyncLLM, timeout: float):
        super().__init__(config)
        self.gate, self.engine, self.timeout = gate, engine, timeout

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)     # given the bound socket, uvicorn does not say where
        logger.info("Uvicorn running on http://%s:%d (Press CTRL+C to quit)",
                    self.config.host, self.config.port)

    def handle_exit(self, sig, frame) -> None:
        if not self.gate.draining:
            self.gate.start_draining(self.timeout)
        elif self.gate.drain_left() > 0:
            self.gate.start_draining(0)
        else:
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

    async def on_tick(self, counter: int) -> bool:
        if self.gate.draining and not self.should_exit and (
                self.gate.in_flight == 0 or self.gate.drain_left() <= 0):
            await asyncio.to_thread(self.engine.shutdown)
            self.should_exit = True
        return await super().on_tick(counter)


def bind(host: str, port: int) -> socket.socket:
    """The listening address, bound as uvicorn binds it (``SO_REUSEADDR``), before the engine
    is built: a taken port fails in a second, not after the model has loaded.

    Raises:
      ValueError: naming ``--host`` / ``--port`` and the reason.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on --host {host} --port {port}: "
                         f"{e.strerror or e}") from None
    return sock


def serve(config: EngineConfig, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, api_key: str | None = None,
          shutdown_timeout: float = 30.0, max_request_bytes: int = DEFAULT_MAX_BODY,
          log_level: str = "info", tool_call_parser: str | None = None,
          step_feed: StepFeed | None = None) -> int:
    """Starts the engine and serves it until SIGTERM / SIGINT; returns the exit status 0.

    Args:
      config: the engine config (``EngineConfig.from_cli``).
      host, port: where to listen (bound before the engine is built).
      served_model_name: the API's model id (default: the ``--model`` value).
      api_key: bearer token required on the API routes (None: open).
      shutdown_timeout: seconds in-flight requests may take to finish after SIGTERM.
      max_request_bytes: the largest request body accepted (413 above).
      log_level: uvicorn's log level.
      tool_call_parser: the format ``tool_choice="auto"`` reads calls in
        (``tool_calls.PARSERS``; None: ``auto`` is refused).
      step_feed: multi-host tensor parallelism's leader end
        (``jaxkv.engine.multihost.open_leader_feed``):
        the engine starts once every follower has joined, and its inputs are replayed on them.

    Raises:
      TypeError, ValueError: a bad engine argument, or an address that cannot be bound
        (before anything listens).
    """
    sock = bind(host, port)
    try:
        if step_feed is None:
            engine = AsyncLLM(**config.to_kwargs())
        else:
            from jaxkv.engine.multihost import start_leader

            engine = start_leader(step_feed, **config.to_kwargs())
    except BaseException:
        sock.close()
        if step_feed is not None:
            step_feed.close()
        raise
    app = build_app(engine, served_model_name=served_model_name or config.model.model,
                    api_key=api_key, model_path=str(engine.engine.runner.model_path),
                    max_request_bytes=max_request_bytes, tool_call_parser=tool_call_parser)
    server = _DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=_AFTER_DRAIN_S),
                             app, engine, shutdown_timeout)
    freeze_gc_heap()
    server.run(sockets=[sock])
    return 0
