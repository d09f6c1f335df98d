"""Mutual TLS between nodes and clients: a ring serves over TLS; plaintext or certificate-less clients
cannot get in."""

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from prima_rpc.channel import OPTIONS, Tls, configure_tls
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc
from tests.rings import collect, local_ring

pytestmark = pytest.mark.slow


def issue(name: str, issuer=None, ca: bool = False):
    """(certificate, key) signed by issuer (certificate, key), or self-signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    return cert, key


def pem(cert, key) -> tuple[bytes, bytes]:
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


@pytest.fixture(scope="module")
def tls_ring(tiny_store, tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    ca = issue("prima test CA", ca=True)
    ca_pem, _ = pem(*ca)
    node_pem, node_key = pem(*issue("node", ca))
    client_pem, client_key = pem(*issue("client", ca))
    for name, data in {"ca.pem": ca_pem, "node.pem": node_pem, "node.key": node_key}.items():
        (d / name).write_bytes(data)
    args = ["--tls-cert", str(d / "node.pem"), "--tls-key", str(d / "node.key"), "--tls-ca", str(d / "ca.pem"),
            "--tls-mutual"]
    configure_tls(Tls(ca_pem, client_pem, client_key))  # this test process is a client with a certificate
    try:
        with local_ring(tiny_store, 2, d, [4, 4], extra_args=[args, args]) as local:
            yield local, ca_pem
    finally:
        configure_tls(None)


def test_the_ring_serves_over_mutual_tls(tls_ring):
    local, _ = tls_ring
    assert len(collect(local.addresses[0], "hi", 4, raw=True)[0]) == 4


def test_plaintext_and_certificate_less_clients_are_refused(tls_ring):
    local, ca_pem = tls_ring
    plaintext = rpc.ControlStub(grpc.insecure_channel(local.addresses[0], options=OPTIONS))
    with pytest.raises(grpc.RpcError) as err:
        plaintext.Info(pb.InfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    no_cert = rpc.ControlStub(grpc.secure_channel(local.addresses[0], grpc.ssl_channel_credentials(ca_pem),
                                                  options=OPTIONS))
    with pytest.raises(grpc.RpcError) as err:
        no_cert.Info(pb.InfoRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_flags_must_come_together(tiny_store, tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "nodes.ring.main", "--peer", "127.0.0.1:1", "--tls-cert", "x.pem"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "TLS needs --tls-cert, --tls-key and --tls-ca" in res.stderr
