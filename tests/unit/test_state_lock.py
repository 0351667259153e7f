"""The worker's state lock: the engine thread lets go of it only while a step's forward pass
runs, so a peer's pin is served then instead of after the step (a real CPU worker driven by its
real engine thread; the test holds the forward pass open through the worker's logits hook)."""

from __future__ import annotations

import threading
import time

import torch

from kvmesh.proto.block_hash import block_hashes
from kvmesh.workers.config import WorkerConfig
from kvmesh.workers.contract.replies import RequestOutput
from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
from kvmesh.workers.engine.scheduler import SchedulerConfig
from kvmesh.workers.engine.state_lock import StateLock
from kvmesh.workers.engine.worker import Worker
from kvmesh.workers.engine_thread import EngineThread
from kvmesh.workers.model.model_config import preset
from kvmesh.workers.model.runner import ModelRunner

BS = 16
PREFIX = [(i * 7) % 250 + 3 for i in range(64)]  # 4 full blocks


def test_released_lets_another_thread_in_and_takes_the_lock_back() -> None:
    lock = StateLock()
    with lock:
        assert lock.try_run(lambda: 1) == (False, None)  # held: no waiting, no run
        with lock.released():
            ran: list[tuple[bool, int | None]] = []
            other = threading.Thread(target=lambda: ran.append(lock.try_run(lambda: 7)))
            other.start()
            other.join(5)
            assert ran == [(True, 7)]
        assert lock.try_run(lambda: 1) == (False, None)  # held again after
    assert lock.run(lambda: 3) == 3


def test_released_takes_the_lock_back_when_the_work_inside_raises() -> None:
    lock = StateLock()
    with lock:
        try:
            with lock.released():
                raise RuntimeError("the forward pass failed")
        except RuntimeError:
            pass
        assert lock.try_run(lambda: 1) == (False, None)


def req(rid: str, prompt: list[int], max_tokens: int = 2) -> WorkerRequest:
    return WorkerRequest(rid, tuple(prompt), SamplingConfig(max_tokens=max_tokens, ignore_eos=True))


def test_a_peer_pins_a_run_while_a_step_forward_runs_not_after_the_step() -> None:
    in_forward, go = threading.Event(), threading.Event()

    def hold_slow_forward(rid: str, _row: torch.Tensor) -> None:
        if rid == "slow":
            in_forward.set()
            go.wait(30)

    config = preset("tiny-random")
    runner = ModelRunner(config, 64, BS, device="cpu", dtype=torch.float32, seed=0)
    worker = Worker(
        "w0",
        runner,
        config.fingerprint(),
        SchedulerConfig(BS, 8, 4096),
        logits_sink=hold_slow_forward,
    )
    worker.add_request(req("first", PREFIX + [1]))
    while worker.has_work:  # its 4 blocks registered before the engine thread starts
        worker.step()
    hashes = block_hashes(PREFIX, BS, worker.root_hash("", ""))
    outputs: list[RequestOutput] = []
    engine = EngineThread(
        worker, WorkerConfig("w0"), None, lambda _rid, o: outputs.append(o), lambda exc: None
    )
    engine.start()
    try:
        engine.submit(lambda: worker.add_request(req("slow", [9] * 40)))
        assert in_forward.wait(30)
        ran, pinned = engine.lock.try_run(lambda: worker.pull_source.pin_run(hashes))
        assert ran and pinned is not None and len(pinned) == 4  # served inside the step
        assert not outputs  # the step had not ended: its forward was still held open
    finally:
        go.set()
        deadline = time.monotonic() + 30
        while not any(o.request_id == "slow" and o.finished for o in outputs):
            assert time.monotonic() < deadline, "the slow request never finished"
            time.sleep(0.01)
        engine.stop()
    assert sorted(worker.pull_source.held_blocks()) == sorted(pinned)
    worker.pull_source.unpin(pinned)
    worker.check_invariants()
    worker.add_request(req("after", [5] * 20))  # stepped without the engine thread now
    while worker.has_work:
        worker.step()
