"""``BrokerState``: the broker's pure core. ``handle(event, now) -> list[Command]``.

No sockets, threads, clocks, files or logging: time comes in as ``now`` (monotonic seconds) and
everything the broker wants done comes out as a command (:mod:`libra.broker.events`): ``Send`` a message,
``JournalWrite`` a durability record, ``StartPlannerSearch`` off the loop, ``Log`` a line. The same object
runs inside the ZeroMQ shell (``server.py``), under the unit tests, and inside the simulator.

``BrokerState`` is the coordinator: it dispatches each event to the components that hold the state and
gathers the commands they return. The components, each in its own module:

- ``sessions.SessionRegistry``: actor and client sessions, liveness after 7/MDP (any frame is a heartbeat;
  dead after ``liveness`` silent intervals), the names actors offer, directives (an actor told to accept
  other kinds gets no new work until it has drained and bid again);
- ``work_table.WorkTable``: every accepted request as a :class:`~libra.broker.work.Work` with ``work_id``,
  ``lease``, ``attempt``; one FIFO queue per ``(kind, name)``; the request index and the reply cache (a
  resubmitted ``request_id`` is answered from the record, never run twice); deadlines and leases;
- ``dispatch.Dispatcher``: takes requests in, matches them to actors (least-loaded first), takes work back
  (work held by a dead actor, or whose lease expired, is re-queued up to ``max_retries`` losses, then fails
  with ``retries_exhausted``; a result carrying a stale lease is dropped) and produces each request's one
  Reply;
- ``rollout.RolloutRouting`` (where each generate turn runs), ``actions.ActionPlacement`` (which queued actions
  start, with how many cores), ``job_board.JobBoard`` (RL jobs), ``plan_rounds.Planning`` (plans → directives).

Mutation rule: state changes only inside ``handle`` (``direct``, ``apply_plan``, ``restore`` build the event).
A peer's message its key's role may not send is refused first (``roles``).
"""

from __future__ import annotations

from typing import Any

from libra.policies.routing.interface import BucketSpec
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode, ProtocolCode
from libra.protocol.payloads_base import PayloadError
from libra.protocol.payloads_lend import lend_label

from . import journal, roles
from .access import PLANNER, Access
from .actions import ActionPlacement
from .adoption import Adoption, parse_held
from .config import BrokerConfig
from .direct_leases import DirectLeases
from .dispatch import Dispatcher
from .events import (
    ApplyPlan,
    BadFrame,
    Command,
    Direct,
    Event,
    Log,
    PeerMessage,
    PlaceLent,
    PlannerDone,
    Rehome,
    Restore,
    RevokePeers,
    Send,
    Tick,
)
from .job_host import JobWork
from .ehp import from_planner_config
from .job_board import JobBoard
from .lending import Lending
from .plan_decider import PlannerLoop, PlannerSettings
from .plan_rounds import Planning
from .rollout import RolloutRouting
from .sessions import ActorSession, SessionRegistry
from .state_views import BrokerViews
from .work_table import WorkTable

__all__ = ["BrokerConfig", "BrokerState"]

#: Messages only a client may send, with what a peer that is not one is told.
_CLIENT_ONLY: dict[type, str] = {
    m.Submit: "say ClientHello before Submit",
    m.StatusRequest: "say ClientHello before StatusRequest",
    m.DirectRequest: "say ClientHello first",
    m.JobSubmit: "say ClientHello before JobSubmit",
    m.JobPoll: "say ClientHello before JobPoll",
    m.LeaseRequest: "say ClientHello before LeaseRequest",
}


class BrokerState(BrokerViews):
    """The broker core. See the module docstring for the contract.

    ``journaling``: emit ``JournalWrite`` commands for accepted client requests and their replies (the
    server turns it on when it keeps a journal). ``planner_offload``: a broker planner round's search comes
    out as a ``StartPlannerSearch`` command for the shell to run off the loop (the server); otherwise it runs
    inline (tests, the simulator).
    """

    def __init__(self, config: BrokerConfig | None = None, *, journaling: bool = False,
                 planner_offload: bool = False) -> None:
        self.config = c = config or BrokerConfig()
        try:
            buckets = [BucketSpec(**b) for b in c.buckets]
        except TypeError as exc:
            raise ValueError(f"bad bucket in broker config (need name, tp, max_tokens): {exc}") from None
        self.rollout = RolloutRouting(c.router, buckets, c.router_params)
        self.actions = (ActionPlacement(c.action_scheduler, c.action_scheduler_params, c.tools)
                        if c.action_scheduler else None)
        planner, ehp = from_planner_config(c.planner)  # grp_ehp: GRP rounds plus the Elastic Hybrid Pool
        loop = PlannerLoop(PlannerSettings.from_dict(planner)) if c.planner else None
        self.stats: dict[str, int] = dict.fromkeys(
            ("submitted", "completed", "failed", "requeued", "stale_results", "bad_frames", "timeouts",
             "unknown_tool", "busy", "duplicates", "actors_expired", "handbacks", "ticks_behind", "role_refused", "job_refused",
             "keys_revoked"), 0)
        self._access = Access(self.stats)
        self._role = self._key = ""  # the role and key of the message being handled
        self._sessions = SessionRegistry(c.heartbeat_s, c.liveness, c.client_idle_s, c.idle_beat_s)
        self._table = WorkTable(c.reply_cache)
        self._jobs = JobBoard()
        self._jobs.ehp = ehp
        self._last_router_step: float | None = None  # when the router last counted a policy step
        if c.router_step_s < 0:
            raise ValueError(f"router_step_s must be >= 0, got {c.router_step_s}")
        self._dispatch = Dispatcher(c, self.stats, self._sessions, self._table, self.rollout, self.actions,
                                    self._jobs, journaling)
        self._planning = Planning(loop, self._sessions, self.rollout, planner_offload, c.engines)
        self._adoption = Adoption(c, self.stats, self._sessions, self._table, self._dispatch)
        self._leases = DirectLeases(self._sessions, self.stats, c.direct_leases_per_actor)
        self._lending = self._dispatch.lending = Lending(c, self._sessions, self.rollout, self._table, self._dispatch)
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
            m.OwnerReclaim: self._on_owner_reclaim,
            **self._leases.handlers,
        }

    # ------------------------------------------------------------------ the entry point
    def handle(self, event: Event, now: float) -> list[Command]:
        """Apply one event; return the commands to execute. Never raises for bad peer input (``Direct`` and
        ``ApplyPlan``, which are not peer input, raise for bad arguments: see :mod:`~libra.broker.events`)."""
        t = type(event)
        if t is PeerMessage:
            peer, msg = event.peer, event.msg
            handler = self._handlers.get(type(msg))
            if handler is None:  # a broker→peer message sent to the broker: unexpected
                return self._reject(peer, ProtocolCode.UNEXPECTED, f"{type(msg).__name__} is not accepted by the broker")
            if event.role:  # under CURVE: its key's role and job scope (access.py)
                refused = self._access.refuse(event, self._sessions.known(peer), now)
                if refused is not None:
                    return refused
            out: list[Command] = []
            self._sessions.touch(peer, now)
            hint = _CLIENT_ONLY.get(type(msg))
            if hint is not None and peer not in self._sessions.clients:
                out.extend(self._reject(peer, ProtocolCode.UNEXPECTED, hint))
            else:
                self._role, self._key = event.role, event.key  # whose message the handler serves (access.py)
                handler(peer, msg, now, out)
            if self._jobs.dirty:
                self._pump_jobs(now, out)
            self._note_decisions(now, out)
            return out
        if t is Tick:
            out = self._on_tick(now, event.behind)
            if self._jobs.wake_waiting():
                self._pump_jobs(now, out)
            self._note_decisions(now, out)
            return out
        if t is PlannerDone:
            out = self._planning.done(event.job, now)
            self._note_decisions(now, out)
            return out
        if t is BadFrame:
            self.stats["bad_frames"] += 1
            if self._sessions.known(event.peer):
                return [Send(event.peer, m.Error(event.error.code.value, event.error.message))]
            return []  # a peer that never said hello gets nothing (7/MDP: treat as invalid)
        if t is Direct:  # the broker process's own API (not a peer): audited as "local"
            cmd = self._sessions.direct(event.actor_id, event.kinds, now, event.mode, event.config)
            return [cmd, self._access.audit("directive", "", "local", now, actor=event.actor_id, kinds=list(event.kinds),
                                            mode=event.mode, directive=cmd.msg.directive_id)]
        if t is ApplyPlan:
            out = self._planning.apply(event.plan, now, event.placement)
            self._note_decisions(now, out, by="local")
            return out
        if t is PlaceLent:
            return self._planning.place_lent(now, event.plan, event.placement)
        if t is Restore:
            n = journal.restore(self._table, self.rollout, event.accepted, event.done, self.config.reply_cache, now)
            if n:
                self.stats["restored"] = self.stats.get("restored", 0) + n
            self._adoption.restored(now)
            return []
        if t is RevokePeers:  # their keys left the allow directory
            out, n = roles.revoke(event.peers, event.why, now, self._sessions.known, self._drop_actor, self._sessions.close_client)
            self.stats["keys_revoked"] += n
            out += [self._access.audit("key_revoked", k, roles.REVOKED, now, sessions_ended=n) for k in event.keys]
            return out
        if t is Rehome:
            out = []
            self._dispatch.rehome(event.buckets, now, out)
            return out
        raise TypeError(f"unknown event {event!r}")

    # ------------------------------------------------------------------ thin entry points
    def direct(self, actor_id: str, kinds: list[str], now: float, mode: str = "finish",
               config: dict[str, Any] | None = None) -> tuple[int, list[Command]]:
        """Tell actor ``actor_id`` to accept ``kinds`` from now on (``handle(Direct(...))``).

        The actor gets no new work until it has drained (``finish``: runs what it holds;
        ``handback``: returns unstarted work) and bid again. Returns (directive id, commands).
        Raises KeyError for an unknown actor and ValueError for a bad mode or kind.
        """
        cmds = self.handle(Direct(actor_id, list(kinds), mode, config), now)
        return cmds[0].msg.directive_id, cmds

    def apply_plan(self, plan: Any, now: float, placement: str | None = None) -> list[Command]:
        """Move GPU actors to the roles of ``plan`` without stopping anything (``handle(ApplyPlan(plan, placement))``;
        see ``plan_rounds.Planning.apply``). Raises ``PlanError`` when the plan does not fit."""
        return self.handle(ApplyPlan(plan, placement), now)

    def restore(self, accepted: list[tuple[str, str, dict[str, Any]]],
                done: list[tuple[str, str, dict[str, Any]]], now: float) -> None:
        """Rebuild after a restart from a journal (``handle(Restore(...))``; see ``journal.restore``). Call
        before serving."""
        self.handle(Restore(accepted, done), now)

    # ------------------------------------------------------------------ sessions
    def _on_actor_hello(self, peer: bytes, msg: m.ActorHello, now: float, out: list[Command]) -> None:
        if self._sessions.known(peer):
            self._drop_actor(peer, now, out, "second hello on one socket")
            out.append(Send(peer, m.Disconnect("protocol violation: second hello on one socket")))
            return
        if msg.capacity < 0:
            out.append(Send(peer, m.Error(ProtocolCode.BAD_TYPE.value, "capacity must be >= 0")))
            return
        try:  # a lent slot must never be taken for one the job owns (it would be given training)
            lend_label(msg.labels)
        except PayloadError as exc:
            out.append(Send(peer, m.Error(ProtocolCode.BAD_TYPE.value, str(exc))))
            return
        # A reconnecting actor (same actor_id, new socket, same supervisor run) replaces its old session at
        # once, keeping the work it still holds. Another supervisor run's actor with an id that a live
        # session holds is refused: two supervisors on one host would otherwise knock each other off for ever.
        held = parse_held(msg.held)
        kept = []
        old = self._sessions.actor_by_id(msg.actor_id)
        if old is not None:
            why = self._sessions.conflict(old, msg, now)
            if why is not None:
                self.stats["hellos_refused"] = self.stats.get("hellos_refused", 0) + 1
                out.append(Log("actor_id_in_use", {"actor": msg.actor_id, "live_pid": old.pid, "new_pid": msg.pid,
                                                   "host": msg.host}, "warning"))
                out.append(Send(peer, m.Disconnect(why, "actor_id_in_use")))
                return
            kept = self._adoption.keep(old, held)
            self._drop_actor(old.peer, now, out, "replaced by a new session", lost=True)
        sess = self._sessions.open_actor(peer, msg, now)
        sess.bucket = self.rollout.bucket_of_actor(sess.directive_config)
        self._lending.hello(sess)
        self._adoption.adopt(sess, held, kept, now, out)  # its Revokes go out before the Welcome
        out.append(Send(peer, self._welcome()))
        self._adoption.returned(sess.actor_id, now, out)  # restored work it no longer holds is queued now
        self._dispatch.fill(sess, now, out)

    def _on_client_hello(self, peer: bytes, msg: m.ClientHello, now: float, out: list[Command]) -> None:
        if peer in self._sessions.actors:
            out.append(Send(peer, m.Disconnect("protocol violation: client hello on an actor socket")))
            self._drop_actor(peer, now, out, "client hello on actor socket", lost=True)
            return
        client_id = Access.scoped(msg.client_id, self._role)  # a job-scoped key's id is taken within its job
        cs = self._sessions.open_client(peer, client_id, now)
        cs.inflight = self._table.in_flight_count(client_id)
        out.append(Send(peer, self._welcome()))

    def _welcome(self) -> m.Welcome:
        c = self.config
        return m.Welcome(self._sessions.new_session_id(), c.broker_id, c.heartbeat_s, c.liveness, c.max_frame_bytes,
                         c.idle_beat_s)

    def _on_heartbeat(self, peer: bytes, msg: m.Heartbeat, now: float, out: list[Command]) -> None:
        if not self._sessions.known(peer):
            out.append(Send(peer, m.Disconnect("unknown session: say hello again")))
        elif msg.gpu and peer in self._sessions.actors:
            self._sessions.actors[peer].gpu = dict(msg.gpu)

    def _on_goodbye(self, peer: bytes, msg: m.Goodbye, now: float, out: list[Command]) -> None:
        if peer in self._sessions.actors:
            self._drop_actor(peer, now, out, f"goodbye: {msg.reason}", lost=False)
        self._sessions.close_client(peer)

    def _drop_actor(self, peer: bytes, now: float, out: list[Command], why: str, lost: bool = True) -> None:
        """Forget an actor session and re-queue what it held (counting a loss if ``lost``)."""
        sess = self._sessions.close_actor(peer, now)
        if sess is None:
            return
        out.extend(self._planning.actor_left(sess.actor_id, why, now))
        if self._jobs.ehp is not None:
            self._jobs.ehp.actor_left(sess.actor_id)
        self._leases.actor_gone(sess, out, why)
        self._dispatch.actor_gone(sess, now, out, why, lost)
        self._lending.gone(sess.actor_id)

    def _actor_or_disconnect(self, peer: bytes, out: list[Command]) -> ActorSession | None:
        sess = self._sessions.actors.get(peer)
        if sess is None:
            out.append(Send(peer, m.Disconnect("unknown actor session: say hello again")))
        return sess

    def _on_bid(self, peer: bytes, msg: m.Bid, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        if sess is None:
            return
        if msg.rebid:  # a capacity update (KV use): more credit may fill it at once, less only stops new work
            if self._sessions.rebid(sess, msg.capacity):
                self._dispatch.fill(sess, now, out)
            return
        was_rollout = "generate" in sess.accepting or sess.targeted > 0 or sess.directive is not None
        if self._sessions.bid(sess, msg.kinds, msg.capacity):  # it finished switching: the plan's next wave
            out.extend(self._planning.switched(sess.actor_id, now))
        bucket = self.rollout.bucket_of_actor(sess.directive_config)
        if was_rollout and (bucket != sess.bucket or "generate" not in sess.accepting):  # turns waiting for it
            self._dispatch.release_targets(peer)
            self._dispatch.refill_others(sess, now, out)
        sess.bucket = bucket
        if self._lending.bid(sess, now, out):  # lent again: the next round plans with it
            out.extend(self._planning.capacity_changed(sess.actor_id, "lent_again", now))
        self._dispatch.fill(sess, now, out)

    def _on_owner_reclaim(self, peer: bytes, msg: m.OwnerReclaim, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        if sess is not None and self._lending.reclaim(sess, msg, now, out):  # the next round plans without it
            out.extend(self._planning.actor_left(sess.actor_id, f"reclaimed by its owner {sess.lent_owner}", now))
            out.extend(self._planning.capacity_changed(sess.actor_id, "reclaimed", now))

    def _on_directive_done(self, peer: bytes, msg: m.DirectiveDone, now: float, out: list[Command]) -> None:
        self._actor_or_disconnect(peer, out)  # the Bid that follows re-opens the actor

    def _on_direct_request(self, peer: bytes, msg: m.DirectRequest, now: float, out: list[Command]) -> None:
        what = {"actor": msg.actor_id, "kinds": list(msg.kinds), "mode": msg.mode}
        try:
            cmd = self._sessions.direct(msg.actor_id, msg.kinds, now, msg.mode, msg.config)
        except (KeyError, ValueError) as exc:
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BAD_REQUEST.value, str(exc))))
            out.append(self._access.audit("directive", self._key, self._role, now, **what, error=str(exc)))
            return
        out.append(cmd)
        out.append(Send(peer, m.Reply(msg.request_id, True, cmd.msg.directive_id)))
        out.append(self._access.audit("directive", self._key, self._role, now, **what, directive=cmd.msg.directive_id))

    # ------------------------------------------------------------------ work
    def _on_submit(self, peer: bytes, msg: m.Submit, now: float, out: list[Command]) -> None:
        msg = Access.scoped_trajectory(msg, self._role)  # a job-scoped key's trajectories are its job's
        self._dispatch.on_submit(self._sessions.clients[peer], peer, msg, now, out)

    def _on_cancel(self, peer: bytes, msg: m.CancelRequest, now: float, out: list[Command]) -> None:
        self._dispatch.on_cancel(self._sessions.clients.get(peer), msg, now, out)

    def _on_result(self, peer: bytes, msg: m.WorkResult, now: float, out: list[Command]) -> None:
        sess = self._actor_or_disconnect(peer, out)
        if sess is None:
            self.stats["stale_results"] += 1
            return
        self._dispatch.on_result(sess, msg, now, out)

    def _on_handback(self, peer: bytes, msg: m.Handback, now: float, out: list[Command]) -> None:
        self._dispatch.on_handback(self._actor_or_disconnect(peer, out), msg, now, out)

    def _on_end_trajectory(self, peer: bytes, msg: m.EndTrajectory, now: float, out: list[Command]) -> None:
        if peer in self._sessions.clients:
            msg = Access.scoped_trajectory(msg, self._role)
            tr = self.rollout.end(msg.trajectory, msg.total_output_tokens, msg.ok)
            self._lending.ended(msg.trajectory, out)
            if tr is not None and msg.ok:
                self._planning.observe(tr.context - tr.generated, max(tr.generated, msg.total_output_tokens),
                                       tr.turns, tr.tool_s)
            if self.actions is not None:
                self.actions.trajectory_finished(msg.trajectory, now)

    def _on_status(self, peer: bytes, msg: m.StatusRequest, now: float, out: list[Command]) -> None:
        out.append(Send(peer, self.status(msg.request_id, now, self._role)))

    def _on_job_submit(self, peer: bytes, msg: m.JobSubmit, now: float, out: list[Command]) -> None:
        reply = self._jobs.submit(msg, now)
        out.append(Send(peer, reply))
        if reply.ok:
            out.append(self._access.audit("job_start", self._key, self._role, now, job=msg.name, rows=len(msg.rows)))

    def _on_job_poll(self, peer: bytes, msg: m.JobPoll, now: float, out: list[Command]) -> None:
        reply = self._jobs.poll(msg, now)
        out.append(Send(peer, reply))
        if msg.cancel:
            out.append(self._access.audit("job_cancel", self._key, self._role, now, job=msg.job, ok=reply.ok))

    def _reject(self, peer: bytes, code: ProtocolCode, message: str) -> list[Command]:
        self.stats["bad_frames"] += 1
        if self._sessions.known(peer):
            return [Send(peer, m.Error(code.value, message))]
        return [Send(peer, m.Disconnect(f"{code.value}: {message}"))]

    # ------------------------------------------------------------------ jobs
    def _pump_jobs(self, now: float, out: list[Command]) -> None:
        """Let the job board deliver replies and submit or cancel its jobs' work."""

        ehp = self._jobs.ehp

        def directives() -> None:  # the pool's borrows and releases, before the step's work is handed out
            for aid, kinds, cfg in ehp.take_moves() if ehp is not None else ():
                if self._sessions.actor_by_id(aid) is not None:
                    out.append(self._sessions.direct(aid, kinds, now, "finish", cfg))
                    out.append(self._access.audit("directive", "", "ehp", now, actor=aid, kinds=list(kinds)))
                    self._jobs.note([("role_switch", f"{aid} -> {cfg.get('role')} (EHP)",
                                      {"actor": aid, "kinds": kinds, **cfg, "by": "ehp"})], now)

        def submit(owner: str, jw: JobWork, why: str) -> None:
            directives()  # a released hybrid actor must not take a train work of the step that leaves it out
            w = self._table.admit(owner, jw.tag, b"", jw.kind, jw.name, jw.args, jw.trajectory, jw.timeout_s, now,
                                  why, pin=jw.pin)
            self.stats["submitted"] += 1
            self._dispatch.offer(w, now, out)

        def cancel(owner: str, why: str) -> None:
            self._dispatch.cancel_owned(owner, now, out, why)

        published, ooms = self._jobs.published, self._jobs.train_ooms
        if ehp is not None:
            ehp.observe_sessions(self._sessions.actors.values(), self._table.queued("generate"))
        self._jobs.rollout_instances = sum(1 for x in self._sessions.actors.values() if "generate" in x.accepting)
        self._jobs.pump(now, submit, cancel)
        directives()
        # a step that ran out of memory makes the planner re-plan; the jobs' measured costs reach it
        self._planning.job_feedback(self._jobs.train_ooms - ooms, self._jobs.measured_costs())
        for _ in range(self._jobs.published - published):  # a weights version: the router's drift clock
            self.rollout.advance()
            self._last_router_step = now

    def _note_decisions(self, now: float, out: list[Command], by: str = PLANNER) -> None:
        """The plans, bucket changes and role switches just decided (``by`` the planner, or the broker process's
        own ``local`` API), as the running jobs' decision records and in the audit trail."""
        notes = self._planning.take_notes()
        if notes:
            self._jobs.note(notes, now)
            out += [self._access.audit(what, "", by, now, text=text) for what, text, _ in notes]

    # ------------------------------------------------------------------ timers
    def _on_tick(self, now: float, behind: bool = False) -> list[Command]:
        out: list[Command] = []
        self.stats["ticks_behind"] += behind
        for peer, verdict in self._sessions.due(now, spare_dead=behind):
            if verdict == "dead":
                self.stats["actors_expired"] += 1
                self._drop_actor(peer, now, out, "actor expired", lost=True)
                out.append(Send(peer, m.Disconnect("expired: no heartbeat")))
            elif verdict == "heartbeat":
                out.append(Send(peer, m.Heartbeat()))
        self._dispatch.expire(now, out)
        self._lending.tick(now, out)
        self._adoption.tick(now, out)
        self._sessions.on_tick(now)
        self._leases.tick(now, out)
        step_s = self.config.router_step_s
        if self._last_router_step is None:
            self._last_router_step = now
        elif step_s > 0 and now - self._last_router_step >= step_s and not self._jobs.any_active():
            self._last_router_step = now
            self.rollout.advance()
        out.extend(self._plan_round(now))
        return out

    def _plan_round(self, now: float) -> list[Command]:
        """When a round of the broker's planner is due (and no plan is still being applied), start it with
        the pressure the core sees now; EARL's rollout TP (``parallelism = "earl"``) is decided first."""
        earl = self._planning.earl_round(now)
        if earl or not self._planning.due(now):
            return earl
        gen = [s for s in self._sessions.actors.values() if "generate" in s.accepting]
        cap = max(1, sum(s.capacity for s in gen))
        queued = self._table.queued("generate")
        active = sum(len(s.held) for s in gen)
        rollout_time, train_time = self._jobs.last_step_times()
        return self._planning.start(now, queue_pressure=min(1.0, queued / cap), active_pressure=min(1.0, active / cap),
                                    rejected_total=self.stats["busy"], rollout_time=rollout_time,
                                    train_time=train_time)
