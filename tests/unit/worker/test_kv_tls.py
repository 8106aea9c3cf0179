"""KV transfer over mutual TLS: a peer with a certificate from the cluster's CA
pulls blocks; one without a trusted certificate gets nothing."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import torch

from tandem.common.tls import TLSSettings, channel
from tandem.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from tandem.worker.kv_connector.metadata import GrpcKVMetadata, LoadSpec
from tests.kit.net import free_port

from ..certs import make_pki
from .test_kv_connector import make_handle, make_side, wait_until


def test_blocks_move_over_mutual_tls_and_strangers_are_refused(tmp_path: Path) -> None:
    trusted, stranger = make_pki(tmp_path)
    prefill, p_caches = make_side(free_port(), tls=trusted, max_chunk_bytes=1 << 20)
    decode, d_caches = make_side(free_port(), fill=0.0, tls=trusted, max_chunk_bytes=1 << 20)
    try:
        handle = make_handle((3,), num_tokens=4, kv_address=prefill.server.address)
        prefill.begin_step(GrpcKVMetadata(holds={handle.remote_request_id: (handle.block_ids, time.time() + 60)}))
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


def test_tls_settings_demand_their_files() -> None:
    with pytest.raises(ValueError, match="cert_file, key_file, ca_file"):
        TLSSettings(enabled=True)
