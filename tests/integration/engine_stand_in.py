"""A stand-in for an engine's KV-event publisher, on real ZMQ sockets, speaking vLLM's protocol:
PUB `[topic, seq (8 bytes big-endian), msgpack EventBatch]` and a ROUTER replay socket answering
`[b"", start]` with `[b"", topic, seq, payload]...` and `[b"", b"", -1, b""]` (vLLM 0.32).

Events are built as msgpack maps exactly to vLLM's schema (`vllm/distributed/kv_events.py`).
It can drop a batch from the live stream (a gap) or from its replay buffer too (a lost gap),
and restart (its sequence begins again at 0)."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgpack
import zmq

TOPIC = b"kv"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[Any], parent: Any, tokens: list[int], block_size: int) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


class StandInEngine:
    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.bind("tcp://127.0.0.1:*")
        self.events_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._buffer: list[tuple[int, bytes]] = []
        self._next_seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve_replay, daemon=True)
        self._thread.start()

    def publish(self, events: list[Any], *, send: bool = True, keep: bool = True) -> int:
        payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
        return self.publish_raw(payload, send=send, keep=keep)

    def publish_raw(self, payload: bytes, *, send: bool = True, keep: bool = True) -> int:
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if keep:
                self._buffer.append((seq, payload))
            if send:
                self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """As a restarted engine: its sequence and replay buffer begin again."""
        with self._lock:
            self._next_seq = 0
            self._buffer.clear()

    def _serve_replay(self) -> None:
        while not self._stop.is_set():
            if not self._router.poll(50):
                continue
            client, _empty, start_bytes = self._router.recv_multipart()
            start = int.from_bytes(start_bytes, "big")
            with self._lock:
                batches = [(s, p) for s, p in self._buffer if s >= start]
            for seq, payload in batches:
                self._router.send_multipart([client, b"", TOPIC, seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._pub.close(linger=0)
        self._router.close(linger=0)
        self._ctx.term()
