"""Prompt tokens served by the store, in vllm-mlx's API usage.

vllm-mlx 0.6.0 reports ``prompt_tokens`` only. Under ``kvstore vllm-mlx
serve`` each request's usage also says how many prompt tokens came from the
store: ``usage.prompt_tokens_details.cached_tokens`` (OpenAI chat completions
and completions), ``usage.input_tokens_details.cached_tokens`` (responses) and
``usage.cache_read_input_tokens`` (Anthropic messages), streamed responses
included (OpenAI's usage chunk, ``response.completed``, Anthropic's
``message_delta``; Anthropic's ``message_start`` is sent before the prompt is
looked up and stays as vllm-mlx sends it).

How the count reaches the response, with no change to vllm-mlx's handlers:

* ``Scheduler.add_request`` fetches a request's prompt from the cache: a
  wrapper notes on the request how many tokens the store served
  (``StorePrefixCache.last_hit``), and ``EngineCore.add_request`` notes the
  request on the HTTP request being answered (a context variable set by the
  middleware, which the engine's calls run under).
* ``UsageMiddleware`` (an ASGI middleware on vllm-mlx's app) adds the count to
  every ``usage`` object of those endpoints' JSON and SSE bodies:
  ``min(request.cached_tokens, store hit)``, so a cache the scheduler threw
  away (it then prefills the whole prompt, ``cached_tokens = 0``) counts 0.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import threading
from typing import Any, Callable, Optional

__all__ = ["UsageMiddleware", "missing", "patch_engine", "HitRecord"]

HIT = "kvstore_store_tokens"  # attribute set on vllm-mlx's Request: prompt tokens the store served


class _Requests:
    """The engine requests one HTTP request made (a context variable holds it:
    child tasks copy the variable, so they share this object)."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def cached(self) -> Optional[int]:
        if not self.requests:
            return None
        return sum(min(r.cached_tokens or 0, getattr(r, HIT, 0)) for r in self.requests)


_CURRENT: contextvars.ContextVar[Optional[_Requests]] = contextvars.ContextVar("kvstore_vllm_usage", default=None)


class HitRecord(threading.local):
    """The last fetch's store hit on this thread (``Scheduler.add_request``
    fetches and reads it on one thread)."""

    tokens: int = 0


def missing(scheduler_module: Any, engine_core: Any) -> list[str]:
    """What the usage patch relies on that this vllm-mlx lacks (empty: all there)."""
    S, out = scheduler_module, []
    add = getattr(S.Scheduler, "add_request", None)
    add = getattr(add, "kvstore_replaces", add)
    if add is None or "memory_aware_cache.fetch(request.prompt_token_ids)" not in inspect.getsource(add) \
            or "request.cached_tokens = " not in inspect.getsource(add):
        out.append("Scheduler.add_request no longer fetches the prompt and sets request.cached_tokens")
    core_add = getattr(engine_core, "add_request", None)
    core_add = getattr(core_add, "kvstore_replaces", core_add)
    if core_add is None or not inspect.iscoroutinefunction(core_add) \
            or "self.scheduler.add_request(request)" not in inspect.getsource(core_add):
        out.append("EngineCore.add_request is no longer a coroutine handing the request to its scheduler")
    from vllm_mlx.request import Request

    if "cached_tokens" not in getattr(Request, "__dataclass_fields__", {}):
        out.append("vllm_mlx.request.Request has no cached_tokens")
    return out


def patch_engine(scheduler_module: Any, engine_core: Any, hits: Callable[[Any], Optional[int]]) -> Callable[[], None]:
    """Note each request's store hit (``hits(scheduler)``: the hit of the
    fetch that scheduler just made, ``None`` when its cache is not the
    store's) and each request on the HTTP request being answered. Returns
    what puts the originals back."""
    Scheduler = scheduler_module.Scheduler
    add, core_add = Scheduler.add_request, engine_core.add_request

    def scheduler_add(scheduler: Any, request: Any) -> None:
        add(scheduler, request)
        n = hits(scheduler)
        if n is not None:
            setattr(request, HIT, n)

    async def core_add_request(core: Any, *a: Any, **kw: Any) -> str:
        request_id = await core_add(core, *a, **kw)
        current = _CURRENT.get()
        request = core.scheduler.requests.get(request_id)
        if current is not None and request is not None:
            current.requests.append(request)
        return request_id

    scheduler_add.kvstore_replaces = getattr(add, "kvstore_replaces", add)
    core_add_request.kvstore_replaces = getattr(core_add, "kvstore_replaces", core_add)
    Scheduler.add_request, engine_core.add_request = scheduler_add, core_add_request

    def undo() -> None:
        Scheduler.add_request, engine_core.add_request = add, core_add

    return undo


# ---------------------------------------------------------------------------
# the HTTP side
# ---------------------------------------------------------------------------

PATHS = {"/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/responses": "responses",
         "/v1/messages": "anthropic"}


def fill(obj: Any, n: int, api: str) -> bool:
    """Put ``n`` into every usage object of one response body or event
    (nested under ``response`` or ``message`` in streamed events); whether
    there was one."""
    if not isinstance(obj, dict):
        return False
    found = any([fill(obj.get(k), n, api) for k in ("response", "message")])
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return found
    if api == "anthropic":
        usage["cache_read_input_tokens"] = n
    elif api == "responses":
        usage["input_tokens_details"] = {**(usage.get("input_tokens_details") or {}), "cached_tokens": n}
    else:
        usage["prompt_tokens_details"] = {**(usage.get("prompt_tokens_details") or {}), "cached_tokens": n}
    return True


def _event(raw: bytes, n: Optional[int], api: str) -> bytes:
    """One SSE event with its ``data:`` JSON's usage filled (as it was where
    it has none, or the count is not known yet)."""
    if n is None or b'"usage"' not in raw:
        return raw
    lines = raw.split(b"\n")
    for i, line in enumerate(lines):
        if line.startswith(b"data:") and line[5:].strip() not in (b"", b"[DONE]"):
            try:
                obj = json.loads(line[5:])
            except ValueError:
                continue
            if fill(obj, n, api):
                lines[i] = b"data: " + json.dumps(obj).encode()
    return b"\n".join(lines)


class UsageMiddleware:
    """ASGI middleware: the store's hit in the usage of vllm-mlx's
    generation endpoints (``PATHS``), whole JSON bodies and SSE streams."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        api = PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if api is None:
            return await self.app(scope, receive, send)
        current = _Requests()
        token = _CURRENT.set(current)
        state: dict[str, Any] = {"start": None, "kind": None, "buf": b""}

        async def relay(message: dict) -> None:
            if message["type"] == "http.response.start":
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                state["kind"] = "sse" if b"event-stream" in ctype else "json" if b"json" in ctype else "other"
                if state["kind"] != "json":
                    return await send(message)
                state["start"] = message  # held until the body is whole: its content-length changes
                return None
            if message["type"] != "http.response.body" or state["kind"] == "other":
                return await send(message)
            state["buf"] += message.get("body", b"")
            more = message.get("more_body", False)
            if state["kind"] == "sse":
                *whole, state["buf"] = state["buf"].split(b"\n\n")
                if not more:
                    whole, state["buf"] = whole + ([state["buf"]] if state["buf"] else []), b""
                body = b"".join(_event(e, current.cached(), api) + b"\n\n" for e in whole)
                return await send({**message, "body": body})
            if more:
                return None
            body, n = state["buf"], current.cached()
            if n is not None:
                try:
                    obj = json.loads(body)
                    if fill(obj, n, api):
                        body = json.dumps(obj).encode()
                except ValueError:
                    pass
            start = state["start"]
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": headers + [(b"content-length", str(len(body)).encode())]})
            await send({**message, "body": body})

        try:
            await self.app(scope, receive, relay)
        finally:
            _CURRENT.reset(token)
