"""``JobPoll`` answers a page of at most ``limit`` records (default ``JOB_POLL_LIMIT``, at most
``JOB_POLL_MAX_LIMIT``; a bad limit is a ``bad_request`` Reply) and says whether more are waiting; the dashboard
and the driver page on from ``next_cursor``. Before, the first poll of a long job carried all its records."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from libra.broker.events import PeerMessage
from libra.broker.state import BrokerConfig, BrokerState
from libra.dashboard.history import History
from libra.dashboard.poller import Poller
from libra.protocol import decode, encode
from libra.protocol import messages as m
from libra.protocol.errors import ErrorCode
from libra.protocol.payloads_job import JobPollReply

SPEC = {"steps": 2, "prompts_per_step": 2, "group_size": 3, "max_policy_lag": 1, "world_size": 1, "env": "arith",
        "episode": {"sampling": {"max_new_tokens": 8}}, "grpo": {"lr": 1e-5}, "micro_batch_tokens": 64,
        "master_port": 12345, "checkpoint_dir": "/tmp/ck"}
ROWS = [{"pid": f"p{i}", "question": f"{i}+1", "answer": i + 1} for i in range(5)]


def _ask(s: BrokerState, msg: Any) -> m.Reply:
    (reply,) = [c.msg for c in s.handle(PeerMessage(b"client", msg), 1.0) if isinstance(getattr(c, "msg", None), m.Reply)]
    return reply


@pytest.fixture
def broker() -> BrokerState:
    """A broker core hosting job ``j`` whose record list is long (as a job's after many steps)."""
    s = BrokerState(BrokerConfig())
    s.handle(PeerMessage(b"client", m.ClientHello("client-1", 1)), 0.5)
    assert _ask(s, m.JobSubmit("s1", "j", SPEC, ROWS)).ok
    s._jobs.hosts["j"].records.extend({"step": i + 1, "reward_mean": 0.0} for i in range(1234))
    return s


def test_a_poll_answers_one_page_and_says_more_are_waiting(broker: BrokerState) -> None:
    first = JobPollReply.from_wire(_ask(broker, m.JobPoll("p1", "j")).output)
    assert len(first.records) == m.JOB_POLL_LIMIT and first.more and first.next_cursor == m.JOB_POLL_LIMIT
    steps, cursor, more = [r["step"] for r in first.records], first.next_cursor, first.more
    while more:
        page = JobPollReply.from_wire(_ask(broker, m.JobPoll("p", "j", cursor, limit=400)).output)
        assert len(page.records) <= 400
        steps += [r["step"] for r in page.records]
        cursor, more = page.next_cursor, page.more
    assert steps == list(range(1, 1235)) and cursor == 1234  # every record once, in order
    last = JobPollReply.from_wire(_ask(broker, m.JobPoll("p", "j", cursor)).output)
    assert last.records == [] and not last.more


@pytest.mark.parametrize("bad", [0, -3, m.JOB_POLL_MAX_LIMIT + 1])
def test_a_bad_limit_is_a_typed_bad_request(broker: BrokerState, bad: int) -> None:
    r = _ask(broker, m.JobPoll("p", "j", limit=bad))
    assert not r.ok and r.error_code == ErrorCode.BAD_REQUEST.value and "JobPoll.limit" in r.error and str(bad) in r.error
    assert _ask(broker, m.JobPoll("p", "j", limit=m.JOB_POLL_MAX_LIMIT)).ok  # the maximum itself is fine


def test_the_limit_travels_on_the_wire_and_an_old_poll_gets_the_default() -> None:
    assert decode(encode(m.JobPoll("r", "j", 3, False, 17))).msg.limit == 17
    assert decode(encode(m.JobPoll("r", "j", 3))).msg.limit == m.JOB_POLL_LIMIT


class PagedBroker:
    """Answers ``status`` and ``job_poll`` for one job of ``n`` records, a page at a time (as the broker)."""

    def __init__(self, n: int) -> None:
        self.records = [{"step": i + 1, "reward_mean": 0.5} for i in range(n)]
        self.polls: list[tuple[int, int]] = []

    async def status(self, timeout: float = 5.0) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(actors=[], queues={}, stats={"jobs": {"j": {"state": "running", "steps_done": 1}}})

    async def job_poll(self, name: str, cursor: int = 0, *, timeout: float = 30.0,
                       limit: int = m.JOB_POLL_LIMIT) -> dict[str, Any]:
        self.polls.append((cursor, limit))
        page = self.records[cursor:cursor + limit]
        return {"records": page, "next_cursor": cursor + len(page), "more": cursor + len(page) < len(self.records),
                "state": "running"}


def test_the_dashboard_pages_through_a_long_jobs_records() -> None:
    client, history = PagedBroker(1234), History("tcp://b:1")
    poller = Poller(client, history, page_size=500)
    asyncio.run(poller.poll_once())
    assert client.polls == [(0, 500), (500, 500), (1000, 500)]  # three bounded replies, not one of 1234 records
    assert history.job_cursor("j") == 1234 and [p["step"] for p in history.jobs["j"]["steps"]][-1] == 1234
    asyncio.run(poller.poll_once())  # the job's summary did not change: not polled again
    assert len(client.polls) == 3
