"""A stand-in OpenAI engine with a prefix cache of its own, for routing tests without vLLM:
`/health`, `/v1/models`, streamed `/v1/completions` on token ids (vLLM's chunk shapes, with
`token_ids` and `usage.prompt_tokens_details.cached_tokens`), and its stored blocks announced
as vLLM-format KV events through a `StandInEngine` publisher. Its block hashes are its own
(Python's tuple hash), as opaque to kvmesh as vLLM's."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.integration.engine_stand_in import StandInEngine, stored


class StandInOpenAIEngine:
    def __init__(self, name: str, block_size: int) -> None:
        self.name = name
        self.block_size = block_size
        self.events = StandInEngine()
        self.held: set[int] = set()
        self.num_requests = 0
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._json({})
                elif self.path == "/v1/models":
                    self._json({"data": [{"id": "stand-in"}]})
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                cached = engine.serve(list(body["prompt"]))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(body["max_tokens"]):
                    last = i == body["max_tokens"] - 1
                    choice = {"token_ids": [7], "finish_reason": "length" if last else None}
                    self._event({"choices": [choice]})
                usage = {"prompt_tokens": len(body["prompt"]),
                         "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
                self._event({"choices": [], "usage": usage})
                self.wfile.write(b"data: [DONE]\n\n")

            def _event(self, obj: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

            def _json(self, obj: dict[str, Any]) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def spec(self) -> str:
        port = self.server.server_address[1]
        return (
            f"{self.name},http://127.0.0.1:{port},{self.events.events_endpoint},"
            f"{self.events.replay_endpoint}"
        )

    def serve(self, prompt: list[int]) -> int:
        """Prefill with the cache: returns the cached tokens; announces the blocks it stored."""
        bs = self.block_size
        num_full = len(prompt) // bs
        hashes = [hash(tuple(prompt[: (i + 1) * bs])) for i in range(num_full)]
        with self._lock:
            self.num_requests += 1
            num_held = 0
            while num_held < num_full and hashes[num_held] in self.held:
                num_held += 1
            reusable = min(num_held, (len(prompt) - 1) // bs)
            new = hashes[num_held:]
            if new:
                parent = hashes[num_held - 1] if num_held else None
                self.events.publish(
                    [stored(new, parent, prompt[num_held * bs : num_full * bs], bs)]
                )
                self.held.update(new)
        return reusable * bs

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def close(self) -> None:
        self.events.close()
