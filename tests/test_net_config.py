"""Addresses and ports: the inproc transport's endpoints and checks, and ``free_port`` within a worker's range."""

from __future__ import annotations

import socket

import pytest

from common.net import NetConfig, curve_wanted, free_port
from common.net.config import PORT_RANGE_ENV


def test_inproc_endpoints_are_named_by_port_and_never_encrypted():
    net = NetConfig(transport="inproc", broker_host="10.0.0.5")
    assert net.address(25555, bind=True) == "inproc://computerrl-25555"
    assert not curve_wanted(net), "inproc never leaves the process"
    assert NetConfig(broker_host="10.0.0.5").address(25555) == "tcp://10.0.0.5:25555"
    with pytest.raises(ValueError, match="net.curve=on needs net.transport=tcp"):
        NetConfig(transport="inproc", curve="on").validate()


def test_free_port_stays_in_its_range_and_skips_a_bound_port(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "21900-21909")
    first = free_port()
    taken = first + 1 if first < 21909 else 21900  # the port this process would hand out next
    held = socket.socket()
    held.bind(("127.0.0.1", taken))
    held.listen()
    try:
        picks = [free_port() for _ in range(8)]
    finally:
        held.close()
    assert all(21900 <= p <= 21909 for p in [first, *picks])
    assert len(set(picks)) == len(picks), "a process does not hand out a port twice in a row"
    assert taken not in picks, "a bound port is skipped"


@pytest.mark.parametrize("spec", ["20000", "b-a", "30000-20000", "0-10"])
def test_a_malformed_port_range_is_refused(monkeypatch, spec):
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()
