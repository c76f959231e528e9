"""Boards for the board tests: a local directory, and (slow) an S3-compatible server on loopback."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from policies.board import Board
from tests.support.s3 import moto_server, s3_options


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def make_board(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., Board]:
    if request.param == "local":
        return lambda run="run", **kw: Board(str(tmp_path / "board"), run, **kw)
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = f"sprawl-{uuid.uuid4().hex[:12]}"
    import boto3  # type: ignore[import-untyped]

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return lambda run="run", **kw: Board(
        f"s3://{bucket}/boards", run, storage_options=s3_options(endpoint), **kw
    )
