"""The coordinator's listening servers: gRPC (with its gate and health), the OpenAI HTTP API and
the Prometheus endpoint, checked before anything else starts and stopped before anything else.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.coordinator.cluster.registry import WorkerRegistry
from kvmesh.coordinator.config import CoordinatorConfig, HttpConfig
from kvmesh.coordinator.coordinator import Coordinator
from kvmesh.coordinator.service.chat_template import load_chat_template
from kvmesh.coordinator.service.field_limits import FieldLimits
from kvmesh.coordinator.service.grpc_server import build_server, set_serving
from kvmesh.coordinator.service.http_server import HttpGate, HttpServer, build_app
from kvmesh.coordinator.service.interceptor import GateInterceptor, gate_from_config
from kvmesh.coordinator.service.openai_frontend import OpenAIFrontend
from kvmesh.coordinator.service.servicer import KVMeshServicer
from kvmesh.coordinator.service.tls import ServerTls, load_server_tls
from kvmesh.coordinator.telemetry.collector import MetricsCollector
from kvmesh.coordinator.telemetry.exporter import MetricsExporter
from kvmesh.workers.contract.replies import RequestRejected
from kvmesh.workers.model.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import grpc


class Servers:
    """What listens for a deployment: the gRPC server behind its gate, the HTTP API sharing that
    gate, the metrics endpoint. `check` runs first in start-up (a bad TLS path or a taken port is
    the user's first error to see, before Ray and the workers start); `stop` runs first in
    shut-down, so no request arrives while the rest goes away."""

    def __init__(
        self, config: CoordinatorConfig, http: HttpConfig | None, metrics_port: int | None
    ) -> None:
        self.config = config
        self.http = http
        self.metrics_port = metrics_port
        self.server: grpc.Server | None = None
        self.port = 0
        self.gate: GateInterceptor | None = None
        self.http_server: HttpServer | None = None
        self.metrics: MetricsExporter | None = None
        self._tls: ServerTls | None = None

    def check(self) -> None:
        """Load the TLS files, make sure the gRPC port is free and bind the metrics port."""
        cc = self.config
        # TLS files first: a bad path should fail before Ray and the workers start.
        self._tls = (
            load_server_tls(cc.tls_cert_file, cc.tls_key_file, cc.tls_client_ca_file)
            if cc.tls_cert_file
            else None
        )
        if cc.port:  # before anything starts: a taken port is the user's first error to see
            ensure_port_free(cc.host, cc.port)
        if self.metrics_port is not None:  # bound first: a port in use fails before Ray starts
            self.metrics = MetricsExporter(cc.host, self.metrics_port)

    def open_gate(self, max_position_embeddings: int) -> GateInterceptor:
        """The gate every request passes (auth, rates, stream slots, field limits)."""
        cc = self.config
        prompt_limit = min(cc.max_prompt_tokens or max_position_embeddings,
                           max_position_embeddings)  # fmt: skip
        self.gate = gate_from_config(cc, FieldLimits(max_prompt_tokens=prompt_limit))
        return self.gate

    def start_grpc(self, servicer: KVMeshServicer, registry: WorkerRegistry) -> None:
        assert self.gate is not None
        cc = self.config
        self.server, self.port, health = build_server(
            servicer,
            cc.host,
            cc.port,
            max_message_bytes=cc.max_message_bytes,
            max_workers=cc.max_concurrent_rpcs,
            interceptors=[self.gate],
            tls=self._tls,
        )
        # Health says SERVING only while some worker can take a request.
        registry.on_changed(lambda: set_serving(health, bool(registry.routable())))
        set_serving(health, bool(registry.routable()))
        self.server.start()

    def start_http(self, coordinator: Coordinator) -> None:
        """The OpenAI API (when configured), sharing the gRPC gate's tokens, rate buckets and
        stream slots."""
        if self.http is None:
            return
        assert self.gate is not None
        cc = self.config
        frontend = OpenAIFrontend(
            coordinator,
            load_tokenizer(cc.model, cc.seed),
            load_chat_template(cc.model),
            client_errors=(RequestRejected,),
        )
        gate = self.gate
        http_gate = HttpGate(gate.auth, gate.rate, gate.streams)
        app = build_app(frontend, http_gate, self.http.max_body_bytes, self.http.max_threads)
        self.http_server = HttpServer(
            app,
            self.http,
            tls_cert_file=cc.tls_cert_file,
            tls_key_file=cc.tls_key_file,
            tls_client_ca_file=cc.tls_client_ca_file,
        )
        self.http_server.start()

    def serve_metrics(self, collector: Callable[[GateInterceptor], MetricsCollector]) -> None:
        """Serve the collector `collector(gate)` builds on the metrics port (when bound)."""
        if self.metrics is not None:
            assert self.gate is not None
            self.metrics.serve(collector(self.gate))

    def stop(self) -> None:
        if self.http_server is not None:
            self.http_server.stop()
            self.http_server = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
        if self.server is not None:
            self.server.stop(grace=1).wait()
            self.server = None
        if self.gate is not None:
            self.gate.close()
            self.gate = None


def ensure_port_free(host: str, port: int) -> None:
    """Raise OSError naming the port when something already listens on it."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # As servers bind: a port whose old connections linger (TIME_WAIT) is free to listen on.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            raise OSError(f"port {port} on {host} is already in use") from None
