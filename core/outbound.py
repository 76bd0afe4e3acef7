"""One HTTP POST to a URL someone else chose (a tenant's webhook), which can neither hold
the caller past a deadline nor reach the operator's own network.

- One wall clock bounds the whole call: resolving, connecting, TLS, sending, the answer's
  headers and its body all run under ``asyncio.timeout``. httpx's own timeouts bound each
  read, so a server trickling a byte every few seconds would otherwise hold the caller
  for as long as it liked.
- The host is resolved once. Every address it resolves to must be public unicast
  (`is_public_address`) and the connection goes to the address that was checked, the
  name kept for the ``Host`` header, SNI and the certificate check (httpcore's
  ``sni_hostname`` request extension): a second lookup to connect could answer a private
  address after the first answered a public one (DNS rebinding).
- At most ``max_response_bytes`` of the answer's body are read (raw, never decompressed),
  then the connection is closed. Redirects are not followed; proxies and credentials from
  the environment are not used.

A failure raises `OutboundError`: its category and ``str()`` are safe to show whoever
chose the URL; its ``detail`` (addresses, ports, the underlying error) is for the
operator's log.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

import httpx

IPAddress = IPv4Address | IPv6Address

MAX_RESPONSE_BYTES = 64 * 1024

TIMEOUT = "timeout"
DNS = "dns"
UNSAFE_DESTINATION = "unsafe_destination"
REFUSED = "refused"
UNREACHABLE = "unreachable"
TLS = "tls"
PROTOCOL = "protocol"
INVALID_URL = "invalid_url"

_SAID = {
    DNS: "the host name did not resolve",
    UNSAFE_DESTINATION: "the host resolves to a non-public address",
    REFUSED: "the connection was refused or reset",
    UNREACHABLE: "no route to the host",
    TLS: "the TLS handshake or the certificate check failed",
    PROTOCOL: "the answer was not valid HTTP",
    INVALID_URL: "not an absolute http or https URL",
}

# IPv6 forms that carry an IPv4 address in their last 32 bits, judged by that address
# (so ::ffff:127.0.0.1 is loopback, and :: and ::1 fall in 0.0.0.0/8).
_CARRY_IPV4 = tuple(ip_network(net) for net in (
    "::ffff:0:0/96",  # IPv4-mapped
    "::/96",  # IPv4-compatible (deprecated)
    "64:ff9b::/96",  # NAT64's well-known prefix
))

_NOT_PUBLIC = tuple((ip_network(net), what) for net, what in (
    ("0.0.0.0/8", "this network"),
    ("10.0.0.0/8", "private"),
    ("100.64.0.0/10", "shared address space (CGNAT)"),
    ("127.0.0.0/8", "loopback"),
    ("169.254.0.0/16", "link-local"),
    ("172.16.0.0/12", "private"),
    ("192.0.0.0/24", "IETF protocol assignments"),
    ("192.0.2.0/24", "documentation"),
    ("192.88.99.0/24", "6to4 relay anycast"),
    ("192.168.0.0/16", "private"),
    ("198.18.0.0/15", "benchmarking"),
    ("198.51.100.0/24", "documentation"),
    ("203.0.113.0/24", "documentation"),
    ("224.0.0.0/4", "multicast"),
    ("240.0.0.0/4", "reserved and broadcast"),
    ("64:ff9b:1::/48", "NAT64 local use"),
    ("100::/64", "discard only"),
    ("2001::/23", "IETF protocol assignments (Teredo, ORCHID, benchmarking)"),
    ("2001:db8::/32", "documentation"),
    ("2002::/16", "6to4"),
    ("3fff::/20", "documentation"),
    ("5f00::/16", "SRv6 segment identifiers"),
    ("fc00::/7", "unique local"),
    ("fe80::/10", "link-local"),
    ("fec0::/10", "site-local"),
    ("ff00::/8", "multicast"),
    ("::/3", "outside global unicast (2000::/3)"),
    ("4000::/2", "outside global unicast (2000::/3)"),
    ("8000::/1", "outside global unicast (2000::/3)"),
))

# NOTE: its own threads, not the event loop's default executor: asyncio.run waits for
# that one on the way out, so a lookup that hangs would hold the caller past the deadline.
# A hung lookup keeps its thread after its call gave up: more threads than the outbound
# lane runs calls, so one tenant's hanging name server cannot take them all.
_RESOLVER = ThreadPoolExecutor(max_workers=32, thread_name_prefix="outbound-resolve")


class OutboundError(Exception):
    """A call that got no usable answer: `category` and ``str()`` are safe to show whoever
    chose the URL; `detail` is for the operator's log only."""

    def __init__(self, category: str, detail: str, *, said: str | None = None) -> None:
        super().__init__(category, detail)
        self.category = category
        self.detail = detail
        self.said = _SAID[category] if said is None else said

    def __str__(self) -> str:
        return f"{self.category}: {self.said}"


def timed_out(deadline_s: float, detail: str = "") -> OutboundError:
    """The error of a call that got no complete answer within its deadline."""
    said = f"no complete answer within {deadline_s:g} s"
    return OutboundError(TIMEOUT, detail or said, said=said)


@dataclass(frozen=True, slots=True)
class Answer:
    status_code: int
    body: bytes  # at most the call's max_response_bytes


def is_public_address(address: IPAddress) -> bool:
    """Whether a URL someone else chose may reach `address`: public unicast only."""
    return _non_public_range(address) is None


def _non_public_range(address: IPAddress) -> str | None:
    if address.version == 6 and any(address in net for net in _CARRY_IPV4):
        address = IPv4Address(int(address) & 0xFFFF_FFFF)
    return next((what for net, what in _NOT_PUBLIC if address in net), None)


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address `host` resolves to, in the resolver's order of preference."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise OutboundError(DNS, f"{host} does not resolve: {exc}") from exc
    addresses = list(dict.fromkeys(ip_address(info[4][0]) for info in infos))
    if not addresses:
        raise OutboundError(DNS, f"{host} resolves to no address")
    return addresses


def destination_check(*, url: str, allow_private: bool) -> list[IPAddress]:
    """The addresses `url`'s host resolves to, once; raises OutboundError when any of them
    is not public (unless `allow_private`), naming them only in the detail."""
    target = _target(url)
    host = target.raw_host.decode("ascii")
    addresses = resolve(host, _port(target))
    refused = [f"{a} ({what})" for a in addresses if (what := _non_public_range(a))]
    if refused and not allow_private:
        raise OutboundError(UNSAFE_DESTINATION, f"{host} resolves to {', '.join(refused)}")
    return addresses


def post(*, url: str, body: bytes, headers: Mapping[str, str], deadline_s: float,
         max_response_bytes: int = MAX_RESPONSE_BYTES, allow_private: bool = False) -> Answer:
    """POSTs `body` to `url` and returns the answer's status and at most
    `max_response_bytes` of its body, or raises OutboundError: either within `deadline_s`
    of the call, whatever the server does."""
    return asyncio.run(_post(url=url, body=body, headers=headers, deadline_s=deadline_s,
                             max_response_bytes=max_response_bytes,
                             allow_private=allow_private))


async def _post(*, url: str, body: bytes, headers: Mapping[str, str], deadline_s: float,
                max_response_bytes: int, allow_private: bool) -> Answer:
    target = _target(url)
    late = timed_out(deadline_s, f"{url}: no complete answer within {deadline_s:g} s")
    try:
        async with asyncio.timeout(deadline_s):
            addresses = await asyncio.get_running_loop().run_in_executor(
                _RESOLVER, partial(destination_check, url=url, allow_private=allow_private))
            return await _exchange(target=target, address=addresses[0], body=body,
                                   headers=headers, deadline_s=deadline_s,
                                   max_response_bytes=max_response_bytes)
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise late from exc
    except (httpx.HTTPError, OSError) as exc:
        raise _categorized(exc, url=url) from exc


async def _exchange(*, target: httpx.URL, address: IPAddress, body: bytes,
                    headers: Mapping[str, str], deadline_s: float,
                    max_response_bytes: int) -> Answer:
    async with httpx.AsyncClient(verify=httpx.create_ssl_context(), trust_env=False,
                                 follow_redirects=False, timeout=deadline_s) as client:
        request = client.build_request(
            "POST", target.copy_with(host=str(address)), content=body,
            headers={**headers, "host": target.netloc.decode("ascii")},
            extensions={"sni_hostname": target.raw_host.decode("ascii")})
        response = await client.send(request, stream=True)
        kept = bytearray()
        try:
            async for chunk in response.aiter_raw():
                kept += chunk
                if len(kept) >= max_response_bytes:
                    break
        finally:
            await response.aclose()
    return Answer(status_code=response.status_code, body=bytes(kept[:max_response_bytes]))


def _target(url: str) -> httpx.URL:
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise OutboundError(INVALID_URL, f"{url!r}: {exc}") from exc
    if target.scheme not in ("http", "https") or not target.raw_host:
        raise OutboundError(INVALID_URL, f"{url!r}: not an absolute http(s) URL")
    return target


def _port(target: httpx.URL) -> int:
    return target.port or (443 if target.scheme == "https" else 80)


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def _categorized(exc: httpx.HTTPError | OSError, *, url: str) -> OutboundError:
    causes = list(_causes(exc))
    detail = f"{url}: " + " <- ".join(f"{type(c).__name__}: {c}" for c in causes)
    if any(isinstance(c, ssl.SSLError) for c in causes):
        return OutboundError(TLS, detail)
    if any(isinstance(c, ConnectionError) for c in causes):
        return OutboundError(REFUSED, detail)
    if isinstance(exc, httpx.ConnectError | OSError):
        return OutboundError(UNREACHABLE, detail)
    return OutboundError(PROTOCOL, detail)
