"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, gpt-oss) over the paged KV cache.

One class covers them all: Qwen2 adds q/k/v biases, Qwen3 adds per-head q/k RMSNorm, and the
mixture-of-experts models put a SparseMoeBlock (moe.py) in place of the MLP of some layers, and
a layer with a sliding window (Mistral's, Qwen2's upper layers) hands it to the attention kernel.
gpt-oss adds an o_proj bias, a learned sink logit per query head (handed to the attention
kernel like the window) and its own MoE block (GptOssMoeBlock); its sliding and full layers
alternate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefleet.kernels.ops import Kernels
from pagefleet.kernels.reference import build_cos_sin_cache
from pagefleet.worker.model_executor.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagefleet.worker.model_executor.model_config import ModelConfig
from pagefleet.worker.model_executor.moe import EXPERT_NAMES, GptOssMoeBlock, SparseMoeBlock
from pagefleet.worker.parallel.tp_group import TPGroup


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens live in the paged cache; shared by every layer."""

    slot_mapping: torch.Tensor     # [T] int64: block_id * block_size + offset
    block_table: torch.Tensor      # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor         # [B] int32: context length including this step's tokens
    # The kernels' plan of this step's attention (``Kernels.attention_planner``), made once on
    # the host and read by every layer; None where the backend plans nothing.
    attn_plan: object | None = None


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, kernels: Kernels, device) -> None:
        super().__init__()
        self.kernels = kernels
        self.sliding_window = cfg.sliding_window(index)  # None: this layer attends over the whole context
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.attention_bias, tp, cfg.dtype, device)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp, cfg.dtype,
                                        device)
        self.num_heads = self.qkv_proj.num_heads
        self.tp_rank = tp.rank
        # gpt-oss: this rank's heads' sink logits [Hq_rank], fp32 as the kernels read them.
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32, device=device),
                                   requires_grad=False) if cfg.attention_sinks else None)
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        # An fp8 KV cache stores K / k_scale and V / v_scale. 1.0, as vLLM uses without calibrated
        # scales (none are loaded yet); the kernels read them only for an fp8 cache.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.dtype, device) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], cos_sin: torch.Tensor) -> torch.Tensor:
        # positions: [T]; x: [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.out_sizes, dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.kernels.rms_norm(q, self.q_norm.weight, self.eps)
            k = self.kernels.rms_norm(k, self.k_norm.weight, self.eps)
        q, k = self.kernels.rotary_embedding(positions, q, k, cos_sin)
        key_cache, value_cache = kv_cache
        self.kernels.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, k_scale=self.k_scale,
                                    v_scale=self.v_scale)
        o = self.kernels.paged_attention(q, key_cache, value_cache, meta.block_table, meta.query_start_loc,
                                         meta.seq_lens, self.scale, k_scale=self.k_scale, v_scale=self.v_scale,
                                         sliding_window=self.sliding_window, sinks=self.sinks, plan=meta.attn_plan)
        return self.o_proj(o.reshape(num_tokens, self.num_heads * self.head_dim))

    def load(self, kind: str, shard: int, src) -> None:
        """The checkpoint's sinks [Hq]: this rank's heads."""
        start = self.tp_rank * self.num_heads
        self.sinks.data.copy_(src[start:start + self.num_heads])


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels, device) -> None:
        super().__init__()
        self.kernels = kernels
        if cfg.intermediate_size % tp.size:
            raise ValueError(f"intermediate_size {cfg.intermediate_size} does not split over "
                             f"tensor_parallel_size {tp.size}")
        per_rank = cfg.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [per_rank, per_rank], cfg.mlp_bias, tp,
                                                 cfg.dtype, device)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp,
                                           cfg.dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TPGroup, kernels: Kernels, device) -> None:
        super().__init__()
        self.kernels = kernels
        self.self_attn = Attention(cfg, index, tp, kernels, device)
        # A mixture-of-experts layer or a dense one: the config says which (moe_layers).
        if cfg.swiglu_limit is not None:
            self.mlp = GptOssMoeBlock(cfg, tp, kernels, device)
        elif index in cfg.moe_layers:
            self.mlp = SparseMoeBlock(cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.hidden_size,
                                      cfg.moe_intermediate_size, tp, kernels, cfg.dtype, device)
        else:
            self.mlp = MLP(cfg, tp, kernels, device)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)

    def forward(self, positions, hidden, residual, meta, kv_cache, cos_sin):
        eps = self.input_layernorm.eps
        if residual is None:
            residual = hidden
            hidden = self.kernels.rms_norm(hidden, self.input_layernorm.weight, eps)
        else:
            hidden, residual = self.kernels.fused_add_rms_norm(hidden, residual, self.input_layernorm.weight, eps)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, cos_sin)
        hidden, residual = self.kernels.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm.weight, eps)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, kernels: Kernels, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.kernels = kernels
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, kernels, device) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, device)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype, device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("cos_sin", build_cos_sin_cache(cfg.head_dim, cfg.max_position_embeddings,
                                                                cfg.rope_theta, cfg.rope_scaling).to(device),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        # input_ids, positions: [T] -> final hidden states [T, hidden]
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache, self.cos_sin)
        hidden, _ = self.kernels.fused_add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # hidden: [S, hidden] -> [S, vocab] fp32 on rank 0 (None on other ranks)
        logits = self.lm_head.logits(hidden)
        return None if logits is None else logits.float()

    def modules_by_checkpoint_name(self) -> dict[str, tuple[nn.Module, str, int]]:
        """Checkpoint tensor name -> (module that loads it, 'weight'|'bias'|'weight_scale', shard index).
        A kind the module does not hold (no bias; a scale while the weights are not FP8) is not expected."""
        table: dict[str, tuple[nn.Module, str, int]] = {
            "model.embed_tokens.weight": (self.embed_tokens, "weight", 0),
            "model.norm.weight": (self.norm, "weight", 0),
        }
        if not self.cfg.tie_word_embeddings:
            table["lm_head.weight"] = (self.lm_head, "weight", 0)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for kind in ("weight", "bias", "weight_scale"):
                for shard, name in enumerate(("q_proj", "k_proj", "v_proj")):
                    table[f"{p}self_attn.{name}.{kind}"] = (attn.qkv_proj, kind, shard)
                if isinstance(mlp, MLP):
                    for shard, name in enumerate(("gate_proj", "up_proj")):
                        table[f"{p}mlp.{name}.{kind}"] = (mlp.gate_up_proj, kind, shard)
                    table[f"{p}mlp.down_proj.{kind}"] = (mlp.down_proj, kind, 0)
            if isinstance(mlp, SparseMoeBlock):
                block, names = EXPERT_NAMES[self.cfg.architecture]
                table.update(mlp.checkpoint_names(f"{p}{block}.", self.cfg.num_experts, names))
            elif isinstance(mlp, GptOssMoeBlock):
                table.update(mlp.checkpoint_names(f"{p}mlp."))
            for kind in ("weight", "bias", "weight_scale"):
                table[f"{p}self_attn.o_proj.{kind}"] = (attn.o_proj, kind, 0)
            if attn.sinks is not None:
                table[f"{p}self_attn.sinks"] = (attn, "sinks", 0)
            table[f"{p}input_layernorm.weight"] = (layer.input_layernorm, "weight", 0)
            table[f"{p}post_attention_layernorm.weight"] = (layer.post_attention_layernorm, "weight", 0)
            if attn.q_norm is not None:
                table[f"{p}self_attn.q_norm.weight"] = (attn.q_norm, "weight", 0)
                table[f"{p}self_attn.k_norm.weight"] = (attn.k_norm, "weight", 0)
        return table
