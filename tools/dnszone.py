"""A small authoritative DNS server for the tests and the benchmarks: records the caller
changes while it serves.

`Zone` holds the records (addresses and SRV records, by name) and how the server
behaves: `answer`, `servfail` (every query answered SERVFAIL), `silent` (every query
dropped: a server that is down). `serve_zone(zone)` serves it on 127.0.0.1, over UDP and
TCP on one port, in the caller's trio nursery (`await nursery.start(serve_zone, zone)`
returns the port). `python -m tools.dnszone ZONE.json` serves a zone file until it is
stopped, and prints `dnszone listening on 127.0.0.1:PORT` once it serves (the
benchmarks' way). Messages are encoded and decoded by dnslib; a UDP answer larger than
the query allows (512 bytes, or its EDNS0 size) is sent truncated, and the resolver asks
again over TCP, as with a real server.
"""

from __future__ import annotations

import errno
import json
import signal
import socket
import sys
from dataclasses import dataclass, field
from functools import partial

import trio
from dnslib import AAAA, QTYPE, RCODE, RR, SRV, A, DNSError, DNSRecord

# The largest DNS message over TCP (its length is two bytes).
_MAX_TCP = 65535
_PLAIN_UDP = 512
_BIND_TRIES = 20


def _key(name: str) -> str:
    return name.lower().rstrip(".")


@dataclass
class Zone:
    """The records served: `addresses[name]` (IPv4 as A, IPv6 as AAAA) and `srv[name]`
    (target, port) pairs; SRV answers carry their targets' addresses in the additional
    section when `additional`. `queries` counts the queries received."""

    addresses: dict[str, list[str]] = field(default_factory=dict)
    srv: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    mode: str = "answer"
    additional: bool = True
    ttl: int = 1
    queries: int = 0

    def set_addresses(self, name: str, addresses: list[str]) -> None:
        self.addresses[_key(name)] = list(addresses)

    def set_srv(self, name: str, records: list[tuple[str, int]]) -> None:
        self.srv[_key(name)] = list(records)

    def _address_records(self, name: str, qtype: int) -> list[RR]:
        records = []
        for address in self.addresses.get(_key(name), ()):
            if ":" in address and qtype == QTYPE.AAAA:
                records.append(RR(name, QTYPE.AAAA, rdata=AAAA(address), ttl=self.ttl))
            elif ":" not in address and qtype == QTYPE.A:
                records.append(RR(name, QTYPE.A, rdata=A(address), ttl=self.ttl))
        return records

    def answer(self, data: bytes) -> DNSRecord | None:
        """The reply to the query `data` (None: no reply, silent or not a query)."""
        try:
            request = DNSRecord.parse(data)
        except DNSError:
            return None
        self.queries += 1
        if self.mode == "silent" or not request.questions:
            return None
        reply = request.reply()
        if self.mode == "servfail":
            reply.header.rcode = RCODE.SERVFAIL
            return reply
        question = request.q
        name, qtype = str(question.qname), question.qtype
        known = _key(name) in self.addresses or _key(name) in self.srv
        if not known:
            reply.header.rcode = RCODE.NXDOMAIN
        elif qtype == QTYPE.SRV:
            for target, port in self.srv.get(_key(name), ()):
                rdata = SRV(priority=0, weight=1, port=port, target=target)
                reply.add_answer(RR(name, QTYPE.SRV, rdata=rdata, ttl=self.ttl))
                if self.additional:
                    for kind in (QTYPE.A, QTYPE.AAAA):
                        reply.add_ar(*self._address_records(target + ".", kind))
        else:
            reply.add_answer(*self._address_records(name, qtype))
        return reply


def _udp_limit(data: bytes) -> int:
    """What the query `data` allows a UDP answer: 512 bytes, or its EDNS0 size."""
    try:
        request = DNSRecord.parse(data)
    except DNSError:
        return _PLAIN_UDP
    sizes = [rr.rclass for rr in request.ar if rr.rtype == QTYPE.OPT]
    return max([_PLAIN_UDP, *sizes])


async def _serve_udp(zone: Zone, sock: trio.socket.SocketType) -> None:
    while True:
        data, peer = await sock.recvfrom(_MAX_TCP)
        reply = zone.answer(data)
        if reply is None:
            continue
        packed = reply.pack()
        if len(packed) > _udp_limit(data):  # its question and the TC flag only
            cut = DNSRecord.parse(data).reply()
            cut.header.tc = 1
            packed = cut.pack()
        await sock.sendto(packed, peer)


async def _serve_tcp_client(zone: Zone, stream: trio.SocketStream) -> None:
    async with stream:
        buffer = b""
        while True:
            chunk = await stream.receive_some(_MAX_TCP)
            if not chunk:
                return
            buffer += chunk
            while len(buffer) >= 2 and len(buffer) >= 2 + int.from_bytes(buffer[:2], "big"):
                size = int.from_bytes(buffer[:2], "big")
                data, buffer = buffer[2 : 2 + size], buffer[2 + size :]
                reply = zone.answer(data)
                if reply is not None:
                    packed = reply.pack()
                    await stream.send_all(len(packed).to_bytes(2, "big") + packed)
            if len(buffer) > _MAX_TCP + 2:
                return


async def _bind(port: int) -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
    """A UDP and a listening TCP socket on 127.0.0.1:`port`; with 0, a port free for both
    (a free UDP port may be taken on TCP: another is tried)."""
    for _ in range(_BIND_TRIES):
        tcp = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        udp = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            await tcp.bind(("127.0.0.1", port))
            await udp.bind(("127.0.0.1", tcp.getsockname()[1]))
            tcp.listen(64)
            return udp, tcp
        except OSError as exc:
            udp.close()
            tcp.close()
            if port or exc.errno != errno.EADDRINUSE:
                raise
    raise OSError(errno.EADDRINUSE, f"no port free for both UDP and TCP in {_BIND_TRIES} tries")


async def serve_zone(
    zone: Zone, port: int = 0, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve `zone` on 127.0.0.1:`port` (0: a free one), UDP and TCP, until cancelled;
    `task_status` gets the port."""
    udp, tcp = await _bind(port)
    with udp, tcp:
        listener = trio.SocketListener(tcp)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_serve_udp, zone, udp)
            nursery.start_soon(trio.serve_listeners, partial(_serve_tcp_client, zone), [listener])
            task_status.started(udp.getsockname()[1])


def load_zone(path: str) -> Zone:
    """A zone file: {"addresses": {NAME: [IP, ...]}, "srv": {NAME: [[TARGET, PORT], ...]}}."""
    with open(path) as file:
        raw = json.load(file)
    srv = {name: [(t, int(p)) for t, p in records] for name, records in raw.get("srv", {}).items()}
    zone = Zone()
    for name, addresses in raw.get("addresses", {}).items():
        zone.set_addresses(name, addresses)
    for name, records in srv.items():
        zone.set_srv(name, records)
    return zone


async def _main(path: str) -> None:
    zone = load_zone(path)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_zone, zone)
        print(f"dnszone listening on 127.0.0.1:{port}", flush=True)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()
                return


if __name__ == "__main__":
    trio.run(_main, sys.argv[1])
