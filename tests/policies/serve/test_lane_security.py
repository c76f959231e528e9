"""TLS, bearer tokens, and board credentials kept out of logs."""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
from pathlib import Path

import aiohttp
import anyio
import pytest
import torch
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from policies.board import Board
from policies.board.store import redact
from policies.serve.backends.base import HttpBackend
from policies.serve.backends.standalone import serve_sidecar
from policies.serve.server import tls_context
from policies.serve.sidecar import Sidecar
from tests.support.boards import engine
from tests.support.raw_http import raw_http, raw_post

pytestmark = pytest.mark.anyio
cryptography = pytest.importorskip("cryptography")  # a dev dependency (self-signed certs)
SECRET = "s3cr3t-SIG"


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def _board(url: str, model_dir: Path) -> Board:
    board = Board(url, "run")
    board.create(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    view = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    board.publish(0, view, view_name="bfloat16")
    return board


async def test_tls_and_bearer_token(tmp_path: Path, tiny_model_dir: Path) -> None:
    board = _board(str(tmp_path / "board"), tiny_model_dir)
    cert, key = _self_signed(tmp_path)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    body = {"prompt_token_ids": [1, 2], "max_tokens": 2}
    async with engine(board, token="tok", poll_interval_s=0.1, tls=tls_context(cert, key)) as url:
        assert url.startswith("https://")
        conn = aiohttp.TCPConnector(ssl=client_ctx)
        async with aiohttp.ClientSession(connector=conn) as s:
            async with s.post(f"{url}/v1/generate", json=body) as r:
                assert r.status == 401
            auth = {"Authorization": "Bearer tok"}
            async with s.post(f"{url}/v1/generate", json=body, headers=auth) as r:
                assert r.status == 200
            async with s.get(f"{url}/health") as r:
                assert r.status == 200
        async with aiohttp.ClientSession() as plain:  # the default trust store rejects the cert
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await plain.get(f"{url}/health")


def test_redact_removes_credentials_and_signatures() -> None:
    text = f"s3://AKIA:{SECRET}@bucket/runs?X-Amz-Signature={SECRET} and https://u:{SECRET}@h/p"
    out = redact(text)
    assert SECRET not in out
    assert "bucket/runs" in out
    assert "h/p" in out


async def test_board_credentials_never_logged(tmp_path: Path, tiny_model_dir: Path) -> None:
    url = f"file://{tmp_path}/board?sig={SECRET}"
    board = _board(url, tiny_model_dir)
    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            await tg.start(
                lambda task_status: serve_sidecar(
                    engine_url="http://127.0.0.1:9",
                    engine_kind="openai",
                    board_url=url,
                    run="run",
                    host="127.0.0.1",
                    port=0,
                    token=None,
                    version=0,
                    task_status=task_status,
                )
            )
            tg.cancel_scope.cancel()
        (Path(board.root) / "POINTER").write_text("not json")
        backend = HttpBackend("http://127.0.0.1:9", model="m", max_context=16)
        sidecar = Sidecar(backend, board, poll_interval_s=1.0, registry=CollectorRegistry())
        await sidecar.reconcile()
    events = {e["event"] for e in logs}
    assert {"sidecar_starting", "board_unreadable"} <= events
    assert SECRET not in repr(logs)


HOSTILE = [
    ("/v1/generate", b'{"prompt_token_ids": [1]}', b"Bearer \xff\xfe\xc3", 401, None),
    ("/v1/generate", b"[" * 200_000 + b"]" * 200_000, b"Bearer tok", 400, None),
    (
        "/v1/generate",
        b'{"prompt_token_ids": [1], "seed": ' + b"7" * 5000 + b"}",
        b"Bearer tok",
        400,
        None,
    ),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
        b"Bearer tok",
        400,
        "messages.0.content",
    ),
    ("/v1/completions", b'{"prompt": "\\udfff", "max_tokens": 2}', b"Bearer tok", 400, "prompt"),
    (
        "/v1/completions",
        b'{"prompt": ["ok", "\\ud83d"], "max_tokens": 2}',
        b"Bearer tok",
        400,
        "prompt.1",
    ),
]


async def test_hostile_bytes_get_4xx_json_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    from tests.support.boards import tiny_board

    board = tiny_board(tmp_path, tiny_model_dir)
    got: list[tuple[str, int, str, str | None]] = []
    async with engine(board, token="tok") as url:
        for path, body, auth, _, _ in HOSTILE:
            status, headers, raw = await raw_http(url, raw_post(path, body, auth))
            kind = headers.get("content-type", "").split(";")[0]
            error = json.loads(raw)["error"] if kind == "application/json" else {}
            assert kind != "application/json" or {"type", "message"} <= set(error)
            got.append((path, status, kind, error.get("param")))
        body = b'{"prompt_token_ids": [1], "max_tokens": 2}'
        status, _, raw = await raw_http(url, raw_post("/v1/generate", body))
        assert status == 200, raw[:200]
    assert got == [(p, s, "application/json", param) for p, _, _, s, param in HOSTILE]
