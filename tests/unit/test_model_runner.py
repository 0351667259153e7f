"""Model runner: matches Hugging Face transformers, and paging never changes the logits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvmesh.workers.model import batch_attention, batch_plan
from kvmesh.workers.model.batch_plan import AttentionMode
from kvmesh.workers.model.model_config import ModelConfig, RopeScaling, load_model_config, preset
from kvmesh.workers.model.runner import ModelRunner, SeqChunk, rope_inv_freq
from kvmesh.workers.model.split_attention import SplitShape
from kvmesh.workers.model.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from kvmesh.workers.model.weights import hashed_uniform, hf_param_shapes, random_weights
from tests.unit.tiny_llama import tiny_llama_config

NUM_BLOCKS = 64
BLOCK_SIZE = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny() -> ModelRunner:
    return ModelRunner(preset("tiny-random"), NUM_BLOCKS, BLOCK_SIZE)


def fresh_runner(like: ModelRunner) -> ModelRunner:
    """A runner sharing `like`'s weights with an empty cache."""
    return ModelRunner(like.config, NUM_BLOCKS, BLOCK_SIZE, weights=like.weights)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def shuffled_table(num_blocks: int, seed: int) -> list[int]:
    return random.Random(seed).sample(range(NUM_BLOCKS), num_blocks)


# ---------------------------------------------------------------- Hugging Face oracle


def _randomize_hf(model: torch.nn.Module) -> None:
    # HF initialises norms to 1 and biases to 0; random ones prove we load and apply them.
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            elif name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


def _hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _check_against_hf(model: torch.nn.Module, model_dir: Path) -> None:
    config = ModelConfig.from_model_dir(str(model_dir))
    runner = ModelRunner(config, NUM_BLOCKS, BLOCK_SIZE, weights_path=str(model_dir))
    ids = prompt(45, seed=3)
    expected = _hf_logits(model, ids)
    table = shuffled_table(12, seed=4)
    whole = runner.forward_all_logits([SeqChunk(ids, 0, table)])[0]
    torch.testing.assert_close(whole, expected, atol=1e-4, rtol=0)
    # Same prompt again in three chunks behind cached prefixes, into other blocks.
    other = shuffled_table(12, seed=5)
    pieces = [(0, 17), (17, 18), (18, 45)]
    got = [runner.forward_all_logits([SeqChunk(ids[a:b], a, other)])[0] for a, b in pieces]
    torch.testing.assert_close(torch.cat(got), expected, atol=1e-4, rtol=0)


def test_logits_match_transformers_llama_with_llama3_rope(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = tiny_llama_config(
        transformers,
        max_position_embeddings=1024,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        rms_norm_eps=1e-5,
        bos_token_id=256,
        eos_token_id=[257, 258],
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    _randomize_hf(model)
    model.save_pretrained(tmp_path, max_shard_size="100KB")  # sharded: exercises the index
    assert (tmp_path / "model.safetensors.index.json").exists()
    _check_against_hf(model, tmp_path)
    config = ModelConfig.from_model_dir(str(tmp_path))
    assert config.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 256)
    assert config.eos_token_ids == (257, 258)


def test_logits_match_transformers_qwen2_with_qkv_bias_and_tied_head(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_config = transformers.Qwen2Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        initializer_range=0.15,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config).eval()
    _randomize_hf(model)
    model.save_pretrained(tmp_path)
    config = ModelConfig.from_model_dir(str(tmp_path))
    assert config.qkv_bias and config.tie_word_embeddings
    _check_against_hf(model, tmp_path)


def test_checkpoint_that_does_not_match_config_is_rejected(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = preset("tiny-random")
    shapes = hf_param_shapes(config)
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size + 8,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
    }
    (tmp_path / "config.json").write_text(json.dumps(hf))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    wrong = ModelConfig.from_model_dir(str(tmp_path))
    with pytest.raises(ValueError, match="shape"):
        ModelRunner(wrong, 8, BLOCK_SIZE, weights_path=str(tmp_path))
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hf["intermediate_size"] = config.intermediate_size
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="lacks tensor model.norm.weight"):
        right = ModelConfig.from_model_dir(str(tmp_path))
        ModelRunner(right, 8, BLOCK_SIZE, weights_path=str(tmp_path))


# ---------------------------------------------------------------- paging


def test_chunked_prefill_into_shuffled_blocks_matches_one_shot(tiny: ModelRunner) -> None:
    ids = prompt(29, seed=1)
    one_shot = fresh_runner(tiny).forward([SeqChunk(ids, 0, list(range(8)))])
    runner = fresh_runner(tiny)
    table = shuffled_table(8, seed=2)
    runner.forward([SeqChunk(ids[:10], 0, table)])  # prefix ends mid-block
    chunked = runner.forward([SeqChunk(ids[10:], 10, table)])
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=0)


def test_split_prefix_attention_gives_the_masked_paths_logits(tiny: ModelRunner) -> None:
    """The prefix / causal-square split with its log-sum-exp merge (the math fallback of the
    fused kernels) equals the one-call masked path, for prefixes ending mid-block and on one."""
    ids = prompt(45, seed=11)
    table = shuffled_table(12, seed=12)
    expected = fresh_runner(tiny).forward_all_logits([SeqChunk(ids, 0, list(range(12)))])[0]
    for cached in (1, 10, 16, 44):
        runner = fresh_runner(tiny)
        runner.attention.mode = AttentionMode(
            paged_decode=False, paged_prefill=False, explicit_masks=True, split_prefill=True
        )
        runner.forward([SeqChunk(ids[:cached], 0, table)])
        got = runner.forward_all_logits([SeqChunk(ids[cached:], cached, table)])[0]
        torch.testing.assert_close(got, expected[cached:], atol=1e-5, rtol=0)


def test_bucketed_split_gives_the_masked_paths_logits(
    tiny: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long prefixes split at a bucketed point with padded rows (the threshold lowered so the
    tiny model reaches it), shorter ones on the masked path: the same logits either way."""
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_PREFIX", 12)
    monkeypatch.setattr(batch_plan, "BUCKETED_MIN_NEW", 2)
    ids = prompt(45, seed=13)
    table = shuffled_table(12, seed=14)
    expected = fresh_runner(tiny).forward_all_logits([SeqChunk(ids, 0, list(range(12)))])[0]
    for cached in (5, 12, 30, 40):
        runner = fresh_runner(tiny)
        runner.attention.mode = AttentionMode(
            paged_decode=False, paged_prefill=False, explicit_masks=True, bucketed_prefill=True
        )
        runner.forward([SeqChunk(ids[:cached], 0, table)])
        plan = runner._plan([SeqChunk(ids[cached:], cached, table)])
        assert (plan.cached[0].split is not None) == (cached >= 12)
        got = runner.forward_all_logits([SeqChunk(ids[cached:], cached, table)])[0]
        torch.testing.assert_close(got, expected[cached:], atol=1e-5, rtol=0)


def test_split_warm_up_runs_every_bucketed_shape_or_turns_the_split_off(
    tiny: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Warm-up runs each shape the runner will split (thresholds lowered for the tiny cache); a
    fused kernel that refuses the model's shapes leaves every chunk on the paged path instead of
    failing the worker's start."""
    monkeypatch.setattr(batch_attention, "BUCKETED_MIN_PREFIX", 8)
    monkeypatch.setattr(batch_attention, "BUCKETED_MIN_NEW", 1)
    runner = fresh_runner(tiny)
    assert runner.attention.warm_up_split(16) == 0  # the split is off on CPU: nothing to warm
    bucketed = AttentionMode(
        paged_decode=False, paged_prefill=False, explicit_masks=True, bucketed_prefill=True
    )
    runner.attention.mode = bucketed
    max_len = NUM_BLOCKS * BLOCK_SIZE
    assert runner.attention.warm_up_split(16) == len(SplitShape.all_bucketed(8, max_len, 1, 16)) > 0

    def refuse(*args: object) -> None:
        raise RuntimeError("no kernel for head dim 16")

    monkeypatch.setattr(batch_attention, "split_prefix_attention", refuse)
    assert runner.attention.warm_up_split(16) == 0
    assert not runner.attention.mode.bucketed_prefill


def test_decode_steps_match_full_prompt_logits(tiny: ModelRunner) -> None:
    ids = prompt(21, seed=6)
    expected = fresh_runner(tiny).forward_all_logits([SeqChunk(ids, 0, list(range(6)))])[0]
    runner = fresh_runner(tiny)
    table = shuffled_table(6, seed=7)
    runner.forward([SeqChunk(ids[:16], 0, table)])
    for pos in range(16, 21):
        step = runner.forward([SeqChunk(ids[pos : pos + 1], pos, table)])
        torch.testing.assert_close(step[0], expected[pos], atol=1e-5, rtol=0)


def test_mixed_batch_matches_each_sequence_alone(tiny: ModelRunner) -> None:
    # (prefix already cached, new tokens): fresh prefills, chunked prefill, decodes of two lengths.
    shapes = [(0, 23), (11, 7), (15, 1), (0, 1), (9, 1), (0, 5)]
    seqs = [prompt(a + b, seed=10 + i) for i, (a, b) in enumerate(shapes)]
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(shapes))]
    batched = fresh_runner(tiny)
    expected = []
    for ids, (cached_len, _), table in zip(seqs, shapes, tables, strict=True):
        alone = fresh_runner(tiny)
        if cached_len:
            alone.forward([SeqChunk(ids[:cached_len], 0, table)])
            batched.forward([SeqChunk(ids[:cached_len], 0, table)])
        expected.append(alone.forward([SeqChunk(ids[cached_len:], cached_len, table)])[0])
    chunks = [
        SeqChunk(ids[a:], a, table) for ids, (a, _), table in zip(seqs, shapes, tables, strict=True)
    ]
    got = batched.forward(chunks)
    assert got.shape == (len(shapes), tiny.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.stack(expected), atol=1e-5, rtol=0)


def test_sequences_sharing_prefix_blocks_read_them_without_rewriting(tiny: ModelRunner) -> None:
    ids = prompt(12, seed=20)
    runner = fresh_runner(tiny)
    runner.forward([SeqChunk(ids[:8], 0, [5, 6])])
    before = runner.block_io.export_blocks([5, 6])
    a = runner.forward([SeqChunk(ids[8:], 8, [5, 6, 7]), SeqChunk([1, 2, 3], 8, [5, 6, 9])])
    torch.testing.assert_close(runner.block_io.export_blocks([5, 6]), before, atol=0, rtol=0)
    alone = fresh_runner(tiny).forward([SeqChunk(ids, 0, [0, 1, 2])])
    torch.testing.assert_close(a[0], alone[0], atol=1e-5, rtol=0)


def test_greedy_steps_fed_on_the_device_give_the_host_loops_tokens(tiny: ModelRunner) -> None:
    ids = [prompt(9 + 5 * i, seed=40 + i) for i in range(3)]
    blocks = shuffled_table(36, seed=50)
    tables = [blocks[12 * i : 12 * (i + 1)] for i in range(3)]
    sync, fed = fresh_runner(tiny), fresh_runner(tiny)
    want = [sync.forward([SeqChunk(p, 0, t) for p, t in zip(ids, tables, strict=True)]).argmax(-1)]
    previous = fed.forward_tokens([SeqChunk(p, 0, t) for p, t in zip(ids, tables, strict=True)])
    got = [previous.device]
    for step in range(8):
        positions = [len(p) + step for p in ids]
        tokens = want[-1].tolist()
        host_fed = [SeqChunk([tokens[i]], n, tables[i]) for i, n in enumerate(positions)]
        want.append(sync.forward(host_fed).argmax(-1))
        # token 0 everywhere: a step that read the chunks' ids would go another way
        previous = fed.forward_tokens(
            [SeqChunk([0], n, t) for n, t in zip(positions, tables, strict=True)], previous=previous
        )
        got.append(previous.device)
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert len({tuple(w.tolist()) for w in want}) > 2  # the tokens change from step to step
    assert previous.tolist() == want[-1].tolist()


def test_feeding_tokens_needs_one_one_token_chunk_each(tiny: ModelRunner) -> None:
    runner = fresh_runner(tiny)
    previous = runner.forward_tokens([SeqChunk([3, 4], 0, [0]), SeqChunk([5], 0, [1])])
    with pytest.raises(ValueError, match=r"previous has 2 tokens.*got \[1\]"):
        runner.forward_tokens([SeqChunk([0], 2, [0])], previous=previous)
    with pytest.raises(ValueError, match=r"got \[2, 1\]"):
        runner.forward_tokens([SeqChunk([0, 0], 2, [0]), SeqChunk([0], 1, [1])], previous=previous)


# ---------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (SeqChunk([1] * 9, 0, [0, 1]), "block table has 2 blocks, 9 tokens need 3"),
        (SeqChunk([1, 320], 0, [0]), r"token ids span \[1, 320\], vocab is 320"),
        (SeqChunk([1], 4, [0, 64]), r"block ids span \[0, 64\], pool has \[0, 64\)"),
        (SeqChunk([1], 0, [-1]), r"block ids span \[-1, -1\]"),
        (SeqChunk([1], 2048, [0] * 513), "reaches 2049 tokens, model context is 2048"),
    ],
)
def test_bad_chunk_raises_value_error_with_numbers(
    tiny: ModelRunner, chunk: SeqChunk, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.forward([chunk])


def test_malformed_chunks_and_batches_are_rejected(tiny: ModelRunner) -> None:
    with pytest.raises(ValueError, match="at least 1 new token"):
        SeqChunk([], 0, [0])
    with pytest.raises(ValueError, match="start_pos must be >= 0, got -1"):
        SeqChunk([1], -1, [0])
    with pytest.raises(ValueError, match="empty"):
        tiny.forward([])
    with pytest.raises(ValueError, match="distinct cache slots"):
        tiny.forward([SeqChunk([1, 2], 0, [3]), SeqChunk([4], 1, [3])])
    with pytest.raises(ValueError, match="seed 1 differs"):
        ModelRunner(preset("tiny-random"), 4, 4, seed=1)
    with pytest.raises(ValueError, match="num_blocks and block_size must be > 0, got 0, 4"):
        ModelRunner(preset("tiny-random"), 0, 4)


# ---------------------------------------------------------------- presets and determinism


def test_random_presets_are_deterministic_per_seed(tiny: ModelRunner) -> None:
    ids = [SeqChunk(prompt(9, seed=30), 0, [0, 1, 2])]
    same = ModelRunner(preset("tiny-random", seed=0), 4, BLOCK_SIZE).forward(ids)
    torch.testing.assert_close(same, fresh_runner(tiny).forward(ids), atol=0, rtol=0)
    other = ModelRunner(preset("tiny-random", seed=1), 4, BLOCK_SIZE, seed=1).forward(ids)
    assert (other - same).abs().max() > 1e-2
    assert preset("tiny-random", 1).fingerprint() != preset("tiny-random", 0).fingerprint()


def test_fingerprints_are_stable_and_differ_between_presets() -> None:
    names = ["tiny-random", "llama3-8b-random", "llama3.2-1b-random", "qwen2-0.5b-random"]
    prints = {preset(name).fingerprint() for name in names}
    assert len(prints) == len(names)
    assert preset("tiny-random").fingerprint() == preset("tiny-random").fingerprint()
    assert load_model_config("tiny-random") == preset("tiny-random")
    # Pinned: a change here re-namespaces every cached block in a cluster; make it on purpose.
    assert preset("tiny-random").fingerprint() == "tiny-random-43296f424762a11e"


def test_hashed_random_values_are_pinned() -> None:
    # The same numbers on every device is what lets CPU and GPU workers share random-model blocks.
    values = hashed_uniform("0:test", (3,), 1.0, torch.device("cpu"), torch.float32)
    expected = torch.tensor([-0.25725364685058594, -0.0007021427154541016, -0.866426944732666])
    torch.testing.assert_close(values, expected, atol=0, rtol=0)


def test_big_preset_shapes_match_published_models() -> None:
    llama8b = preset("llama3-8b-random")
    assert llama8b.num_queries_per_kv == 4 and llama8b.rope_scaling is not None
    # 128 KiB of bf16 KV per token is the well-known Llama-3-8B figure.
    assert ModelRunner.kv_bytes_per_block(llama8b, 16, torch.bfloat16) == 16 * 128 * 1024
    assert preset("llama3.2-1b-random").tie_word_embeddings
    assert preset("qwen2-0.5b-random").qkv_bias
    with pytest.raises(ValueError, match="unknown preset"):
        preset("gpt-17")


def test_llama3_rope_scaling_keeps_short_wavelengths_and_stretches_long_ones() -> None:
    config = preset("tiny-random")
    assert config.rope_scaling is not None
    plain = rope_inv_freq(ModelConfig.from_hf_dict({**_hf_dict(config), "rope_scaling": None}))
    scaled = rope_inv_freq(config)
    assert torch.equal(scaled[:3], plain[:3])  # wavelengths < 512 / 4
    torch.testing.assert_close(scaled[4:], plain[4:] / 4.0)  # wavelengths > 512
    assert plain[3] / 4.0 < scaled[3] < plain[3]  # blended band


def _hf_dict(config: ModelConfig) -> dict[str, object]:
    return {
        "architectures": [config.architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rope_theta": config.rope_theta,
    }


def test_hf_dict_reading_handles_v4_layout_windows_and_unsupported_rope() -> None:
    v4 = {
        **_hf_dict(preset("tiny-random")),
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "eos_token_id": 7,
    }
    config = ModelConfig.from_hf_dict(v4)
    assert config.rope_theta == 500000.0 and config.eos_token_ids == (7,)
    assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    mistral = {**v4, "architectures": ["MistralForCausalLM"], "rope_scaling": None}
    mistral |= {"sliding_window": 4096, "max_position_embeddings": 32768}
    assert ModelConfig.from_hf_dict(mistral).max_position_embeddings == 4096
    with pytest.raises(ValueError, match="rope_type 'longrope' is not supported"):
        ModelConfig.from_hf_dict({**v4, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    with pytest.raises(
        ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"
    ):
        ModelConfig.from_hf_dict({**v4, "num_key_value_heads": 3})


# ---------------------------------------------------------------- block transfer


def test_exported_blocks_imported_elsewhere_continue_the_sequence(tiny: ModelRunner) -> None:
    ids = prompt(14, seed=40)
    source = fresh_runner(tiny)
    source_table = [7, 3, 12, 30]
    source.forward([SeqChunk(ids[:12], 0, source_table)])
    blocks = source.block_io.export_blocks(source_table[:3])
    c = tiny.config
    assert blocks.shape == (3, c.num_layers, 2, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    assert blocks.is_contiguous()
    target = fresh_runner(tiny)
    target_table = [50, 1, 22, 9]
    target.block_io.import_blocks(target_table[:3], blocks)
    torch.testing.assert_close(
        target.block_io.export_blocks(target_table[:3]), blocks, atol=0, rtol=0
    )
    expected = source.forward([SeqChunk(ids[12:], 12, source_table)])
    got = target.forward([SeqChunk(ids[12:], 12, target_table)])
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match="duplicates"):
        target.block_io.import_blocks([1, 1, 2], blocks)
    with pytest.raises(ValueError, match="expected"):
        target.block_io.import_blocks([1, 2], blocks)
    with pytest.raises(ValueError, match=r"block ids span \[0, 64\]"):
        target.block_io.export_blocks([0, 64])


def test_random_weights_are_the_same_for_any_dtype_up_to_rounding() -> None:
    config = preset("tiny-random")
    fp32 = random_weights(config, seed=0, dtype=torch.float32)
    bf16 = random_weights(config, seed=0, dtype=torch.bfloat16)
    torch.testing.assert_close(fp32.layers[1].qkv_proj.to(torch.bfloat16), bf16.layers[1].qkv_proj)
    assert fp32.num_bytes() == 2 * bf16.num_bytes()


# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trips_utf8_and_skips_specials() -> None:
    tok = load_tokenizer("tiny-random")
    assert isinstance(tok, ByteTokenizer)
    text = "héllo wörld — 漢字 🚀\n"
    ids = tok.encode(text)
    assert ids[0] == 256 and max(ids[1:]) < 256 and len(ids) == 1 + len(text.encode())
    assert tok.decode(ids + [257]) == text
    assert tok.eos_token_ids == (257,) and tok.vocab_size == 320
    assert tok.decode([0xE6, 0xBC]) == "\ufffd"  # a cut multi-byte character does not raise


def test_checkpoint_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    rust = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    rust.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    rust.save(str(tmp_path / "tokenizer.json"))
    hf = {**_hf_dict(preset("tiny-random")), "eos_token_id": 2, "bos_token_id": None}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [1, 2]
    assert tok.decode([1, 2]) == "hello world"
    assert tok.eos_token_ids == (2, 1)
