"""The ``vllm`` runtime: a causal LM served by vLLM's own OpenAI server, with Shardline in front of it.

vLLM pins an older fastapi than Prefect, so it never shares Shardline's environment: it runs as its
own process, from its own environment or image. This runtime either

- points to a vLLM server that already runs (``SHARDLINE_VLLM_URL``, e.g. a sidecar container or a
  Kubernetes Service; its served model name is the bundle's name), or
- starts one per model and supervises it (``SHARDLINE_VLLM_PYTHON``: the Python of vLLM's own
  environment): ``python -m vllm.entrypoints.openai.api_server --model <bundle folder>
  --served-model-name <name> --host 127.0.0.1 --port <free>``, plus ``SHARDLINE_VLLM_ARGS``
  (``--gpu-memory-utilization 0.9``, ``--tensor-parallel-size 2``...); ready when its ``/health``
  answers, started again if it exits (``shardline.processes.restart_delay``'s back-off), stopped with the
  model. It dies with its replica (``shardline.processes``: PR_SET_PDEATHSIG on Linux). Its port is
  reserved (``shardline.local_ports.reserve_port``: vLLM binds it itself); one that exits because another
  process took the port is started again on a new one, and requests follow it there.

The bundle is a Hugging Face checkpoint as vLLM reads it (``config.json``, safetensors weights,
``tokenizer.json`` and ``tokenizer_config.json``, ``generation_config.json``; ``shardline.build.llm_build``
packages one), with the signature of every ``llm`` bundle: ``prompt`` in; ``completion``,
``prompt_tokens``, ``completion_tokens`` out.

What Shardline adds in front: the replica's tenants, quotas (``max_streams``, ``tokens_per_minute``),
metering and metrics, the router's placement, and the same ``Engine`` as the CPU runtime
(``RemoteEngine``, on the engines' base: ``tokenize``, ``chat_prompt``, the one prompt check, ``submit``
with ``SamplingParams`` and token events, ``generate_many``), so the HTTP tier and batch generation
(``predict``: ``VllmModel`` is a ``GeneratingRuntime``) work unchanged. The prompt is tokenized here with
the bundle's tokenizer, checked, and sent to vLLM as token ids (so a tenant's prompt tokens are counted
before anything is sent); vLLM streams back text with its token ids (``return_token_ids``) and running
usage (``continuous_usage_stats``), and closing the stream aborts the request in vLLM.

How the streams run: each request is a task on an event loop, never a thread of its own. Submitted from a
running loop (``serve``'s, for the HTTP tier), it runs on that loop and its events are there for the response
without a hop between threads (before, a thread per request read vLLM's stream and handed each token to the
loop: with the GIL and a busy machine, first tokens waited up to hundreds of milliseconds; bench/README.md,
"llm_serving.py"); batch generation's requests run on the engine's own loop thread. The connections to vLLM are
kept alive and reused: a stream is read to vLLM's ``[DONE]`` after its last token, so that its connection serves
the next request instead of a new one per request.
``tests/support/vllm_server.py`` answers as vLLM does, so this path runs in every test run
(``tests/integration/test_vllm_openai.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import orjson

from shardline.bundle import Manifest
from shardline.errors import ChildNotReady, NotInstalled, RuntimeUnavailable
from shardline.local_ports import release, reserve_port
from shardline.processes import Child, restart_delay, spawn, start_on_port
from shardline.runtimes.base import RuntimeOptions
from shardline.runtimes.generation import EngineConfig, RequestHandle, SamplingParams, TokenEvent
from shardline.runtimes.generation.base import LLM_EXTRA, EngineBase, Request
from shardline.runtimes.generation.runtime import GeneratingRuntime

log = logging.getLogger(__name__)
STOP_GRACE_S = 30.0  # longer than processes.GRACE_S: vLLM shuts its engine's workers down and frees the GPU first


class RemoteHandle:
    """A request sent to vLLM (a ``RequestHandle``): ``cancel()`` cancels its task, which closes its stream (its
    connection), and vLLM aborts it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.task: asyncio.Task[None] | None = None
        self.started = False  # its task runs (a task cancelled before its first step would never say "cancelled")
        self.cancelled = False
        self.done = False

    def cancel(self) -> None:
        """Stop it; harmless after its end, and from any thread."""
        if self.done or self.cancelled:
            return
        self.cancelled = True  # a task not started yet sees it first thing
        if _running_loop() is self.loop:
            self._cancel_task()
        else:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs there any more
                self.loop.call_soon_threadsafe(self._cancel_task)

    def _cancel_task(self) -> None:
        if self.task is not None and self.started and not self.task.done():
            self.task.cancel()


class RemoteEngine(EngineBase):
    """An ``Engine`` over a vLLM OpenAI server: the bundle's text side here, the tokens from vLLM.

    Its requests are tasks on an event loop, each a stream read as it comes over keep-alive connections
    (``_VllmClient``), never a thread per request: a stream submitted from a running event loop (``serve``'s) runs
    on that loop, so its events reach the HTTP tier without a hop between threads; one submitted from elsewhere
    (batch generation's ``generate_many``, whose caller waits) runs on the engine's own loop thread."""

    def __init__(self, model_dir: Path, config: EngineConfig, base_url: str, served_name: str,
                 api_key: str | None = None) -> None:
        super().__init__(model_dir, config)
        self.base_url = base_url.rstrip("/")
        self.served_name = served_name
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._running = False
        self._clients: dict[asyncio.AbstractEventLoop, _VllmClient] = {}
        self._own_loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._active: set[RemoteHandle] = set()
        self._counts = {"requests": 0, "tokens_generated": 0}

    def start(self) -> None:
        """Read the tokenizer and generation config.

        Raises:
            RuntimeUnavailable: tokenizers or httpx is missing.
            InvalidBundle: the tokenizer or a config is unreadable.
        """
        try:
            import httpx  # noqa: F401 - the client (_VllmClient)
            from tokenizers import Tokenizer
        except ImportError as e:
            raise NotInstalled(f"the vllm runtime needs {e.name}; {LLM_EXTRA}") from e
        self.read_bundle_text(Tokenizer)
        self._running = True

    def close(self) -> None:
        """Cancel what runs, close the connections and stop the engine's own loop. Twice is harmless."""
        with self._lock:
            self._running = False
            active = list(self._active)
            clients, self._clients = list(self._clients.items()), {}
            own, self._own_loop = self._own_loop, None
        for handle in active:
            handle.cancel()
        for loop, client in clients:
            if loop is not own and not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # closed meanwhile
                    loop.call_soon_threadsafe(client.close)
        if own is not None:  # its requests end (each says "cancelled") before it stops
            ending = [h for h in active if h.loop is own]
            own_client = dict(clients).get(own)
            with contextlib.suppress(RuntimeError, TimeoutError):
                asyncio.run_coroutine_threadsafe(_wind_down(ending, own_client), own).result(STOP_GRACE_S)
            own.call_soon_threadsafe(own.stop)

    def stats(self) -> dict[str, int]:
        """Requests in flight (``slots_busy``, as the CPU engine says it), sent so far and tokens generated."""
        with self._lock:
            return {"slots_busy": len(self._active), **self._counts}

    def _check_running(self) -> None:
        if not self._running:
            raise RuntimeError("submit() before start() or after close()")

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams,
               on_event: Callable[[TokenEvent], None]) -> RequestHandle:
        """As every engine's (``EngineBase.submit``), but called on a running event loop the request runs on that
        loop, and ``on_event`` is called there (never before ``submit`` returns)."""
        self._check_running()
        return self._send([(self.check_prompt(prompt_ids), on_event)], params, _running_loop())[0]

    def _enqueue(self, requests: list[Request], params: SamplingParams) -> list[RemoteHandle]:
        """``generate_many``'s prompts, on the engine's own loop (its caller waits for them)."""
        return self._send(requests, params, None)

    def _send(self, requests: list[Request], params: SamplingParams,
              loop: asyncio.AbstractEventLoop | None) -> list[RemoteHandle]:
        """Start each checked prompt's stream as a task on ``loop`` (None: the engine's own), which calls its
        ``on_event`` for each piece and once with a ``finish_reason`` ("cancelled" after ``cancel()``, "error"
        when vLLM fails or goes away)."""
        loop = loop or self._engine_loop()
        handles = []
        for prompt, on_event in requests:
            handle = RemoteHandle(loop)
            with self._lock:
                self._active.add(handle)
                self._counts["requests"] += 1
            if _running_loop() is loop:
                _start(handle, self._stream(handle, prompt, params, on_event))
            else:
                loop.call_soon_threadsafe(_start, handle, self._stream(handle, prompt, params, on_event))
            handles.append(handle)
        return handles

    def _engine_loop(self) -> asyncio.AbstractEventLoop:
        """The engine's own event loop, on a daemon thread started on first use."""
        with self._lock:
            if self._own_loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=_run_forever, args=(loop,), name="vllm-client", daemon=True).start()
                self._own_loop = loop
            return self._own_loop

    def _client(self, loop: asyncio.AbstractEventLoop) -> _VllmClient:
        """The client of ``loop`` (a client's connections belong to one loop); those of closed loops forgotten."""
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                self._clients = {known: c for known, c in self._clients.items() if not known.is_closed()}
                client = self._clients[loop] = _VllmClient()
            return client

    def _body(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        # vLLM takes top_p in (0, 1] only, greedy or not; top_p 0 keeps the most likely token: greedy, as on the CPU
        greedy = params.temperature == 0 or params.top_p == 0
        body: dict[str, Any] = {
            "model": self.served_name, "prompt": prompt, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            "max_tokens": min(params.max_tokens, self.config.max_context - len(prompt)),
            "temperature": 0.0 if greedy else params.temperature, "top_p": 1.0 if greedy else params.top_p,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    async def _stream(self, handle: RemoteHandle, prompt: list[int], params: SamplingParams,
                      on_event: Callable[[TokenEvent], None]) -> None:
        handle.started = True
        completion, finish, error = 0, None, None
        try:
            if handle.cancelled:
                raise asyncio.CancelledError
            client = self._client(asyncio.get_running_loop())
            status, lines = await client.stream(f"{self.base_url}/v1/completions",
                                                orjson.dumps(self._body(prompt, params)), self._headers)
            try:
                if status != 200:
                    error = f"vLLM answered {status}: {_error_message(''.join([line async for line in lines]).encode())}"
                else:
                    async for line in lines:
                        if finish is not None or not line.startswith("data: {"):
                            continue  # after the last token: read to [DONE], so that the connection is kept
                        chunk = orjson.loads(line[6:])
                        if "error" in chunk:  # vLLM failed mid-stream: its error object, then [DONE]
                            error = f"vLLM failed: {_error_message(line[6:].encode())}"
                            break
                        choices = chunk.get("choices")
                        if not choices:
                            continue
                        choice = choices[0]
                        finish = choice.get("finish_reason")
                        tokens = tuple(choice.get("token_ids") or ())
                        usage = chunk.get("usage") or {}
                        completion = int(usage.get("completion_tokens") or completion + len(tokens))
                        with self._lock:
                            self._counts["tokens_generated"] += len(tokens)
                        if finish is not None:
                            self._release(handle)  # free before its last event, as the CPU engine's slot is
                        on_event(TokenEvent(choice.get("text") or "", tokens, finish, len(prompt), completion))
            finally:
                await lines.aclose()  # read to its end: the connection goes back to the pool; else it is closed
        except asyncio.CancelledError:
            handle.cancelled = True
        except Exception as e:  # noqa: BLE001 - the stream's end says what happened
            if not handle.cancelled:
                error = f"{type(e).__name__}: {e}"
        finally:
            self._release(handle)
        if finish is not None:
            return  # its last event went out (a cancel() that came after it changes nothing)
        if handle.cancelled:
            on_event(TokenEvent("", (), "cancelled", len(prompt), completion))
        else:
            on_event(TokenEvent("", (), "error", len(prompt), completion,
                                error or "vLLM ended the stream without a finish_reason"))

    def _release(self, handle: RemoteHandle) -> None:
        """The request is over: no longer in flight, and ``cancel()`` is a no-op from now on."""
        handle.done = True
        with self._lock:
            self._active.discard(handle)


class _VllmClient:
    """httpx's async client on one event loop: keep-alive connections to vLLM (TCP_NODELAY, as anyio opens them),
    as many as there are streams (vLLM batches them all; a bound here would queue them)."""

    def __init__(self) -> None:
        import httpx

        self._client = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    async def stream(self, url: str, body: bytes, headers: dict[str, str]) -> tuple[int, AsyncGenerator[str, None]]:
        """POST ``body`` (JSON); the answer's status and its lines as they come. Closing the lines before their end
        closes the connection (vLLM then aborts the request); read to their end, it serves the next request."""
        request = self._client.build_request("POST", url, content=body,
                                             headers={**headers, "content-type": "application/json"})
        response = await self._client.send(request, stream=True)

        async def lines() -> AsyncGenerator[str, None]:
            try:
                async for line in response.aiter_lines():
                    yield line
            finally:
                await response.aclose()

        return response.status_code, lines()

    def close(self) -> None:
        """Close every connection (called on the client's loop)."""
        asyncio.ensure_future(self.aclose())

    async def aclose(self) -> None:
        """Close every connection."""
        await self._client.aclose()


async def _wind_down(handles: list[RemoteHandle], client: _VllmClient | None) -> None:
    """Wait for cancelled requests to end, then close the connections (the engine's own loop, at close; their
    tasks exist by now: each was started by a callback queued before this)."""
    await asyncio.gather(*(h.task for h in handles if h.task is not None), return_exceptions=True)
    if client is not None:
        await client.aclose()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _start(handle: RemoteHandle, stream: Coroutine[Any, Any, None]) -> None:
    """Run a request's stream as a task on the loop of this thread (its handle's)."""
    handle.task = asyncio.get_running_loop().create_task(stream)


def _run_forever(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        loop.close()


def _error_message(body: bytes) -> str:
    """The message of vLLM's error object (``{"error": {"message": ...}}``), else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return repr(body[:300])


class VllmServer:
    """vLLM's OpenAI server for one bundle, started from vLLM's own Python and kept running (see the module
    docstring): a ``shardline.processes`` child in a session of its own, so that stopping it (or SIGKILL after
    ``STOP_GRACE_S``) reaches its engine's worker processes too."""

    def __init__(self, python: str, bundle_dir: Path, served_name: str, args: Sequence[str], max_context: int,
                 start_timeout_s: float, log_file: Path) -> None:
        self.python, self.bundle_dir, self.served_name = python, bundle_dir, served_name
        self.args, self.max_context, self.start_timeout_s, self.log_file = list(args), max_context, start_timeout_s, log_file
        self.port = reserve_port()
        self.on_moved: Callable[[str], None] | None = None  # told the new URL when it starts on another port
        self.process: Child | None = None
        self._started_at = 0.0
        self._lock = threading.Lock()  # no start after stop() has begun
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self.restarts = 0

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line that starts it."""
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.bundle_dir),
                "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(self.port),
                "--max-model-len", str(self.max_context), *self.args]

    def start(self) -> None:
        """Start it and wait until ``/health`` answers 200 (``processes.start_on_port``: started again on a new port
        when another process took its port first).

        Raises:
            RuntimeUnavailable: the Python is not there, vLLM exits, or it is not healthy within the time-out
                (the message quotes its log).
        """
        if not Path(self.python).exists():
            raise RuntimeUnavailable(f"SHARDLINE_VLLM_PYTHON is {self.python!r}, which does not exist; give the Python "
                                     "of an environment where vLLM is installed, or SHARDLINE_VLLM_URL of a running server")
        try:
            start_on_port(self._spawn, _healthy, self.port, self.start_timeout_s, self._move)
        except ChildNotReady as e:
            self.stop()
            raise RuntimeUnavailable(f"{e}; check SHARDLINE_VLLM_PYTHON and SHARDLINE_VLLM_ARGS (or give it longer: "
                                     "SHARDLINE_VLLM_START_TIMEOUT_S)") from e
        self._watcher = threading.Thread(target=self._watch, name=f"vllm-{self.served_name}", daemon=True)
        self._watcher.start()

    def _move(self, port: int) -> None:
        """Another process holds its port: from now on it is on ``port`` (and requests follow it there)."""
        log.warning("vLLM for %s: another process holds port %d; it moves to port %d", self.served_name, self.port,
                    port)
        self.port = port
        if self.on_moved is not None:
            self.on_moved(self.url)

    def _spawn(self, port: int) -> Child:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeUnavailable(f"vLLM for {self.served_name} is stopping; it is not started again")
            self.port = port
            self.process = spawn(f"vLLM for {self.served_name}", self.command(), self.log_file, env=env,
                                 own_session=True)
            self._started_at = time.monotonic()
        log.info("started vLLM for %s (pid %d) on %s", self.served_name, self.process.pid, self.url)
        return self.process

    def _watch(self) -> None:
        """Start it again after each exit, after ``processes.restart_delay``'s back-off, on its port while nothing
        else holds it, else on a new one."""
        delay = 0.0
        while not self._stopping.wait(1.0):
            process = self.process
            if process is None or process.poll() is None:
                continue
            delay = restart_delay(delay, time.monotonic() - self._started_at)
            log.warning("vLLM for %s exited with %s; starting it again in %.0f s", self.served_name,
                        process.returncode, delay)
            if self._stopping.wait(delay):
                return
            port = reserve_port(prefer=self.port)
            if port != self.port:
                self._move(port)
            self.restarts += 1
            with contextlib.suppress(RuntimeUnavailable):  # stopping meanwhile
                self._spawn(port)

    def stop(self) -> None:
        """SIGTERM it, SIGKILL its session after ``STOP_GRACE_S``. Twice is harmless."""
        with self._lock:
            self._stopping.set()
            process = self.process
        if process is not None:
            process.stop(STOP_GRACE_S)
        release(self.port)


def _healthy(port: int) -> bool:
    """Whether vLLM's server on ``port`` answers ``GET /health`` with 200."""
    import httpx

    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


class VllmModel(GeneratingRuntime):
    """An ``llm`` bundle served by vLLM (see the module docstring); ``predict`` and ``engine`` as every
    ``GeneratingRuntime``'s."""

    def __init__(self, bundle_dir: Path, manifest: Manifest, options: RuntimeOptions) -> None:
        super().__init__(bundle_dir, manifest, options)
        self._server: VllmServer | None = None

    def load(self) -> None:
        """Find or start vLLM, then read the tokenizer and the generation defaults.

        Raises:
            RuntimeUnavailable: neither SHARDLINE_VLLM_URL nor SHARDLINE_VLLM_PYTHON is set, or vLLM does not start.
            InvalidBundle: a file is unreadable, or a runtime_config value is out of range.
        """
        from shardline.settings import VllmSettings

        settings = VllmSettings()
        config = EngineConfig.from_runtime_config(self.manifest.runtime_config, self.manifest.reference)
        server = None
        if settings.url:
            url = settings.url
        elif settings.python:
            server = VllmServer(settings.python, self.bundle_dir, self.manifest.name, settings.args, config.max_context,
                                settings.start_timeout_s, Path(settings.log_dir) / f"vllm-{self.manifest.name}.log")
            server.start()
            url = server.url
        else:
            raise RuntimeUnavailable(f"{self.manifest.reference} runs on vLLM, which runs in an environment of its own: "
                                     "set SHARDLINE_VLLM_URL to a running vLLM OpenAI server, or SHARDLINE_VLLM_PYTHON "
                                     "to the Python of an environment where vLLM is installed")
        engine = RemoteEngine(self.bundle_dir, config, url, self.manifest.name, settings.api_key)
        if server is not None:  # started again on another port: requests follow it there
            server.on_moved = functools.partial(setattr, engine, "base_url")
        try:
            try:
                engine.start()
            except BaseException:
                engine.close()
                raise
            self._use(engine)
        except BaseException:
            if server is not None:
                server.stop()
            raise
        self._server = server

    @property
    def device(self) -> str:
        """Where vLLM runs it: 'cuda' (vLLM's wheels are CUDA builds; a CPU build says 'cpu' through this setting)."""
        if self._engine is None:
            return "unloaded"
        from shardline.settings import VllmSettings

        return VllmSettings().device

    def close(self) -> None:
        """Close the client and stop the vLLM server this runtime started (one it found is left running)."""
        super().close()
        server, self._server = self._server, None
        if server is not None:
            server.stop()


__all__ = ["RemoteEngine", "VllmModel", "VllmServer"]
