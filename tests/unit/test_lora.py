"""LoRA adapters in the runner: PEFT folders, batched with other adapters, match peft."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from kvmesh.workers.model.model_config import ModelConfig
from kvmesh.workers.model.runner import ModelRunner, SeqChunk
from tests.unit.tiny_llama import tiny_llama_config

NUM_BLOCKS = 64
BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], Path]:
    """A random Llama checkpoint and two PEFT adapters written by peft itself: one on every
    projection, one on q/v only with another rank and rsLoRA."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    hf_config = tiny_llama_config(
        transformers,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(hf_config).eval()
    base.save_pretrained(root / "base")
    specs = {
        "all": peft.LoraConfig(
            r=8,
            lora_alpha=16,
            target_modules=[
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ],
            init_lora_weights=False,  # random B: the adapter really changes the logits
        ),
        "qv": peft.LoraConfig(
            r=4,
            lora_alpha=8,
            use_rslora=True,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
        ),
    }
    tuned = {}
    for name, spec in specs.items():
        torch.manual_seed(len(name))
        model = peft.get_peft_model(copy.deepcopy(base), spec).eval()
        model.save_pretrained(root / name)
        tuned[name] = model
    return base, tuned, root


def _logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _runner(root: Path) -> ModelRunner:
    config = ModelConfig.from_model_dir(str(root / "base"))
    runner = ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE, weights_path=str(root / "base"))
    runner.load_adapter("all", str(root / "all"))
    runner.load_adapter("qv", str(root / "qv"))
    return runner


def test_batched_adapters_each_match_peft_and_the_base_rows_stay_base(
    checkpoint: tuple[Any, dict[str, Any], Path],
) -> None:
    base, tuned, root = checkpoint
    runner = _runner(root)
    prompts = {"": _prompt(21, 1), "all": _prompt(18, 2), "qv": _prompt(13, 3)}
    tables = {"": list(range(0, 8)), "all": list(range(8, 16)), "qv": list(range(16, 24))}
    batch = [SeqChunk(ids, 0, tables[name], adapter=name) for name, ids in prompts.items()]
    got = runner.forward_all_logits(batch)
    expected = [
        _logits(base, prompts[""]),
        _logits(tuned["all"], prompts["all"]),
        _logits(tuned["qv"], prompts["qv"]),
    ]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=0)
    # The adapters really change the model (the test could fail).
    assert not torch.allclose(expected[1], _logits(base, prompts["all"]), atol=1e-2)
    assert not torch.allclose(expected[2], _logits(base, prompts["qv"]), atol=1e-2)


def test_decode_steps_of_different_adapters_batch_together(
    checkpoint: tuple[Any, dict[str, Any], Path],
) -> None:
    _, tuned, root = checkpoint
    runner = _runner(root)
    ids_all, ids_qv = _prompt(15, 4), _prompt(11, 5)
    t_all, t_qv = list(range(0, 6)), list(range(6, 12))
    runner.forward(
        [
            SeqChunk(ids_all[:12], 0, t_all, adapter="all"),
            SeqChunk(ids_qv[:9], 0, t_qv, adapter="qv"),
        ]
    )
    # Cached prefixes, then a mixed step: a chunked prefill of one and a decode of the other.
    last = runner.forward(
        [
            SeqChunk(ids_all[12:], 12, t_all, adapter="all"),
            SeqChunk(ids_qv[9:10], 9, t_qv, adapter="qv"),
        ]
    )
    torch.testing.assert_close(last[0], _logits(tuned["all"], ids_all)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(last[1], _logits(tuned["qv"], ids_qv[:10])[-1], atol=1e-4, rtol=0)


def test_adapters_that_do_not_fit_are_refused_with_the_reason(
    checkpoint: tuple[Any, dict[str, Any], Path], tmp_path: Path
) -> None:
    _, _, root = checkpoint
    runner = _runner(root)
    with pytest.raises(ValueError, match="adapter 'nope' is not loaded; loaded: \\['all', 'qv'\\]"):
        runner.forward([SeqChunk([1, 2, 3], 0, [0], adapter="nope")])
    with pytest.raises(ValueError, match="already loaded"):
        runner.load_adapter("all", str(root / "all"))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        runner.load_adapter("x", str(tmp_path))
    config = json.loads((root / "qv" / "adapter_config.json").read_text())
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match=r"uses \['use_dora'\]"):
        runner.load_adapter("dora", str(dora))


def test_a_worker_serves_adapters_beside_the_base_model_without_sharing_their_blocks(
    checkpoint: tuple[Any, dict[str, Any], Path],
) -> None:
    from collections import defaultdict

    from kvmesh.workers.contract.requests import SamplingConfig, WorkerRequest
    from kvmesh.workers.engine.scheduler import SchedulerConfig
    from kvmesh.workers.engine.worker import Worker

    base, tuned, root = checkpoint
    runner = _runner(root)
    first_logits: dict[str, torch.Tensor] = {}
    worker = Worker(
        "w0",
        runner,
        runner.fingerprint,
        SchedulerConfig(BLOCK_SIZE, 8, 4096),
        logits_sink=lambda rid, row: first_logits.setdefault(rid, row),
    )
    assert worker.info().adapters == ("all", "qv")
    ids = _prompt(22, 6)
    sampling = SamplingConfig(max_tokens=2, ignore_eos=True)

    def run(*requests: WorkerRequest) -> dict[str, int]:
        for r in requests:
            worker.add_request(r)
        cached: dict[str, int] = defaultdict(int)
        while worker.has_work:
            for out in worker.step():
                if out.prefill is not None:
                    cached[out.request_id] = out.prefill.local_tokens
            worker.check_invariants()
        return cached

    first = run(
        WorkerRequest("base", tuple(ids), sampling),
        WorkerRequest("all", tuple(ids), sampling, adapter="all"),
    )
    assert first == {"base": 0, "all": 0}  # same tokens, different namespaces: no sharing
    torch.testing.assert_close(first_logits["base"], _logits(base, ids)[-1], atol=1e-4, rtol=0)
    torch.testing.assert_close(
        first_logits["all"], _logits(tuned["all"], ids)[-1], atol=1e-4, rtol=0
    )
    again = run(
        WorkerRequest("qv", tuple(ids), sampling, adapter="qv"),
        WorkerRequest("all-2", tuple(ids), sampling, adapter="all"),
    )
    assert again == {"qv": 0, "all-2": 20}  # the adapter's own blocks are its cache
    torch.testing.assert_close(first_logits["all-2"], first_logits["all"], atol=1e-5, rtol=0)
    with pytest.raises(
        ValueError, match="does not serve adapter 'law'; it serves \\['all', 'qv'\\]"
    ):
        worker.add_request(WorkerRequest("law", tuple(ids), sampling, adapter="law"))
