"""Fetching pictures by URL cannot be turned on the host: loopback, private, link-local and other
non-public addresses are refused unless the server allows them, checked at the address the
connection uses and again at every redirect, with the redirects and the bytes capped."""

from __future__ import annotations

import http.server
import ipaddress
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import Server

from aiollama.errors import ImageError
from aiollama.server.fetch import Fetcher


class Files(http.server.BaseHTTPRequestHandler):
    """/cat.png: a body; /big: more than a small cap; /to?url=U: a redirect to U; /loop: a
    redirect to itself."""

    def do_GET(self) -> None:  # noqa: N802
        if self.path.startswith("/to?url="):
            self.send_response(302)
            self.send_header("Location", self.path[len("/to?url="):])
            self.end_headers()
        elif self.path == "/loop":
            self.send_response(301)
            self.send_header("Location", "/loop")
            self.end_headers()
        elif self.path in ("/cat.png", "/big"):
            body = b"x" * (100 if self.path == "/cat.png" else 5000)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def files() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::ffff:127.0.0.1", "fe80::1", "fc00::1",
                                     "240.0.0.1"])
def test_addresses_that_are_not_public_are_refused(address: str) -> None:
    assert not Fetcher().allowed(ipaddress.ip_address(address), 80)


def test_public_addresses_pass_and_private_ones_when_allowed() -> None:
    assert Fetcher().allowed(ipaddress.ip_address("93.184.215.14"), 443)
    assert Fetcher().allowed(ipaddress.ip_address("2606:4700::6810:84e5"), 443)
    widened = Fetcher(private_addresses=True)
    assert widened.allowed(ipaddress.ip_address("127.0.0.1"), 80) and widened.allowed(ipaddress.ip_address("10.0.0.1"), 80)
    assert not widened.allowed(ipaddress.ip_address("224.0.0.1"), 80)  # multicast never
    assert not widened.allowed(ipaddress.ip_address("0.0.0.0"), 80)


def test_loopback_is_refused_by_default_and_fetched_when_allowed(files: str) -> None:
    with pytest.raises(ImageError, match="not a public address"):
        Fetcher().fetch(files + "/cat.png")
    with pytest.raises(ImageError, match="not a public address"):
        Fetcher().fetch(files.replace("127.0.0.1", "localhost") + "/cat.png")
    assert Fetcher(private_addresses=True).fetch(files + "/cat.png") == b"x" * 100


def test_a_name_that_resolves_to_loopback_is_refused_before_any_connection(files: str) -> None:
    connected = []

    def rebinding(host: str, port: int) -> list[str]:
        connected.append(host)
        return ["127.0.0.1"]  # a public-looking name whose record points home

    with pytest.raises(ImageError, match="images.example"):
        Fetcher(resolver=rebinding).fetch("http://images.example/cat.png")
    assert connected == ["images.example"]


def test_a_redirect_to_loopback_is_refused(files: str) -> None:
    port = files.rsplit(":", 1)[1]

    class OnePort(Fetcher):
        def allowed(self, address: Any, port_: int) -> bool:
            return port_ == int(port) or super().allowed(address, port_)

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Files)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        inside = f"http://127.0.0.1:{other.server_address[1]}/cat.png"
        assert OnePort().fetch(files + "/cat.png") == b"x" * 100
        with pytest.raises(ImageError, match="not a public address"):
            OnePort().fetch(files + "/to?url=" + inside)  # the redirect is checked again
        with pytest.raises(ImageError, match="redirects more than 3 times"):
            OnePort().fetch(files + "/loop")
    finally:
        other.shutdown()
        other.server_close()


def test_domains_and_bytes_are_capped(files: str) -> None:
    with pytest.raises(ImageError, match="only from images.example"):
        Fetcher(allowed_domains=("images.example",)).fetch("http://elsewhere.example/cat.png")
    both = Fetcher(allowed_domains=("localhost",), private_addresses=True)
    assert both.fetch(files.replace("127.0.0.1", "localhost") + "/cat.png") == b"x" * 100
    with pytest.raises(ImageError, match="larger than 1000 bytes"):
        Fetcher(private_addresses=True, max_bytes=1000).fetch(files + "/big")
    for url in ("ftp://x/cat.png", "file:///etc/passwd", "http:///cat.png"):
        with pytest.raises(ImageError):
            Fetcher().fetch(url)


def test_the_server_refuses_to_fetch_from_its_own_machine(tiny_path: Path, files: str) -> None:
    server = Server(tiny_path, "--n-ctx", "1024", "--n-seq-max", "2", "--log-level", "warning", "--fetch-images")
    try:
        body = {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": files + "/cat.png"}}]}]}
        status, _, answer = server.post("/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and "not a public address" in answer["error"]["message"], answer
        assert answer["error"]["param"] == "messages[0].content[1].image_url"
    finally:
        server.stop()
