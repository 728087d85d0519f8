"""The dashboard's server side: the loopback-or-token rule (``libra dashboard`` refuses a public address without a
token), the token check on every route but the static files (the real Starlette app, driven over ASGI), and the
poller (a status a poll, a job poll only when the job's summary changed, one event per poll to each page)."""

from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from libra.client.errors import BrokerUnreachable, LibraError
from libra.dashboard.__main__ import MissingExtra, _web, main
from libra.dashboard.app import build_app
from libra.dashboard.guard import bind_problem, is_loopback
from libra.dashboard.history import History
from libra.dashboard.poller import Poller

TOKEN = "s3cret-token-0123456789"


@pytest.fixture(autouse=True)
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command line that is not refused fails the test instead of serving forever."""
    def refuse() -> None:
        raise AssertionError("libra dashboard went on to serve: it should have refused")

    monkeypatch.setattr("libra.dashboard.__main__._web", refuse)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7", "example.invalid"])
def test_a_public_address_without_a_token_is_refused_with_exit_2(host: str, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LIBRA_DASHBOARD_TOKEN", raising=False)
    assert main(["--host", host, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"--host {host} is not a loopback address" in err and "--token" in err and "LIBRA_DASHBOARD_TOKEN" in err


def test_a_short_token_is_refused_and_the_environment_token_counts(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["--host", "0.0.0.0", "--token", "abc"]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    monkeypatch.setenv("LIBRA_DASHBOARD_TOKEN", TOKEN)
    assert bind_problem("0.0.0.0", TOKEN) is None
    monkeypatch.setenv("LIBRA_DASHBOARD_TOKEN", "short")
    assert main(["--host", "0.0.0.0"]) == 2 and "at least 16" in capsys.readouterr().err


def test_without_the_web_packages_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    with pytest.raises(MissingExtra, match=r"needs uvicorn: pip install 'libra\[dashboard\]'"):
        _web()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_needs_no_token(host: str) -> None:
    assert is_loopback(host) and bind_problem(host, None) is None


def test_a_bad_broker_address_is_refused_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--broker", "http://nope"]) == 2
    assert "libra dashboard:" in capsys.readouterr().err


class Broker:
    """Answers ``status`` and ``job_poll`` like an AsyncClient, from what the test sets."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {"completed": 0}
        self.polls: list[tuple[str, int]] = []
        self.down = False

    async def status(self, timeout: float = 5.0) -> Any:
        if self.down:
            raise BrokerUnreachable("no status reply within 1s")
        return SimpleNamespace(actors=[{"id": "h/cpu0", "host": "h", "slot": "cpu0", "kinds": ["train"]}],
                               queues={"generate:default": 2}, stats=json.loads(json.dumps(self.stats)))

    async def job_poll(self, name: str, cursor: int = 0, *, timeout: float = 30.0, limit: int = 500) -> dict[str, Any]:
        self.polls.append((name, cursor))
        if name == "gone":
            raise LibraError("no job 'gone' on this broker")
        step = cursor + 1
        return {"records": [{"step": step, "reward_mean": 0.1 * step}], "next_cursor": cursor + 1, "state": "running"}


def asgi_get(app: Any, path: str, query: str = "", headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One GET through the ASGI app (no HTTP client needed); an event stream is read up to its first event."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8265)}
    out: dict[str, Any] = {"body": b""}
    first_event = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await first_event.wait()
        return {"type": "http.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            out["status"] = msg["status"]
        elif msg["type"] == "http.response.body":
            out["body"] += msg.get("body", b"")
            if b"\n\n" in out["body"] or not msg.get("more_body"):
                first_event.set()

    async def go() -> None:
        await asyncio.wait_for(app(scope, receive, send), 10)

    asyncio.run(go())
    return out["status"], out["body"]


def make_poller() -> Poller:
    poller = Poller(Broker(), History("tcp://b:1"), interval_s=1.0, clock=lambda: 1000.0)
    asyncio.run(poller.poll_once())
    return poller


def test_with_a_token_every_route_but_the_static_files_answers_401_without_it() -> None:
    app = build_app(make_poller(), TOKEN)
    for path in ("/", "/api/status", "/api/events"):
        status, body = asgi_get(app, path)
        assert status == 401 and b"token" in body, path
        assert asgi_get(app, path, query="token=wrong-token-0123456789")[0] == 401
        assert asgi_get(app, path, headers={"Authorization": "Bearer nope"})[0] == 401
    assert asgi_get(app, "/", query=f"token={TOKEN}")[0] == 200
    status, body = asgi_get(app, "/api/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and json.loads(body)["snapshot"]["queues"] == {"generate:default": 2}
    status, body = asgi_get(app, "/api/events", query=f"token={TOKEN}")
    assert status == 200 and b"\ndata: {" in body
    assert asgi_get(app, "/static/uPlot.iife.min.js")[0] == 200  # the library and the page's script: public


def test_without_a_token_the_page_and_the_api_answer() -> None:
    app = build_app(make_poller())
    status, body = asgi_get(app, "/")
    assert status == 200 and b"<title>Libra dashboard</title>" in body
    assert json.loads(asgi_get(app, "/api/status")[1])["polls"] == 1
    for f in ("dashboard.js", "dashboard.css", "uPlot.min.css", "NOTICE"):
        assert asgi_get(app, f"/static/{f}")[0] == 200, f


def test_the_poller_asks_for_a_jobs_records_only_when_its_summary_changed() -> None:
    broker = Broker()
    poller = Poller(broker, History("tcp://b:1"), clock=lambda: 1000.0)

    async def go() -> list[str | None]:
        q = poller.subscribe()
        broker.stats["jobs"] = {"j": {"state": "running", "steps_done": 0}, "gone": {"state": "running"}}
        await poller.poll_once()
        await poller.poll_once()  # nothing changed: no job poll
        broker.stats["jobs"]["j"]["steps_done"] = 1
        await poller.poll_once()
        broker.down = True
        await poller.poll_once()
        poller.close()
        return [q.get_nowait() for _ in range(q.qsize())]

    events = asyncio.run(go())
    assert [p for p in broker.polls if p[0] == "j"] == [("j", 0), ("j", 1)]
    assert broker.polls.count(("gone", 0)) == 3  # refused each time: asked again, never recorded
    views = [json.loads(e) for e in events if e is not None]
    assert events[-1] is None and len(views) == 3  # 4 polls, 3 kept (the queue keeps the newest), then the end
    last = views[-1]
    assert last["error"].startswith("BrokerUnreachable") and last["polls"] == 3
    assert last["jobs"]["j"]["step"] == [1, 2] and "gone" not in last["jobs"]
