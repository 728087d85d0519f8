"""The open-files limit of a process that holds many connections (the broker, an actor's data plane, a bench's
actor farms).

Every peer of a ZeroMQ socket is a file descriptor, and a socket itself takes two or three more. Many systems
start a process with a soft limit of 1,024 open files (systemd's default for services, most login shells, many
container runtimes) although the hard limit is far higher. A broker at that limit cannot accept its 1,000th-odd
actor: libzmq fails the accept with EMFILE and the actor's hello is simply never seen. ``raise_open_files_limit``
lifts the soft limit to the hard one (what any process may do without privileges, as Go's runtime does for
itself at start-up) and says what it found; the systemd units in deploy/ set ``LimitNOFILE`` too.
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.logging import get_logger

log = get_logger("libra.transport.fdlimit")

#: Below this hard limit a broker of 10,000 actors would run out of descriptors: say so at start-up ...
LOW_HARD_LIMIT = 16_384
#: ... and suggest this one (what deploy/systemd/libra-broker.service sets, and more).
ADVISED_HARD_LIMIT = 65_536


@dataclass(frozen=True, slots=True)
class OpenFilesLimit:
    before: int  # the soft limit the process started with
    soft: int  # the soft limit now
    hard: int

    @property
    def raised(self) -> bool:
        return self.soft > self.before


def raise_open_files_limit(component: str, *, advise: bool = False) -> OpenFilesLimit | None:
    """Lift this process's soft ``RLIMIT_NOFILE`` to its hard limit; returns the limits, or None where the
    platform has no ``resource`` module. Logs ``open_files_limit`` when it raised the limit, and a warning when
    ``advise`` and the hard limit is below :data:`LOW_HARD_LIMIT` (how to raise it: ``LimitNOFILE=`` in the
    unit, ``ulimit -Hn`` in the shell)."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    new = soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            new = target
        except (ValueError, OSError) as exc:  # e.g. a kernel cap (fs.nr_open) below the hard limit
            log.warning("open_files_limit_not_raised", component=component, soft=soft, hard=hard, error=str(exc))
    limits = OpenFilesLimit(before=soft, soft=new, hard=hard)
    if limits.raised:
        log.info("open_files_limit", component=component, soft_before=soft, soft=new, hard=hard)
    if advise and hard != resource.RLIM_INFINITY and hard < LOW_HARD_LIMIT:
        log.warning("open_files_limit_low", component=component, hard=hard, advised=ADVISED_HARD_LIMIT,
                    hint=f"about {max(hard - 64, 0)} peers fit; raise it with LimitNOFILE={ADVISED_HARD_LIMIT} in the "
                         f"systemd unit or `ulimit -Hn {ADVISED_HARD_LIMIT}` as root before starting")
    return limits
