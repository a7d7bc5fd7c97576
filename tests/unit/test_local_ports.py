"""How ``shardline.local_ports`` picks a port, against a stand-in for the OS's binds (no sockets here: the real ones
are tests/integration/test_local_ports.py's)."""

from __future__ import annotations

import errno
from itertools import islice

import pytest

from shardline.local_ports import pick, tries


class Net:
    """The ports bound on one address: ``bind(0)`` hands out the next of ``os_order`` that is free, as an OS would."""

    def __init__(self, os_order: list[int], taken: set[int] | None = None) -> None:
        self.os_order = os_order
        self.bound: set[int] = set(taken or ())
        self.binds: list[int] = []

    def bind(self, port: int) -> Bound:
        self.binds.append(port)
        if port == 0:
            port = next((p for p in self.os_order if p not in self.bound), 0)
            if not port:
                raise OSError(errno.EADDRINUSE, "no free port left")
        elif port in self.bound:
            raise OSError(errno.EADDRINUSE, "Address already in use")
        self.bound.add(port)
        return Bound(self, port)


class Bound:
    def __init__(self, net: Net, port: int) -> None:
        self.net, self.port = net, port

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)

    def close(self) -> None:
        self.net.bound.discard(self.port)


def test_a_pick_tries_the_preferred_port_first_then_the_oss_picks() -> None:
    assert list(islice(tries(), 3)) == [0, 0, 0]
    assert list(islice(tries(41000), 3)) == [41000, 0, 0]


def test_the_preferred_port_is_given_back_while_nothing_holds_it() -> None:
    net = Net(os_order=[50001, 50003])

    assert pick(net.bind, tries(41000), reserved=set()).port == 41000
    assert net.binds == [41000]


def test_a_preferred_port_another_holds_is_passed_over_for_one_the_os_picks() -> None:
    net = Net(os_order=[50001, 50003], taken={41000})

    sock = pick(net.bind, tries(41000), reserved=set())

    assert sock.port == 50001 and net.binds == [41000, 0]


def test_a_port_this_process_reserved_is_never_handed_out_again() -> None:
    # The OS would hand out 50001 first (its reservation is TIME_WAIT only, which a server's own bind passes):
    # the pick holds it while the OS picks again, then lets it go; a reserved preferred port is not even tried.
    net = Net(os_order=[50001, 50003, 50005])

    sock = pick(net.bind, tries(50001), reserved={50001})

    assert sock.port == 50003
    assert net.binds == [0, 0]  # 50001 was not tried as the preferred port
    assert net.bound == {50003}  # the passed-over socket on 50001 was closed


def test_every_port_a_pick_passed_over_is_let_go_when_it_fails() -> None:
    net = Net(os_order=[50001, 50003])

    with pytest.raises(OSError, match="no free port left"):
        pick(net.bind, tries(), reserved={50001, 50003})
    assert net.bound == set()


def test_an_error_other_than_a_taken_port_is_raised() -> None:
    def unreachable(port: int) -> Bound:
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")

    with pytest.raises(OSError, match="Cannot assign requested address"):
        pick(unreachable, tries(41000), reserved=set())


def test_a_pick_over_ports_that_are_all_taken_says_so() -> None:
    net = Net(os_order=[], taken={41000, 41001})

    with pytest.raises(OSError) as raised:
        pick(net.bind, [41000, 41001], reserved=set())
    assert raised.value.errno == errno.EADDRINUSE
