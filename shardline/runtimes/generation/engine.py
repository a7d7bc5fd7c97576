"""Text generation on CPU with continuous batching: the engine behind the ``llm`` runtime.

``GenerationEngine`` serves one causal LM bundle (a Hugging Face Llama checkpoint: ``config.json``,
``model.safetensors``, ``tokenizer.json``, optionally ``generation_config.json``) from one thread of
its own. Requests are submitted with ``submit(prompt_ids, params, on_event)`` from any thread; the
engine calls ``on_event`` from its thread with each new piece of text (a ``TokenEvent``), the last
one carrying a ``finish_reason``.

How it batches (continuous batching over a static slot cache, as vLLM does on a smaller scale):

- the K/V cache is preallocated for ``max_batch`` slots of ``max_context`` tokens each;
- a request takes a free slot (or waits in a FIFO queue), its prompt is prefilled alone, writing its
  slot, and its first token is sampled from that;
- every engine step then runs ONE decode forward for all ``max_batch`` slots at once (free slots
  compute on zeros and are ignored), attention over the whole ``max_context`` masked by each slot's
  length. Every decode step has the same shapes, so a sequence's tokens never depend on what else
  runs beside it: the same prompt and seed give the same text alone or among 15 others, bit for bit.

Text is streamed by decoding the whole completion after each token and sending what is new, holding
back the last word (a WordPiece ``##`` piece or a tokenizer's clean-up may still change it) and any
tail that could begin a stop string. The pieces of a sequence's events add up to its completion.

The bundle's text side (tokenizer, special tokens, chat template, the one prompt check) and the flow of
``submit`` and ``generate_many`` are every engine's, from ``EngineBase`` (``base.py``); this module adds
the slots, the queue, the engine thread and sampling.

Threads: ``threads`` is torch's intra-op thread count for the engine's forward passes (0 leaves
torch's default, every core). ``torch.set_num_threads`` is not per process: with torch's OpenMP
backend it sets the calling thread's pool at once and the default that threads adopt when they
first use torch, leaving threads that already did alone. The engine calls it in its own thread and
then puts the default back, so only the engine thread runs with ``threads``. One thread is the
default: on a 2-core machine a second intra-op thread made the 16-slot decode step slower.

torch, safetensors and tokenizers are imported by ``start()`` (``pip install 'shardline[llm]'``);
importing this module costs nothing.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline.errors import InferenceFailed, InvalidBundle, NotInstalled
from shardline.runtimes.generation.base import LLM_EXTRA, TOKENIZER_FILE, EngineBase, Request
from shardline.runtimes.generation.requests import EngineConfig, FinishReason, SamplingParams, TokenEvent, held_back

log = logging.getLogger(__name__)


class _Sequence:
    """One request's state; the engine thread owns it, fields marked (lock) change under the engine's lock."""

    def __init__(self, prompt: list[int], params: SamplingParams, on_event: Callable[[TokenEvent], None],
                 limit: int) -> None:
        self.prompt = prompt
        self.params = params
        self.on_event = on_event
        self.limit = limit
        self.slot: int | None = None  # (lock)
        self.cancelled = False  # (lock)
        self.done = False  # (lock)
        self.tokens: list[int] = []
        self.emitted = ""
        self.generator: Any = None

    def event(self, text: str, new: tuple[int, ...], finish: FinishReason | None,
              error: str | None = None) -> TokenEvent:
        return TokenEvent(text, new, finish, len(self.prompt), len(self.tokens), error)


class Handle:
    """A submitted request (a ``RequestHandle``): ``cancel()`` it to stop it and free its slot at once."""

    def __init__(self, engine: GenerationEngine, sequence: _Sequence) -> None:
        self._engine = engine
        self._sequence = sequence

    def cancel(self) -> None:
        """Drop the request: its slot (or queue place) is free on return, and the engine sends its
        ``on_event`` one last event with finish_reason "cancelled" at its next step. Harmless after the end."""
        self._engine._cancel(self._sequence)


def _require_packages() -> tuple[Any, Any]:
    """torch and tokenizers.Tokenizer (and safetensors, which the weights need), or NotInstalled."""
    try:
        import safetensors.torch  # noqa: F401
        import torch
        from tokenizers import Tokenizer
    except ImportError as e:
        raise NotInstalled(f"generating text needs {e.name!r} (torch, safetensors and tokenizers); "
                           f"{LLM_EXTRA}") from e
    return torch, Tokenizer


class GenerationEngine(EngineBase):
    """Generates text for many requests at once from one thread (see the module docstring); an ``Engine``.

    Args:
        model_dir: the bundle folder (``config.json``, ``model.safetensors``, ``tokenizer.json``).
        config: slots, context length and chat template.
        threads: torch intra-op threads for the engine thread; 0 leaves torch's default.
        device: where the forward passes run ('cpu', 'cuda', 'cuda:1'); sampling stays on the CPU.
    """

    def __init__(self, model_dir: Path, config: EngineConfig, threads: int = 1, device: str = "cpu") -> None:
        super().__init__(model_dir, config)
        self.threads = threads
        self.device = device  # a torch device: the weights, the slot cache and the forward passes live there
        self._wake = threading.Condition()
        self._slots: list[_Sequence | None] = [None] * config.max_batch
        self._waiting: deque[_Sequence] = deque()
        self._cancelled: list[_Sequence] = []
        self._closing = False
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._counts = {"decode_steps": 0, "prefills": 0, "tokens_generated": 0}
        self._model: Any = None
        self._torch: Any = None

    # -- lifecycle ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Load the tokenizer and weights and start the engine thread.

        Raises:
            NotInstalled: torch, safetensors or tokenizers is not installed.
            InvalidBundle: a file is missing or unreadable (the message names it), or ``max_context``
                is beyond the model's positions.
        """
        if self._thread is not None:
            raise RuntimeError("the generation engine is already started")
        torch, tokenizer_class = _require_packages()
        from shardline.runtimes.generation.llama import LlamaConfig, LlamaModel

        self._torch = torch
        self.read_bundle_text(tokenizer_class)
        model_config = LlamaConfig.read(self.model_dir)
        if self.config.max_context > model_config.max_position_embeddings:
            raise InvalidBundle(f"max_context {self.config.max_context} is beyond the "
                                f"{model_config.max_position_embeddings} positions the model in {self.model_dir} "
                                "knows; set runtime_config max_context to at most that")
        if self._tokenizer.get_vocab_size() > model_config.vocab_size:
            raise InvalidBundle(f"{TOKENIZER_FILE} has {self._tokenizer.get_vocab_size()} tokens, the model in "
                                f"{self.model_dir} only {model_config.vocab_size}; package the matching tokenizer")
        self._model = LlamaModel.load(self.model_dir, self.config.max_batch, self.config.max_context, self.device)
        self.vocab_size = model_config.vocab_size
        self._thread = threading.Thread(target=self._run, name=f"generation-{self.model_dir.name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the engine thread; requests still running or waiting get a "cancelled" event. Twice is harmless."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._model = None

    # -- requests -----------------------------------------------------------------------------------

    def _enqueue(self, requests: list[Request], params: SamplingParams) -> list[Handle]:
        """Queue checked prompts together: the engine admits them in one step (as far as slots allow)."""
        sequences = [_Sequence(prompt, params, on_event, min(params.max_tokens, self.config.max_context - len(prompt)))
                     for prompt, on_event in requests]
        with self._wake:
            self._check_running()
            self._waiting.extend(sequences)
            self._wake.notify_all()
        return [Handle(self, sequence) for sequence in sequences]

    def stats(self) -> dict[str, int]:
        """For metrics: slots (all, busy), requests waiting, decode steps, prefills and tokens generated so far."""
        with self._wake:
            busy = sum(s is not None for s in self._slots)
            return {"slots": len(self._slots), "slots_busy": busy, "waiting": len(self._waiting), **self._counts}

    def _check_running(self) -> None:
        if self._failure is not None:
            raise InferenceFailed(f"the generation engine of {self.model_dir} stopped on an error "
                                  f"({self._failure!r}); reload the model") from self._failure
        if self._thread is None or self._closing:
            raise RuntimeError("submit() before start() or after close()")

    def _cancel(self, sequence: _Sequence) -> None:
        with self._wake:
            if sequence.done or sequence.cancelled:
                return
            sequence.cancelled = True
            if sequence.slot is None:
                self._waiting.remove(sequence)
            elif self._slots[sequence.slot] is sequence:
                self._slots[sequence.slot] = None
            self._cancelled.append(sequence)
            self._wake.notify_all()

    # -- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        _pin_threads(self._torch, self.threads)
        try:
            while True:
                with self._wake:
                    while not (self._closing or self._waiting or self._cancelled or any(self._slots)):
                        self._wake.wait()
                    if self._closing:
                        break
                    cancelled, self._cancelled = self._cancelled, []
                    admitted = self._admit()
                for sequence in cancelled:
                    self._deliver(sequence, sequence.event("", (), "cancelled"))
                self._step(admitted)
        except BaseException as e:  # noqa: BLE001 - every request must hear of it
            log.exception("the generation engine of %s failed", self.model_dir)
            with self._wake:
                self._failure = e
        self._drain()

    def _admit(self) -> list[_Sequence]:
        """Move waiting requests into free slots, first come first served (under the lock)."""
        admitted = []
        for slot, taken in enumerate(self._slots):
            if not self._waiting:
                break
            if taken is None:
                sequence = self._waiting.popleft()
                sequence.slot = slot
                self._slots[slot] = sequence
                admitted.append(sequence)
        return admitted

    def _step(self, admitted: list[_Sequence]) -> None:
        """Prefill the newly admitted requests one by one, then one decode step for every slot."""
        torch = self._torch
        for sequence in admitted:
            if sequence.cancelled:
                continue
            seed = sequence.params.seed if sequence.params.seed is not None else secrets.randbits(63)
            sequence.generator = torch.Generator().manual_seed(seed % 2**64)
            logits = self._model.prefill(sequence.slot, sequence.prompt)
            self._counts["prefills"] += 1
            self._advance(sequence, logits)
        with self._wake:
            active = [(slot, s) for slot, s in enumerate(self._slots) if s is not None]
        if not active:
            return
        tokens, positions = [0] * len(self._slots), [0] * len(self._slots)
        for slot, sequence in active:
            tokens[slot] = sequence.tokens[-1]
            positions[slot] = len(sequence.prompt) + len(sequence.tokens) - 1
        logits = self._model.decode(torch.tensor(tokens), torch.tensor(positions))
        self._counts["decode_steps"] += 1
        for slot, sequence in active:
            if not sequence.cancelled:
                self._advance(sequence, logits[slot])

    def _advance(self, sequence: _Sequence, logits: Any) -> None:
        """Sample a sequence's next token, decide whether it ends, and send its event."""
        token = _sample(self._torch, logits, sequence.params, sequence.generator)
        sequence.tokens.append(token)
        self._counts["tokens_generated"] += 1
        finish: FinishReason | None = "stop" if token in self.eos_token_ids else None
        text = self.detokenize(sequence.tokens if finish is None else sequence.tokens[:-1])  # no end-of-sequence
        stops = [at for at in (text.find(s) for s in sequence.params.stop) if at >= 0]
        if stops:
            text, finish = text[:min(stops)], "stop"
        elif finish is None and len(sequence.tokens) >= sequence.limit:
            finish = "length"
        if finish is None:
            end = held_back(text, sequence.params.stop)
            piece = text[len(sequence.emitted):end] if text.startswith(sequence.emitted) else ""
        else:
            piece = text[len(sequence.emitted):] if text.startswith(sequence.emitted) else ""
            with self._wake:
                if sequence.cancelled:
                    return  # cancel() won the race: its "cancelled" event is the last
                sequence.done = True
                if sequence.slot is not None and self._slots[sequence.slot] is sequence:
                    self._slots[sequence.slot] = None
        sequence.emitted += piece
        self._deliver(sequence, sequence.event(piece, (token,), finish))

    def _deliver(self, sequence: _Sequence, event: TokenEvent) -> None:
        if sequence.cancelled and event.finish_reason != "cancelled":
            return  # cancelled while this step ran: the request hears nothing more but its end
        try:
            sequence.on_event(event)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
            log.exception("on_event of a generation request failed; cancelling the request")
            if event.finish_reason is None:
                self._cancel(sequence)

    def _drain(self) -> None:
        """End every request still queued or running (the engine is closing or failed)."""
        with self._wake:
            pending = [s for s in (*self._slots, *self._waiting) if s is not None and not (s.done or s.cancelled)]
            self._slots = [None] * len(self._slots)
            self._waiting.clear()
            cancelled, self._cancelled = self._cancelled, []
            failure = self._failure
            for sequence in pending:
                sequence.done = True
        for sequence in cancelled:
            self._deliver(sequence, sequence.event("", (), "cancelled"))
        for sequence in pending:
            if failure is None:
                self._deliver(sequence, sequence.event("", (), "cancelled"))
            else:
                self._deliver(sequence, sequence.event("", (), "error", f"{type(failure).__name__}: {failure}"))


def _sample(torch: Any, logits: Any, params: SamplingParams, generator: Any) -> int:
    """One token from one slot's logits: the most likely at temperature 0, else drawn with the slot's
    own generator from the nucleus of ``top_p``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=generator))
    ordered, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(ordered, 0) - ordered) < params.top_p
    keep[0] = True
    return int(order[torch.multinomial(ordered * keep, 1, generator=generator)])


def _pin_threads(torch: Any, threads: int) -> None:
    """Give the calling (engine) thread ``threads`` intra-op threads and leave the process default as it was."""
    if threads <= 0:
        return
    before = torch.get_num_threads()  # this thread's first use of torch: the process default
    if before == threads:
        return
    torch.set_num_threads(threads)
    restore = threading.Thread(target=torch.set_num_threads, args=(before,), name="generation-threads")
    restore.start()
    restore.join()


__all__ = ["GenerationEngine", "Handle"]
