"""Latency presets: every derived number recomputed here from the documented figures."""

from __future__ import annotations

import math

import pytest

from bench.sim.latency import GIB, PRESETS, QWEN25_7B, RTX_4090, LatencyModel, preset

# Documented figures (sources in bench/sim/latency.py), typed in again on purpose.
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 3584, 18944, 28, 28, 4, 152064
PEAK_FP16_TENSOR = 165.2e12  # Ada whitepaper, FP32 accumulate
BANDWIDTH = 1008e9  # 21 Gbps x 384 bit
VRAM = 24564 * 2**20  # nvidia-smi total


def test_rtx_4090_figures():
    assert RTX_4090.tensor_flops == PEAK_FP16_TENSOR
    assert RTX_4090.memory_bandwidth == 21e9 * 384 / 8 == BANDWIDTH
    assert RTX_4090.total_memory == VRAM


def test_qwen25_7b_parameter_count_matches_the_model_card():
    head_dim = HIDDEN // HEADS
    linear = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * head_dim + 3 * HIDDEN * INTER)
    small = LAYERS * (HIDDEN + 2 * KV_HEADS * head_dim + 2 * HIDDEN) + HIDDEN
    embed = 2 * VOCAB * HIDDEN  # untied LM head
    assert QWEN25_7B.num_params == linear + small + embed == 7_615_616_512  # "7.61B"
    assert round((QWEN25_7B.num_params - embed) / 1e9, 2) == 6.53  # "6.53B non-embedding"


def test_kv_bytes_per_token():
    # K and V, 28 layers, 4 KV heads of 128, fp16
    assert QWEN25_7B.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2 == 57_344


def test_weight_bytes_fp16_and_awq():
    fp16 = PRESETS["4090-qwen2.5-7b-fp16"].latency.model
    awq = PRESETS["4090-qwen2.5-7b-awq"].latency.model
    assert fp16.weight_bytes == 2 * 7_615_616_512
    linear = fp16.linear_params
    per_weight = 0.5 + 1 / 64 + 1 / 256  # int4 + fp16 scale / 128 + 4-bit zero / 128
    assert awq.weight_bytes == int(linear * per_weight + 2 * (fp16.num_params - linear))
    assert 5.4e9 < awq.weight_bytes < 5.7e9  # the ~5.5 GB checkpoint


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_kv_capacity_follows_vllm_memory_profiling(name):
    p = preset(name)
    m = p.latency.model
    activation = 8192 * (3 * INTER + 4 * HIDDEN) * 2 + 128 * VOCAB * 4
    assert p.activation_peak_bytes == activation
    kv = VRAM * 0.90 - m.weight_bytes - activation - int(0.4 * GIB) - int(0.5 * GIB)
    assert p.kv_cache_bytes() == int(kv)
    assert p.num_blocks() == int(kv) // (16 * 57_344)
    assert p.num_blocks(block_size=32) == int(kv) // (32 * 57_344)
    # a larger memory fraction gives more blocks
    assert p.num_blocks(gpu_memory_utilization=0.95) > p.num_blocks()


def test_kv_capacity_orders_of_magnitude():
    assert 90_000 < preset("4090-qwen2.5-7b-fp16").kv_cache_tokens() < 110_000
    assert 250_000 < preset("4090-qwen2.5-7b-awq").kv_cache_tokens() < 290_000


def test_decode_step_is_bytes_over_bandwidth_plus_overheads():
    lat = preset("4090-qwen2.5-7b-fp16").latency
    m = lat.model
    ctx = 1000
    byts = m.weight_bytes + (ctx + 1) * 57_344
    expect = byts / (BANDWIDTH * 0.8) + 3e-3 + 20e-6
    assert lat.decode_step_time(1, ctx) == pytest.approx(expect, rel=1e-9)
    # batch 1 fp16: ~50 tokens/s on a 4090
    assert 40 < 1 / lat.decode_step_time(1, ctx) < 60


def test_prefill_is_flops_over_effective_throughput():
    lat = preset("4090-qwen2.5-7b-fp16").latency
    n = 4096
    linear = 2 * QWEN25_7B.linear_params * n
    attention = 4 * 28 * 28 * 128 * n * (n + 1) / 2
    lm_head = 2 * VOCAB * HIDDEN
    expect = (linear + attention + lm_head) / (PEAK_FP16_TENSOR * 0.6) + 3e-3 + 20e-6
    assert lat.prefill_time(n) == pytest.approx(expect, rel=1e-9)
    # a cached prefix removes its linear FLOPs but not the attention to it
    assert lat.prefill_time(n, cached_tokens=2048) < lat.prefill_time(n)
    assert lat.prefill_time(n, cached_tokens=2048) > lat.prefill_time(2048)


def test_mixed_step_is_the_roofline_of_both():
    lat = preset("4090-qwen2.5-7b-awq").latency
    only_decode = lat.step_time(0, 0.0, 0, 32, 32 * 2000, 32)
    with_chunk = lat.step_time(2048, 2048 * 1024.5, 0, 32, 32 * 2000, 33)
    assert with_chunk > only_decode
    assert lat.step_time(0, 0.0, 0, 0, 0, 0) == 0.0


def test_measured_numbers_replace_the_assumptions():
    base = preset("4090-qwen2.5-7b-awq").latency
    cal = base.calibrated(prefill_tok_s=8000.0, decode_step_s=0.012, step_overhead_s=0.002)
    assert cal.step_overhead_s == 0.002
    assert 4096 / cal.prefill_time(4096) == pytest.approx(8000.0, rel=1e-6)
    assert cal.decode_step_time(1, 1024) == pytest.approx(0.012, rel=1e-6)
    with pytest.raises(ValueError):
        base.calibrated(decode_step_s=0.001)


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="4090-qwen2.5-7b-awq"):
        preset("h100")


def test_latency_model_is_a_value():
    a = LatencyModel(RTX_4090, QWEN25_7B)
    b = LatencyModel(RTX_4090, QWEN25_7B)
    assert a == b and math.isclose(a.decode_step_time(1, 10), b.decode_step_time(1, 10))
