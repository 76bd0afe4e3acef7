"""One outbound POST against real servers on loopback: a wall-clock deadline no trickling
server extends, a capped answer, the host resolved once and the connection made to the
address checked (Host, SNI and the certificate still the name's), non-public addresses
refused one by one, and failures told by category only."""

from __future__ import annotations

import select
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from ipaddress import ip_address

import pytest

from core import outbound

HOOKS = "hooks.example.test"


class Server:
    """A TCP server on loopback whose connections `handle(conn, server)` serves, each on a
    thread; what they saw goes into `seen`."""

    def __init__(self, handle, *, tls: ssl.SSLContext | None = None) -> None:
        self.seen: dict = {"connections": 0}
        self.done = threading.Event()
        self.stop = threading.Event()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server.seen["connections"] += 1
                conn = self.request
                try:
                    if tls is not None:
                        conn = tls.wrap_socket(conn, server_side=True)
                    handle(conn, server)
                except OSError as exc:
                    server.seen["error"] = exc
                finally:
                    server.done.set()

        self.tcp = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.tcp.daemon_threads = True
        self.port = self.tcp.server_address[1]
        threading.Thread(target=self.tcp.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.tcp.shutdown()
        self.tcp.server_close()


@pytest.fixture
def serve():
    made: list[Server] = []

    def make(handle, **kw) -> Server:
        made.append(Server(handle, **kw))
        return made[-1]

    yield make
    for server in made:
        server.close()


def read_request(conn) -> tuple[dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("closed before the request's headers")
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    headers = {}
    for line in head.decode().split("\r\n")[1:]:
        name, value = line.split(":", 1)
        headers[name.strip().lower()] = value.strip()
    while len(body) < int(headers.get("content-length", 0)):
        body += conn.recv(65536)
    return headers, body


def answer(status: int, body: bytes = b""):
    def handle(conn, server) -> None:
        server.seen["headers"], server.seen["body"] = read_request(conn)
        conn.sendall(b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n" % (status, len(body)) +
                     body)
    return handle


def trickle_body(conn, server) -> None:
    read_request(conn)
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n")
    while not server.stop.wait(1):
        conn.sendall(b"x")


def trickle_headers(conn, server) -> None:
    read_request(conn)
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
        if server.stop.wait(1):
            return
        conn.sendall(bytes([byte]))


def post(url: str, *, deadline_s: float = 5, allow_private: bool = True, **kw):
    return outbound.post(url=url, body=b'{"ok":true}', headers={"content-type":
                         "application/json"}, deadline_s=deadline_s,
                         allow_private=allow_private, **kw)


def refusal(url: str, **kw) -> outbound.OutboundError:
    with pytest.raises(outbound.OutboundError) as caught:
        post(url, **kw)
    return caught.value


@pytest.mark.parametrize("trickle", [trickle_body, trickle_headers])
def test_a_server_trickling_its_answer_is_cut_at_the_deadline(serve, trickle):
    server = serve(trickle)
    started = time.monotonic()
    error = refusal(f"http://127.0.0.1:{server.port}/hook", deadline_s=2)
    assert time.monotonic() - started < 2 + 2
    assert error.category == "timeout"
    assert str(error) == "timeout: no complete answer within 2 s"


def test_a_huge_answer_is_read_only_up_to_the_cap_and_the_connection_closed(serve):
    size = 10 * 1024 * 1024

    def huge(conn, server) -> None:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        server.seen["sent"] = 0
        chunk = b"x" * 65536
        while server.seen["sent"] < size:
            conn.sendall(chunk)
            server.seen["sent"] += len(chunk)

    server = serve(huge)
    got = post(f"http://127.0.0.1:{server.port}/hook", max_response_bytes=64 * 1024)
    assert got.status_code == 200 and len(got.body) == 64 * 1024
    assert server.done.wait(10)
    assert isinstance(server.seen.get("error"), ConnectionError)  # the client hung up
    assert server.seen["sent"] < size


def test_a_closed_port_is_refused_and_says_nothing_of_the_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    error = refusal(f"http://127.0.0.1:{port}/hook")
    assert str(error) == "refused: the connection was refused or reset"
    assert str(port) not in str(error) and "Errno" not in str(error)
    assert str(port) in error.detail  # for the operator's log


def test_an_error_status_is_returned_not_raised_and_redirects_are_not_followed(serve):
    server = serve(answer(500, b"oops"))
    assert post(f"http://127.0.0.1:{server.port}/hook").status_code == 500
    moved = serve(lambda conn, s: (read_request(conn), conn.sendall(
        b"HTTP/1.1 302 Found\r\nLocation: http://127.0.0.1:%d/\r\nContent-Length: 0\r\n\r\n"
        % server.port)))
    assert post(f"http://127.0.0.1:{moved.port}/hook").status_code == 302
    assert server.seen["connections"] == 1


def test_a_name_that_does_not_resolve_is_a_dns_error():
    assert refusal("http://no-such-host.invalid/hook").category == "dns"


def test_a_name_resolving_to_a_private_address_is_refused_without_connecting():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        error = refusal(f"http://localhost:{port}/hook", allow_private=False)
        assert select.select([listener], [], [], 0)[0] == []  # nothing knocked
    assert str(error) == "unsafe_destination: the host resolves to a non-public address"
    assert "127.0.0.1" in error.detail


def test_the_connection_goes_to_the_address_resolved_once_with_the_names_host_header(
        serve, monkeypatch):
    server = serve(answer(204))
    lookups = []

    def resolve(host: str, port: int):
        lookups.append((host, port))
        return [ip_address("127.0.0.1")]

    monkeypatch.setattr(outbound, "resolve", resolve)
    assert post(f"http://{HOOKS}:{server.port}/hook").status_code == 204
    assert lookups == [(HOOKS, server.port)]
    assert server.seen["headers"]["host"] == f"{HOOKS}:{server.port}"
    assert server.seen["body"] == b'{"ok":true}'


def test_one_non_public_address_among_a_names_addresses_refuses_it(monkeypatch):
    monkeypatch.setattr(outbound, "resolve", lambda host, port: [
        ip_address("8.8.8.8"), ip_address("10.0.0.1")])
    assert refusal(f"http://{HOOKS}/hook", allow_private=False).category == \
        "unsafe_destination"


@pytest.fixture
def certificate(tmp_path):
    """A self-signed certificate for HOOKS, and the TLS server context that presents it."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    f"/CN={HOOKS}", "-addext", f"subjectAltName=DNS:{HOOKS}",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return cert, context


def test_tls_to_the_pinned_address_sends_the_names_sni_and_checks_its_certificate(
        serve, monkeypatch, certificate):
    cert, context = certificate
    names = []
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    server = serve(answer(200), tls=context)
    monkeypatch.setattr(outbound, "resolve", lambda host, port: [ip_address("127.0.0.1")])
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert post(f"https://{HOOKS}:{server.port}/hook").status_code == 200
    assert names == [HOOKS]
    assert server.seen["headers"]["host"] == f"{HOOKS}:{server.port}"
    # the same server and address, asked for by another name: its certificate is refused
    assert refusal(f"https://other.example.test:{server.port}/hook").category == "tls"


def test_a_certificate_nobody_vouches_for_is_a_tls_error(serve, monkeypatch, certificate):
    _, context = certificate
    server = serve(answer(200), tls=context)
    monkeypatch.setattr(outbound, "resolve", lambda host, port: [ip_address("127.0.0.1")])
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    error = refusal(f"https://{HOOKS}:{server.port}/hook")
    assert str(error) == "tls: the TLS handshake or the certificate check failed"


@pytest.mark.parametrize(("address", "public"), [
    ("8.8.8.8", True),
    ("2606:4700::1111", True),
    ("::ffff:8.8.8.8", True),  # IPv4-mapped: judged by the IPv4 address
    ("64:ff9b::808:808", True),  # NAT64 of 8.8.8.8
    ("::ffff:127.0.0.1", False),
    ("::ffff:10.0.0.1", False),
    ("::10.0.0.1", False),  # IPv4-compatible
    ("64:ff9b::a00:1", False),  # NAT64 of 10.0.0.1
    ("64:ff9b:1::a00:1", False),  # NAT64, local use
    ("2002:808:808::1", False),  # 6to4
    ("2002:7f00:1::1", False),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),  # Teredo
    ("2001:10::1", False),  # ORCHID
    ("2001:20::1", False),  # ORCHIDv2
    ("2001:db8::1", False),
    ("3fff::1", False),
    ("fd00::1", False),
    ("fc00::1", False),
    ("fe80::1", False),
    ("fec0::1", False),
    ("ff02::1", False),
    ("::1", False),
    ("::", False),
    ("100::1", False),
    ("4000::1", False),
    ("100.64.0.1", False),
    ("100.127.255.254", False),
    ("127.0.0.1", False),
    ("10.0.0.1", False),
    ("172.16.0.1", False),
    ("192.168.1.1", False),
    ("169.254.169.254", False),
    ("0.0.0.0", False),
    ("192.0.0.8", False),
    ("192.0.2.1", False),
    ("198.18.0.1", False),
    ("198.51.100.1", False),
    ("203.0.113.1", False),
    ("192.88.99.1", False),
    ("224.0.0.1", False),
    ("240.0.0.1", False),
    ("255.255.255.255", False),
])
def test_only_public_unicast_addresses_are_public(address, public):
    assert outbound.is_public_address(ip_address(address)) is public
