"""A step-driven model of a continuous-batching inference engine (vLLM-like), with no I/O.

The model is what ``sluice sim`` serves over HTTP, and what tests drive directly with a stepped
clock. Time enters only as arguments: the caller asks for the next step's duration, lets that much
time pass (or pretends to), then applies the step.

One engine step emits one token for every running sequence and takes::

    base_step_s + per_seq_s * running + prefill_s_per_token * (prefill tokens admitted this step)

At most ``max_num_seqs`` sequences run at once; the rest wait in an unbounded FCFS queue, as in
vLLM's default scheduler. Every running sequence holds ``prompt + generated`` tokens of KV cache;
when the next step would not fit in ``kv_cache_tokens``, the most recently admitted sequence is
preempted by recompute: it goes back to the front of the waiting queue, keeps the tokens it has
already produced, and pays prefill for ``prompt + generated`` tokens when readmitted.

With ``prefix_cache_tokens`` > 0 the engine keeps an LRU cache of prompt blocks (vLLM's automatic
prefix caching): a request's prompt is a chain of ``prefix_block_tokens``-token blocks, each named
by a hash of itself and every block before it (:func:`prefix_blocks`); at admission the leading
blocks found in the cache are not prefilled (at least the last prompt token always is), and the
request's blocks go into the cache, the first block most recently used, so that eviction eats
chains from their tails as vLLM's free-block queue does.

Capacity in steady state, with every slot busy (S = effective slots, N = completion tokens,
P = prompt tokens): each sequence stays in the batch for exactly N steps, so S requests finish
every N steps, and those N steps also carry the prefill of the S requests that replace them::

    capacity_rps = S / (N * (base_step_s + per_seq_s * S) + S * prefill_s_per_token * P)
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

from sluice.core import cost

__all__ = [
    "PRESETS",
    "PRESET_NOTES",
    "REFERENCE_COMPLETION_TOKENS",
    "REFERENCE_PROMPT_TOKENS",
    "BatchModel",
    "BatchStats",
    "PrefixCache",
    "RequestState",
    "SimParams",
    "SimRequest",
    "StepResult",
    "capacity_rps",
    "estimate_chat_tokens",
    "estimate_text_tokens",
    "lone_latency_s",
    "prefix_blocks",
    "prefix_blocks_of_chat",
    "preset",
    "step_duration_s",
    "token_text",
]

# The shapes that capacity figures are quoted for (in --help, on start, in docs/sim.md).
REFERENCE_COMPLETION_TOKENS = 128
REFERENCE_PROMPT_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SimParams:
    """Everything the simulator needs: the engine's timing and memory, and the server's knobs.

    ``model`` and the fault-injection fields (``fail_first``, ``error_rate``, ``stall_after``,
    ``seed``) are applied by the HTTP server, not by :class:`BatchModel`; they live here so that one
    frozen value describes a whole simulator.

    ``prefix_cache_tokens`` is the prefix cache's size in tokens (0, the default: no prefix cache,
    every prompt prefilled in full); ``prefix_block_tokens`` the size of one cached block (vLLM's
    default block size, 16).
    """

    max_num_seqs: int = 16
    base_step_s: float = 0.016
    per_seq_s: float = 0.000415
    prefill_s_per_token: float = 0.00002
    kv_cache_tokens: int = 1_600_000
    max_model_len: int = 32_768
    default_max_tokens: int = 128
    model: str = "sim"
    fail_first: int = 0
    error_rate: float = 0.0
    stall_after: int | None = None
    seed: int = 0
    prefix_cache_tokens: int = 0
    prefix_block_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if min(self.base_step_s, self.per_seq_s, self.prefill_s_per_token) < 0:
            raise ValueError("step timings must not be negative")
        if self.base_step_s + self.per_seq_s <= 0:
            # A zero-length step would let the server spin without ever yielding time.
            raise ValueError("base_step_s + per_seq_s must be positive")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2")
        if self.kv_cache_tokens < self.max_model_len:
            # Otherwise a lone request could need more cache than exists and never be admitted.
            raise ValueError("kv_cache_tokens must be at least max_model_len")
        if self.default_max_tokens < 1:
            raise ValueError("default_max_tokens must be at least 1")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.fail_first < 0:
            raise ValueError("fail_first must not be negative")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be between 0 and 1")
        if self.stall_after is not None and self.stall_after < 0:
            raise ValueError("stall_after must not be negative")
        if self.prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must not be negative")
        if self.prefix_block_tokens < 1:
            raise ValueError("prefix_block_tokens must be at least 1")


_ARTICLE = SimParams()

PRESETS: Mapping[str, SimParams] = MappingProxyType(
    {
        "article": _ARTICLE,
        # 100x faster in every timing, same shape: a 128-token answer takes about 21 ms.
        "fast": replace(_ARTICLE, base_step_s=0.00016, per_seq_s=0.00000415, prefill_s_per_token=0.0000002),
        "llama-cpu": SimParams(
            max_num_seqs=4,
            base_step_s=0.0016,
            per_seq_s=0.0041,
            prefill_s_per_token=0.0001,
            kv_cache_tokens=8192,
            max_model_len=2048,
        ),
    }
)

PRESET_NOTES: Mapping[str, str] = MappingProxyType(
    {
        "article": "the article's engine: vLLM, 0.5B model, one 24 GB GPU (16 seqs, ~2.1 s per lone answer)",
        "fast": "the article's shape 100x faster, for tests (~21 ms per lone 128-token answer)",
        "llama-cpu": "llama-server -np 4 on 2 CPU cores (~175 tok/s alone, ~56 tok/s per stream at 4)",
    }
)


def preset(name: str, **overrides: Any) -> SimParams:
    """The named preset, with any :class:`SimParams` fields replaced; ``KeyError`` if unknown."""
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    known = {f.name for f in fields(SimParams)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"unknown SimParams fields: {', '.join(sorted(unknown))}")
    return replace(PRESETS[name], **overrides)


def step_duration_s(params: SimParams, running: int, prefill_tokens: int) -> float:
    return params.base_step_s + params.per_seq_s * running + params.prefill_s_per_token * prefill_tokens


def capacity_rps(
    params: SimParams,
    completion_tokens: int = REFERENCE_COMPLETION_TOKENS,
    prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
) -> float:
    """Requests per second finished with every slot busy (see the module docstring).

    Slots are capped by the KV cache too, counting each sequence at its final size; that is a
    lower bound of how many fit, since sequences start small.
    """
    per_request_kv = prompt_tokens + completion_tokens
    slots = max(1, min(params.max_num_seqs, params.kv_cache_tokens // per_request_kv))
    cycle_s = completion_tokens * (params.base_step_s + params.per_seq_s * slots)
    cycle_s += slots * params.prefill_s_per_token * prompt_tokens
    return slots / cycle_s


def lone_latency_s(
    params: SimParams,
    completion_tokens: int = REFERENCE_COMPLETION_TOKENS,
    prompt_tokens: int = REFERENCE_PROMPT_TOKENS,
) -> float:
    """End-to-end time of one request on an otherwise idle engine."""
    return completion_tokens * step_duration_s(params, 1, 0) + params.prefill_s_per_token * prompt_tokens


# The simulated engine counts prompts by the gateway's rule (sluice.core.cost): one rule, not two
# that drift apart. The server hands over each message's text (parts joined), not the message.


def estimate_text_tokens(text: str) -> int:
    """Prompt tokens of a completion's text: the gateway's estimate, about four characters a token."""
    return cost.estimate_prompt_tokens(text)


def estimate_chat_tokens(contents: Sequence[str]) -> int:
    """Prompt tokens of a chat whose messages hold these texts: the gateway's estimate of it."""
    return cost.estimate_chat_tokens([{"role": "user", "content": c} for c in contents])


def token_text(index: int) -> str:
    """The text of the ``index``-th generated token (0-based): short, distinct, and countable."""
    return f" tok{index}"


#: Characters of text per estimated token (the estimate of :mod:`sluice.core.cost`).
CHARS_PER_TOKEN = 4


def _chain(pieces: Sequence[bytes]) -> tuple[int, ...]:
    """Each piece's hash chained with all before it: equal hashes mean equal prefixes."""
    out: list[int] = []
    h = b""
    for piece in pieces:
        h = hashlib.blake2b(h + piece, digest_size=8).digest()
        out.append(int.from_bytes(h, "big"))
    return tuple(out)


def prefix_blocks(prompt: str | Sequence[int], prompt_tokens: int, block_tokens: int = 16) -> tuple[int, ...]:
    """The chained hashes of a prompt's full blocks of ``block_tokens`` tokens.

    A token-id prompt is cut into blocks of ids. A text prompt has no real tokens here, so it is
    cut at ``block_tokens x`` :data:`CHARS_PER_TOKEN` characters (the estimate's four characters a
    token): two texts share their first k blocks exactly when they share their first
    ``64 k`` characters (16-token blocks). Never more blocks than ``prompt_tokens`` fills.
    """
    limit = prompt_tokens // block_tokens
    if isinstance(prompt, str):
        width = block_tokens * CHARS_PER_TOKEN
        count = min(len(prompt) // width, limit)
        return _chain([prompt[i * width : (i + 1) * width].encode() for i in range(count)])
    count = min(len(prompt) // block_tokens, limit)
    ids = list(prompt)
    return _chain(
        [",".join(map(str, ids[i * block_tokens : (i + 1) * block_tokens])).encode() for i in range(count)]
    )


def prefix_blocks_of_chat(
    messages: Sequence[tuple[str, str]], prompt_tokens: int, block_tokens: int = 16
) -> tuple[int, ...]:
    """The chained block hashes of a chat given as (role, text) pairs.

    The chat is laid out as one text, each message a 16-character role header (the estimate counts
    4 tokens a message for it) followed by its text, as a chat template would, and cut as
    :func:`prefix_blocks` cuts a text; a conversation that grows by messages keeps its blocks.
    """
    text = "".join(f"<|{role[:11]}|>".ljust(16, "_") + content for role, content in messages)
    return prefix_blocks(text, prompt_tokens, block_tokens)


class PrefixCache:
    """An LRU set of cached block hashes, holding at most ``capacity_tokens // block_tokens``.

    Attributes:
        capacity_blocks: blocks it holds at most (0: the cache is off).
        block_tokens: tokens per block.
    """

    def __init__(self, capacity_tokens: int, block_tokens: int = 16) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def cached_blocks(self, blocks: Sequence[int]) -> int:
        """How many of the leading blocks are cached (a chain stops at its first miss)."""
        n = 0
        for b in blocks:
            if b not in self._blocks:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int]) -> None:
        """Put (or refresh) the blocks, the first one most recently used, evicting the least."""
        if self.capacity_blocks <= 0:
            return
        for b in reversed(blocks[: self.capacity_blocks]):
            self._blocks[b] = None
            self._blocks.move_to_end(b)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


class RequestState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One request inside the engine; the handle :meth:`BatchModel.submit` returns.

    ``generated`` only grows: tokens survive preemption, so whoever relays them can send
    ``token_text(i)`` for every ``i < generated`` as soon as it is counted. ``blocks`` are the
    prompt's chained block hashes (:func:`prefix_blocks`; empty: nothing to cache) and
    ``cached_tokens`` the prompt tokens its first admission found in the prefix cache.
    """

    request_id: str
    prompt_tokens: int
    max_tokens: int
    arrival: float
    state: RequestState = RequestState.WAITING
    generated: int = 0
    preemptions: int = 0
    admitted_once: bool = False
    first_token_at: float | None = None
    finished_at: float | None = None
    blocks: tuple[int, ...] = ()
    cached_tokens: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.prompt_tokens + self.generated

    @property
    def done(self) -> bool:
        return self.state in (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(frozen=True, slots=True)
class StepResult:
    duration: float
    emitted: tuple[SimRequest, ...]
    finished: tuple[SimRequest, ...]
    admitted: tuple[SimRequest, ...]
    preempted: tuple[SimRequest, ...]


@dataclass(slots=True)
class BatchStats:
    """Counters since the engine was created, named after the vLLM metrics they feed."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    recomputed_prefill_tokens_total: int = 0
    preemptions_total: int = 0
    finished_total: int = 0
    aborted_total: int = 0
    wasted_generation_tokens_total: int = 0
    steps_total: int = 0
    busy_s_total: float = 0.0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0


@dataclass(slots=True)
class _Plan:
    batch: list[SimRequest]
    admitted: list[SimRequest]
    preempted: list[SimRequest]
    duration: float


class BatchModel:
    """The scheduler and its state; single-threaded, driven by :meth:`next_step_duration` and
    :meth:`step`.

    A step's batch is fixed when it is planned (by ``next_step_duration`` or ``step``), as a GPU
    step's batch is fixed when it is launched: requests submitted afterwards wait for the next
    step, and requests aborted afterwards simply emit nothing when the step completes.
    """

    def __init__(self, params: SimParams) -> None:
        self.params = params
        self.stats = BatchStats()
        self._running: list[SimRequest] = []  # in admission order
        self._waiting: deque[SimRequest] = deque()
        self._live: dict[str, SimRequest] = {}  # waiting or running, by id
        self._kv_used = 0
        self._plan: _Plan | None = None
        self.prefix_cache = PrefixCache(params.prefix_cache_tokens, params.prefix_block_tokens)

    def submit(
        self,
        request_id: str,
        prompt_tokens: int,
        max_tokens: int,
        now: float,
        blocks: Sequence[int] = (),
    ) -> SimRequest:
        """Queue a request at the back of the waiting queue; ``ValueError`` if it can never fit.

        ``blocks``: the prompt's chained block hashes, for the prefix cache (if it is on)."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already in the engine")
        if prompt_tokens < 1 or max_tokens < 1:
            raise ValueError("prompt_tokens and max_tokens must be at least 1")
        if prompt_tokens + max_tokens > self.params.max_model_len:
            raise ValueError(
                f"prompt_tokens + max_tokens = {prompt_tokens + max_tokens} exceeds "
                f"max_model_len {self.params.max_model_len}"
            )
        req = SimRequest(request_id, prompt_tokens, max_tokens, arrival=now, blocks=tuple(blocks))
        self._live[request_id] = req
        self._waiting.append(req)
        return req

    def abort(self, request_id: str, now: float) -> bool:
        """Remove a waiting or running request at once; its tokens so far count as wasted."""
        req = self._live.pop(request_id, None)
        if req is None:
            return False
        if req.state is RequestState.RUNNING:
            self._running.remove(req)
            self._kv_used -= req.kv_tokens
        else:
            self._waiting.remove(req)
        req.state = RequestState.ABORTED
        req.finished_at = now
        self.stats.aborted_total += 1
        self.stats.wasted_generation_tokens_total += req.generated
        return True

    def get(self, request_id: str) -> SimRequest | None:
        return self._live.get(request_id)

    @property
    def running(self) -> tuple[SimRequest, ...]:
        """Running requests in admission order (the last one is the next preemption victim)."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[SimRequest, ...]:
        """Waiting requests in the order they will be admitted."""
        return tuple(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_tokens_used(self) -> int:
        return self._kv_used

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV cache held, 0..1 (vLLM's ``gpu_cache_usage_perc`` is a fraction too)."""
        return self._kv_used / self.params.kv_cache_tokens

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def next_step_duration(self) -> float | None:
        """Plan the next step (admissions, preemptions) and return its duration; None when idle.

        Calling it again before :meth:`step` returns the same plan's duration.
        """
        plan = self._planned()
        return None if plan is None else plan.duration

    def step(self, now: float) -> StepResult:
        """Complete the planned step (planning it first if needed), as of time ``now``."""
        plan = self._planned()
        if plan is None:
            return StepResult(0.0, (), (), (), ())
        self._plan = None
        emitted: list[SimRequest] = []
        finished: list[SimRequest] = []
        for req in plan.batch:
            if req.state is not RequestState.RUNNING:
                continue  # aborted while the step ran
            req.generated += 1
            self._kv_used += 1
            emitted.append(req)
            if req.first_token_at is None:
                req.first_token_at = now
            if req.generated >= req.max_tokens:
                finished.append(req)
        for req in finished:
            self._running.remove(req)
            self._kv_used -= req.kv_tokens
            del self._live[req.request_id]
            req.state = RequestState.FINISHED
            req.finished_at = now
        self.stats.generation_tokens_total += len(emitted)
        self.stats.finished_total += len(finished)
        self.stats.steps_total += 1
        self.stats.busy_s_total += plan.duration
        return StepResult(
            plan.duration, tuple(emitted), tuple(finished), tuple(plan.admitted), tuple(plan.preempted)
        )

    def _planned(self) -> _Plan | None:
        if self._plan is None and self.has_work():
            self._plan = self._schedule()
        return self._plan

    def _schedule(self) -> _Plan:
        budget = self.params.kv_cache_tokens
        preempted: list[SimRequest] = []
        # Each running sequence stores one more token's KV this step.
        while len(self._running) > 1 and self._kv_used + len(self._running) > budget:
            victim = self._running.pop()
            self._kv_used -= victim.kv_tokens
            victim.state = RequestState.WAITING
            victim.preemptions += 1
            # Front of the queue, so it is readmitted before anything that arrived after it.
            self._waiting.appendleft(victim)
            preempted.append(victim)
        self.stats.preemptions_total += len(preempted)

        admitted: list[SimRequest] = []
        prefill_tokens = 0
        # Like vLLM, admit nothing in a step that had to preempt: memory is already short.
        while not preempted and self._waiting and len(self._running) < self.params.max_num_seqs:
            head = self._waiting[0]
            # Strict FCFS: if the head does not fit, nobody behind it jumps the queue.
            if self._kv_used + len(self._running) + head.kv_tokens + 1 > budget:
                break
            self._waiting.popleft()
            head.state = RequestState.RUNNING
            self._running.append(head)
            self._kv_used += head.kv_tokens
            cached = self._cached_prefix(head)
            prefill_tokens += head.kv_tokens - cached
            if head.admitted_once:
                self.stats.recomputed_prefill_tokens_total += head.kv_tokens - cached
            else:
                head.admitted_once = True
                head.cached_tokens = cached
                self.stats.prompt_tokens_total += head.prompt_tokens
                if self.prefix_cache.capacity_blocks > 0:
                    self.stats.prefix_cache_queries_total += head.prompt_tokens
                    self.stats.prefix_cache_hits_total += cached
            admitted.append(head)

        # The invariants above guarantee a lone request always fits, so work means a batch.
        assert self._running, "engine has waiting work but could schedule nothing"
        duration = step_duration_s(self.params, len(self._running), prefill_tokens)
        return _Plan(list(self._running), admitted, preempted, duration)

    def _cached_prefix(self, req: SimRequest) -> int:
        """Prompt tokens of ``req`` that the prefix cache spares from prefill; then caches its
        blocks (they are computed in this step, and shared by whatever comes after)."""
        cache = self.prefix_cache
        if cache.capacity_blocks <= 0 or not req.blocks:
            return 0
        hit = cache.cached_blocks(req.blocks)
        cache.insert(req.blocks)
        # Like vLLM, the last prompt token is always computed: its logits give the first token.
        return min(hit * cache.block_tokens, req.prompt_tokens - 1)
