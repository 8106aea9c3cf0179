"""KV transfer over mutual TLS, each side with its role's certificate from the local CA
(tandem.local.pki): a decode worker pulls blocks; a peer without a trusted certificate gets nothing,
and a trusted certificate of another role (a gateway's) may neither read a prompt's KV nor release
its hold (PERMISSION_DENIED, the hold kept)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import grpc
import pytest
import torch

from tandem.common.identity import DENIED_MESSAGE
from tandem.common.tls import CHECK_INTERVAL_S, TLSSettings, channel
from tandem.local.pki import ensure_pki, rotate
from tandem.v1 import common_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector import wire
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tests.kit.net import free_port

from ..certs import make_pki
from .test_kv_connector import holds_of, make_handle, make_side, wait_until


def _kv_calls(
    address: str, tls: TLSSettings, request_id: str, layout: common_pb2.KVLayout, capability: str = ""
) -> dict[str, grpc.RpcError | None]:
    """Each KV endpoint called once as ``tls``'s holder, as a decode worker would: the error it answered,
    or None."""
    answers: dict[str, grpc.RpcError | None] = {}
    with channel(address, tls) as ch:
        stub = kv_transfer_pb2_grpc.KVTransferStub(ch)
        calls = {
            "Describe": lambda: stub.Describe(kv_transfer_pb2.DescribeRequest(), timeout=3),
            "PullBlockBytes": lambda: list(
                ch.unary_stream(
                    wire.PULL_METHOD, request_serializer=kv_transfer_pb2.PullBlocksRequest.SerializeToString
                )(
                    kv_transfer_pb2.PullBlocksRequest(
                        request_id=request_id, block_ids=[3], expected_layout=layout, capability=capability
                    ),
                    timeout=3,
                )
            ),
            "StreamBlockBytes": lambda: list(
                ch.unary_stream(
                    wire.STREAM_METHOD, request_serializer=kv_transfer_pb2.StreamBlocksRequest.SerializeToString
                )(
                    kv_transfer_pb2.StreamBlocksRequest(
                        request_id=request_id,
                        num_blocks=1,
                        num_prompt_tokens=4,
                        expected_layout=layout,
                        capability=capability,
                    ),
                    timeout=3,
                )
            ),
            "Release": lambda: stub.Release(
                kv_transfer_pb2.ReleaseBlocksRequest(request_id=request_id, capability=capability), timeout=3
            ),
        }
        for name, call in calls.items():
            try:
                call()
                answers[name] = None
            except grpc.RpcError as exc:
                answers[name] = exc
    return answers


def test_blocks_move_over_mutual_tls_and_strangers_are_refused(tmp_path: Path) -> None:
    pki = ensure_pki(tmp_path / "pki")
    _, stranger = make_pki(tmp_path)
    prefill, p_caches = make_side(free_port(), tls=pki["prefill"], max_chunk_bytes=1 << 20)
    decode, d_caches = make_side(free_port(), fill=0.0, tls=pki["decode"], max_chunk_bytes=1 << 20)
    try:
        handle = make_handle((3,), num_tokens=4, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        decode.begin_step(GrpcKVMetadata(loads=[LoadSpec("req-1-abcdefgh", handle, (3,), (0,), 4, 0)]))
        wait_until(lambda: "req-1-abcdefgh" in decode.puller._ended)
        decode.get_transfer_results(set())  # the engine step that reports the load
        assert not decode.take_load_records()["req-1-abcdefgh"].failed
        for name in p_caches:
            assert torch.equal(d_caches[name][0], p_caches[name][3])

        # A client whose certificate the CA did not sign cannot even describe the layout ...
        with channel(prefill.server.address, stranger) as ch, pytest.raises(grpc.RpcError):
            kv_transfer_pb2_grpc.KVTransferStub(ch).Describe(kv_transfer_pb2.DescribeRequest(), timeout=3)
        # ... and neither can a plaintext client.
        with channel(prefill.server.address, TLSSettings()) as ch, pytest.raises(grpc.RpcError):
            kv_transfer_pb2_grpc.KVTransferStub(ch).Describe(kv_transfer_pb2.DescribeRequest(), timeout=3)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_only_a_decode_workers_certificate_reads_or_releases_kv(tmp_path: Path) -> None:
    """A gateway's certificate (trusted, but not a decode worker's) gets PERMISSION_DENIED from every KV
    endpoint and the hold stays; then a decode worker's certificate reads the block and releases it."""
    pki = ensure_pki(tmp_path / "pki")
    prefill, _caches = make_side(free_port(), tls=pki["prefill"], max_chunk_bytes=1 << 20)
    try:
        handle = make_handle((3,), num_tokens=4, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle)))
        address = prefill.server.address
        assert prefill.server.layout is not None
        layout = prefill.server.layout.to_proto()
        for role in ("gateway", "prefill", "router", "operator"):
            refused = _kv_calls(address, pki[role], handle.request_id, layout)
            for name, error in refused.items():
                assert error is not None, (role, name)
                assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (role, name, error)  # type: ignore[attr-defined]
                assert error.details() == DENIED_MESSAGE  # type: ignore[attr-defined]
        # Nothing was released: the decode worker's certificate reads the block, then releases it.
        answers = _kv_calls(address, pki["decode"], handle.request_id, layout, handle.capability)
        assert answers["Describe"] is None and answers["PullBlockBytes"] is None and answers["Release"] is None
        with channel(address, pki["decode"]) as ch:
            stub = kv_transfer_pb2_grpc.KVTransferStub(ch)
            again = stub.Release(
                kv_transfer_pb2.ReleaseBlocksRequest(request_id=handle.request_id, capability=handle.capability)
            )
            assert again.found is False  # the first decode Release above took it
            # Stats (no prompt in them) answer any component.
        with channel(address, pki["operator"]) as ch:
            kv_transfer_pb2_grpc.KVTransferStub(ch).GetStats(kv_transfer_pb2.KVStatsRequest(), timeout=3)
    finally:
        prefill.shutdown()


def test_tls_settings_demand_their_files() -> None:
    with pytest.raises(ValueError, match="cert_file, key_file, ca_file"):
        TLSSettings(enabled=True)


def test_pulls_go_on_across_a_rotation_of_both_sides_certificates(tmp_path: Path) -> None:
    """Every role's key and certificate are issued anew under a running prefill KV server and a running
    decode puller (the local CA's --rotate): the next pull works, with the new files on both sides."""
    pki = ensure_pki(tmp_path / "pki")
    prefill, p_caches = make_side(free_port(), tls=pki["prefill"], max_chunk_bytes=1 << 20)
    decode, d_caches = make_side(free_port(), fill=0.0, tls=pki["decode"], max_chunk_bytes=1 << 20)
    try:
        for n, block in enumerate((3, 5)):
            if n == 1:
                first_channels = dict(decode.puller._channels)
                rotate(tmp_path / "pki")
                time.sleep(CHECK_INTERVAL_S + 0.2)  # the puller looks at its files at most this often
            request_id, engine_request_id = f"req-{n}", f"req-{n}-12345678"
            handle = make_handle((block,), num_tokens=4, kv_address=prefill.server.address)
            handle = dataclasses.replace(handle, request_id=request_id)
            prefill.begin_step(GrpcKVMetadata(holds=holds_of(handle, f"{request_id}-abcdefgh")))
            decode.begin_step(GrpcKVMetadata(loads=[LoadSpec(engine_request_id, handle, (block,), (n,), 4, 0)]))
            wait_until(lambda e=engine_request_id: e in decode.puller._ended)  # type: ignore[misc]
            decode.get_transfer_results(set())
            assert not decode.take_load_records()[engine_request_id].failed
            for name in p_caches:
                assert torch.equal(d_caches[name][n], p_caches[name][block])
        # A new channel, dialled with the new files (the old one closes after the pull deadline).
        assert decode.puller._channels.keys() == first_channels.keys()
        assert all(decode.puller._channels[a] is not first_channels[a] for a in first_channels)
    finally:
        prefill.shutdown()
        decode.shutdown()
