"""Where webhooks may go. A job's ``webhook_url`` is chosen by whoever submits the job, and the service
POSTs to it from inside its own network, so a URL naming that network is server-side request forgery:
``http://127.0.0.1:8000/...``, a cloud metadata address (169.254.169.254), a database next door.

The rule: a destination is refused when any of its addresses is loopback, private (10/8, 172.16/12,
192.168/16, fc00::/7, and 100.64.0.0/10 shared by carrier-grade NAT), link-local (169.254/16,
fe80::/10), multicast, reserved or unspecified (0.0.0.0/8, ::). An IPv6 address that carries an IPv4
one (IPv4-mapped ``::ffff:127.0.0.1``, 6to4 ``2002:7f00:1::``) is judged by the IPv4 address. A
deployment whose receivers are internal lists them in ``[webhooks] allow_hosts``: host names (exact,
any case; every address the name resolves to is then allowed), addresses, or networks ('10.0.0.0/8').

The rule is applied twice:

* at submission, ``check_webhook_url`` (the API answers 400 with its message and stores nothing).
  A name is resolved there; a name that does not resolve yet is accepted (its DNS may be down for a
  moment, or the receiver not published yet), because every delivery checks again.
* at each delivery, ``resolve_safe`` resolves the name once and the notifier connects to one of the
  addresses it checked, never to the name: a name re-pointed between the check and the connection
  (DNS rebinding) still reaches only a checked address.

URLs are parsed by httpx, the library that sends the webhooks, so the check and the request agree on
the host, and both read the host through ``host_of`` (percent-escapes decoded, a final dot dropped), so
``127.0.0.1.`` and ``%31%32%37.0.0.1`` are judged as the 127.0.0.1 they spell. Numeric spellings a resolver accepts ('2130706433', '127.1', '0x7f.1') are addresses too:
they go through ``getaddrinfo`` like any name, which turns them into 127.0.0.1.
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

HINT = "a deployment can allow internal receivers with [webhooks] allow_hosts"
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT (RFC 6598): private, though not RFC 1918
_THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # "this host on this network" (RFC 1122): connects locally
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_HOST_CHARS = re.compile(r"[a-z0-9._:\[\]-]+")  # names, IPv4 and IPv6 spellings, lower case
_NUMERIC = re.compile(r"([0-9.]+|[0-9a-fA-F.%]*:[0-9a-fA-F:.%]*)(/.*)?")  # IPv4 or IPv6 spelling, maybe a prefix


class UnsafeDestination(ValueError):
    """A webhook destination that is refused; the message says which address, why, and how to allow it."""


def forbidden(ip: str | Address) -> str | None:
    """Why ``ip`` is refused as a webhook destination ("loopback", "private", "link-local", "multicast",
    "reserved", "unspecified"), or None for an address on the public internet."""
    addr = _effective(ipaddress.ip_address(ip))
    if addr.is_unspecified or addr in _THIS_NETWORK:
        return "unspecified"
    if addr.is_loopback:
        return "loopback"
    if addr.is_link_local:
        return "link-local"
    if addr.is_multicast:
        return "multicast"
    if addr.is_reserved:
        return "reserved"
    if addr.is_private or addr in _SHARED:
        return "private"
    if not addr.is_global:  # special-purpose ranges the checks above do not name (they vary by Python)
        return "reserved"
    return None


def _effective(addr: Address) -> Address:
    """The IPv4 address an IPv6 one carries (IPv4-mapped or 6to4), else ``addr``."""
    if addr.version == 6:
        return addr.ipv4_mapped or addr.sixtofour or addr
    return addr


@dataclass(frozen=True)
class Allowlist:
    """Destinations allowed although ``forbidden`` refuses their addresses: ``[webhooks] allow_hosts``."""

    names: frozenset[str] = frozenset()  # lower case, IDNA (punycode), no trailing dot
    networks: tuple[Network, ...] = ()  # an address is a /32 or /128

    @classmethod
    def parse(cls, entries: Iterable[str]) -> "Allowlist":
        """From host names, addresses and networks; ValueError names the first malformed entry."""
        names, networks = set(), []
        for entry in entries:
            text = entry.strip()
            try:
                networks.append(ipaddress.ip_network(text))
                continue
            except ValueError as e:
                if _NUMERIC.fullmatch(text):  # meant as an address or network, not a name
                    raise ValueError(f"[webhooks] allow_hosts: {entry!r} is not an address or network: {e}") from None
            names.add(_allowed_name(entry, text))
        return cls(frozenset(names), tuple(networks))

    def allows(self, host: str, ip: str | Address) -> bool:
        """Whether a request to ``host`` (as in the URL) may go to ``ip`` (one of its addresses)."""
        if _norm(host) in self.names:
            return True
        addr = ipaddress.ip_address(ip)
        return any(a in net for a in {addr, _effective(addr)} for net in self.networks)


def _allowed_name(entry: str, text: str) -> str:
    try:
        name = _norm(httpx.URL(scheme="http", host=text).raw_host.decode("ascii"))
    except (httpx.InvalidURL, UnicodeError, ValueError):
        name = ""
    if not _HOST_NAME.fullmatch(name):
        raise ValueError(f"[webhooks] allow_hosts: {entry!r} is not a host name, an address or a network "
                         "(e.g. 'hooks.internal', '10.0.0.5', '10.0.0.0/8'; no scheme, port or wildcard)")
    return name


def _norm(host: str) -> str:
    return host.lower().rstrip(".")


def host_of(raw_host: str) -> str:
    """The host a URL names, as a resolver reads it: percent-escapes decoded (until none is left: '%2531'
    is '%31' is '1'), lower case, without the final dot of a fully qualified name. UnsafeDestination
    when what is left is not a host name or an address."""
    host = raw_host
    while "%" in host and (decoded := urllib.parse.unquote(host)) != host:
        host = decoded
    host = _norm(host)
    if not _HOST_CHARS.fullmatch(host):
        raise UnsafeDestination(f"webhook host {raw_host!r} is not a host name or an address")
    return host


def _addresses(host: str, port: int | None, resolve: bool = True) -> list[str]:
    """``host``'s addresses (read through ``host_of``), in the resolver's order; without ``resolve``,
    only numeric hosts are parsed (OSError for a name). 'localhost' and its subdomains are loopback
    without a lookup, as RFC 6761 reserves them ('localhost.' would otherwise go to DNS, which may not
    know it)."""
    host = host_of(host)
    if host == "localhost" or host.endswith(".localhost"):
        return ["127.0.0.1", "::1"]
    flags = 0 if resolve else socket.AI_NUMERICHOST
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    return list(dict.fromkeys(sockaddr[0] for *_, sockaddr in found))


def _refusal(host: str, addresses: list[str], allow: Allowlist) -> str | None:
    for ip in addresses:
        reason = forbidden(ip)
        if reason is not None and not allow.allows(host, ip):
            return f"resolves to {ip}, a {reason} address: refused ({HINT})"
    return None


def parse_url(url: str) -> httpx.URL:
    """``url`` as httpx will send it; UnsafeDestination unless it is http or https with a host."""
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise UnsafeDestination(f"webhook_url {url} is not a valid URL: {e}") from None
    if target.scheme not in ("http", "https") or not target.raw_host:
        raise UnsafeDestination(f"webhook_url {url} needs http:// or https:// and a host")
    return target


def check_url(url: str, allow: Allowlist, resolve: bool = True) -> None:
    """Raise UnsafeDestination when ``url`` (http or https) would be delivered to a refused address.
    A host name that does not resolve (or any name, with ``resolve=False``) passes: the delivery checks
    again with ``resolve_safe``."""
    target = parse_url(url)
    host = host_of(target.raw_host.decode("ascii"))
    try:
        addresses = _addresses(host, target.port, resolve)
    except OSError:  # no address now; the delivery resolves it again and refuses it then if need be
        return
    if (why := _refusal(host, addresses, allow)) is not None:
        raise UnsafeDestination(f"webhook_url {url} {why}")


def resolve_safe(host: str, port: int | None, allow: Allowlist) -> list[str]:
    """``host``'s addresses (connect to these, not to the name), or UnsafeDestination if any of them
    is refused: a name with one internal address among public ones is refused, since the resolver's
    order, not this code, would pick which one a later connection uses. OSError when ``host`` does
    not resolve."""
    host = host_of(host)
    addresses = _addresses(host, port)
    if (why := _refusal(host, addresses, allow)) is not None:
        raise UnsafeDestination(f"webhook destination {host} {why}")
    return addresses


def check_webhook_url(url: str, allow_hosts: tuple[str, ...]) -> str | None:
    """For the API at submission: why ``url`` is refused (answer 400 with it), or None when it may be
    stored. ``allow_hosts`` is ``WebhookConfig.allow_hosts``."""
    try:
        check_url(url, _allowlist(tuple(allow_hosts)))
    except UnsafeDestination as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=8)
def _allowlist(entries: tuple[str, ...]) -> Allowlist:
    return Allowlist.parse(entries)
