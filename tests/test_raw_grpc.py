"""The raw gRPC baselines of ``bench/round_bench.py``: fedra's throughput is judged against
them, so they must move, and in checked mode check, every byte they claim to."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def raw() -> ModuleType:
    spec = importlib.util.spec_from_file_location("raw_grpc", BENCH / "raw_grpc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["raw_grpc"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def server(raw: ModuleType, tmp_path: Path) -> Iterator[str]:
    srv, port = raw.create_server("127.0.0.1:0", raw.payload(2 << 20), str(tmp_path))
    srv.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        srv.stop(grace=None).wait()


@pytest.mark.parametrize("mode", ["raw", "proto", "checked"])
def test_each_mode_moves_every_byte_both_ways(
    raw: ModuleType, server: str, tmp_path: Path, mode: str
) -> None:
    total = (3 << 20) + 7  # not whole chunks, and past the server's 2 MiB: it cycles
    result = raw.measure(
        server, total, 1 << 20, repeats=1, proto=mode == "proto", checked=mode == "checked"
    )
    assert result.total_bytes == total and result.upload_bps > 0 and result.download_bps > 0
    assert result.checked == (mode == "checked")
    assert sorted(os.listdir(tmp_path)) == ["payload"]  # spooled uploads are removed


def test_a_checked_upload_must_match_its_digest(raw: ModuleType, server: str) -> None:
    data = raw.payload(1 << 20)
    with grpc.insecure_channel(server) as channel:
        upload = channel.stream_unary("/fedra.bench.Raw/UploadChecked")
        good = upload(iter([hashlib.sha256(data).digest(), data]), timeout=30)
        assert raw._COUNT.unpack(good)[0] == len(data)
        with pytest.raises(grpc.RpcError) as err:
            upload(iter([hashlib.sha256(b"other").digest(), data]), timeout=30)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS


def test_checked_downloads_are_verified_against_the_known_payload(raw: ModuleType) -> None:
    data = raw.payload(3 << 20)
    assert raw.cycled_digest(data[: 1 << 20], 3 << 20) == hashlib.sha256(data).digest()
    with pytest.raises(ValueError, match="whole"):
        raw.create_server("127.0.0.1:0", data[:-1], "/nonexistent")


def test_the_server_modes_bench_moves_and_checks_every_upload(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``bench/server_modes.py`` (threaded against asyncio server): each upload's bytes
    reach the server whole (the client checks the digest it gets back), in both modes,
    and every process it started is gone afterwards."""
    import multiprocessing

    monkeypatch.syspath_prepend(str(BENCH))  # its processes start fresh, import it by name
    import server_modes as modes  # type: ignore[import-not-found]

    for asyncio_server in (False, True):
        wall_s, cpu_s = modes.measure(asyncio_server, 2, 300_000, 70_000, 2)
        assert wall_s > 0 and cpu_s >= 0
    assert multiprocessing.active_children() == []
