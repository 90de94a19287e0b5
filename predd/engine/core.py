"""The engine: one step = schedule -> run -> commit -> reply.

Everything here runs on one thread (the server loop), so there are no locks. Requests
come in through `Intake` (predd/engine/intake.py: sessions, limits at the door, the
handlers, held changes); pred and generate handlers queue a Call (predd/engine/calls.py)
that the steps compute. Each step the scheduler admits and plans calls
(predd/engine/scheduler.py; what a call reserves: `Admission`, predd/engine/admission.py),
the runner computes the planned chunks (predd/worker/runner.py), completed calls are
committed to their objects, and the outputs become replies (predd/engine/outputs.py) or
a generate's next token. An answered pred's next step may be queued before it is asked
(`Continuation`, predd/engine/continuation.py); a caller may end its call between steps
(`Cancellation`, predd/engine/cancellation.py).

Failure rule: any exception of one call becomes an errno reply to that call alone (EIO
for a bug, logged), and its object is put back as it was; a batch that raises runs
again in halves until each failing chunk stands alone.
"""
from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

import symphony_protocol as p
from predd.engine import calls
from predd.engine import outputs
from predd.engine.admission import Admission
from predd.engine.calls import Call
from predd.engine.cancellation import Cancellation
from predd.engine.continuation import Continuation
from predd.engine.chunk import Chunk, chunks_for
from predd.engine.config import EngineConfig
from predd.engine.deferred import Deferred
from predd.engine.intake import Handler, Intake, Send
from predd.engine.metrics import Counters
from predd.engine.scheduler import Plan, PlanItem, Scheduler
from predd.engine.speculation import Speculation
from predd.memory.kvstore import KVStore
from predd.memory.policy import Memory
from predd.memory.pool import Pool
from predd.memory.tiers import TierStore
from predd.model.tokenizer import Tokenizer
from predd.server.capabilities import Capabilities
from predd.server.request_limits import Limits
from predd.server.quotas import Quotas
from predd.server.sessions import Sessions
from predd.worker.runner import Launch, Runner
from predd.worker.tp import RankLost


@dataclass(eq=False)
class Flight:
    """A step between `Engine.launch` and `Engine.land`: its plan, the calls whose
    chunks were built (`items`, `chunks`), its pass (`launched`; `error` where the
    launch raised), the calls answered for good (`settled`), and where the step's own
    CPU time is counted from (`cpu_at`; None while its pass runs)."""
    plan: Plan
    items: list[PlanItem] = field(default_factory=list)
    chunks: list[Chunk] = field(default_factory=list)
    launched: Launch | None = None
    error: Exception | None = None   # what the launch raised
    started: float = 0.0
    settled: set[int] = field(default_factory=set)
    failed: bool = False
    cpu_at: float | None = None      # the thread's CPU clock where the step's own work began
    done_at: float | None = None     # when `ready` first found the pass done

    def ready(self) -> bool:
        """Whether its pass is done (no pass, or one that raised, is)."""
        if self.done_at is not None:
            return True
        if self.launched is None or self.launched.ready():
            self.done_at = time.monotonic()
            return True
        return False


class Engine(Intake, Admission, Cancellation, Continuation):
    """predd's state (pool, tiers, store, capabilities, sessions, scheduler, memory
    policy) and its step loop, with the parts that use them: requests in (`Intake`),
    admission, cancellation and speculative continuation. `handlers` answer each
    request record (predd.server.handlers.HANDLERS)."""

    def __init__(self, runner: Runner, tokenizer: Tokenizer, config: EngineConfig,
                 send: Send, log: Callable[[str], None] = lambda msg: None, *,
                 handlers: Mapping[type[p.Request], Handler]) -> None:
        self.handlers = handlers
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.send = send
        self.log = log
        m = config.memory
        self.pool = Pool(runner.config.kv_pages, runner.config.page_size, m.host_pages,
                         m.disk_pages)
        self.quotas = Quotas(config.quota, sum(self.pool.capacity), config.trusted_uid)
        self.tiers = TierStore(self.pool, runner.cache, m.swap_dir)
        self.store = KVStore(self.pool, self.tiers, on_resize=self.quotas.resized)
        self.caps = Capabilities(self._free_object)
        self.sessions = Sessions(config.lease_s)
        self.scheduler = Scheduler(config.scheduler, on_leave=self._left)
        self.speculation = Speculation(config.speculate, self.scheduler, self.store)
        self._answered: list[tuple[Call, p.PredReply]] = []   # a step's pred replies
        # Replies of a device step whose next call a speculation waits for, held until the
        # next pass is launched (`release_held`), for the clients the server says
        # (`hold_for`: those whose next call it reads while a pass runs; None: none)
        self.hold_for: Callable[[bytes], bool] | None = None
        self.held: list[tuple[bytes, int, p.PredReply]] = []
        self.memory = Memory(m, self.store, self.tiers, self.scheduler.admitted,
                             lambda oid: self.quotas.charges[oid].uid)
        self.deferred = Deferred()
        self.counters = Counters()
        self.vocab: int = runner.model_config.vocab_size
        self.limits: Limits = config.limits.resolved(runner.model_config.max_position)
        self.started = time.monotonic()
        self.flying: Flight | None = None    # a step between launch and land

    # ------------------------------------------------------------ the step

    def step(self) -> bool:
        """Run one batch if any call is ready; whether one ran."""
        flight = self.launch()
        if flight is None:
            return False
        self.land(flight)
        return True

    def launch(self) -> Flight | None:
        """A step's first half: schedule a batch and start its forward pass; None when no
        call is ready. Until `land`, requests go to `handle_in_flight` alone."""
        started, cpu = time.perf_counter(), time.thread_time()
        self.speculation.before_step()
        plan = self.scheduler.schedule(self._admit)
        if not plan.items and self.speculation.drop_all:   # they held the room: again
            self.speculation.before_step()
            plan = self.scheduler.schedule(self._admit)
        self.counters.time_s["schedule"] += time.perf_counter() - started
        if not plan.items:
            self.replay_deferred(time.monotonic())
            return None
        flight = Flight(plan, cpu_at=cpu)
        self.flying = flight
        try:
            self._launch(flight)
        except RankLost:
            raise                      # not this batch's fault: predd cannot go on
        except Exception as exc:
            self._failed(flight, exc)
        self._count_cpu(flight)
        return flight

    def land(self, flight: Flight) -> None:
        """A step's second half: wait for its pass, commit what completed, reply."""
        self.flying = None
        if not flight.failed:
            try:
                self._land(flight)
            except RankLost:
                raise
            except Exception as exc:
                self._failed(flight, exc)
        self.replay_deferred(time.monotonic())
        self._count_cpu(flight)

    def _count_cpu(self, flight: Flight) -> None:
        """`step_cpu`: the thread's CPU since `flight.cpu_at` (a step's own work, never
        its pass's: the clock is read once before the pass and once after)."""
        if flight.cpu_at is not None:
            self.counters.time_s["step_cpu"] += time.thread_time() - flight.cpu_at
            flight.cpu_at = None

    def _failed(self, flight: Flight, exc: Exception) -> None:
        """A bug in the step's bookkeeping: fail what is unsettled."""
        self.log(f"step failed: {traceback.format_exc()}")
        flight.failed = True
        for item in flight.plan.items:
            if item.call.cid in flight.settled:     # answered: just out of the queue
                self.scheduler.remove(item.call)
                continue
            flight.settled.add(item.call.cid)
            self._fail(item.call, exc)

    def _launch(self, flight: Flight) -> None:
        """Build the plan's chunks and start their pass. A call whose chunk cannot be
        built fails alone; a launch that raises is run again by halves when it lands."""
        prepared = time.perf_counter()
        flight.items, flight.chunks = chunks_for(flight.plan.items, self.store,
                                                 flight.settled, self._fail)
        self.counters.time_s["prepare"] += time.perf_counter() - prepared
        self._count_cpu(flight)
        flight.started = time.monotonic()
        if flight.chunks:
            try:
                flight.launched = self.runner.launch(flight.chunks)
            except RankLost:
                raise                  # not this batch's fault: predd cannot go on
            except Exception as exc:   # run again by halves when it lands
                flight.error = exc

    def _land(self, flight: Flight) -> None:
        """Commit what completed and reply. A call that fails (building its chunk, in
        the forward pass, picking its token) fails alone; `flight.settled` collects the
        calls answered for good."""
        times, settled, items = self.counters.time_s, flight.settled, flight.items
        results = self._results(flight)
        flight.cpu_at = time.thread_time()
        # the pass's time: to when it was seen done, not to the end of the turn that saw it
        elapsed = (flight.done_at or time.monotonic()) - flight.started
        times["forward"] += elapsed
        finishing = time.perf_counter()
        ran: list[PlanItem] = []
        for item, out in zip(items, results):
            call = item.call
            if isinstance(out, Exception):
                settled.add(call.cid)
                self._fail(call, out)
                continue
            call.step_s += elapsed
            if len(out):
                call.logits.append(out)
            if item.completes and not call.speculative:   # its known tokens are all computed
                calls.commit(call, self.store, item.start + item.count)
            ran.append(item)
        ran_on = next((out for out in results if isinstance(out, torch.Tensor)), None)
        device = None if ran_on is None or ran_on.is_cpu else ran_on.device
        self.counters.batch_picks_failed += outputs.pick_tokens(
            [i.call for i in ran if i.completes], device)
        if device is not None:        # the step's logits are there: what calls keep, here
            outputs.to_host([i.call for i in ran])
        finished: set[int] = set()
        failed: set[int] = set()
        self._answered.clear()
        holding = self.hold_for is not None and device is not None and self.speculation.on
        try:
            for item in ran:
                if item.completes:
                    try:
                        if self._reply_done(item.call, holding):
                            finished.add(item.call.cid)
                    except Exception as exc:
                        failed.add(item.call.cid)
                        self._fail(item.call, exc)
            settled |= finished | failed
            ran = [i for i in ran if i.call.cid not in failed]
            self.counters.count_step([i.count for i in ran], elapsed)
            for item in ran:
                session = self.sessions.of_sid(item.call.session)
                if session is not None:
                    session.tokens_computed += item.count
            self.scheduler.update(Plan(ran), finished, time.monotonic(), elapsed)
            for call, reply in self._answered:   # out of the queue: their next steps
                self.speculate(call, reply)
        finally:
            if holding:                          # every reply built goes, now or later
                self._hold(self._answered)
        times["outputs"] += time.perf_counter() - finishing

    def _hold(self, answered: list[tuple[Call, p.PredReply]]) -> None:
        """A device step's pred replies: sent now, or held until the next pass is launched
        where a speculation waits for the call's next call (it is then taken while that
        pass runs, not before it is launched)."""
        for call, reply in answered:
            if call.oid in self.speculation.by_oid and self.hold_for(call.identity):
                self.held.append((call.identity, call.rid, reply))
            else:
                self._send_reply(call.identity, call.rid, reply)

    def release_held(self) -> None:
        """Send the replies held since the last step (`_hold`)."""
        held, self.held = self.held, []
        for identity, rid, reply in held:
            self._send_reply(identity, rid, reply)

    def _send_reply(self, identity: bytes, rid: int, reply: p.PredReply) -> None:
        """One built reply sent; a failure is logged and the rest still go."""
        try:
            self._reply(identity, rid, reply)
        except Exception as exc:
            self.log(f"reply {rid} not sent: {type(exc).__name__}: {exc}")

    def _results(self, flight: Flight) -> list[torch.Tensor | Exception]:
        """The launched pass's rows, on the device it ran on; where the launch or the
        pass failed, the chunks run again by halves (`_split`)."""
        chunks = flight.chunks
        if not chunks:
            return []
        try:
            if flight.launched is None:
                raise flight.error or RuntimeError("the step's pass was not launched")
            return self._counted(self.runner.land(flight.launched, host=False), chunks)
        except RankLost:
            raise                  # not this batch's fault: predd cannot go on
        except Exception as exc:
            return self._split(chunks, exc)

    def _execute(self, chunks: list[Chunk]) -> list[torch.Tensor | Exception]:
        """runner.execute, isolating failures: if the batch raises, its halves run
        again (bisection) until each failing chunk stands alone with its exception. The
        failed pass wrote only into the calls' own reserved slots, which the retry
        rewrites (or the failed call's undo releases)."""
        if not chunks:
            return []
        try:
            return self._counted(self.runner.execute(chunks, host=False), chunks)
        except RankLost:
            raise                  # not this batch's fault: predd cannot go on
        except Exception as exc:
            return self._split(chunks, exc)

    @staticmethod
    def _counted(results, chunks: list[Chunk]) -> list[torch.Tensor]:
        results = list(results)
        if len(results) != len(chunks):
            raise RuntimeError(f"runner returned {len(results)} results for "
                               f"{len(chunks)} chunks")
        return results

    def _split(self, chunks: list[Chunk], exc: Exception) -> list[torch.Tensor | Exception]:
        """A batch that raised `exc`: its halves run again, down to each failing chunk."""
        if len(chunks) == 1:
            return [exc]
        self.log(f"a batch of {len(chunks)} failed ({type(exc).__name__}: {exc}); "
                 "retrying it in halves")
        mid = len(chunks) // 2
        return self._execute(chunks[:mid]) + self._execute(chunks[mid:])

    def _reply_done(self, call: Call, holding: bool = False) -> bool:
        """A call's known tokens are computed: reply, or feed a generate's next token
        back (streaming it). Whether the call is done; a generate's done reply is its one
        terminal message, carrying its last token, finish_reason and cost. `holding`: a
        pred's reply is not sent here but by `_hold`, once its next step is known."""
        obj = self.store.get(call.oid)
        pages = len(obj.pages)         # the cost's (made only for a reply that carries it)
        if call.speculative:           # kept, uncommitted, for the call that takes it
            # the step's logits are not kept past the step (nor all of them by a view)
            call.logits = [] if call.picks is not None else [t.clone() for t in call.logits]
            call.parked = True
            return False
        if not call.generating:
            reply = self._pred_reply(call, pages)
            if not holding:                # else sent or held once its next step is known
                self._reply(call.identity, call.rid, reply)
            if self.speculation.on:
                self._answered.append((call, reply))
            return True
        token, logprob = outputs.next_token(call)
        call.generated.append(token)
        call.logprobs.append(logprob)
        reason = outputs.stop_reason(call, token, self.tokenizer.decode,
                                     full=obj.length + 1 > self.limits.context)
        if reason is None:
            reason = calls.extend(call, token, self.store, self.quotas, self.memory)
            if self.speculation.make_room(reason):
                reason = calls.extend(call, token, self.store, self.quotas, self.memory)
        if reason is None:
            if call.stream:
                self._reply(call.identity, call.rid,
                            p.GenerateChunk(tokens=[token], logprobs=[logprob]))
            return False
        last = slice(-1, None) if call.stream else slice(None)
        self._reply(call.identity, call.rid, p.GenerateReply(
            tokens=call.generated[last], logprobs=call.logprobs[last],
            generated=len(call.generated), finish_reason=reason, cost=call.cost(pages)))
        return True

    def _pred_reply(self, call: Call, pages: int) -> p.PredReply:
        reply = outputs.pred_reply(call, call.cost(pages))
        if isinstance(reply, p.PredLogits):
            self.counters.logits_rows["buffer" if reply.slot >= 0 else "frame"] += \
                reply.shape[0]
        return reply
