"""The data channel under Ray's TLS (``RAY_USE_TLS``): TLS with Ray's certificates on both
ends (a CA and a node certificate made here), nothing readable on the wire, only holders of
a certificate of Ray's CA admitted; the client's fallback to Ray calls when it cannot load
the certificates; ``raymq status`` saying which transport the client uses and why."""
from __future__ import annotations

import datetime
import pickle
import socket
import threading

import pytest

from raymq import rpc
from raymq.actors.channel import Endpoint, connect, tls_context

cryptography = pytest.importorskip("cryptography")


class Target:
    def send(self, *args):
        return {"echo": args}


def _certificate(name: str, issuer=None, *, ca: bool = False):
    """(certificate, key) named ``name``, signed by ``issuer`` (a (certificate, key);
    None: by itself)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


def _write(directory, stem: str, cert, key) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture
def ray_tls(tmp_path, monkeypatch):
    """Ray's TLS settings as a TLS cluster sets them on every node: a CA and a node
    certificate it signed; returns the paths, and a stranger's (another CA's)."""
    ca = _certificate("ray-ca", ca=True)
    ca_path, _ = _write(tmp_path, "ca", *ca)
    node_cert, node_key = _write(tmp_path, "node", *_certificate("ray-node", ca))
    other_ca = _certificate("other-ca", ca=True)
    stranger = _write(tmp_path, "stranger", *_certificate("stranger", other_ca))
    for var, value in (("RAY_USE_TLS", "1"), ("RAY_TLS_SERVER_CERT", node_cert),
                       ("RAY_TLS_SERVER_KEY", node_key), ("RAY_TLS_CA_CERT", ca_path)):
        monkeypatch.setenv(var, value)
    return {"ca": ca_path, "cert": node_cert, "key": node_key, "stranger": stranger}


class Sniffer:
    """A TCP relay to ``target`` that keeps every byte it forwards (both ways)."""

    def __init__(self, target):
        self.target, self.seen, self._lock = target, bytearray(), threading.Lock()
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", self._srv.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a, b):
        try:
            while data := a.recv(65536):
                with self._lock:
                    self.seen += data
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._srv.close()


def _direct(monkeypatch, address, authkey):
    """The SDK's transport choice for a shard whose actor hands out ``address``."""
    from raymq.transport import make_transport
    monkeypatch.setattr(rpc, "connected", lambda: True)
    monkeypatch.setattr(rpc, "call", lambda method, timeout_s=None: method())

    class Handle:
        def endpoint(self):
            return address, authkey
    return make_transport("direct", lambda i: Handle())


SECRET = b"card 4111-1111-1111-1111"


def test_with_rays_tls_on_nothing_of_a_call_is_readable_on_the_wire(ray_tls, monkeypatch):
    ep = Endpoint(Target())  # as a shard opens it: TLS because Ray's is on
    sniff = Sniffer(ep.address)
    t = _direct(monkeypatch, sniff.address, ep.authkey)
    try:
        assert t.call(0, "send", SECRET, timeout_s=5) == {"echo": (SECRET,)}
        assert sniff.seen and SECRET not in sniff.seen and b"#CHALLENGE#" not in sniff.seen
        assert t.name == "direct" and "TLS with Ray's certificates" in t.why
    finally:
        t.close()
        sniff.close()
        ep.close()
    monkeypatch.delenv("RAY_USE_TLS")  # the proof that the relay would see it otherwise
    ep = Endpoint(Target())
    sniff = Sniffer(ep.address)
    t = _direct(monkeypatch, sniff.address, ep.authkey)
    try:
        assert t.call(0, "send", SECRET, timeout_s=5) == {"echo": (SECRET,)}
        assert SECRET in sniff.seen and "plain TCP" in t.why
    finally:
        t.close()
        sniff.close()
        ep.close()


def test_only_a_client_with_a_certificate_of_rays_ca_gets_in(ray_tls, monkeypatch):
    import ssl

    from raymq.actors.channel import ChannelLimits
    ep = Endpoint(Target(), limits=ChannelLimits(handshake_timeout_ms=2000))
    try:
        with pytest.raises((OSError, EOFError)):  # plain TCP: no TLS handshake, no entry
            connect(ep.address, ep.authkey, 5, tls=None)
        stranger = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # trusts Ray's CA, but its own
        stranger.check_hostname = False                      # certificate is another CA's
        stranger.load_verify_locations(ray_tls["ca"])
        stranger.load_cert_chain(*ray_tls["stranger"])
        with pytest.raises((OSError, EOFError)):
            connect(ep.address, ep.authkey, 5, tls=stranger)
        anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no certificate at all
        anonymous.check_hostname = False
        anonymous.load_verify_locations(ray_tls["ca"])
        with pytest.raises((OSError, EOFError)):
            connect(ep.address, ep.authkey, 5, tls=anonymous)
        link = connect(ep.address, ep.authkey, 5)  # Ray's certificates (the default)
        assert link.tls
        link.send_bytes(pickle.dumps(("send", (1,))))
        assert pickle.loads(link.recv_bytes()) == (True, {"echo": (1,)})
    finally:
        ep.close()


def test_an_idle_tls_connection_is_closed_too(ray_tls):
    """(A kernel receive timeout does not end a blocking TLS read: the endpoint must use
    another way for TLS connections.)"""
    from raymq.actors.channel import ChannelLimits
    from tests.helpers import wait_for
    ep = Endpoint(Target(), limits=ChannelLimits(idle_timeout_ms=300))
    try:
        link = connect(ep.address, ep.authkey, 5)
        link.send_bytes(pickle.dumps(("send", (1,))))
        assert pickle.loads(link.recv_bytes()) == (True, {"echo": (1,)})
        wait_for(lambda: ep.connections() == 0, 10, "the idle TLS connection closed")
        with pytest.raises((EOFError, OSError)):
            link.recv_bytes()
    finally:
        ep.close()


def test_a_client_that_cannot_load_rays_certificates_falls_back_to_ray_and_says_why(
        ray_tls, monkeypatch, tmp_path):
    from raymq.transport import make_transport
    handle = lambda i: None  # noqa: E731
    monkeypatch.setenv("RAY_TLS_CA_CERT", str(tmp_path / "missing-ca.crt"))
    t = make_transport("direct", handle)
    assert t.name == "ray"
    assert "fallback from 'direct'" in t.why and "missing-ca.crt" in t.why and "\n" not in t.why
    monkeypatch.delenv("RAY_TLS_CA_CERT")
    t = make_transport("direct", handle)
    assert t.name == "ray" and "RAY_TLS_CA_CERT is not set" in t.why
    assert "transport='ray'" in make_transport("ray", handle).why
    monkeypatch.setenv("RAY_USE_TLS", "0")
    t = make_transport("direct", handle)
    assert t.name == "direct" and "plain TCP" in t.why
    t.close()
    assert tls_context(server_side=True) is None


@pytest.mark.ray
def test_status_says_which_transport_the_client_uses_and_why(mq, capsys):
    from raymq.tools.cli import main
    assert mq.admin.status()["transport"] == {"name": mq.transport.name,
                                              "why": mq.transport.why}
    assert main(["status"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines()
             if line.startswith("transport: ")]
    assert lines == ["transport: direct -- each shard's data channel, plain TCP: Ray's TLS "
                     "is off (RAY_USE_TLS not 1)"]
