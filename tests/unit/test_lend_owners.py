"""The owner plug-ins of lent capacity (libra.actors.owners): the --lend grammar and each of its errors, the
notice owner through its file, its HTTP callback and its signals, the schedule owner, and the serving-load
owner against a fake load endpoint that answers scripted readings."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from libra.actors.owners import (
    LendSpec,
    LendSpecError,
    NoticeOwner,
    Owner,
    OwnerError,
    ScheduleOwner,
    ServingLoadOwner,
    owner_from_spec,
    parse_lend_spec,
)
from libra.policies.lending import HeadroomRule

# -- the spec --------------------------------------------------------------------------------------------


def test_each_kind_parses_into_typed_settings() -> None:
    s = parse_lend_spec("owner=fleet-a,kind=serving,url=http://127.0.0.1:8001/,target_ms=50,hold_s=2")
    assert s == LendSpec("fleet-a", "serving", {"url": "http://127.0.0.1:8001", "target_ms": 50.0, "hold_s": 2.0})
    assert s.label() == {"owner": "fleet-a", "rule": "headroom"}
    n = parse_lend_spec("owner=spot,kind=notice,file=/run/libra/reclaim,http=0,signal=usr1,deadline_s=12")
    assert n.options == {"file": "/run/libra/reclaim", "http": 0, "signal": "USR1", "deadline_s": 12.0}
    assert n.rule == "notice"
    w = parse_lend_spec("owner=night,kind=schedule,windows=22:00-06:00;12:00-13:30")
    assert w.options["windows"] == ((79200.0, 21600.0), (43200.0, 48600.0))


@pytest.mark.parametrize(("spec", "key"), [
    ("", "--lend:"),
    ("kind=notice,file=/x", "owner"),
    ("owner=a b,kind=notice,file=/x", "owner"),
    ("owner=a,kind=cloud", "kind"),
    ("owner=a,kind=notice", "file"),
    ("owner=a,kind=notice,file=/x,colour=red", "colour"),
    ("owner=a,kind=notice,file=/x,file=/y", "file"),
    ("owner=a,kind=notice,file", "'file' is not key=value"),
    ("owner=a,kind=notice,http=http", "http"),
    ("owner=a,kind=notice,http=70000", "http"),
    ("owner=a,kind=notice,signal=HUP", "signal"),
    ("owner=a,kind=notice,file=/x,deadline_s=-1", "deadline_s"),
    ("owner=a,kind=notice,file=/x,deadline_s=soon", "deadline_s"),
    ("owner=a,kind=serving,target_ms=50", "url"),
    ("owner=a,kind=serving,url=ftp://h,target_ms=50", "url"),
    ("owner=a,kind=serving,url=http://h:1", "target_ms"),
    ("owner=a,kind=serving,url=http://h:1,target_ms=0", "target_ms"),
    ("owner=a,kind=serving,url=http://h:1,target_ms=nan", "target_ms"),
    ("owner=a,kind=serving,url=http://h:1,target_ms=5,reclaim_above=1.5", "reclaim_above"),
    ("owner=a,kind=serving,url=http://h:1,target_ms=5,lend_below=0.9,reclaim_above=0.8", "lend_below"),
    ("owner=a,kind=serving,url=http://h:1,target_ms=5,windows=1:00-2:00", "windows"),
    ("owner=a,kind=schedule", "windows"),
    ("owner=a,kind=schedule,windows=22:00", "windows"),
    ("owner=a,kind=schedule,windows=25:00-06:00", "windows"),
    ("owner=a,kind=schedule,windows=10:00-10:00", "windows"),
    ("owner=a,kind=schedule,windows=10:00-11:60", "windows"),
])
def test_each_bad_spec_is_a_typed_error_naming_its_key(spec: str, key: str) -> None:
    with pytest.raises(LendSpecError, match=key):
        parse_lend_spec(spec)
    with pytest.raises(ValueError):  # LendSpecError is a ValueError: a CLI can treat it as bad input
        owner_from_spec(spec)


def test_owner_from_spec_builds_each_kind(tmp_path) -> None:
    made = [owner_from_spec("owner=s,kind=serving,url=http://127.0.0.1:9,target_ms=40,deadline_s=3"),
            owner_from_spec(f"owner=n,kind=notice,file={tmp_path / 'r'},deadline_s=7"),
            owner_from_spec("owner=w,kind=schedule,windows=00:00-24:00")]
    try:
        assert [type(o) for o in made] == [ServingLoadOwner, NoticeOwner, ScheduleOwner]
        assert all(isinstance(o, Owner) for o in made) and [o.name for o in made] == ["s", "n", "w"]
        assert made[0].rule == HeadroomRule(target_s=0.04, deadline_s=3.0)
        assert made[1].deadline_s == 7.0
    finally:
        for o in made:
            o.close()


# -- the notice owner --------------------------------------------------------------------------------------


def test_notice_file_present_reclaims_with_its_body_and_removed_lends(tmp_path) -> None:
    f = tmp_path / "reclaim"
    owner = NoticeOwner("spot", file=f, deadline_s=30)
    assert owner.poll(1000.0).allow
    f.write_text("")
    os.utime(f, (1000.0, 1000.0))
    sig = owner.poll(1004.0)  # the deadline counts from the notice (its mtime), not from the poll
    assert (sig.allow, sig.deadline_s, sig.reason) == (False, 26.0, "spot_notice")
    f.write_text(json.dumps({"deadline_s": 5, "reason": "maintenance"}))
    os.utime(f, (2000.0, 2000.0))
    assert (owner.poll(2001.0).deadline_s, owner.poll(2001.0).reason) == (4.0, "maintenance")
    assert owner.poll(3000.0).deadline_s == 0.0  # past its deadline: give it back now
    f.write_text("not json")
    os.utime(f, (4000.0, 4000.0))
    bad = owner.poll(4000.0)  # an unreadable body is still a notice (the safe side), with the default
    assert (bad.allow, bad.deadline_s) == (False, 30.0)
    f.unlink()
    assert owner.poll(4001.0).allow


def _post(url: str, body: bytes = b"") -> tuple[int, dict]:
    req = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_notice_http_callback_reclaims_and_lends_again() -> None:
    owner = NoticeOwner("spot", http_port=0, deadline_s=30)
    base = f"http://127.0.0.1:{owner.http_port}"
    try:
        assert owner.http_port and owner.poll(0).allow
        status, state = _post(f"{base}/reclaim", json.dumps({"deadline_s": 2.5, "reason": "preempted"}).encode())
        assert status == 200 and state["allow"] is False and state["reason"] == "preempted"
        import time

        sig = owner.poll(time.time())
        assert not sig.allow and 0 < sig.deadline_s <= 2.5 and sig.reason == "preempted"
        with urllib.request.urlopen(f"{base}/", timeout=5) as resp:
            assert json.loads(resp.read())["allow"] is False
        assert _post(f"{base}/reclaim", b'{"deadline_s": -1}')[0] == 400
        assert _post(f"{base}/reclaim", b"[1]")[0] == 400
        assert _post(f"{base}/nowhere")[0] == 404
        assert _post(f"{base}/lend")[0] == 200 and owner.poll(time.time()).allow
        status, _ = _post(f"{base}/reclaim")  # no body: the default deadline
        assert status == 200 and owner.poll(time.time()).deadline_s == pytest.approx(30, abs=1)
    finally:
        owner.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{base}/", timeout=2)


def test_notice_http_port_in_use_is_a_typed_error() -> None:
    first = NoticeOwner("a", http_port=0)
    try:
        with pytest.raises(OwnerError, match="cannot listen"):
            NoticeOwner("b", http_port=first.http_port)
    finally:
        first.close()


def test_notice_signals_reclaim_and_lend_in_the_main_thread() -> None:
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)
    owner = NoticeOwner("spot", signal_name="USR1", deadline_s=9)
    try:
        import time

        assert owner.poll(time.time()).allow
        os.kill(os.getpid(), signal.SIGUSR1)
        sig = owner.poll(time.time())
        assert (sig.allow, sig.reason) == (False, "spot_notice") and 8 < sig.deadline_s <= 9
        os.kill(os.getpid(), signal.SIGUSR2)
        assert owner.poll(time.time()).allow
    finally:
        owner.close()
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGUSR2)) == before


def test_notice_signal_outside_the_main_thread_is_a_typed_error() -> None:
    got: list[BaseException] = []

    def build() -> None:
        try:
            NoticeOwner("spot", signal_name="USR1")
        except BaseException as exc:  # noqa: BLE001 (what the thread saw is the result)
            got.append(exc)

    t = threading.Thread(target=build)
    t.start()
    t.join()
    assert len(got) == 1 and isinstance(got[0], OwnerError) and "main thread" in str(got[0])


# -- the schedule owner ----------------------------------------------------------------------------------


def test_schedule_owner_lends_inside_its_windows_only() -> None:
    owner = owner_from_spec("owner=night,kind=schedule,windows=22:00-06:00;12:00-13:00,deadline_s=60")
    day = 86_400 * 20_000
    assert owner.poll(day + 23 * 3600).allow and owner.poll(day + 5 * 3600).allow
    assert owner.poll(day + 12.5 * 3600).allow
    out = owner.poll(day + 9 * 3600)
    assert (out.allow, out.deadline_s, out.reason) == (False, 60.0, "outside_window")


# -- the serving-load owner against a fake load endpoint -----------------------------------------------------


class FakeLoad:
    """A loopback HTTP server whose ``GET /load`` answers the next scripted body (a dict, or raw bytes)."""

    def __init__(self) -> None:
        self.script: list[object] = []
        fake = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                return

            def do_GET(self) -> None:
                body = fake.script.pop(0) if fake.script else {"p99_tpot_s": None}
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(200 if self.path == "/load" else 404)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_serving_owner_follows_the_headroom_rule_on_scripted_readings() -> None:
    fake = FakeLoad()
    rule = HeadroomRule(target_s=0.050, hold_s=10.0, deadline_s=5.0)
    owner = ServingLoadOwner("fleet", fake.url, rule)
    try:
        fake.script = [{"p99_tpot_s": 0.020}, {"p99_tpot_s": 0.040}, {"p99_tpot_s": 0.045},
                       {"p99_tpot_s": 0.020}, {"p99_tpot_s": 0.030}, {"p99_tpot_s": None}]
        assert owner.poll(100.0).allow and owner.lent  # calm: lent at once
        assert owner.poll(101.0).allow  # 40 ms < 0.85 x 50 ms: still lent
        sig = owner.poll(102.0)  # 45 ms >= 42.5 ms: reclaimed with the rule's deadline
        assert (sig.allow, sig.deadline_s, sig.reason) == (False, 5.0, "slo_headroom_low")
        assert (owner.lent, owner.since) == (False, 102.0)
        assert not owner.poll(105.0).allow  # calm, but hold_s has not passed
        assert owner.poll(112.5).allow  # 30 ms < 35 ms and 10 s since the reclaim
        assert owner.poll(113.0).allow and owner.last_p99_s is None  # no traffic counts as headroom
    finally:
        fake.close()


def test_the_running_batch_reclaims_before_the_window_p99_moves_and_holds_the_lend_back() -> None:
    rule = HeadroomRule(target_s=0.050, hold_s=0.0, deadline_s=5.0)
    # the window's p99 (finished requests) is still calm; the batch decoding now is at 45 ms a token
    sig = rule.step(True, 0.020, 10.0, 0.0, step_s=0.045)
    assert (sig.allow, sig.reason) == (False, "slo_headroom_low")
    assert rule.step(True, 0.020, 10.0, 0.0, step_s=0.030).allow  # both under 42.5 ms: stays lent
    assert not rule.step(False, 0.020, 20.0, 0.0, step_s=0.036).allow  # 36 ms >= 35 ms: not calm, not lent
    assert rule.step(False, 0.020, 20.0, 0.0, step_s=None).allow  # idle owner, calm window: lent


def test_serving_owner_reads_the_running_batch_when_the_server_reports_it() -> None:
    fake = FakeLoad()
    owner = ServingLoadOwner("fleet", fake.url, HeadroomRule(target_s=0.050, hold_s=0.0, deadline_s=5.0))
    try:
        fake.script = [{"p99_tpot_s": 0.020, "step_tpot_s": 0.021}, {"p99_tpot_s": 0.020, "step_tpot_s": 0.046},
                       {"p99_tpot_s": 0.020, "step_tpot_s": "slow"}]
        assert owner.poll(1.0).allow and owner.last_step_s == 0.021
        sig = owner.poll(2.0)
        assert (sig.allow, sig.reason, owner.last_step_s) == (False, "slo_headroom_low", 0.046)
        assert owner.poll(3.0).reason == "owner_unreachable"  # a step time that is not a duration
    finally:
        fake.close()


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"p50_tpot_s": 0.01}', b'{"p99_tpot_s": "fast"}',
                                  b'{"p99_tpot_s": -1}'])
def test_serving_owner_reclaims_on_a_reading_it_cannot_use(body: bytes) -> None:
    fake = FakeLoad()
    owner = ServingLoadOwner("fleet", fake.url, HeadroomRule(target_s=0.05, hold_s=0, deadline_s=4))
    try:
        assert owner.poll(1.0).allow
        fake.script = [body]
        sig = owner.poll(2.0)
        assert (sig.allow, sig.deadline_s, sig.reason) == (False, 4.0, "owner_unreachable")
        assert owner.poll(3.0).allow  # readable and calm again (hold_s=0)
    finally:
        fake.close()


def test_serving_owner_reclaims_when_the_owner_is_unreachable() -> None:
    fake = FakeLoad()
    url = fake.url
    fake.close()  # nothing listens there now
    owner = ServingLoadOwner("fleet", url, HeadroomRule(target_s=0.05, deadline_s=4), timeout_s=0.2)
    sig = owner.poll(1.0)
    assert (sig.allow, sig.reason) == (False, "owner_unreachable") and not owner.reachable
