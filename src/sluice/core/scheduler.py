"""Dispatch order inside one model's queue.

Two levels (docs/design.md, "Scheduling"):

* between priority classes, strict priority, except that a class keeps its configured minimum
  share of dispatches while classes compete, so that a low class is never starved forever;
* inside a class, start-time fair queuing (SFQ) between tenants, weighted, with jobs costed in tokens:
  a tenant that floods the queue gets ever later start tags, so another tenant's occasional request
  starts after at most about one job.

The structures here hold only ids, tenants and costs; the job records live in the broker.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClassSpec:
    """A priority class. ``min_share`` is the fraction of dispatches it keeps while others compete."""

    name: str
    min_share: float = 0.0


DEFAULT_CLASSES: tuple[ClassSpec, ...] = (
    ClassSpec("high", 0.0),
    ClassSpec("normal", 0.1),
    ClassSpec("low", 0.05),
)


@dataclass(slots=True)
class Entry:
    job_id: str
    tenant: str
    cost: int
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Backlog:
    """One tenant's queued jobs in one class, as admission reads them (``lua/admit.lua`` reads the
    same from the tenant's list and the state hash).

    Attributes:
        tenant: whose.
        jobs, tokens: how many jobs it has queued in the class, and their cost.
        tag: the start tag (virtual time) of its head job.
        head_cost, head_weight: its head job's cost and weight; the weight stands for all its jobs'
            in :func:`work_before`.
        newest_id, newest_cost: its newest job, the one that gives way when a bound is reached.
    """

    tenant: str
    jobs: int
    tokens: int
    tag: float
    head_cost: int
    head_weight: float
    newest_id: str
    newest_cost: int

    @property
    def span(self) -> float:
        """The virtual time its jobs take, one after the other (at its head job's weight)."""
        return self.tokens / self.head_weight


def work_before(b: Backlog, start: float) -> tuple[int, int]:
    """The jobs and tokens of backlog ``b`` that start before a job whose start tag is ``start``:
    those whose own start tags are lower, and its head job on a tie (it is in the heap already).

    Between its head and its tail the tags are taken as evenly spaced, so that this costs the same
    whatever the backlog's length (``admit.lua`` computes it in the same operations, for the same
    numbers): exact for jobs of one cost, and at most one job off otherwise.
    """
    if b.jobs == 0 or b.tag > start:
        return 0, 0
    if b.jobs == 1 or b.tag + b.span <= start:
        return b.jobs, b.tokens
    n = min(max(math.ceil((start - b.tag) * b.jobs / b.span - 1e-9), 1), b.jobs)
    if n == b.jobs:
        return b.jobs, b.tokens
    return n, b.head_cost + math.floor((b.tokens - b.head_cost) * (n - 1) / (b.jobs - 1) + 0.5)


@dataclass
class _Tenant:
    jobs: deque[Entry] = field(default_factory=deque)
    tag: float = 0.0  # start tag of the head job while backlogged
    #: finish tag of the job dispatched last; -inf for none yet, so that a tenant never dispatched
    #: starts at the virtual time of its push, whenever that is, as in _fairqueue.lua (no f: field:
    #: vtime). Not the virtual time when it was first seen: that goes back when a tenant passed
    #: over for its cap is popped later, and a tenant whose first jobs were all removed unstarted
    #: then started (and counted the work ahead of it) from the later time, Redis from the earlier.
    finish: float = -math.inf
    tokens: int = 0  # the cost of ``jobs``
    #: the key of its entry in ``FairQueue._drained`` (None: it has none): one entry a tenant, however
    #: often it drains while the virtual time stays behind its finish tag (a new one where its finish
    #: tag went back, a job handed back at the virtual time: the entry of the earlier key is stale)
    drained_key: float | None = None


class FairQueue:
    """Start-time fair queuing between tenants, by cost (tokens) over weight."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}
        #: the tenants of ``_tenants`` with jobs queued: those that have none stay there for their
        #: finish tag (a tenant's next start is no earlier), and every admission's look at the
        #: backlogs (:meth:`backlogs`, the claims' :meth:`has_eligible`) walks only these, not
        #: every tenant the queue has seen (bench/claim_tenants)
        self._backlogged: dict[str, _Tenant] = {}
        #: (finish tag, name) of the tenants that drained with their finish tag ahead of the virtual
        #: time, the earliest first: :meth:`forget_drained` forgets each once the virtual time has
        #: reached it. Otherwise every tenant id a queue ever saw stayed in ``_tenants`` for good.
        self._drained: list[tuple[float, str]] = []
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self.vtime = 0.0
        self.jobs = 0
        self.tokens = 0

    def __len__(self) -> int:
        return self.jobs

    def _schedule(self, name: str, t: _Tenant) -> None:
        heapq.heappush(self._heap, (t.tag, next(self._seq), name))

    def push(self, entry: Entry, *, front: bool = False) -> None:
        t = self._tenants.get(entry.tenant)
        if t is None:
            t = self._tenants[entry.tenant] = _Tenant()
        was_idle = not t.jobs
        if was_idle:
            self._backlogged[entry.tenant] = t
        if front:
            t.jobs.appendleft(entry)
            # A job handed back (lease lost, retry) has waited already: it goes next for its tenant,
            # at the current virtual time, not behind the tenant's later work.
            t.tag = self.vtime if was_idle else min(t.tag, self.vtime)
            self._schedule(entry.tenant, t)
        else:
            t.jobs.append(entry)
            if was_idle:
                t.tag = max(self.vtime, t.finish)
                self._schedule(entry.tenant, t)
        t.tokens += entry.cost
        self.jobs += 1
        self.tokens += entry.cost

    def _take_head(self, blocked: Collection[str]) -> tuple[tuple[float, int, str], _Tenant] | None:
        """Remove and return the heap item of the first tenant not in ``blocked``."""
        skipped = []
        found = None
        while self._heap:
            item = heapq.heappop(self._heap)
            t = self._tenants.get(item[2])
            if t is None or not t.jobs or t.tag != item[0]:
                continue  # stale: the tenant was re-tagged or emptied
            if item[2] in blocked:
                skipped.append(item)  # at its concurrency cap: look past it
                continue
            found = (item, t)
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def peek(self, blocked: Collection[str] = ()) -> Entry | None:
        head = self._take_head(blocked)
        if head is None:
            return None
        heapq.heappush(self._heap, head[0])  # the same item: ties keep their order
        return head[1].jobs[0]

    def has_eligible(self, blocked: Collection[str] = ()) -> bool:
        if not blocked:
            return self.jobs > 0
        return any(name not in blocked for name in self._backlogged)

    def pop(self, blocked: Collection[str] = ()) -> Entry | None:
        """The next job in fair order, passing over the tenants in ``blocked``."""
        head = self._take_head(blocked)
        if head is None:
            return None
        (_, _, name), t = head
        entry = t.jobs.popleft()
        t.tokens -= entry.cost
        self.vtime = t.tag
        t.finish = t.tag + entry.cost / entry.weight
        if t.jobs:
            t.tag = t.finish
            self._schedule(name, t)
        else:
            del self._backlogged[name]
            if t.finish <= self.vtime:
                del self._tenants[name]  # nothing to remember: max(vtime, finish) is vtime anyway
            else:
                # Kept for its finish tag, ahead of the virtual time: forgotten later, off the
                # claim's path (forget_drained, from the broker's upkeep).
                self._list_drained(name, t)
        self.jobs -= 1
        self.tokens -= entry.cost
        return entry

    def remove(self, job_id: str, tenant: str) -> Entry | None:
        t = self._tenants.get(tenant)
        if t is None:
            return None
        for entry in t.jobs:
            if entry.job_id == job_id:
                t.jobs.remove(entry)
                if not t.jobs:
                    del self._backlogged[tenant]
                    self._list_drained(tenant, t)
                t.tokens -= entry.cost
                self.jobs -= 1
                self.tokens -= entry.cost
                return entry
        return None

    def _list_drained(self, name: str, t: _Tenant) -> None:
        """An entry in ``_drained`` for ``t``, drained, unless it has one at its finish tag or earlier
        (``_Tenant.drained_key``: one entry a tenant)."""
        if t.drained_key is None or t.finish < t.drained_key:
            t.drained_key = t.finish
            heapq.heappush(self._drained, (t.finish, name))

    def forget_drained(self) -> int:
        """Forget the tenants with no jobs whose finish tag the virtual time has reached for good:
        nothing to remember, max(vtime, finish) is vtime then (a job of theirs pushed starts as a
        new tenant's would). How many went. For good: the virtual time goes back when a tenant
        passed over for its cap is popped later, to its head's tag, so only a finish at or below
        every queued tag (the heap's least, stale items too: a bound) and the virtual time is
        reached for good. An entry of ``_drained`` is checked when it comes up: the tenant may
        have jobs again (listed anew when it drains), or a later finish tag (pushed again with it).
        A tenant has one entry at most (``_Tenant.drained_key``): a floor held back by a capped
        tenant's queued head would otherwise keep one entry per drain of every other tenant."""
        floor = self.vtime
        if self._heap and self._heap[0][0] < floor:
            floor = self._heap[0][0]
        drained, tenants, gone = self._drained, self._tenants, 0
        while drained and drained[0][0] <= floor:
            key, name = heapq.heappop(drained)
            t = tenants.get(name)
            if t is None or t.drained_key != key:
                continue  # not this tenant's entry: it was forgotten since (a new record)
            t.drained_key = None
            if t.jobs:
                continue
            if t.finish <= floor:
                del tenants[name]
                gone += 1
            else:
                t.drained_key = t.finish
                heapq.heappush(drained, (t.finish, name))
        return gone

    def held_back(self, tenant: str, room: int) -> tuple[int, int]:
        """Jobs and tokens of ``tenant`` queued here beyond its first ``room`` jobs (in its order)."""
        t = self._tenants.get(tenant)
        if t is None or len(t.jobs) <= room:
            return 0, 0
        kept = sum(e.cost for e in itertools.islice(t.jobs, room))
        return len(t.jobs) - room, t.tokens - kept

    def backlogs(self) -> list[Backlog]:
        """Every tenant with jobs queued here."""
        out = []
        for name, t in self._backlogged.items():
            head, newest = t.jobs[0], t.jobs[-1]
            out.append(
                Backlog(
                    name, len(t.jobs), t.tokens, t.tag, head.cost, head.weight, newest.job_id, newest.cost
                )
            )
        return out

    def start_tag(self, tenant: str) -> float:
        """The start tag a job of ``tenant`` pushed now would get: after its queued jobs (their span
        at its head job's weight, as :func:`work_before` counts them), else the virtual time or,
        if later, the finish tag of its last dispatched job."""
        t = self._tenants.get(tenant)
        if t is None:
            return self.vtime
        if t.jobs:
            return t.tag + t.tokens / t.jobs[0].weight
        return max(self.vtime, t.finish)

    def head_tokens(self, tenant: str, n: int) -> int:
        """The cost of the first ``n`` jobs of ``tenant`` queued here."""
        t = self._tenants.get(tenant)
        return 0 if t is None else sum(e.cost for e in itertools.islice(t.jobs, n))

    def tenant_jobs(self, tenant: str) -> int:
        """How many jobs of ``tenant`` are queued here."""
        t = self._tenants.get(tenant)
        return len(t.jobs) if t is not None else 0

    def position(self, job_id: str, tenant: str) -> int | None:
        """How many jobs of this class would be dispatched before it (an estimate for clients)."""
        t = self._tenants.get(tenant)
        if t is None:
            return None
        for i, entry in enumerate(t.jobs):
            if entry.job_id == job_id:
                own_tag = t.tag + sum(e.cost / e.weight for e in itertools.islice(t.jobs, i))
                ahead = i
                for name, other in self._backlogged.items():
                    if name == tenant:
                        continue
                    tag = other.tag
                    for e in other.jobs:
                        if tag >= own_tag:
                            break
                        ahead += 1
                        tag += e.cost / e.weight
                return ahead
        return None

    def __iter__(self) -> Iterator[Entry]:
        for t in self._tenants.values():
            yield from t.jobs


@dataclass(frozen=True, slots=True)
class FairView:
    """Where the fair order would put a job of one tenant joining its class now (see
    :meth:`ClassScheduler.fair_view`).

    Attributes:
        ahead_jobs, ahead_tokens: the work that would start before it: the classes above, its own
            tenant's jobs in its class, and of every other tenant in its class the jobs whose start
            tags fall before its own (:func:`work_before`); less, everywhere, the jobs other tenants
            hold back by their concurrency caps.
        runnable_tokens: every queued job's cost, less the jobs held back by concurrency caps (its own
            tenant's too: the engine's queue, which codel reads, is not a capped tenant's backlog).
        victim: the tenant of its class with the most jobs queued there (the most tokens, then the
            greatest name, on a tie), when that is at least two more than its own tenant has there:
            the backlog that gives way when a bound is reached. None: no tenant is that much heavier.
    """

    ahead_jobs: int
    ahead_tokens: int
    runnable_tokens: int
    victim: Backlog | None


class ClassScheduler:
    """The queue of one model: its priority classes, each a :class:`FairQueue`.

    Strict priority, with credits for the minimum shares: while classes compete, every waiting class
    that is not served earns its ``min_share`` in credit; a lower class holding a whole credit is
    served next and pays one. A class with ``min_share`` 0.05 thus gets about one dispatch in twenty
    under contention, never jumps ahead before it has waited for them, and banks nothing while idle.
    """

    def __init__(self, classes: Sequence[ClassSpec] = DEFAULT_CLASSES) -> None:
        if not classes:
            raise ValueError("at least one priority class is needed")
        self.classes = list(classes)
        self.queues: dict[str, FairQueue] = {c.name: FairQueue() for c in self.classes}
        self.credit: dict[str, float] = {c.name: 0.0 for c in self.classes}

    # Loops rather than sum() over a generator: read on every admission and claim, and each of a
    # generator's steps is a call of its own.
    @property
    def jobs(self) -> int:
        total = 0
        for q in self.queues.values():
            total += q.jobs
        return total

    @property
    def tokens(self) -> int:
        total = 0
        for q in self.queues.values():
            total += q.tokens
        return total

    def push(self, cls: str, entry: Entry, *, front: bool = False) -> None:
        self.queues[cls].push(entry, front=front)

    def next_class(self, blocked: Collection[str] = ()) -> str | None:
        return self._next_of(self._waiting(blocked))

    def _waiting(self, blocked: Collection[str]) -> list[ClassSpec]:
        """The classes with a job that may start (of a tenant not in ``blocked``), highest first."""
        return [c for c in self.classes if self.queues[c.name].has_eligible(blocked)]

    def _next_of(self, waiting: list[ClassSpec]) -> str | None:
        """The class served next of the ``waiting`` ones: the first, unless a lower one is due."""
        if not waiting:
            return None
        due = [c for c in waiting[1:] if self.credit[c.name] >= 1.0]
        if due:
            return max(due, key=lambda c: self.credit[c.name]).name
        return waiting[0].name

    def pop(self, blocked: Collection[str] = ()) -> tuple[str, Entry] | None:
        """The next job of the model; tenants in ``blocked`` (at their concurrency cap) wait."""
        waiting = self._waiting(blocked)  # once: the choice and the credits read the same
        cls = self._next_of(waiting)
        if cls is None:
            return None
        entry = self.queues[cls].pop(blocked)
        assert entry is not None
        if self.credit[cls] >= 1.0:
            self.credit[cls] -= 1.0
        for c in waiting:
            if c.name != cls:
                self.credit[c.name] += c.min_share
        for c in self.classes:
            if not self.queues[c.name].jobs:
                self.credit[c.name] = 0.0
        return cls, entry

    def remove(self, cls: str, job_id: str, tenant: str) -> Entry | None:
        return self.queues[cls].remove(job_id, tenant)

    def forget_drained(self) -> int:
        """:meth:`FairQueue.forget_drained` of every class: how many tenants went."""
        gone = 0
        for q in self.queues.values():
            gone += q.forget_drained()
        return gone

    def ahead(self, cls: str) -> tuple[int, int]:
        """Jobs and tokens queued in ``cls`` and every class above it."""
        jobs = tokens = 0
        for c in self.classes:
            q = self.queues[c.name]
            jobs += q.jobs
            tokens += q.tokens
            if c.name == cls:
                break
        return jobs, tokens

    def held_back(self, tenant: str, room: int) -> list[tuple[int, int]]:
        """Per class, highest first: the jobs and tokens of ``tenant`` that wait for its concurrency
        cap rather than for the queue, those beyond the first ``room`` it may start (its higher
        classes first, its own order inside a class). They are not ahead of another tenant's job:
        however long they wait, they cannot take the slots that job would run on (admit.lua
        mirrors this in its ahead counts)."""
        out = []
        for c in self.classes:
            q = self.queues[c.name]
            n = q.tenant_jobs(tenant)
            out.append(q.held_back(tenant, room))
            room = max(room - n, 0)
        return out

    def fair_view(self, cls: str, tenant: str, rooms: Mapping[str, int]) -> FairView:
        """The work ahead of a job of ``tenant`` joining class ``cls`` now, in the fair order.

        ``rooms``: for each tenant that holds jobs back by its concurrency cap (more queued and
        running than its cap), how many more it may start; its jobs beyond those, in
        :meth:`held_back`'s order, are ahead of nobody else's. A light tenant's job lands near the
        head of its class, whatever a heavy one has queued: only that backlog's head, and what it
        has queued within the light tenant's share, is ahead of it.
        """
        runnable = self.tokens
        ahead_jobs = ahead_tokens = 0
        for c in self.classes:
            if c.name == cls:
                break
            ahead_jobs += self.queues[c.name].jobs
            ahead_tokens += self.queues[c.name].tokens
        held: dict[str, int] = {}  # of each capped tenant: its jobs in cls held back
        for name, room in rooms.items():
            above = True
            for c, (jobs, tokens) in zip(self.classes, self.held_back(name, room), strict=True):
                # Held back, a job is not in front of the engine, whoever's it is: the queue's delay
                # leaves it out. A tenant's own jobs are still all ahead of its next one.
                runnable -= tokens
                if name == tenant:
                    continue
                if c.name == cls:
                    above = False
                    held[name] = jobs
                elif above:
                    ahead_jobs, ahead_tokens = ahead_jobs - jobs, ahead_tokens - tokens
        q = self.queues[cls]
        start = q.start_tag(tenant)
        own = 0
        victim: Backlog | None = None
        for b in q.backlogs():
            if b.tenant == tenant:
                own = b.jobs
                ahead_jobs, ahead_tokens = ahead_jobs + b.jobs, ahead_tokens + b.tokens
                continue
            jobs, tokens = work_before(b, start)
            kept = b.jobs - held.get(b.tenant, 0)
            if kept < jobs:  # it may start only its first `kept`: FairQueue.held_back's count
                jobs, tokens = kept, q.head_tokens(b.tenant, kept)
            ahead_jobs, ahead_tokens = ahead_jobs + jobs, ahead_tokens + tokens
            if victim is None or (b.jobs, b.tokens, b.tenant) > (victim.jobs, victim.tokens, victim.tenant):
                victim = b
        if victim is not None and victim.jobs < own + 2:
            victim = None
        return FairView(ahead_jobs, ahead_tokens, runnable, victim)

    def position(self, cls: str, job_id: str, tenant: str) -> int | None:
        own = self.queues[cls].position(job_id, tenant)
        if own is None:
            return None
        above = 0
        for c in self.classes:
            if c.name == cls:
                break
            above += self.queues[c.name].jobs
        return above + own
