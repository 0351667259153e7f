"""The directory of service workers every coordinator attaches to, on the coordinators' Redis
client (`IndexStore` is one): the fleet's id, worker numbers, claims and replacements."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, cast

from kvmesh.proto import redis_schema as schema


@dataclass(frozen=True, slots=True)
class WorkerService:
    """A worker running as a long-lived service: how any coordinator reaches it."""

    worker_id: str
    actor_name: str
    """Its detached Ray actor's name (in `ray_namespace`)."""
    ray_namespace: str
    num_gpus: float
    """GPUs its actor reserves (a replacement asks for the same)."""
    config_json: str
    """Its WorkerConfig, as JSON (a replacement starts from it)."""


class ServiceDirectory:
    """The directory's calls, on the client of the class it is mixed into."""

    _client: Any

    def fleet_id(self) -> str:
        """The fleet's id, made by the first coordinator that asks (all later ones agree)."""
        self._client.hsetnx(schema.FLEET_KEY, "id", os.urandom(4).hex())
        return cast(bytes, self._client.hget(schema.FLEET_KEY, "id")).decode()

    def next_worker_number(self) -> int:
        """0, 1, 2, ... across the fleet's whole life: a worker id is never given twice (a
        replacement is a new worker, and every coordinator must see it as one)."""
        return int(self._client.hincrby(schema.FLEET_KEY, "next_worker", 1)) - 1

    def claim_service(self, service: WorkerService) -> bool:
        """Register a service worker under its id; False if the id is taken (atomic)."""
        key = schema.service_key(service.worker_id)
        if not self._client.hsetnx(key, "actor_name", service.actor_name):
            return False
        fields = {
            "ray_namespace": service.ray_namespace,
            "num_gpus": repr(service.num_gpus),
            "config_json": service.config_json,
        }
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(key, mapping=fields)
        pipe.sadd(schema.SERVICES_SET, service.worker_id)
        pipe.execute()
        return True

    def services(self) -> list[WorkerService]:
        out = []
        for raw in sorted(cast(set[bytes], self._client.smembers(schema.SERVICES_SET))):
            worker_id = raw.decode()
            h = {
                k.decode(): v.decode()
                for k, v in self._client.hgetall(schema.service_key(worker_id)).items()
            }
            if "config_json" not in h:
                continue  # being claimed right now
            out.append(
                WorkerService(
                    worker_id,
                    h["actor_name"],
                    h["ray_namespace"],
                    float(h["num_gpus"]),
                    h["config_json"],
                )
            )
        return out

    def remove_service(self, worker_id: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.srem(schema.SERVICES_SET, worker_id)
        pipe.delete(schema.service_key(worker_id), schema.replacing_key(worker_id))
        pipe.execute()

    def claim_replacement(self, worker_id: str, ttl_s: float) -> bool:
        """True for exactly one caller per dead worker (within `ttl_s`)."""
        return bool(
            self._client.set(schema.replacing_key(worker_id), "1", nx=True, px=int(ttl_s * 1000))
        )
