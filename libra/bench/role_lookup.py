"""What key roles cost the broker per message (``python -m libra.bench role_lookup``), in one run.

Under CURVE the broker's shell reads each message's key (the connection's ZAP user id) and looks its role up
(``libra.transport.zmqio.recv_frames_user``, ``libra.broker.roles``); without roles it read the frames as bytes
(``recv_frames``). One process, a CURVE ROUTER and a CURVE DEALER on loopback TCP with an authenticator over a
role-split allow directory: ``--messages`` small frames are queued, then drained by each reader in turn,
alternating ``--rounds`` times. Printed: µs per message for each and the difference, and the ratio.

The core's side (``libra.broker.access``: the role table and the job scope): the same ``Heartbeat`` handed to
one ``BrokerState`` as from a peer without CURVE (role "", nothing checked) and from a job-scoped client key
(``client:a``), best of ``--rounds``; printed the same way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from libra.broker.roles import REVOKED
from libra.local import free_port
from libra.protocol import encode
from libra.protocol import messages as m
from libra.transport.keys import create_keypair
from libra.transport.security import Authenticator, CurveClient, CurveServer, apply_client, apply_server
from libra.transport.zmqio import recv_frames, recv_frames_user

from .output import run_and_emit


def _drain(sock: zmq.Socket, n: int, with_role: Authenticator | None) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        if with_role is None:
            recv_frames(sock, 0)
        else:
            _, key = recv_frames_user(sock, 0)
            with_role.roles.get(key, REVOKED)
    return time.perf_counter() - t0


def _core(role: str, n: int, rounds: int) -> float:
    """µs per ``Heartbeat`` through ``BrokerState.handle`` from a client session whose key has ``role``."""
    from libra.broker.events import PeerMessage
    from libra.broker.state import BrokerConfig, BrokerState

    st, key, beat = BrokerState(BrokerConfig()), "K" * 40, m.Heartbeat()
    st.handle(PeerMessage(b"c", m.ClientHello("c", 1), (), role, key), 0.0)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            st.handle(PeerMessage(b"c", beat, (), role, key), 1.0)
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        keys, allowed = Path(tmp) / "keys", Path(tmp) / "allowed"
        broker, client = create_keypair(keys, "broker"), create_keypair(keys, "c")
        (allowed / "clients").mkdir(parents=True)
        (allowed / "clients" / "c.key").write_bytes(client.public_file.read_bytes())
        ctx = zmq.Context()
        auth = Authenticator(ctx, allowed)
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        try:
            apply_server(router, CurveServer.from_files(broker.secret_file, allowed))
            router.setsockopt(zmq.RCVHWM, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)
            url = f"tcp://127.0.0.1:{free_port()}"
            router.bind(url)
            apply_client(dealer, CurveClient.from_files(client.secret_file, broker.public_file))
            dealer.connect(url)
            frames = encode(m.Heartbeat())
            dealer.send_multipart(frames)
            router.recv_multipart()  # the handshake is done
            plain, roles = [], []
            for _ in range(args.rounds):
                for reader, out in ((None, plain), (auth, roles)):
                    for _ in range(args.messages):
                        dealer.send_multipart(frames)
                    while router.poll(0) == 0:
                        time.sleep(0.001)
                    time.sleep(0.2)  # let the I/O thread queue them all
                    out.append(_drain(router, args.messages, reader) / args.messages * 1e6)
        finally:
            router.close(0)
            dealer.close(0)
            auth.stop()
            ctx.term()
    p, r = min(plain), min(roles)
    core_plain, core_scoped = _core("", args.messages, args.rounds), _core("client:a", args.messages, args.rounds)
    return {"bench": "role_lookup", "messages": args.messages, "rounds": args.rounds,
            "bytes_us_per_msg": p, "with_role_us_per_msg": r, "extra_us_per_msg": r - p, "ratio": r / p,
            "core_unchecked_us_per_msg": core_plain, "core_scoped_us_per_msg": core_scoped,
            "core_extra_us_per_msg": core_scoped - core_plain, "core_ratio": core_scoped / core_plain}


def fmt(res: dict[str, Any]) -> str:
    return (f"bench role_lookup: {res['messages']} CURVE messages drained from a ROUTER, best of {res['rounds']} "
            f"rounds each\n  frames as bytes (before roles)       {res['bytes_us_per_msg']:.2f} us/message\n"
            f"  frames + key + role lookup (roles)   {res['with_role_us_per_msg']:.2f} us/message\n"
            f"  extra {res['extra_us_per_msg']:.2f} us/message ({res['ratio']:.2f}x)\n"
            f"the core, a Heartbeat through BrokerState.handle\n"
            f"  no CURVE (nothing checked)           {res['core_unchecked_us_per_msg']:.2f} us/message\n"
            f"  a job-scoped key (role and scope)    {res['core_scoped_us_per_msg']:.2f} us/message\n"
            f"  extra {res['core_extra_us_per_msg']:.2f} us/message ({res['core_ratio']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m libra.bench role_lookup",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=20000, help="messages drained per reader per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, alternating the readers")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    return run_and_emit(run, a, fmt)


if __name__ == "__main__":
    sys.exit(main())
