"""The dispatcher of the broker core: moves work between the work table and the actors.

It takes requests in (``Submit`` after its checks, a job's work, a restored request), decides where each
runs (a generate turn asks the rollout router, an action the action policy when one is configured,
anything else goes to the least-loaded actor that serves it, else waits in its FCFS queue; work pinned
to an actor, ``Work.pin``, goes to that actor only and fails when it is gone), hands work
out when an actor has free credit, takes it back (result, hand-back, lost actor, expired lease or
deadline, cancel) and produces the one Reply of every request. It returns what to send as commands in
``out``; it never sends, logs or writes anything itself.

It reads and updates the session registry's records (their work fields: ``held``, ``cores_used``,
``targeted``, ``completed``), the work table, the rollout router's bookkeeping and the action policy, all
through their public interfaces, and the job board (``job_board.JobBoard``) for the replies of work a job owns
and the weights a job published.
"""

from __future__ import annotations

from typing import Any

from libra.policies.routing.interface import RoutingError
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode

from .actions import ActionPlacement
from .config import BrokerConfig
from .events import Command, JournalWrite, Log, Send
from .job_board import JobBoard
from .journal import accept_record, start_record
from .rollout import RolloutRouting
from .sessions import ActorSession, ClientSession, SessionRegistry
from .work import Work, WorkState
from .work_table import WorkTable

__all__ = ["Dispatcher"]

#: The Reply fields a ``done`` journal record keeps.
_REPLY_FIELDS = ("ok", "output", "error_code", "error", "work_id", "attempts", "actor_id", "duration_s",
                 "retry_after_s", "tool_code")


class Dispatcher:
    """Matches work to actors (see the module docstring). ``counters`` is the core's stats dict."""

    def __init__(self, config: BrokerConfig, counters: dict[str, int], sessions: SessionRegistry,
                 table: WorkTable, rollout: RolloutRouting, actions: ActionPlacement | None, jobs: JobBoard,
                 journaling: bool) -> None:
        self.config = config
        self.stats = counters
        self.sessions = sessions
        self.table = table
        self.rollout = rollout
        self.actions = actions
        self.jobs = jobs
        self.journaling = journaling
        self.lending: Any = None  # the broker's lent slots (lending.Lending), set by BrokerState

    # ------------------------------------------------------------------ new work
    def on_submit(self, cs: ClientSession, peer: bytes, msg: m.Submit, now: float, out: list[Command]) -> None:
        """A client's Submit: answer a resubmission from the record, refuse what cannot run (bad kind or
        timeout, no actor offers it, back-pressure), else accept it (journaled) and place it."""
        dup = self.table.in_flight(cs.client_id, msg.request_id)
        if dup is not None:  # already in flight: the one Reply will come when it finishes
            self.stats["duplicates"] += 1
            dup.client = peer
            return
        cached = self.table.cached_reply(cs.client_id, msg.request_id)
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
        why = self.sessions.refusal(msg.kind, msg.name, now, bool(self.jobs.hosts or self.config.planner))
        if why is not None:
            self.stats["unknown_tool"] += 1
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.UNKNOWN_TOOL.value, why)))
            return
        waiting = self.table.queue_len(key)
        if waiting is not None and waiting >= self.config.max_queued_per_key:
            self.stats["busy"] += 1
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BUSY.value,
                                          f"{waiting} requests already wait for {msg.kind} {msg.name!r}",
                                          retry_after_s=1.0)))
            return
        if cs.inflight >= self.config.max_inflight_per_client:
            self.stats["busy"] += 1
            out.append(Send(peer, m.Reply(msg.request_id, False, None, ErrorCode.BUSY.value,
                                          f"this client already has {cs.inflight} unanswered requests",
                                          retry_after_s=0.5)))
            return
        w = self.table.admit(cs.client_id, msg.request_id, peer, msg.kind, key[1], msg.args, msg.trajectory,
                             msg.timeout_s, now, "submit", prior_attempts=msg.prior_attempts)
        if self.journaling:
            out.append(accept_record(cs.client_id, msg, w.work_id))
        cs.inflight += 1
        self.stats["submitted"] += 1
        if w.failures > self.config.max_retries:  # a direct call whose actor was lost too often
            self.fail(w, now, out, ErrorCode.RETRIES_EXHAUSTED,
                      f"its actor was lost {w.failures} times; giving up after {self.config.max_retries} retries")
            return
        self.submit(w, now, out)

    def on_cancel(self, cs: ClientSession | None, msg: m.CancelRequest, now: float, out: list[Command]) -> None:
        w = self.table.in_flight(cs.client_id, msg.request_id) if cs is not None else None
        if w is not None:
            self.fail(w, now, out, ErrorCode.CANCELLED, "cancelled by the client")

    def submit(self, w: Work, now: float, out: list[Command]) -> None:
        """Place newly accepted client work: route a turn, schedule an action, or give it to an actor."""
        if w.kind == "generate" and w.trajectory:
            self.route_generate(w, now, out)
            return
        if w.kind == "action" and self.actions is not None:
            self.table.push(w)
            self.schedule_actions(now, out)
            return
        self.offer(w, now, out)

    def offer(self, w: Work, now: float, out: list[Command]) -> None:
        """Give new ``w`` to the least-loaded actor that serves it (pinned work: its actor only), else queue it."""
        sess = self._taker(w)
        if sess is not None:
            self.assign(w, sess, now, out)
        else:
            self.table.push(w)

    def _taker(self, w: Work) -> ActorSession | None:
        """The actor to give ``w`` now: pinned work only to its own actor when it serves ``w`` and has credit."""
        if not w.pin:
            return self.sessions.best_actor(w.key)
        sess = self.sessions.actor_by_id(w.pin)
        return sess if sess is not None and sess.free > 0 and sess.serves(*w.key) else None

    def route_generate(self, w: Work, now: float, out: list[Command]) -> None:
        """Ask the rollout router where this turn runs; stick to that instance or queue for it."""
        view = self.rollout.view(self.sessions.rollout_instances())
        try:
            d, tr = self.rollout.route(w.trajectory or "", w.args, view)
        except RoutingError as exc:  # no ready rollout instance (yet): queue it; any instance may take it
            out.append(Log("generate turn queued: no rollout instance can take it now",
                           {"work_id": w.work_id, "trajectory": w.trajectory, "why": str(exc)},
                           component="libra.broker.rollout"))
            bucket = self.rollout.buckets[0].name
            w.route = {"bucket": bucket, "reason": "no_instance", "migrated": False, "mode": None}
            w.name = bucket
            self.table.push(w)
            self.refill_others(None, now, out)  # an instance of another bucket may be idle
            return
        w.route = {"bucket": d.bucket, "reason": d.reason, "migrated": d.migrated, "mode": d.migrate_mode}
        if self.lending is not None and self.lending.evicted:  # leaving a slot its owner reclaimed
            self.lending.route(w.trajectory or "", tr.context, w.route, now)
        target = self.sessions.actor_by_id(d.instance_id) if d.instance_id else None
        w.name = target.bucket if target is not None else (d.placed_bucket or d.bucket)
        if target is not None and target.free > 0:
            self.assign(w, target, now, out)
            return
        if target is not None:
            w.target = target.peer
            target.targeted += 1
        self.table.push(w)

    def schedule_actions(self, now: float, out: list[Command]) -> None:
        """Let action placement start queued actions (see ``actions.py``): one round over every action
        actor's cores and GPU services; each placed action leaves its queue with its route."""
        assert self.actions is not None
        queues = self.table.queues
        if not any(q for (k, _), q in queues.items() if k == "action"):
            return
        works = self.table.works
        for wid, sess, route in self.actions.place(list(self.sessions.actors.values()), queues, works, now):
            w = works[wid]
            queues[w.key].remove(wid)
            w.route = route
            self.assign(w, sess, now, out)
        for actor_id, why in self.actions.unparsed_labels():  # the actor runs on its fallback: say so
            self.stats["actor_labels_unparsed"] = self.stats.get("actor_labels_unparsed", 0) + 1
            out.append(Log("actor_labels_unparsed", {"actor": actor_id, "error": why,
                                                     "fallback": "its own cores, no CPU ids or NUMA nodes"},
                           "warning", "libra.broker.actions"))

    # ------------------------------------------------------------------ handing work out
    def fill(self, sess: ActorSession, now: float, out: list[Command]) -> None:
        """Give ``sess`` the oldest queued work it can serve until its credit runs out."""
        if self.actions is not None and "action" in sess.accepting:
            self.schedule_actions(now, out)
        orphans = self._orphan_buckets() if "generate" in sess.accepting else frozenset()
        queues, works = self.table.queues, self.table.works
        scheduled = self.actions is not None
        while sess.free > 0:
            best_key: tuple[str, str] | None = None
            best_seq = 0
            best_i = 0
            for key, q in queues.items():
                if q and (sess.serves(*key) or (key[0] == "generate" and key[1] in orphans and sess.directive is None)
                          ) and not (key[0] == "action" and scheduled):
                    i = 0
                    if key[0] == "generate":  # sticky turns wait for their own instance
                        i = next((j for j, wid in enumerate(q) if works[wid].target in (None, sess.peer)), -1)
                        if i < 0:
                            continue
                    elif works[q[0]].pin and works[q[0]].pin != sess.actor_id:  # pinned work waits for its actor
                        i = next((j for j, wid in enumerate(q) if works[wid].pin in ("", sess.actor_id)), -1)
                        if i < 0:
                            continue
                    seq = works[q[i]].seq
                    if best_key is None or seq < best_seq:
                        best_key, best_seq, best_i = key, seq, i
            if best_key is None:
                return
            self.assign(self.table.take(best_key, best_i), sess, now, out)

    def refill_others(self, skip: ActorSession | None, now: float, out: list[Command]) -> None:
        """Offer queued work to every actor with free credit except ``skip``. Nothing queued: nothing to offer,
        and no scan of every actor (a lost actor calls this: 1,000 idle actors expiring at once among 19,000
        were 19 million fills, the loop stalled, more expired, and the broker collapsed)."""
        if not any(self.table.queues.values()):
            return
        for other in list(self.sessions.actors.values()):
            if other is not skip and other.free > 0:
                self.fill(other, now, out)

    def _orphan_buckets(self) -> frozenset[str]:
        """Names of generate queues that no ready rollout instance serves: a bucket a re-plan removed, or one
        whose instances are all gone or switching. Any rollout instance takes their turns rather than letting
        them wait for an instance that may never come."""
        served = self.sessions.served_buckets()
        return frozenset(k[1] for k, q in self.table.queues.items() if k[0] == "generate" and q and k[1] not in served)

    def assign(self, w: Work, sess: ActorSession, now: float, out: list[Command]) -> None:
        """Lease ``w`` (off its queue) to ``sess`` and send the Assign."""
        if w.target is not None:
            t = self.sessions.actors.get(w.target)
            if t is not None:
                t.targeted -= 1
            w.target = None
        self.table.lease(w, sess.peer, sess.actor_id, now, self.config.lease_s)
        if self.journaling and not self.jobs.owns(w.client_id):  # a restart keeps its lease and attempt count
            out.append(start_record(w))
        sess.held.add(w.work_id)
        self.sessions.took_work(sess)
        if w.kind == "action" and self.actions is not None:
            self.actions.hold(w, sess, now)
        sess.last_sent = now
        args = w.args
        weights = self.jobs.weights
        if w.kind == "generate" and weights is not None and type(args) is dict and args.get("weights") is None:
            args = {**args, "weights": weights}  # a job's newest version, loaded between turns
        out.append(Send(sess.peer, m.Assign(w.work_id, w.lease, w.attempt, w.kind, w.name, args,
                                            w.trajectory, max(0.0, w.deadline - now), w.route)))

    # ------------------------------------------------------------------ taking work back
    def on_result(self, sess: ActorSession, msg: m.WorkResult, now: float, out: list[Command]) -> None:
        w = self.table.current(msg.work_id, msg.lease, sess.peer)
        if w is None:
            self.stats["stale_results"] += 1
            return
        sess.held.discard(w.work_id)
        self.release_cores(w, sess, failed=not msg.ok, now=now)
        sess.completed += 1
        if w.trajectory:
            if w.kind == "generate" and msg.ok:
                self.rollout.turn_done(w.trajectory, msg.output)
                if self.lending is not None and self.lending.evicted:
                    self.lending.turn_done(w.trajectory, sess.actor_id, out)
            elif w.kind == "action":
                self.rollout.tool_returned(w.trajectory, w.name, msg.ok, msg.output, msg.error_code,
                                           now - w.submitted_at)
        if msg.ok:
            w.move(WorkState.DONE, "result")
            self.stats["completed"] += 1
            self.finish(w, m.Reply(w.request_id, True, msg.output, "", "", w.work_id, w.attempt,
                                   sess.actor_id, msg.duration_s), out)
        else:
            tool_code = msg.error_code or ErrorCode.TOOL_FAILED.value
            w.move(WorkState.FAILED, tool_code)
            self.stats["failed"] += 1
            self.finish(w, m.Reply(w.request_id, False, None, ErrorCode.TOOL_FAILED.value, msg.error, w.work_id,
                                   w.attempt, sess.actor_id, msg.duration_s, tool_code=tool_code), out)
        if sess.reclaimed_until and self.lending is not None:
            self.lending.work_left(sess, out)
        self.fill(sess, now, out)

    def on_handback(self, sess: ActorSession | None, msg: m.Handback, now: float, out: list[Command]) -> None:
        w = self.table.current(msg.work_id, msg.lease, sess.peer) if sess is not None else None
        if sess is None or w is None:
            self.stats["stale_results"] += 1
            return
        sess.held.discard(w.work_id)
        self.release_cores(w, sess, now=now)
        self.stats["handbacks"] += 1
        self.requeue(w, now, out, f"handback: {msg.reason}", count_failure=False, front=True)
        if sess.reclaimed_until and self.lending is not None:
            self.lending.work_left(sess, out)
        self.fill(sess, now, out)

    def actor_gone(self, sess: ActorSession, now: float, out: list[Command], why: str, lost: bool) -> None:
        """The session ``sess`` was closed: re-queue what it held (counting a loss if ``lost``)."""
        self.release_targets(sess.peer)
        works = self.table.works
        for wid in sorted(sess.held, key=lambda x: works[x].seq):
            self.release_cores(works[wid], sess, now=now)
            self.requeue(works[wid], now, out, why, count_failure=lost)
        sess.held.clear()
        self.refill_others(None, now, out)  # released turns may fit an idle instance now

    def release_targets(self, peer: bytes) -> None:
        """Queued generate turns that waited for ``peer`` may now run on any instance of their bucket."""
        sess = self.sessions.actors.get(peer)
        works = self.table.works
        for key, q in self.table.queues.items():
            if key[0] == "generate":
                for wid in q:
                    w = works[wid]
                    if w.target == peer:
                        w.target = None
                        if w.trajectory:
                            self.rollout.requeue_target_lost(w.trajectory)
        if sess is not None:
            sess.targeted = 0

    def release_cores(self, w: Work, sess: ActorSession, failed: bool = False, now: float | None = None) -> None:
        if self.actions is not None and w.kind == "action":
            sess.cores_used = max(0, sess.cores_used - self.actions.unstarted(w.work_id, failed, now))

    def expire(self, now: float, out: list[Command]) -> None:
        """On the timer: fail work past its deadline, take back work whose lease expired."""
        for w in self.table.due_deadlines(now):
            self.stats["timeouts"] += 1
            self.fail(w, now, out, ErrorCode.TIMEOUT,
                      f"no result within {w.deadline - w.submitted_at:.3g}s (attempts: {w.attempt})")
        for w in self.table.due_leases(now):
            holder = self.sessions.actors.get(w.actor) if w.actor else None
            self.take_back(w, holder, now, out, "lease expired", count_failure=True)
            if holder is not None:
                self.fill(holder, now, out)

    def take_back(self, w: Work, holder: ActorSession | None, now: float, out: list[Command], why: str,
                  count_failure: bool, front: bool = False) -> None:
        """Take leased ``w`` from ``holder`` (revoked, its cores released; None: its holder is gone) and
        re-queue it (:meth:`requeue`)."""
        if holder is not None:
            holder.held.discard(w.work_id)
            self.release_cores(w, holder, now=now)
            out.append(Send(holder.peer, m.Revoke(w.work_id, w.lease, why)))
        self.requeue(w, now, out, why, count_failure=count_failure, front=front)

    def requeue(self, w: Work, now: float, out: list[Command], why: str, count_failure: bool,
                front: bool = False) -> None:
        """Leased ``w`` comes back (its holder already let go): run it again elsewhere, or fail it once it
        was lost more than ``max_retries`` times. Pinned work runs again only on its own actor: it fails at
        once when that actor is gone or no longer serves it."""
        if w.pin:
            mine = self.sessions.actor_by_id(w.pin)
            if mine is None or not mine.serves(*w.key):
                w.actor = None
                self.fail(w, now, out, ErrorCode.RETRIES_EXHAUSTED,
                          f"pinned to actor {w.pin!r}, which {'is gone' if mine is None else 'no longer serves it'}"
                          f" (last: {why})")
                return
        if count_failure:
            w.failures += 1
            if w.failures > self.config.max_retries:
                w.actor = None
                self.fail(w, now, out, ErrorCode.RETRIES_EXHAUSTED,
                          f"lost {w.failures} times (last: {why}); giving up after {self.config.max_retries} retries")
                return
        w.actor = None
        w.move(WorkState.QUEUED, why)
        self.stats["requeued"] += 1
        if w.kind == "generate" and w.trajectory:
            self.rollout.requeue_target_lost(w.trajectory)
            if self.lending is not None and w.trajectory in self.lending.evicted and type(w.route) is dict:
                tr = self.rollout.trajs.get(w.trajectory)
                self.lending.route(w.trajectory, tr.context if tr else 0, w.route, now)
        sess = None if (w.kind == "action" and self.actions is not None) else self._taker(w)
        if sess is not None:
            self.assign(w, sess, now, out)
            return
        self.table.put_back(w, front)
        if w.kind == "action" and self.actions is not None:
            self.schedule_actions(now, out)

    def fail(self, w: Work, now: float, out: list[Command], code: ErrorCode, why: str) -> None:
        """End live ``w`` with an error: off its queue, or revoked from its holder; the one Reply says why."""
        if w.state is WorkState.QUEUED:
            if w.target is not None and w.target in self.sessions.actors:
                self.sessions.actors[w.target].targeted -= 1
            w.target = None
            self.table.unqueue(w)
        elif w.state is WorkState.LEASED and w.actor is not None:
            holder = self.sessions.actors.get(w.actor)
            if holder is not None:
                holder.held.discard(w.work_id)
                self.release_cores(w, holder, now=now)
                out.append(Send(holder.peer, m.Revoke(w.work_id, w.lease, code.value)))
                self.fill(holder, now, out)
        w.move(WorkState.FAILED, code.value)
        self.stats["failed"] += 1
        self.finish(w, m.Reply(w.request_id, False, None, code.value, why, w.work_id, w.attempt), out)

    def finish(self, w: Work, reply: m.Reply, out: list[Command]) -> None:
        """Send the one Reply for ``w`` and forget the work, remembering the reply for resubmits (work a job
        owns: its reply goes to the job board)."""
        self.table.remove(w)
        if self.actions is not None and w.kind == "action":
            self.actions.ended(w.work_id)
        if self.jobs.owns(w.client_id):
            self.table.release(w)
            self.jobs.collect(w.client_id, w.request_id, reply)
            return
        cs = self.sessions.client_for(w.client, w.client_id)
        if cs is not None:
            cs.inflight = max(0, cs.inflight - 1)
        if self.journaling:
            out.append(JournalWrite("done", w.client_id, w.request_id, {f: getattr(reply, f) for f in _REPLY_FIELDS}))
        self.table.remember(w, reply)
        out.append(Send(w.client, reply))

    # ------------------------------------------------------------------ re-plans
    def rehome(self, buckets: dict[str, str], now: float, out: list[Command]) -> None:
        """Move rollout instances and queued turns of removed buckets onto current ones (``events.Rehome``)."""
        for sess in self.sessions.actors.values():
            if "generate" in sess.accepting and sess.bucket in buckets:
                sess.bucket = buckets[sess.bucket]
        if self.table.rename_generate(buckets):
            self.refill_others(None, now, out)

    def cancel_owned(self, client_id: str, now: float, out: list[Command], why: str) -> None:
        """Fail, as cancelled, everything ``client_id`` still has (a job that stopped)."""
        for w in self.table.owned_by(client_id):
            self.fail(w, now, out, ErrorCode.CANCELLED, why)
