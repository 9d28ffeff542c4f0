"""Fetching a picture a request names by URL, without letting the request aim the server at the
machine it runs on or at its private network.

A URL's host is resolved once, each address is checked, and the connection is made to the checked
address (the name is not resolved again, so DNS rebinding cannot swap in another one; TLS still
checks the certificate against the name). Only globally routable addresses pass unless the server
allows private ones; an allow-list of domains narrows it further. Every redirect is checked the
same way, at most ``max_redirects`` of them, and a body past ``max_bytes`` is refused.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urljoin, urlsplit

from aiollama.errors import ImageError

MAX_FETCHED_BYTES = 32 * 2**20
FETCH_SECONDS = 20.0
REDIRECTS = (301, 302, 303, 307, 308)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]


def resolve(host: str, port: int) -> list[str]:
    """The addresses ``host`` resolves to."""
    return list(dict.fromkeys(str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


def _plain(address: Address) -> Address:
    """An IPv4 address mapped into IPv6 as the IPv4 address it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@dataclass(frozen=True)
class Fetcher:
    """How a server fetches pictures: from public addresses only (or, with ``private_addresses``,
    from any but multicast and unspecified ones), and only from ``allowed_domains`` when given."""

    allowed_domains: tuple[str, ...] = ()
    private_addresses: bool = False
    max_bytes: int = MAX_FETCHED_BYTES
    max_redirects: int = 3
    timeout: float = FETCH_SECONDS
    resolver: Resolver = field(default=resolve, compare=False)

    def allowed(self, address: Address, port: int) -> bool:
        """Whether the server may connect to ``address``."""
        address = _plain(address)
        if address.is_multicast or address.is_unspecified:
            return False
        return self.private_addresses or address.is_global

    def fetch(self, url: str) -> bytes:
        """The body at ``url``. Raises ImageError naming why it was not fetched."""
        for _ in range(self.max_redirects + 1):
            status, location, body = self._get(url)
            if status in REDIRECTS:
                if not location:
                    raise ImageError(f"the image at {url[:200]} redirects nowhere")
                url = urljoin(url, location)
                continue
            if status != 200:
                raise ImageError(f"the image at {url[:200]} could not be fetched: HTTP {status}")
            return body
        raise ImageError(f"the image at {url[:200]} redirects more than {self.max_redirects} times")

    def _target(self, url: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, the address to connect to), or ImageError for a URL not to fetch."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageError(f"only http(s) image URLs are fetched, not {url[:200]}")
        host = parts.hostname.rstrip(".").lower()
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ImageError(f"the image URL {url[:200]} has a bad port") from None
        if self.allowed_domains and not any(host == d or host.endswith("." + d) for d in self.allowed_domains):
            raise ImageError(f"this server fetches images only from {', '.join(self.allowed_domains)}, not {host}")
        try:
            addresses = [ipaddress.ip_address(a.split("%")[0]) for a in self.resolver(host, port)]
        except (OSError, ValueError) as exc:
            raise ImageError(f"the image host {host} could not be resolved: {exc}") from None
        good = [a for a in addresses if self.allowed(a, port)]
        if not good:
            shown = ", ".join(str(a) for a in addresses) or "nothing"
            raise ImageError(f"this server does not fetch images from {host} ({shown}): not a public address")
        return parts.scheme, host, port, str(good[0])

    def _get(self, url: str) -> tuple[int, str | None, bytes]:
        scheme, host, port, address = self._target(url)
        parts = urlsplit(url)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            sock = socket.create_connection((address, port), timeout=self.timeout)
            if scheme == "https":
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
            conn = http.client.HTTPConnection(host, port, timeout=self.timeout)
            conn.sock = sock  # connected to the address checked above, not resolved again
            try:
                conn.request("GET", path, headers={"Host": parts.netloc, "User-Agent": "aiollama"})
                response = conn.getresponse()
                if response.status in REDIRECTS:
                    return response.status, response.getheader("Location"), b""
                declared = response.getheader("Content-Length", "")
                if declared.isdigit() and int(declared) > self.max_bytes:
                    raise ImageError(f"the image at {url[:200]} is larger than {self.max_bytes} bytes")
                body = response.read(self.max_bytes + 1)
            finally:
                conn.close()
        except (OSError, http.client.HTTPException) as exc:
            raise ImageError(f"the image at {url[:200]} could not be fetched: {exc}") from None
        if len(body) > self.max_bytes:
            raise ImageError(f"the image at {url[:200]} is larger than {self.max_bytes} bytes")
        return response.status, None, body
