"""The engine thread hands a step's first tokens over to their streams before it runs the next
step (a real CPU worker driven by its real engine thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.engine_thread import HAND_OVER_S, EngineThread
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner

BS = 16


def req(rid: str, prompt: list[int], max_tokens: int) -> WorkerRequest:
    return WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, ignore_eos=True))


def test_first_tokens_are_handed_over_before_the_next_step_and_nothing_else_is() -> None:
    config = preset("tiny-random")
    runner = ModelRunner(config, 64, BS, device="cpu", dtype=torch.float32, seed=0)
    worker = Worker("w0", runner, config.fingerprint(), SchedulerConfig(BS, 8, 4096))
    lock = threading.Lock()
    outputs: list[RequestOutput] = []
    hand_overs: list[tuple[list[str], float, int]] = []  # ids, timeout, outputs delivered by then

    def deliver(_rid: str, o: RequestOutput | Exception) -> None:
        assert isinstance(o, RequestOutput)
        with lock:
            outputs.append(o)

    def hand_over(request_ids: Sequence[str], timeout_s: float) -> bool:
        with lock:
            hand_overs.append((list(request_ids), timeout_s, len(outputs)))
        return True

    engine = EngineThread(
        worker, WorkerConfig("w0"), None, deliver, lambda exc: None, hand_over=hand_over
    )
    engine.start()
    try:
        engine.submit(lambda: worker.add_request(req("long", [7] * 20, max_tokens=4)))
        engine.submit(lambda: worker.add_request(req("one", [9] * 20, max_tokens=1)))
        deadline = time.monotonic() + 30
        while sum(o.finished for o in list(outputs)) < 2:
            assert time.monotonic() < deadline, "the requests never finished"
            time.sleep(0.01)
    finally:
        engine.stop()
    # "long"'s first token is handed over once, right after it was delivered, before its second;
    # "one"'s only output is its last (it goes out after the step's events), never handed over.
    assert [(ids, timeout) for ids, timeout, _ in hand_overs] == [(["long"], HAND_OVER_S)]
    delivered_by_then = hand_overs[0][2]
    assert [o.request_id for o in outputs[:delivered_by_then]].count("long") == 1
    assert outputs[delivered_by_then - 1].request_id == "long"
    assert outputs[delivered_by_then - 1].prefill is not None
