"""The coordinator's gRPC server: the servicer (`servicer.py`) behind its interceptors, with
standard health checking (`grpc.health.v1`) and reflection, on a plain or a TLS port."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.coordinator.service.servicer import KVMeshServicer
from kvmesh.coordinator.service.tls import ServerTls
from kvmesh.proto import kvmesh_pb2 as pb
from kvmesh.proto import kvmesh_pb2_grpc as pb_grpc

SERVICE_NAME = "kvmesh.v1.KVMesh"


def build_server(
    servicer: KVMeshServicer,
    host: str,
    port: int,
    *,
    max_message_bytes: int,
    max_workers: int,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    tls: ServerTls | None = None,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """A configured, not yet started server with health checking and reflection, and its port.
    With `tls` the port speaks TLS only (and requires client certificates if it has a CA)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvmesh-rpc"),
        interceptors=list(interceptors),
        maximum_concurrent_rpcs=max_workers,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A port another server holds is an error, not a second listener sharing it.
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_KVMeshServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        pb.DESCRIPTOR.services_by_name["KVMesh"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    if tls is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        credentials = grpc.ssl_server_credentials(
            [(tls.private_key, tls.certificate_chain)],
            root_certificates=tls.client_ca,
            require_client_auth=tls.client_ca is not None,
        )
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    set_serving(health_servicer, True)
    return server, bound, health_servicer


def set_serving(health_servicer: health.HealthServicer, serving: bool) -> None:
    """The health answer for the service and the server as a whole."""
    status = (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )
    for name in (SERVICE_NAME, ""):
        health_servicer.set(name, status)
