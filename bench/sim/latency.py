"""Latency model of one engine step, from first principles, and the RTX 4090 presets.

An engine step runs one forward pass over every token scheduled in it (chunks of
prefill and one token per decoding request: continuous batching with chunked
prefill).  Its time is a roofline::

    compute_s = FLOPs / (peak_tensor_flops * compute_efficiency)
    memory_s  = bytes  / (memory_bandwidth  * bandwidth_efficiency)
    step_s    = max(compute_s, memory_s) + step_overhead_s + seq_overhead_s * sequences

* FLOPs: ``2 * linear_params`` per token through the transformer's linear layers,
  ``2 * vocab * hidden`` per sampled token for the LM head (vLLM computes logits
  only at the positions it samples), and attention ``4 * layers * q_dim`` per
  (query, key) pair: ``QK^T`` and ``AV`` each ``2 * q_dim`` FLOPs per pair, a
  chunk of ``c`` new tokens after ``p`` cached ones attending to
  ``c * (p + (c + 1) / 2)`` pairs (causal).
* Bytes: the weights once per step, the KV cache every scheduled token reads
  (its whole context, once per sequence and layer) and writes (its own K and V).

Prefill steps (thousands of tokens) are compute bound, decode steps (one token
per sequence) are bandwidth bound: "prefill time from FLOPs over effective
throughput, decode steps from bytes moved over memory bandwidth, plus per-step
overheads".

KV capacity follows vLLM's memory profiling::

    kv_bytes = total_memory * gpu_memory_utilization - weights - activation_peak
               - non_torch_memory - cuda_graph_memory
    blocks   = kv_bytes // (block_size * kv_bytes_per_token)

Every figure is a field of :class:`GpuSpec`, :class:`ModelSpec` or
:class:`LatencyModel` with its source in the field's comment; the presets build
them.  Measured numbers replace derived ones with :meth:`LatencyModel.calibrated`
(prefill tokens/s, decode step time, step overhead) and ``num_blocks`` (KV
capacity read from vLLM's log line "GPU KV cache size: N tokens").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from routing.tiers import DISK_READ_BYTES_PER_S

__all__ = [
    "GIB",
    "GpuSpec",
    "LatencyModel",
    "ModelSpec",
    "PRESETS",
    "Preset",
    "QWEN25_7B",
    "RTX_4090",
    "preset",
]

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class GpuSpec:
    """Peak figures of one GPU.

    Attributes:
        name: marketing name.
        tensor_flops: dense FP16 tensor-core FLOP/s with FP32 accumulate (what
            PyTorch / vLLM GEMMs and FlashAttention use).
        memory_bandwidth: DRAM bandwidth, bytes/s.
        total_memory: device memory as CUDA reports it (``nvidia-smi`` total), bytes.
        host_link_bandwidth: peak bandwidth of its link to host memory, one
            direction, bytes/s (copies of the host KV tier).
    """

    name: str
    tensor_flops: float
    memory_bandwidth: float
    total_memory: int
    host_link_bandwidth: float


RTX_4090 = GpuSpec(
    name="NVIDIA GeForce RTX 4090",
    # NVIDIA Ada Lovelace GPU Architecture whitepaper (v1.0, 2022), Appendix A,
    # "GeForce RTX 4090": Peak FP16 Tensor TFLOPS with FP32 Accumulate 165.2
    # (330.4 with sparsity; 330.3 with FP16 accumulate, which PyTorch does not use).
    tensor_flops=165.2e12,
    # Same table: 24 GB GDDR6X, 384-bit interface at 21 Gbps -> 1008 GB/s.
    memory_bandwidth=1008e9,
    # nvidia-smi reports 24564 MiB total on an RTX 4090 (24 GiB less driver-reserved memory).
    total_memory=24564 * MIB,
    # Same whitepaper: PCI Express 4.0 x16 host interface.  PCIe 4.0 signals 16 GT/s a lane with
    # 128b/130b encoding (PCI-SIG, PCI Express Base Specification 4.0): 16 lanes carry
    # 16 * 16e9 * 128/130 / 8 = 31.5 GB/s each way.
    host_link_bandwidth=16 * 16e9 * 128 / 130 / 8,
)


@dataclass(frozen=True)
class ModelSpec:
    """Transformer shape and weight format.

    Attributes:
        name: Hugging Face model id.
        hidden: hidden size.
        intermediate: MLP intermediate size.
        layers: decoder layers.
        heads: attention (query) heads.
        kv_heads: key/value heads (grouped-query attention).
        vocab: vocabulary size (embedding and LM head rows).
        tied_embeddings: LM head shares the embedding matrix.
        weight_bytes_per_param: bytes per weight of the linear layers (2 for
            fp16/bf16; AWQ int4 with group size 128 stores 0.5 byte per weight
            plus an fp16 scale and a 4-bit zero point per 128 weights).
        kv_bytes_per_elem: bytes per cached K or V element (2: fp16 KV cache).
        max_position_embeddings: native context length.
    """

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool
    weight_bytes_per_param: float = 2.0
    kv_bytes_per_elem: int = 2
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def linear_params_per_layer(self) -> int:
        """Weights of q, k, v, o projections and the gated MLP (gate, up, down)."""
        q_o = 2 * self.hidden * self.hidden
        k_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return q_o + k_v + mlp

    @property
    def linear_params(self) -> int:
        return self.layers * self.linear_params_per_layer

    @property
    def small_params(self) -> int:
        """Kept in 16 bits even when quantized: q/k/v biases (Qwen2), RMSNorm weights."""
        per_layer = (self.hidden + 2 * self.kv_heads * self.head_dim) + 2 * self.hidden
        return self.layers * per_layer + self.hidden

    @property
    def embedding_params(self) -> int:
        """Embedding table plus the LM head when it is not tied."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        return self.linear_params + self.small_params + self.embedding_params

    @property
    def weight_bytes(self) -> int:
        """Bytes of all weights on the GPU."""
        return int(self.linear_params * self.weight_bytes_per_param + 2 * (self.small_params + self.embedding_params))

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_elem


# Qwen/Qwen2.5-7B-Instruct, config.json on Hugging Face: hidden_size 3584,
# intermediate_size 18944, num_hidden_layers 28, num_attention_heads 28,
# num_key_value_heads 4, vocab_size 152064, tie_word_embeddings false,
# max_position_embeddings 32768.  These give 7,615,616,512 parameters, the
# model card's "7.61B" (6.53B non-embedding).
QWEN25_7B = ModelSpec(
    name="Qwen/Qwen2.5-7B-Instruct",
    hidden=3584,
    intermediate=18944,
    layers=28,
    heads=28,
    kv_heads=4,
    vocab=152064,
    tied_embeddings=False,
)

# Qwen/Qwen2.5-7B-Instruct-AWQ (model card: AWQ 4-bit, group size 128, zero point).
# Per linear weight: 4 bits (0.5 B) + fp16 scale / 128 (1/64 B) + 4-bit zero / 128
# (1/256 B) = 0.51953125 B.  Embeddings, LM head, biases and norms stay fp16.
# Result: 5.57 GB of weights, the ~5.5 GB of the published checkpoint.
QWEN25_7B_AWQ = replace(
    QWEN25_7B, name="Qwen/Qwen2.5-7B-Instruct-AWQ", weight_bytes_per_param=0.5 + 1 / 64 + 1 / 256
)


@dataclass(frozen=True)
class LatencyModel:
    """Step-time model of one engine replica (see the module docstring).

    Attributes:
        gpu: the GPU's peak figures.
        model: the model's shape and weight format.
        compute_efficiency: fraction of peak tensor FLOP/s reached by prefill
            GEMMs and attention.  Assumption: 0.6 for fp16 cuBLAS GEMMs at
            thousands of tokens on Ada (large GEMMs reach 60-70 % of peak,
            FlashAttention less); 0.5 for AWQ through the Marlin kernel, which
            dequantizes on the fly.  Replace with a measurement
            (:meth:`calibrated` ``prefill_tok_s``).
        bandwidth_efficiency: fraction of peak DRAM bandwidth reached by decode
            steps.  Assumption: 0.8 (memory-bound GEMV / paged attention kernels
            reach 70-90 %).  Replace with :meth:`calibrated` ``decode_step_s``.
        step_overhead_s: fixed cost of a step besides the forward pass:
            scheduling, input preparation, sampling, output processing in the
            engine's Python loop.  Assumption: 3 ms with CUDA graphs.
        seq_overhead_s: per-sequence part of that cost (sampling, detokenizing,
            streaming one delta).  Assumption: 20 us.
        host_link_efficiency: fraction of the host link's peak that a copy
            of KV blocks from pinned host memory reaches.  Assumption: 0.8
            (DMA set-up and transaction-layer packet overhead); replace it with
            a measurement (e.g. CUDA's ``bandwidthTest --memory=pinned``).
        disk_read_bandwidth: bytes/s the node's local disk tier reads KV blocks
            at (vLLM's tiering ``fs`` tier); default and source
            :data:`routing.tiers.DISK_READ_BYTES_PER_S`.
    """

    gpu: GpuSpec
    model: ModelSpec
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 3e-3
    seq_overhead_s: float = 20e-6
    host_link_efficiency: float = 0.8
    disk_read_bandwidth: float = DISK_READ_BYTES_PER_S
    _c: tuple = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        m = self.model
        object.__setattr__(self, "_c", (
            1.0 / (self.gpu.tensor_flops * self.compute_efficiency),  # s per FLOP
            1.0 / (self.gpu.memory_bandwidth * self.bandwidth_efficiency),  # s per byte
            2.0 * m.linear_params,  # linear FLOPs per token
            4.0 * m.layers * m.heads * m.head_dim,  # attention FLOPs per (query, key) pair
            2.0 * m.vocab * m.hidden,  # LM-head FLOPs per sampled token
            float(m.weight_bytes),
            float(m.kv_bytes_per_token),
        ))

    # ------------------------------------------------------------------ pieces

    @property
    def linear_flops_per_token(self) -> float:
        return 2.0 * self.model.linear_params

    @property
    def lm_head_flops_per_sample(self) -> float:
        return 2.0 * self.model.vocab * self.model.hidden

    @property
    def attention_flops_per_pair(self) -> float:
        """QK^T and AV over every layer for one (query, key) pair."""
        return 4.0 * self.model.layers * self.model.heads * self.model.head_dim

    def prefill_flops(self, context: int, new: int) -> float:
        """FLOPs of a chunk of ``new`` tokens after ``context`` cached ones (logits excluded)."""
        pairs = new * (context + (new + 1) / 2.0)
        return new * self.linear_flops_per_token + pairs * self.attention_flops_per_pair

    # ------------------------------------------------------------------ steps

    def step_time(
        self,
        prefill_tokens: int,
        prefill_pairs: float,
        prefill_kv_read_tokens: int,
        decode_seqs: int,
        decode_context: int,
        sampled: int,
    ) -> float:
        """Seconds of one engine step.

        Args:
            prefill_tokens: prompt tokens computed in this step (all chunks).
            prefill_pairs: causal (query, key) pairs of those chunks,
                ``sum(c * (p + (c + 1) / 2))``.
            prefill_kv_read_tokens: cached context the chunks attend to,
                ``sum(p)`` (read once per chunk).
            decode_seqs: decoding sequences, one token each.
            decode_context: sum of their context lengths (KV read per step).
            sampled: tokens sampled (decodes plus chunks that end their prefill).
        """
        tokens = prefill_tokens + decode_seqs
        if tokens == 0:
            return 0.0
        s_flop, s_byte, lin, attn, head, weights, kv = self._c
        flops = tokens * lin + (prefill_pairs + decode_context + decode_seqs) * attn + sampled * head
        byts = weights + (prefill_kv_read_tokens + decode_context + tokens) * kv
        busy = flops * s_flop
        mem = byts * s_byte
        if mem > busy:
            busy = mem
        return busy + self.step_overhead_s + self.seq_overhead_s * (decode_seqs + (1 if prefill_tokens else 0))

    def prefill_time(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        """One prompt prefilled alone in one step (for calibration and docs)."""
        new = prompt_tokens - cached_tokens
        pairs = new * (cached_tokens + (new + 1) / 2.0)
        return self.step_time(new, pairs, cached_tokens, 0, 0, 1)

    def host_load_time(self, tokens: int) -> float:
        """Seconds to copy the KV of ``tokens`` tokens from the host tier into GPU memory."""
        return tokens * self.model.kv_bytes_per_token / (self.gpu.host_link_bandwidth * self.host_link_efficiency)

    def disk_load_time(self, tokens: int) -> float:
        """Seconds to read the KV of ``tokens`` tokens from the disk tier into the host tier."""
        return tokens * self.model.kv_bytes_per_token / self.disk_read_bandwidth

    def decode_step_time(self, batch: int, context: int) -> float:
        """One decode step of ``batch`` sequences of ``context`` tokens each."""
        return self.step_time(0, 0.0, 0, batch, batch * context, batch)

    # ------------------------------------------------------------------ measured numbers

    def calibrated(
        self,
        *,
        prefill_tok_s: float | None = None,
        prefill_ref_tokens: int = 4096,
        decode_step_s: float | None = None,
        decode_ref_context: int = 1024,
        step_overhead_s: float | None = None,
    ) -> LatencyModel:
        """A copy whose efficiencies reproduce measured figures.

        Args:
            prefill_tok_s: measured prefill throughput (tokens/s) of one
                ``prefill_ref_tokens``-token prompt alone.
            decode_step_s: measured time of one decode step of a single
                sequence with ``decode_ref_context`` tokens of context (the
                inter-token latency at batch 1).
            step_overhead_s: measured fixed cost per step.

        Raises:
            ValueError: a measured figure below the step overhead (impossible).
        """
        out = self if step_overhead_s is None else replace(self, step_overhead_s=step_overhead_s)
        if prefill_tok_s is not None:
            want = prefill_ref_tokens / prefill_tok_s - out.step_overhead_s - out.seq_overhead_s
            if want <= 0:
                raise ValueError("prefill throughput implies a step shorter than the step overhead")
            n = prefill_ref_tokens
            flops = out.prefill_flops(0, n) + out.lm_head_flops_per_sample
            out = replace(out, compute_efficiency=flops / (want * out.gpu.tensor_flops))
        if decode_step_s is not None:
            want = decode_step_s - out.step_overhead_s - out.seq_overhead_s
            if want <= 0:
                raise ValueError("decode step time is shorter than the step overhead")
            kv = out.model.kv_bytes_per_token
            byts = out.model.weight_bytes + (decode_ref_context + 1) * kv
            out = replace(out, bandwidth_efficiency=byts / (want * out.gpu.memory_bandwidth))
        return out


@dataclass(frozen=True)
class Preset:
    """An engine configuration on one GPU: model, latency model, vLLM settings.

    Attributes:
        name: preset id (``--preset``).
        latency: the step-time model.
        gpu_memory_utilization: vLLM's fraction of device memory for weights,
            activations and KV cache (0.90 in ``infra/serve_config.4090.yaml``).
        max_num_batched_tokens: chunked-prefill token budget per step (8192 there).
        max_num_seqs: running requests per engine (128 there).
        max_model_len: context length (32768 there).
        block_size: KV-cache block size (16 there).
        non_torch_bytes: memory vLLM's profiler counts outside the PyTorch
            allocator (cuBLAS workspace, NCCL, CUDA context growth).
            Assumption: 0.4 GiB.
        cuda_graph_bytes: memory of captured CUDA graphs, which vLLM reserves
            before sizing the KV cache.  Assumption: 0.5 GiB for a 7B model.
    """

    name: str
    latency: LatencyModel
    gpu_memory_utilization: float = 0.90
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 128
    max_model_len: int = 32768
    block_size: int = 16
    non_torch_bytes: int = int(0.4 * GIB)
    cuda_graph_bytes: int = int(0.5 * GIB)

    @property
    def activation_peak_bytes(self) -> int:
        """Peak activation memory of vLLM's profiling forward pass.

        The profile run pushes ``max_num_batched_tokens`` tokens through the
        model; the largest live tensors are the MLP's gate and up projections
        and their product (3 x intermediate) plus a few hidden-size buffers
        (residual, normed input, attention output, MLP output: 4 x hidden), in
        fp16; and the sampler's fp32 logits for ``max_num_seqs`` sequences.
        """
        m = self.latency.model
        per_token = (3 * m.intermediate + 4 * m.hidden) * 2
        return self.max_num_batched_tokens * per_token + self.max_num_seqs * m.vocab * 4

    def kv_cache_bytes(self, gpu_memory_utilization: float | None = None) -> int:
        """Bytes vLLM gives the KV cache (see the module docstring)."""
        util = self.gpu_memory_utilization if gpu_memory_utilization is None else gpu_memory_utilization
        budget = self.latency.gpu.total_memory * util
        rest = (self.latency.model.weight_bytes + self.activation_peak_bytes + self.non_torch_bytes
                + self.cuda_graph_bytes)
        return max(0, int(budget - rest))

    def num_blocks(self, block_size: int | None = None, gpu_memory_utilization: float | None = None) -> int:
        """KV-cache blocks per replica (what vLLM logs as ``num_gpu_blocks``)."""
        bs = block_size or self.block_size
        return self.kv_cache_bytes(gpu_memory_utilization) // (bs * self.latency.model.kv_bytes_per_token)

    def kv_cache_tokens(self, gpu_memory_utilization: float | None = None) -> int:
        """KV capacity in tokens (vLLM's "GPU KV cache size: N tokens")."""
        return self.kv_cache_bytes(gpu_memory_utilization) // self.latency.model.kv_bytes_per_token


PRESETS: dict[str, Preset] = {
    "4090-qwen2.5-7b-awq": Preset(
        name="4090-qwen2.5-7b-awq",
        latency=LatencyModel(RTX_4090, QWEN25_7B_AWQ, compute_efficiency=0.5),
    ),
    "4090-qwen2.5-7b-fp16": Preset(
        name="4090-qwen2.5-7b-fp16",
        latency=LatencyModel(RTX_4090, QWEN25_7B, compute_efficiency=0.6),
    ),
}
"""RTX 4090 presets: the project's 4090 engine settings (``infra/serve_config.4090.yaml``)."""


def preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        KeyError: unknown preset (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return math.ceil(tokens / block_size)
