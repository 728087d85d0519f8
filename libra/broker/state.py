"""``BrokerState``: the broker's pure core. ``handle(event, now) -> list[Command]``.

No sockets, threads, clocks or logging side effects: time comes in as ``now`` (monotonic seconds) and
everything the broker wants done comes out as :class:`~libra.broker.events.Send` commands. The same
object runs inside the ZeroMQ shell (``server.py``), under the unit tests, and inside the simulator.

What it keeps:
- the actor registry (one session per connected actor socket) with capabilities, the kinds each accepts
  now, its capacity and the work it holds; liveness after 7/MDP (any frame is a heartbeat; dead after
  ``liveness`` silent intervals);
- one FIFO queue per ``(kind, name)``; bids are matched to queued work, least-loaded actor first;
- every accepted request as a :class:`~libra.broker.work.Work` with ``work_id``, ``lease``, ``attempt``.
  Work held by a dead actor, or whose lease expired, is re-queued (up to ``max_retries`` losses, then it
  fails with ``retries_exhausted``); a result carrying a stale lease is dropped. Each accepted request
  gets exactly one Reply; a resubmitted ``request_id`` is answered from the record, never run twice.
- directives: an actor told to accept other kinds gets no new work until it has drained and bid again.

Mutation rule: state changes only inside ``handle`` (and ``direct``, the planner's entry point).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict, deque
from typing import Any

from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode, ProtocolCode

from libra.policies.routing.interface import BucketSpec

from . import views
from . import jobs, journal, planning
from .actions import ActionPlacement, schedule_actions
from .events import BadFrame, Command, Event, Journal, PeerMessage, PlannerDone, Send, Tick
from .planner_loop import PlannerLoop, PlannerSettings
from .pools import GpuSlot, PlanApplier
from .rollout import RolloutRouting, route_generate
from .sessions import ActorSession, BrokerConfig, ClientSession
from .work import Work, WorkState


class BrokerState:
    """The broker core. See the module docstring for the contract."""

    def __init__(self, config: BrokerConfig | None = None) -> None:
        self.config = config or BrokerConfig()
        try:
            buckets = [BucketSpec(**b) for b in self.config.buckets]
        except TypeError as exc:
            raise ValueError(f"bad bucket in broker config (need name, tp, max_tokens): {exc}") from None
        self.rollout = RolloutRouting(self.config.router, buckets, self.config.router_params)
        self.actions = (ActionPlacement(self.config.action_scheduler, self.config.action_scheduler_params,
                                        self.config.tools) if self.config.action_scheduler else None)
        self.actors: dict[bytes, ActorSession] = {}
        self.clients: dict[bytes, ClientSession] = {}
        self.works: dict[str, Work] = {}
        self.queues: dict[tuple[str, str], deque[str]] = {}
        self._by_request: dict[tuple[str, str], str] = {}
        self._replies: OrderedDict[tuple[str, str], m.Reply] = OrderedDict()
        self._deadlines: list[tuple[float, int, str]] = []  # lazy deletion; compacted when mostly stale
        self._offers: dict[str, frozenset[str]] = {}  # kind -> names offered by live actors
        self._leases: list[tuple[float, int, str]] = []
        self._work_ids = itertools.count(1)
        self._leases_seq = itertools.count(1)
        self._seq = itertools.count(1)
        self._directives = itertools.count(1)
        self._sessions = itertools.count(1)
        self.plan_applier: PlanApplier | None = None
        self.planner = PlannerLoop(PlannerSettings.from_dict(self.config.planner)) if self.config.planner else None
        #: False: a planning round searches inline; True (the server): the round's search is left in
        #: ``planner.job`` for the shell to run off the loop and hand back as a ``PlannerDone`` event.
        self.planner_offload = False
        self.journaling = False  # the shell turns this on and drains ``journal_out`` after every event
        self.journal_out: list[Journal] = []
        self._plan_generation = 0
        self.jobs: dict[str, Any] = {}  # name -> libra.broker.job.JobHost
        self.jobs_dirty = False
        self.job_replies: list[tuple[str, str, m.Reply]] = []
        self.job_weights: dict[str, Any] | None = None  # newest weights a job published (see _assign)
        self.stats: dict[str, int] = dict.fromkeys(
            ("submitted", "completed", "failed", "requeued", "stale_results", "bad_frames", "timeouts",
             "unknown_tool", "busy", "duplicates", "actors_expired", "handbacks"),
            0,
        )
        self._handlers = {
            m.ActorHello: self._on_actor_hello,
            m.ClientHello: self._on_client_hello,
            m.Heartbeat: self._on_heartbeat,
            m.Bid: self._on_bid,
            m.Submit: self._on_submit,
            m.WorkResult: self._on_result,
            m.Handback: self._on_handback,
            m.DirectiveDone: self._on_directive_done,
            m.StatusRequest: self._on_status,
            m.CancelRequest: self._on_cancel,
            m.Goodbye: self._on_goodbye,
            m.DirectRequest: self._on_direct_request,
            m.EndTrajectory: self._on_end_trajectory,
            m.JobSubmit: self._on_job_submit,
            m.JobPoll: self._on_job_poll,
        }

    # ------------------------------------------------------------------ entry points
    def handle(self, event: Event, now: float) -> list[Command]:
        """Apply one event; return what to send. Never raises for bad peer input."""
        if type(event) is PeerMessage:
            handler = self._handlers.get(type(event.msg))
            out: list[Command] = []
            if handler is None:  # a broker→peer message sent to the broker: unexpected
                return self._reject(event.peer, ProtocolCode.UNEXPECTED,
                                    f"{type(event.msg).__name__} is not accepted by the broker")
            sess = self.actors.get(event.peer)
            if sess is not None:
                sess.last_seen = now
            else:
                cs = self.clients.get(event.peer)
                if cs is not None:
                    cs.last_seen = now
            handler(event.peer, event.msg, now, out)
            if self.jobs_dirty:
                jobs.pump(self, now, out)
            return out
        if type(event) is Tick:
            out = self._on_tick(now)
            if self.jobs_dirty:
                jobs.pump(self, now, out)
            return out
        if type(event) is PlannerDone:
            return planning.plan_done(self, event.job, now)
        if type(event) is BadFrame:
            self.stats["bad_frames"] += 1
            if event.peer in self.actors or event.peer in self.clients:
                return [Send(event.peer, m.Error(event.error.code.value, event.error.message))]
            return []  # a peer that never said hello gets nothing (7/MDP: treat as invalid)
        raise TypeError(f"unknown event {event!r}")

    def direct(self, actor_id: str, kinds: list[str], now: float, mode: str = "finish",
               config: dict[str, Any] | None = None) -> tuple[int, list[Command]]:
        """Tell actor ``actor_id`` to accept ``kinds`` from now on (the planner's entry point).

        The actor gets no new work until it has drained (``finish``: runs what it holds;
        ``handback``: returns unstarted work) and bid again. Returns (directive id, commands).
        Raises KeyError for an unknown actor and ValueError for a bad mode or kind.
        """
        if mode not in ("finish", "handback"):
            raise ValueError(f"directive mode must be 'finish' or 'handback', got {mode!r}")
        bad = [k for k in kinds if k not in m.WORK_KINDS]
        if bad:
            raise ValueError(f"unknown work kind(s) {bad} (known: {', '.join(m.WORK_KINDS)})")
        sess = self._actor_by_id(actor_id)
        if sess is None:
            raise KeyError(f"no live actor with id {actor_id!r}")
        did = next(self._directives)
        sess.directive = did
        sess.directive_config = dict(config or {})
        sess.last_sent = now
        return did, [Send(sess.peer, m.Directive(did, list(kinds), mode, dict(config or {})))]

    def gpu_slots(self) -> list[GpuSlot]:
        """The connected GPU actors as plan slots (labels ``slot_kind == "gpu"``, slot ``gpuN``)."""
        return planning.gpu_slots(self)

    def apply_plan(self, plan: Any, now: float) -> list[Command]:
        """Move GPU actors to the roles of ``plan`` without stopping anything (see ``planning.apply_plan``)."""
        return planning.apply_plan(self, plan, now)

    # ------------------------------------------------------------------ sessions
    def _on_actor_hello(self, peer: bytes, msg: m.ActorHello, now: float, out: list[Command]) -> None:
        if peer in self.actors or peer in self.clients:
            self._drop_session(peer, now, out, "second hello on one socket")
            out.append(Send(peer, m.Disconnect("protocol violation: second hello on one socket")))
            return
        if msg.capacity < 0:
            out.append(Send(peer, m.Error(ProtocolCode.BAD_TYPE.value, "capacity must be >= 0")))
            return
        # A reconnecting actor (same actor_id, new socket) replaces its old session at once.
        old = self._actor_by_id(msg.actor_id)
        if old is not None:
            self._drop_session(old.peer, now, out, "replaced by a new session", lost=True)
        caps = {k: frozenset(v) for k, v in msg.capabilities.items()}
        sess = ActorSession(
            peer=peer, actor_id=msg.actor_id, host=msg.host, slot=msg.slot, pid=msg.pid,
            capabilities=caps, accepting=frozenset(k for k in msg.kinds if k in caps),
            capacity=msg.capacity, labels=dict(msg.labels), connected_at=now, last_seen=now, last_sent=now,
        )
        role = msg.labels.get("role")
        sess.directive_config = dict(role) if isinstance(role, dict) else {}
        sess.bucket = self.rollout.bucket_of_actor(sess.directive_config)
        cores = msg.labels.get("cores")
        sess.cores = cores if type(cores) is int and cores > 0 else max(1, msg.capacity)
        self.actors[peer] = sess
        self._refresh_offers()
        out.append(Send(peer, self._welcome()))
        self._fill_actor(sess, now, out)

    def _on_client_hello(self, peer: bytes, msg: m.ClientHello, now: float, out: list[Command]) -> None:
        if peer in self.actors:
            out.append(Send(peer, m.Disconnect("protocol violation: client hello on an actor socket")))
            self._drop_session(peer, now, out, "client hello on actor socket", lost=True)
            return
        cs = self.clients.get(peer)
        if cs is None:
            cs = self.clients[peer] = ClientSession(peer, msg.client_id, now)
        else:
            cs.client_id = msg.client_id
        cs.inflight = sum(1 for (cid, _), _ in self._by_request.items() if cid == msg.client_id)
        out.append(Send(peer, self._welcome()))

    def _welcome(self) -> m.Welcome:
        c = self.config
        return m.Welcome(f"s{next(self._sessions)}", c.broker_id, c.heartbeat_s, c.liveness, c.max_frame_bytes)

    def _on_heartbeat(self, peer: bytes, msg: m.Heartbeat, now: float, out: list[Command]) -> None:
        if peer not in self.actors and peer not in self.clients:
            out.append(Send(peer, m.Disconnect("unknown session: say hello again")))

    def _on_goodbye(self, peer: bytes, msg: m.Goodbye, now: float, out: list[Command]) -> None:
        if peer in self.actors:
            self._drop_session(peer, now, out, f"goodbye: {msg.reason}", lost=False)
        self.clients.pop(peer, None)

    def _refresh_offers(self) -> None:
        offers: dict[str, set[str]] = {}
        for s in self.actors.values():
            for kind, names in s.capabilities.items():
                offers.setdefault(kind, set()).update(names)
        self._offers = {k: frozenset(v) for k, v in offers.items()}

    def _actor_by_id(self, actor_id: str) -> ActorSession | None:
        for s in self.actors.values():
            if s.actor_id == actor_id:
                return s
        return None

    def _drop_session(self, peer: bytes, now: float, out: list[Command], why: str, lost: bool = True) -> None:
        """Forget an actor session and re-queue what it held (counting a loss if ``lost``)."""
        sess = self.actors.pop(peer, None)
        if sess is None:
            return
        if self.plan_applier is not None and not self.plan_applier.done and sess.actor_id in self.plan_applier.target:
            planning.abandon_plan(self, sess.actor_id, why, now)
        self._refresh_offers()
        self._release_targets(peer)
        for wid in sorted(sess.held, key=lambda w: self.works[w].seq):
            self._release_cores(self.works[wid], sess)
            self._requeue(self.works[wid], now, out, why, count_failure=lost)
        sess.held.clear()
        self._refill_others(None, now, out)  # released turns may fit an idle instance now

    def _refill_others(self, skip: ActorSession | None, now: float, out: list[Command]) -> None:
        """Offer queued work to every actor with free credit except ``skip``."""
        for other in list(self.actors.values()):
            if other is not skip and other.free > 0:
                self._fill_actor(other, now, out)

    def _release_targets(self, peer: bytes) -> None:
        """Queued generate turns that waited for ``peer`` may now run on any instance of their bucket."""
        sess = self.actors.get(peer)
        for key, q in self.queues.items():
            if key[0] == "generate":
                for wid in q:
                    w = self.works[wid]
                    if w.target == peer:
                        w.target = None
                        if w.trajectory:
                            self.rollout.requeue_target_lost(w.trajectory)
        if sess is not None:
            sess.targeted = 0

    # ------------------------------------------------------------------ bids and directives
    def _actor_or_disconnect(self, peer: bytes, out: list[Command]) -> ActorSession | None:
        sess = self.actors.get(peer)
        if sess is None:
            out.append(Send(peer, m.Disconnect("unknown actor session: say hello again")))
        return sess

    def _on_bid(self, peer: bytes, msg: m.Bid, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        if sess is None:
            return
        sess.accepting = frozenset(k for k in msg.kinds if k in sess.capabilities)
        sess.capacity = max(0, msg.capacity)
        switched = sess.directive is not None
        sess.directive = None
        if switched and self.plan_applier is not None:
            for aid, role in self.plan_applier.on_switched(sess.actor_id):
                out.extend(self.direct(aid, role.kinds, now, "finish", role.config())[1])
        bucket = self.rollout.bucket_of_actor(sess.directive_config)
        if bucket != sess.bucket or "generate" not in sess.accepting:
            self._release_targets(peer)
            self._refill_others(sess, now, out)
        sess.bucket = bucket
        self._fill_actor(sess, now, out)

    def _on_directive_done(self, peer: bytes, msg: m.DirectiveDone, now: float, out: list[Command]) -> None:
        self._actor_or_disconnect(peer, out)  # the Bid that follows re-opens the actor

    def _on_direct_request(self, peer: bytes, msg: m.DirectRequest, now: float, out: list[Command]) -> None:
        if peer not in self.clients:
            out.extend(self._reject(peer, ProtocolCode.UNEXPECTED, "say ClientHello first"))
            return
        try:
            did, cmds = self.direct(msg.actor_id, msg.kinds, now, msg.mode, msg.config)
        except (KeyError, ValueError) as exc:
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value, str(exc))))
            return
        out.extend(cmds)
        out.append(Send(peer, m.Reply(msg.request_id, True, did)))

    # ------------------------------------------------------------------ requests
    def _on_submit(self, peer: bytes, msg: m.Submit, now: float, out: list[Command]) -> None:
        cs = self.clients.get(peer)
        if cs is None:
            out.extend(self._reject(peer, ProtocolCode.UNEXPECTED, "say ClientHello before Submit"))
            return
        rkey = (cs.client_id, msg.request_id)
        if rkey in self._by_request:  # already in flight: the one Reply will come when it finishes
            self.stats["duplicates"] += 1
            self.works[self._by_request[rkey]].client = peer
            return
        cached = self._replies.get(rkey)
        if cached is not None:
            self.stats["duplicates"] += 1
            out.append(Send(peer, cached))
            return
        if msg.kind not in m.WORK_KINDS:
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value,
                                          f"unknown work kind {msg.kind!r} (known: {', '.join(m.WORK_KINDS)})")))
            return
        if not (msg.timeout_s > 0):
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value,
                                          f"timeout_s must be > 0, got {msg.timeout_s}")))
            return
        key = (msg.kind, msg.name)
        if msg.kind == "generate" and not msg.trajectory:  # no trajectory: any instance of the named bucket
            key = (msg.kind, self.rollout.bucket_named(msg.name))
        names = self._offers.get(msg.kind, frozenset())
        if self.actors and (not names if msg.kind == "generate" else msg.name not in names and "*" not in names):
            self.stats["unknown_tool"] += 1
            offered = sorted(names)
            out.append(Send(peer, m.Reply(
                msg.request_id, False, None, ErrorCode.UNKNOWN_TOOL.value,
                f"no actor offers {msg.kind} {msg.name!r}; offered: {', '.join(offered) or 'none'}")))
            return
        q = self.queues.get(key)
        if q is not None and len(q) >= self.config.max_queued_per_key:
            self.stats["busy"] += 1
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BUSY.value,
                                          f"{len(q)} requests already wait for {msg.kind} {msg.name!r}",
                                          retry_after_s=1.0)))
            return
        if cs.inflight >= self.config.max_inflight_per_client:
            self.stats["busy"] += 1
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BUSY.value,
                                          f"this client already has {cs.inflight} unanswered requests",
                                          retry_after_s=0.5)))
            return
        w = self._admit(cs.client_id, msg.request_id, peer, msg.kind, key[1], msg.args, msg.trajectory,
                        msg.timeout_s, now, "submit")
        wid = w.work_id
        self._journal(Journal("accept", cs.client_id, msg.request_id, {
            "kind": msg.kind, "name": msg.name, "args": msg.args, "trajectory": msg.trajectory,
            "timeout_s": msg.timeout_s}))
        cs.inflight += 1
        self.stats["submitted"] += 1
        if msg.kind == "generate" and msg.trajectory:
            self._route_generate(w, now, out)
            return
        if msg.kind == "action" and self.actions is not None:
            self.queues.setdefault(key, deque()).append(wid)
            self._schedule_actions(now, out)
            return
        sess = self._best_actor(key)
        if sess is not None:
            self._assign(w, sess, now, out)
        else:
            self.queues.setdefault(key, deque()).append(wid)

    def _admit(self, client_id: str, request_id: str, peer: bytes, kind: str, name: str, args: Any,
               trajectory: str | None, timeout_s: float, now: float, why: str) -> Work:
        """Create and index a new piece of work (not yet queued or assigned)."""
        wid = f"w{next(self._work_ids)}"
        w = Work(wid, request_id, peer, kind, name, args, trajectory, now, now + timeout_s, next(self._seq),
                 client_id=client_id, timeout_s=timeout_s)
        w.story.append(f"queued:{why}")
        self.works[wid] = w
        self._by_request[(client_id, request_id)] = wid
        heapq.heappush(self._deadlines, (w.deadline, w.seq, wid))
        if len(self._deadlines) > 2 * len(self.works) + 1024:  # bound memory: drop finished entries
            self._deadlines = [e for e in self._deadlines if e[2] in self.works]
            heapq.heapify(self._deadlines)
        return w

    def _route_generate(self, w: Work, now: float, out: list[Command]) -> None:
        route_generate(self, w, now, out)

    def _on_job_submit(self, peer: bytes, msg: m.JobSubmit, now: float, out: list[Command]) -> None:
        jobs.on_job_submit(self, peer, msg, now, out)

    def _on_job_poll(self, peer: bytes, msg: m.JobPoll, now: float, out: list[Command]) -> None:
        jobs.on_job_poll(self, peer, msg, now, out)

    def _on_end_trajectory(self, peer: bytes, msg: m.EndTrajectory, now: float, out: list[Command]) -> None:
        if peer in self.clients:
            tr = self.rollout.end(msg.trajectory, msg.total_output_tokens, msg.ok)
            if tr is not None and msg.ok and self.planner is not None:
                self.planner.observe(tr.context - tr.generated, max(tr.generated, msg.total_output_tokens), tr.turns,
                                     tr.tool_s)
            if self.actions is not None:
                self.actions.trajectory_finished(msg.trajectory, now)

    def _journal(self, rec: Journal) -> None:
        if self.journaling:
            self.journal_out.append(rec)

    def restore(self, accepted: list[tuple[str, str, dict[str, Any]]],
                done: list[tuple[str, str, dict[str, Any]]], now: float) -> None:
        """Rebuild after a restart from a journal (see ``journal.restore``). Call before serving."""
        journal.restore(self, accepted, done, now)

    def _on_cancel(self, peer: bytes, msg: m.CancelRequest, now: float, out: list[Command]) -> None:
        cs = self.clients.get(peer)
        wid = self._by_request.get((cs.client_id, msg.request_id)) if cs else None
        if wid is not None:
            self._fail(self.works[wid], now, out, ErrorCode.CANCELLED, "cancelled by the client")

    # ------------------------------------------------------------------ results
    def _on_result(self, peer: bytes, msg: m.WorkResult, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        if sess is None:
            self.stats["stale_results"] += 1
            return
        w = self.works.get(msg.work_id)
        if w is None or w.state is not WorkState.LEASED or w.lease != msg.lease or w.actor != peer:
            self.stats["stale_results"] += 1
            return
        sess.held.discard(w.work_id)
        self._release_cores(w, sess)
        sess.completed += 1
        if w.trajectory:
            if w.kind == "generate" and msg.ok:
                self.rollout.turn_done(w.trajectory, msg.output)
            elif w.kind == "action":
                self.rollout.tool_returned(w.trajectory, w.name, msg.ok, msg.output, msg.error_code,
                                           now - w.submitted_at)
        if msg.ok:
            w.move(WorkState.DONE, "result")
            self.stats["completed"] += 1
            self._finish(w, m.Reply(w.request_id, True, msg.output, "", "", w.work_id, w.attempt,
                                    sess.actor_id, msg.duration_s), out)
        else:
            tool_code = msg.error_code or ErrorCode.TOOL_FAILED.value
            w.move(WorkState.FAILED, tool_code)
            self.stats["failed"] += 1
            self._finish(w, m.Reply(w.request_id, False, None, ErrorCode.TOOL_FAILED.value, msg.error, w.work_id,
                                    w.attempt, sess.actor_id, msg.duration_s, tool_code=tool_code), out)
        self._fill_actor(sess, now, out)

    def _on_handback(self, peer: bytes, msg: m.Handback, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        w = self.works.get(msg.work_id)
        if sess is None or w is None or w.state is not WorkState.LEASED or w.lease != msg.lease or w.actor != peer:
            self.stats["stale_results"] += 1
            return
        sess.held.discard(w.work_id)
        self._release_cores(w, sess)
        self.stats["handbacks"] += 1
        self._requeue(w, now, out, f"handback: {msg.reason}", count_failure=False, front=True)
        self._fill_actor(sess, now, out)

    # ------------------------------------------------------------------ timers
    def _on_tick(self, now: float) -> list[Command]:
        out: list[Command] = []
        c = self.config
        dead_after = c.heartbeat_s * c.liveness
        for peer, sess in list(self.actors.items()):
            if now - sess.last_seen > dead_after:
                self.stats["actors_expired"] += 1
                self._drop_session(peer, now, out, "actor expired", lost=True)
                out.append(Send(peer, m.Disconnect("expired: no heartbeat")))
            elif now - sess.last_sent >= c.heartbeat_s:
                sess.last_sent = now
                out.append(Send(peer, m.Heartbeat()))
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, wid = heapq.heappop(self._deadlines)
            w = self.works.get(wid)
            if w is not None and w.state in (WorkState.QUEUED, WorkState.LEASED):
                self.stats["timeouts"] += 1
                self._fail(w, now, out, ErrorCode.TIMEOUT,
                           f"no result within {w.deadline - w.submitted_at:.3g}s (attempts: {w.attempt})")
        while self._leases and self._leases[0][0] <= now:
            _, lease, wid = heapq.heappop(self._leases)
            w = self.works.get(wid)
            if w is not None and w.state is WorkState.LEASED and w.lease == lease:
                holder = self.actors.get(w.actor) if w.actor else None
                if holder is not None:
                    holder.held.discard(wid)
                    self._release_cores(w, holder)
                    out.append(Send(holder.peer, m.Revoke(wid, lease, "lease expired")))
                self._requeue(w, now, out, "lease expired", count_failure=True)
                if holder is not None:
                    self._fill_actor(holder, now, out)
        for peer, cs in list(self.clients.items()):
            if cs.inflight <= 0 and now - cs.last_seen > c.client_idle_s:
                del self.clients[peer]
        out.extend(planning.plan_round(self, now))
        return out

    # ------------------------------------------------------------------ matching
    def _release_cores(self, w: Work, sess: ActorSession) -> None:
        if self.actions is not None and w.kind == "action":
            sess.cores_used = max(0, sess.cores_used - self.actions.unstarted(w.work_id))

    def _schedule_actions(self, now: float, out: list[Command]) -> None:
        schedule_actions(self, now, out)

    def _best_actor(self, key: tuple[str, str]) -> ActorSession | None:
        best: ActorSession | None = None
        best_free = 0
        for sess in self.actors.values():
            f = sess.free
            if f > best_free and sess.serves(*key):
                best, best_free = sess, f
        return best

    def _fill_actor(self, sess: ActorSession, now: float, out: list[Command]) -> None:
        """Give ``sess`` the oldest queued work it can serve until its credit runs out."""
        if self.actions is not None and "action" in sess.accepting:
            self._schedule_actions(now, out)
        orphans = self._orphan_buckets() if "generate" in sess.accepting else frozenset()
        while sess.free > 0:
            best_q: deque[str] | None = None
            best_seq = 0
            best_i = 0
            for key, q in self.queues.items():
                if q and (sess.serves(*key) or (key[0] == "generate" and key[1] in orphans and sess.directive is None)
                          ) and not (key[0] == "action" and self.actions is not None):
                    i = 0
                    if key[0] == "generate":  # sticky turns wait for their own instance
                        i = next((j for j, wid in enumerate(q)
                                  if self.works[wid].target in (None, sess.peer)), -1)
                        if i < 0:
                            continue
                    seq = self.works[q[i]].seq
                    if best_q is None or seq < best_seq:
                        best_q, best_seq, best_i = q, seq, i
            if best_q is None:
                return
            wid = best_q[best_i]
            del best_q[best_i]
            self._assign(self.works[wid], sess, now, out)

    def _orphan_buckets(self) -> frozenset[str]:
        """Names of generate queues that no ready rollout instance serves: a bucket a re-plan removed, or one
        whose instances are all gone or switching. Any rollout instance takes their turns rather than letting
        them wait for an instance that may never come."""
        served = {s.bucket for s in self.actors.values() if "generate" in s.accepting and s.directive is None}
        return frozenset(k[1] for k, q in self.queues.items() if k[0] == "generate" and q and k[1] not in served)

    def _assign(self, w: Work, sess: ActorSession, now: float, out: list[Command]) -> None:
        if w.target is not None:
            t = self.actors.get(w.target)
            if t is not None:
                t.targeted -= 1
            w.target = None
        w.lease = next(self._leases_seq)
        w.attempt += 1
        w.actor = sess.peer
        w.move(WorkState.LEASED, f"assign:{sess.actor_id}")
        w.lease_expires = min(w.deadline, now + self.config.lease_s)
        if w.lease_expires < w.deadline:
            heapq.heappush(self._leases, (w.lease_expires, w.lease, w.work_id))
        sess.held.add(w.work_id)
        if w.kind == "action" and self.actions is not None:
            cores = int(w.route.get("cores", 1))
            sess.cores_used += cores
            self.actions.started(w.work_id, cores, now)
        sess.last_sent = now
        args = w.args
        if w.kind == "generate" and self.job_weights is not None and type(args) is dict and args.get("weights") is None:
            args = {**args, "weights": self.job_weights}  # a job's newest version, loaded between turns
        out.append(Send(sess.peer, m.Assign(w.work_id, w.lease, w.attempt, w.kind, w.name, args,
                                            w.trajectory, max(0.0, w.deadline - now), w.route)))

    def _requeue(self, w: Work, now: float, out: list[Command], why: str, count_failure: bool,
                 front: bool = False) -> None:
        if count_failure:
            w.failures += 1
            if w.failures > self.config.max_retries:
                w.actor = None
                self._fail(w, now, out, ErrorCode.RETRIES_EXHAUSTED,
                           f"lost {w.failures} times (last: {why}); giving up after {self.config.max_retries} retries")
                return
        w.actor = None
        w.move(WorkState.QUEUED, why)
        self.stats["requeued"] += 1
        if w.kind == "generate" and w.trajectory:
            self.rollout.requeue_target_lost(w.trajectory)
        sess = None if (w.kind == "action" and self.actions is not None) else self._best_actor(w.key)
        if sess is not None:
            self._assign(w, sess, now, out)
            return
        q = self.queues.setdefault(w.key, deque())
        if front:
            q.appendleft(w.work_id)
        else:  # keep FCFS order by the original submission sequence
            q.append(w.work_id)
            if len(q) > 1 and self.works[q[-2]].seq > w.seq:
                items = sorted(q, key=lambda x: self.works[x].seq)
                q.clear()
                q.extend(items)
        if w.kind == "action" and self.actions is not None:
            self._schedule_actions(now, out)

    def _fail(self, w: Work, now: float, out: list[Command], code: ErrorCode, why: str) -> None:
        if w.state is WorkState.QUEUED:
            if w.target is not None and w.target in self.actors:
                self.actors[w.target].targeted -= 1
            w.target = None
            q = self.queues.get(w.key)
            if q is not None:
                try:
                    q.remove(w.work_id)
                except ValueError:
                    pass
        elif w.state is WorkState.LEASED and w.actor is not None:
            holder = self.actors.get(w.actor)
            if holder is not None:
                holder.held.discard(w.work_id)
                self._release_cores(w, holder)
                out.append(Send(holder.peer, m.Revoke(w.work_id, w.lease, code.value)))
                self._fill_actor(holder, now, out)
        w.move(WorkState.FAILED, code.value)
        self.stats["failed"] += 1
        self._finish(w, m.Reply(w.request_id, False, None, code.value, why, w.work_id, w.attempt), out)

    def _finish(self, w: Work, reply: m.Reply, out: list[Command]) -> None:
        """Send the one Reply for ``w`` and forget the work, remembering the reply for resubmits."""
        del self.works[w.work_id]
        if self.actions is not None and w.kind == "action":
            self.actions.ended(w.work_id)
        if w.client_id.startswith(jobs.OWNER_PREFIX):
            self._by_request.pop((w.client_id, w.request_id), None)
            jobs.collect(self, w, reply)
            return
        cs = self.clients.get(w.client) or next(
            (c for c in self.clients.values() if c.client_id == w.client_id), None)
        if cs is not None:
            cs.inflight = max(0, cs.inflight - 1)
        rkey = (w.client_id, w.request_id)
        self._journal(Journal("done", w.client_id, w.request_id, {
            f: getattr(reply, f) for f in ("ok", "output", "error_code", "error", "work_id", "attempts",
                                           "actor_id", "duration_s", "retry_after_s", "tool_code")}))
        if self._by_request.get(rkey) == w.work_id:
            del self._by_request[rkey]
            self._replies[rkey] = reply
            if len(self._replies) > self.config.reply_cache:
                self._replies.popitem(last=False)
        out.append(Send(w.client, reply))

    def _reject(self, peer: bytes, code: ProtocolCode, message: str) -> list[Command]:
        self.stats["bad_frames"] += 1
        if peer in self.actors or peer in self.clients:
            return [Send(peer, m.Error(code.value, message))]
        return [Send(peer, m.Disconnect(f"{code.value}: {message}"))]

    # ------------------------------------------------------------------ views
    def _on_status(self, peer: bytes, msg: m.StatusRequest, now: float, out: list[Command]) -> None:
        if peer not in self.clients:
            out.extend(self._reject(peer, ProtocolCode.UNEXPECTED, "say ClientHello before StatusRequest"))
            return
        out.append(Send(peer, self.snapshot(msg.request_id, now)))

    def snapshot(self, request_id: str, now: float) -> m.StatusReply:
        """A status view: one dict per actor, queue depths by ``kind:name``, counters."""
        return views.snapshot(self, request_id, now)

    def validate(self) -> None:
        """Check invariants (tests call this after every scenario). Raises AssertionError."""
        views.validate(self)
