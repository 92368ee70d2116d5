"""KV / weight arithmetic against hand-computed bytes, the presets, and fit() plans."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from kvbench.sizing import (
    SizingReport,
    bytes_for_elements,
    fit,
    format_table,
    kv_bytes_per_batch,
    kv_bytes_per_block,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    num_blocks_for_tokens,
    num_params,
    report_to_dict,
    weight_bytes,
)
from kvbench.specs import HardwareSpec, ModelSpec, SpecError

CONF = Path(__file__).resolve().parents[1] / "conf"
MODEL_PRESETS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
HARDWARE_PRESETS = sorted(p.stem for p in (CONF / "hardware").glob("*.yaml"))
GIB = 1024**3


def load_model(name: str) -> ModelSpec:
    # Merging into the structured schema rejects unknown keys and wrong types.
    merged = OmegaConf.merge(OmegaConf.structured(ModelSpec), OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(merged)


def load_hardware(name: str) -> HardwareSpec:
    merged = OmegaConf.merge(
        OmegaConf.structured(HardwareSpec), OmegaConf.load(CONF / "hardware" / f"{name}.yaml")
    )
    return OmegaConf.to_object(merged)


# --------------------------------------------------------------------------- presets
def test_all_required_presets_exist() -> None:
    required_models = {
        "llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "mistral-7b", "mixtral-8x7b",
        "qwen2.5-7b", "falcon-7b", "deepseek-v2", "tiny-mha", "tiny-gqa", "tiny-mqa", "smollm2-135m",
    }  # fmt: skip
    required_hardware = {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4", "rtx-4090", "cpu"}
    assert required_models <= set(MODEL_PRESETS)
    assert required_hardware <= set(HARDWARE_PRESETS)


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_model_preset_has_exactly_the_spec_fields_and_validates(name: str) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    assert list(raw) == [f.name for f in dataclasses.fields(ModelSpec)]
    spec = load_model(name)
    assert spec.name == name
    spec.validate()
    assert num_params(spec) > 0


@pytest.mark.parametrize("name", HARDWARE_PRESETS)
def test_hardware_preset_has_exactly_the_spec_fields_and_validates(name: str) -> None:
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / f"{name}.yaml"))
    assert list(raw) == [f.name for f in dataclasses.fields(HardwareSpec)]
    hardware = load_hardware(name)
    assert hardware.name == name
    hardware.validate()
    # One unit rule for every preset: whole GiB.
    assert hardware.memory_bytes % GIB == 0


@pytest.mark.parametrize(
    ("name", "gib"),
    [
        ("a100-40gb", 40),
        ("a100-80gb", 80),
        ("h100-80gb", 80),
        ("h200-141gb", 141),
        ("l4", 24),
        ("rtx-4090", 24),
    ],
)
def test_gpu_memory_is_the_marketed_size_in_gib(name: str, gib: int) -> None:
    assert load_hardware(name).memory_bytes == gib * GIB


def test_hopper_bandwidths() -> None:
    assert load_hardware("h100-80gb").hbm_bandwidth_gbps == 3350.0
    assert load_hardware("h200-141gb").hbm_bandwidth_gbps == 4800.0
    assert load_hardware("h100-80gb").memory_bytes == 85_899_345_920


def test_tiny_presets_differ_only_in_kv_heads() -> None:
    mha, gqa, mqa = (load_model(n) for n in ("tiny-mha", "tiny-gqa", "tiny-mqa"))
    assert (mha.num_kv_heads, gqa.num_kv_heads, mqa.num_kv_heads) == (8, 2, 1)
    assert (mha.attention_kind, gqa.attention_kind, mqa.attention_kind) == ("mha", "gqa", "mqa")
    for other in (gqa, mqa):
        assert replace(other, name=mha.name, num_kv_heads=mha.num_kv_heads) == mha
    assert (mha.num_layers, mha.hidden_size, mha.num_q_heads, mha.head_dim) == (4, 256, 8, 32)
    assert (mha.intermediate_size, mha.vocab_size, mha.max_position_embeddings, mha.dtype) == (
        688,
        4096,
        2048,
        "fp32",
    )


def test_smollm2_preset() -> None:
    spec = load_model("smollm2-135m")
    assert (spec.num_layers, spec.hidden_size, spec.intermediate_size) == (30, 576, 1536)
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (9, 3, 64)
    assert (spec.vocab_size, spec.max_position_embeddings, spec.rope_theta) == (49152, 8192, 100000.0)
    assert spec.tie_word_embeddings and spec.weights == "smollm2"
    assert (spec.bos_token_id, spec.eos_token_id) == (1, 2)
    # Llama formula with tied embeddings; published as "135M".
    assert num_params(spec) == 134_515_008


# --------------------------------------------------------------------------- KV bytes
def test_llama3_70b_bytes_per_token_and_8k_sequence() -> None:
    spec = load_model("llama-3-70b")
    # 2 x 80 layers x 8 KV heads x 128 x 2 B
    assert kv_bytes_per_token(spec, "bf16") == 327_680
    assert kv_bytes_per_sequence(spec, "bf16", 8192) == 2_684_354_560  # 2.5 GiB


def test_llama2_70b_is_gqa_like_llama3_70b_and_mha_would_be_8x() -> None:
    llama2 = load_model("llama-2-70b")
    # The published Llama-2-70B config has 8 KV heads, so its KV equals Llama-3-70B's.
    assert llama2.num_kv_heads == 8
    assert kv_bytes_per_token(llama2, "bf16") == 327_680
    # An MHA 70B shape (64 KV heads, e.g. LLaMA-1 65B's layout) needs 8x as much.
    mha = replace(llama2, num_kv_heads=64)
    assert kv_bytes_per_token(mha, "bf16") == 8 * 327_680 == 2_621_440
    assert kv_bytes_per_sequence(mha, "bf16", 8192) == 8 * 2_684_354_560


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-2-7b", 524_288),  # 2 x 32 x 32 x 128 x 2
        ("llama-3-8b", 131_072),  # 2 x 32 x 8 x 128 x 2
        ("mistral-7b", 131_072),
        ("mixtral-8x7b", 131_072),  # experts do not change attention
        ("qwen2.5-7b", 57_344),  # 2 x 28 x 4 x 128 x 2
        ("falcon-7b", 8_192),  # MQA: 2 x 32 x 1 x 64 x 2
        ("deepseek-v2", 69_120),  # MLA: 60 x (512 + 64) x 2, no factor 2, no heads
        ("smollm2-135m", 23_040),  # 2 x 30 x 3 x 64 x 2
    ],
)
def test_bf16_bytes_per_token(name: str, expected: int) -> None:
    assert kv_bytes_per_token(load_model(name), "bf16") == expected


def test_mqa_and_mla_ignore_what_they_should() -> None:
    falcon = load_model("falcon-7b")
    assert falcon.attention_kind == "mqa"
    # MQA KV does not depend on the number of query heads.
    assert kv_bytes_per_token(replace(falcon, num_q_heads=1), "bf16") == 8_192
    deepseek = load_model("deepseek-v2")
    assert deepseek.attention_kind == "mla"
    # MLA KV depends on neither heads nor head_dim.
    assert kv_bytes_per_token(replace(deepseek, num_kv_heads=1, head_dim=7), "bf16") == 69_120


@pytest.mark.parametrize(
    ("dtype", "llama3_70b_bytes", "tiny_mqa_bytes"),
    [
        # Llama-3-70B: 163,840 elements / token. tiny-mqa: 2 x 4 x 1 x 32 = 256 elements.
        ("fp32", 655_360, 1_024),
        ("float32", 655_360, 1_024),
        ("bf16", 327_680, 512),
        ("fp16", 327_680, 512),
        ("fp8", 163_840, 256),
        ("int8", 163_840, 256),
        ("int4", 81_920, 128),
    ],
)
def test_every_dtype(dtype: str, llama3_70b_bytes: int, tiny_mqa_bytes: int) -> None:
    assert kv_bytes_per_token(load_model("llama-3-70b"), dtype) == llama3_70b_bytes
    assert kv_bytes_per_token(load_model("tiny-mqa"), dtype) == tiny_mqa_bytes


def test_int4_fraction_of_a_byte_raises_but_whole_blocks_do_not() -> None:
    # One layer, one MLA latent value: a single int4 token is half a byte.
    half_byte = ModelSpec(name="odd", num_layers=1, kv_lora_rank=1, qk_rope_head_dim=0)
    with pytest.raises(SpecError, match="not a whole number of bytes"):
        kv_bytes_per_token(half_byte, "int4")
    assert kv_bytes_per_block(half_byte, "int4", 16) == 8
    with pytest.raises(SpecError, match="int4"):
        kv_bytes_per_sequence(half_byte, "int4", 3)
    with pytest.raises(SpecError, match="not a whole number of bytes"):
        bytes_for_elements(3, "int4")


def test_unknown_dtype_and_bad_sizes_name_the_field() -> None:
    spec = load_model("tiny-gqa")
    with pytest.raises(SpecError, match="dtype: unknown dtype 'fp6'"):
        kv_bytes_per_token(spec, "fp6")
    with pytest.raises(SpecError, match="block_size"):
        kv_bytes_per_block(spec, "fp32", 0)
    with pytest.raises(SpecError, match="seq_len"):
        kv_bytes_per_sequence(spec, "fp32", 0)
    with pytest.raises(SpecError, match="batch"):
        kv_bytes_per_batch(spec, "fp32", 16, 0)


def test_block_and_batch_bytes_llama3_8b() -> None:
    spec = load_model("llama-3-8b")
    assert kv_bytes_per_block(spec, "bf16", 16) == 2_097_152  # 2 MiB
    assert kv_bytes_per_batch(spec, "bf16", 8192, 64) == 68_719_476_736  # 64 GiB
    assert num_blocks_for_tokens(8192, 16) == 512
    assert num_blocks_for_tokens(8193, 16) == 513
    assert num_blocks_for_tokens(0, 16) == 0


# --------------------------------------------------------------------------- parameters
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-2-7b", 6_738_415_616),
        ("llama-3-8b", 8_030_261_248),
        ("llama-2-70b", 68_976_648_192),
        ("llama-3-70b", 70_553_706_496),
        ("mistral-7b", 7_241_732_096),
        ("mixtral-8x7b", 46_702_792_704),
        ("qwen2.5-7b", 7_615_616_512),  # set in the preset (q/k/v biases)
        ("falcon-7b", 6_921_720_704),  # set in the preset (not a Llama block)
        ("deepseek-v2", 236_000_000_000),  # published total
    ],
)
def test_param_counts(name: str, expected: int) -> None:
    assert num_params(load_model(name)) == expected


def test_llama_formula_by_parts_for_llama2_7b() -> None:
    spec = load_model("llama-2-7b")
    embeddings = 32000 * 4096
    per_layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert num_params(spec) == 2 * embeddings + 32 * per_layer + 4096
    tied = replace(spec, tie_word_embeddings=True)
    assert num_params(spec) - num_params(tied) == embeddings


def test_mla_without_num_params_raises() -> None:
    spec = replace(load_model("deepseek-v2"), num_params=None)
    with pytest.raises(SpecError, match="model.num_params: required for MLA"):
        num_params(spec)


def test_weight_bytes() -> None:
    spec = load_model("llama-3-8b")
    assert weight_bytes(spec, "bf16") == 16_060_522_496
    assert weight_bytes(spec, "fp8") == 8_030_261_248
    assert weight_bytes(spec, "int4") == 4_015_130_624
    assert weight_bytes(spec, "fp32") == 32_121_044_992


# --------------------------------------------------------------------------- fit
def test_fit_llama3_8b_on_h100() -> None:
    report = fit(load_model("llama-3-8b"), load_hardware("h100-80gb"), 8192, 64, "bf16", "bf16")
    # usable = 85,899,345,920 x 9/10; budget = usable - 2 x 8,030,261,248 - 1 GiB
    assert report.usable_memory_bytes == 77_309_411_328
    assert report.weight_bytes == 16_060_522_496
    assert report.activation_reserve_bytes == 1_073_741_824
    assert report.kv_budget_bytes == 60_175_147_008
    assert report.kv_bytes_per_token == 131_072
    assert report.kv_bytes_per_block == 2_097_152
    assert report.kv_bytes_per_sequence == 1_073_741_824
    assert report.kv_bytes_per_batch == 68_719_476_736
    # 28,693 x 2,097,152 = 60,173,172,736 <= budget < 28,694 x 2,097,152
    assert report.num_gpu_blocks == 28_693
    assert report.max_tokens == 459_099  # budget // 131,072 (remainder 122,880)
    assert report.max_tokens_paged == 459_088  # 28,693 x 16
    assert report.blocks_per_sequence == 512
    assert report.max_sequences_paged == 56  # 28,693 // 512
    assert report.max_sequences_slab_seq_len == 56  # budget // 1 GiB
    assert report.max_sequences_slab_max_len == 56  # max positions = 8,192 = seq_len
    assert report.weights_fit
    assert not report.batch_fits_paged and not report.batch_fits_slab
    assert fit(
        load_model("llama-3-8b"), load_hardware("h100-80gb"), 8192, 56, "bf16", "bf16"
    ).batch_fits_paged


def test_fit_paged_beats_slab_when_max_positions_exceed_seq_len() -> None:
    # Mistral-7B on H100, 1,000-token sequences, fp8 KV, no activation reserve.
    report = fit(
        load_model("mistral-7b"),
        load_hardware("h100-80gb"),
        1000,
        1,
        "fp8",
        "bf16",
        activation_reserve_bytes=0,
    )
    # budget = 77,309,411,328 - 2 x 7,241,732,096 = 62,825,947,136
    assert report.kv_budget_bytes == 62_825_947_136
    # fp8: 65,536 B/token, 1,048,576 B/block -> 59,915 blocks (remainder 516,096)
    assert report.num_gpu_blocks == 59_915
    assert report.blocks_per_sequence == 63  # ceil(1000 / 16)
    assert report.max_sequences_paged == 951  # 59,915 // 63
    assert report.max_sequences_slab_seq_len == 958  # budget // 65,536,000
    assert report.max_sequences_slab_max_len == 29  # budget // (32,768 x 65,536)


def test_fit_llama3_70b_bf16_does_not_fit_one_h100() -> None:
    report = fit(load_model("llama-3-70b"), load_hardware("h100-80gb"), 8192, 1, "bf16", "bf16")
    assert report.weight_bytes == 141_107_412_992 > report.usable_memory_bytes
    assert not report.weights_fit
    assert report.kv_budget_bytes == 0
    assert report.num_gpu_blocks == report.max_tokens == report.max_sequences_paged == 0
    assert not report.batch_fits_paged


def test_fit_mla_on_h200_uses_published_param_count() -> None:
    # DeepSeek-V2 fp8 weights (236 GB) exceed one H200 (141 GiB).
    report = fit(load_model("deepseek-v2"), load_hardware("h200-141gb"), 4096, 1, "bf16", "fp8")
    assert report.weight_bytes == 236_000_000_000
    assert not report.weights_fit


def test_fit_rejects_bad_arguments_naming_them() -> None:
    spec, hardware = load_model("tiny-gqa"), load_hardware("cpu")
    with pytest.raises(SpecError, match="seq_len: 4096 exceeds model.max_position_embeddings=2048"):
        fit(spec, hardware, 4096, 1, "fp32", "fp32")
    with pytest.raises(SpecError, match="gpu_memory_utilization"):
        fit(spec, hardware, 128, 1, "fp32", "fp32", gpu_memory_utilization=1.5)
    with pytest.raises(SpecError, match="activation_reserve_bytes"):
        fit(spec, hardware, 128, 1, "fp32", "fp32", activation_reserve_bytes=-1)
    with pytest.raises(SpecError, match="batch"):
        fit(spec, hardware, 128, 0, "fp32", "fp32")


def test_report_to_dict_is_json_and_format_table_is_readable() -> None:
    report = fit(load_model("llama-3-8b"), load_hardware("h100-80gb"), 8192, 64, "bf16", "bf16")
    data = report_to_dict(report)
    assert json.loads(json.dumps(data)) == data
    assert set(data) == {f.name for f in dataclasses.fields(SizingReport)}
    text = format_table(report)
    assert "\x1b[" not in text  # no colour codes in logs or files
    assert "60,175,147,008 B (56.04 GiB)" in text
    assert "28,693" in text
    assert "llama-3-8b on h100-80gb" in text
    assert len(text.splitlines()) < 40


# --------------------------------------------------------------------------- properties
DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")


@st.composite
def specs(draw: st.DrawFn) -> ModelSpec:
    num_kv_heads = draw(st.sampled_from([1, 2, 4, 8]))
    mla = draw(st.booleans())
    return ModelSpec(
        name="prop",
        num_layers=draw(st.integers(1, 96)),
        num_q_heads=num_kv_heads * draw(st.integers(1, 8)),
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([16, 32, 64, 80, 128, 256])),
        max_position_embeddings=draw(st.integers(1, 1 << 17)),
        kv_lora_rank=draw(st.integers(1, 1024)) if mla else 0,
        qk_rope_head_dim=draw(st.integers(0, 128)) if mla else 0,
    )


@settings(max_examples=150, deadline=None)
@given(
    spec=specs(), block_size=st.integers(1, 256), seq_len=st.integers(1, 1 << 17), batch=st.integers(1, 512)
)
def test_kv_byte_identities(spec: ModelSpec, block_size: int, seq_len: int, batch: int) -> None:
    fp32 = kv_bytes_per_token(spec, "fp32")
    assert fp32 == 2 * kv_bytes_per_token(spec, "bf16") == 4 * kv_bytes_per_token(spec, "fp8")
    for dtype in DTYPES:
        per_token = kv_bytes_per_token(spec, dtype)
        assert kv_bytes_per_block(spec, dtype, block_size) == block_size * per_token
        assert kv_bytes_per_sequence(spec, dtype, seq_len) == seq_len * per_token
        assert kv_bytes_per_batch(spec, dtype, seq_len, batch) == batch * seq_len * per_token


@settings(max_examples=150, deadline=None)
@given(
    spec=specs(),
    memory_gib=st.integers(1, 192),
    utilization=st.sampled_from([0.5, 0.8, 0.9, 0.95, 1.0]),
    block_size=st.sampled_from([1, 8, 16, 32, 128]),
    seq_fraction=st.floats(0.0, 1.0),
    kv_dtype=st.sampled_from(DTYPES),
    reserve=st.integers(0, 4 * GIB),
)
def test_fit_invariants(
    spec: ModelSpec,
    memory_gib: int,
    utilization: float,
    block_size: int,
    seq_fraction: float,
    kv_dtype: str,
    reserve: int,
) -> None:
    spec = replace(spec, num_params=1_000_000)
    seq_len = max(1, int(seq_fraction * spec.max_position_embeddings))
    hardware = HardwareSpec(name="prop", memory_bytes=memory_gib * GIB)
    r = fit(spec, hardware, seq_len, 1, kv_dtype, "bf16", block_size, utilization, reserve)
    assert r.usable_memory_bytes <= hardware.memory_bytes
    assert r.kv_budget_bytes == max(0, r.usable_memory_bytes - r.weight_bytes - reserve)
    # Whole blocks: the pool fits the budget and one more block would not.
    assert r.num_gpu_blocks * r.kv_bytes_per_block <= r.kv_budget_bytes
    assert (r.num_gpu_blocks + 1) * r.kv_bytes_per_block > r.kv_budget_bytes
    assert r.max_tokens_paged <= r.max_tokens < r.max_tokens_paged + block_size
    assert r.max_sequences_paged * r.blocks_per_sequence <= r.num_gpu_blocks
    # Reserving the full context never admits more sequences than reserving seq_len.
    assert r.max_sequences_slab_max_len <= r.max_sequences_slab_seq_len
    assert r.batch_fits_paged == (r.max_sequences_paged >= 1)
