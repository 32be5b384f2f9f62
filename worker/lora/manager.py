"""A model's adapters on one rank: LoRA layers beside its projections, adapters in host memory
(least recently used evicted past ``max_cpu_loras``), and ``max_loras`` GPU slots filled as steps
ask for them.

The engine registers each adapter once (``add_lora``: read and checked then, so a bad adapter is
refused when it is added, not in a step); a step names each row's adapter by ``lora_int_id``
(``StepInput.lora_ids``), and ``mapping`` puts those adapters in slots and sorts the rows by adapter.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from pagefleet.worker.lora.adapter import TARGETS, LoRAAdapter, load_adapter
from pagefleet.worker.lora.layers import LoRABatch, LoRALinear, LoRAMapping
from pagefleet.worker.lora.request import LoRARequest

if TYPE_CHECKING:
    from pagefleet.worker.model_executor.layers import QuantizableLinear
    from pagefleet.worker.model_executor.model import LlamaForCausalLM


class LoRAManager:
    def __init__(self, model: LlamaForCausalLM, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None,
                 device: torch.device) -> None:
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.device = device
        self.dtype = model.cfg.dtype
        self.batch = LoRABatch()
        # (layer, merged linear name) -> the linear; (layer, PEFT target) -> full (in, out) features
        self.linears: dict[tuple[int, str], QuantizableLinear] = {}
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        self._attach(model)
        self.known: dict[int, LoRARequest] = {}           # every adapter registered, by lora_int_id
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # loaded adapters, least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> GPU slot, least recently used first
        self.host_scaling: dict[int, float] = {}  # lora_int_id -> its adapter's scaling, once read

    def _attach(self, model: LlamaForCausalLM) -> None:
        """A LoRA layer beside each projection of every layer (a mixture-of-experts layer's experts
        take none: an adapter targeting them is refused)."""
        cfg = model.cfg
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            found = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
            self.shapes.update({(i, "q_proj"): (cfg.hidden_size, q_out), (i, "k_proj"): (cfg.hidden_size, kv_out),
                                (i, "v_proj"): (cfg.hidden_size, kv_out), (i, "o_proj"): (q_out, cfg.hidden_size)})
            if hasattr(mlp, "gate_up_proj"):
                found.update(gate_up_proj=mlp.gate_up_proj, down_proj=mlp.down_proj)
                inter = cfg.intermediate_size
                self.shapes.update({(i, "gate_proj"): (cfg.hidden_size, inter), (i, "up_proj"): (cfg.hidden_size, inter),
                                    (i, "down_proj"): (inter, cfg.hidden_size)})
            for name, linear in found.items():
                local_in = linear.weight.shape[1]
                out_sizes = getattr(linear, "out_sizes", [linear.weight.shape[0]])
                linear.lora = LoRALinear(local_in, out_sizes, self.max_loras, self.max_lora_rank, self.batch,
                                         self.dtype, self.device)
                self.linears[(i, name)] = linear

    # ---- adapters -----------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Register ``request``'s adapter and load it into host memory: LoRAAdapterError (a ValueError)
        names what is wrong with it. An id already registered must name the same adapter."""
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is {known.lora_name!r} ({known.lora_path}) "
                                 f"already, not {request.lora_name!r} ({request.lora_path})")
            self._host_adapter(request.lora_int_id)
            return
        adapter = load_adapter(request.lora_name, request.lora_path, self.max_lora_rank, self.shapes, self.dtype)
        self.known[request.lora_int_id] = request
        self._keep_on_host(request.lora_int_id, adapter)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot and host copy too); whether it was registered."""
        if self.known.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        self.host_scaling.pop(lora_int_id, None)
        slot = self.slots.pop(lora_int_id, None)
        if slot is not None:
            for linear in self.linears.values():
                linear.lora.clear_slot(slot)
        return True

    def _host_adapter(self, lora_int_id: int) -> LoRAAdapter:
        adapter = self.host.get(lora_int_id)
        if adapter is not None:
            self.host.move_to_end(lora_int_id)
            return adapter
        request = self.known.get(lora_int_id)
        if request is None:
            raise KeyError(f"no LoRA adapter of lora_int_id {lora_int_id} is registered (add_lora)")
        adapter = load_adapter(request.lora_name, request.lora_path, self.max_lora_rank, self.shapes, self.dtype)
        self._keep_on_host(lora_int_id, adapter)
        return adapter

    def _keep_on_host(self, lora_int_id: int, adapter: LoRAAdapter) -> None:
        self.host[lora_int_id] = adapter
        self.host_scaling[lora_int_id] = adapter.scaling
        self.host.move_to_end(lora_int_id)
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)

    # ---- a step -------------------------------------------------------------------------------

    def mapping(self, lora_ids: list[int | None], query_start_loc: list[int]) -> LoRAMapping:
        """Slot every adapter the step's rows name (``lora_ids``: one per sequence row, None for the
        base model) and sort the token rows into one segment per adapter."""
        rows: dict[int, list[int]] = {}
        for i, lora_int_id in enumerate(lora_ids):
            if lora_int_id is not None:
                rows.setdefault(lora_int_id, []).extend(range(query_start_loc[i], query_start_loc[i + 1]))
        if len(rows) > self.max_loras:
            raise ValueError(f"a step names {len(rows)} LoRA adapters; max_loras is {self.max_loras}")
        order: list[int] = []
        scalings: list[float] = []
        segments = []
        for lora_int_id, seg_rows in rows.items():
            slot = self._slot(lora_int_id, keep=rows)
            segments.append((slot, len(order), len(order) + len(seg_rows)))
            order.extend(seg_rows)
            scalings.extend([self.host_scaling[lora_int_id]] * len(seg_rows))
        return LoRAMapping(torch.tensor(order, dtype=torch.int64, device=self.device),
                           torch.tensor(scalings, dtype=self.dtype, device=self.device).unsqueeze(1), segments)

    def _slot(self, lora_int_id: int, keep: dict[int, list[int]]) -> int:
        """The GPU slot of an adapter, loading it into a free one or the least recently used one
        that this step does not use."""
        slot = self.slots.get(lora_int_id)
        if slot is not None:
            self.slots.move_to_end(lora_int_id)
            return slot
        adapter = self._host_adapter(lora_int_id)
        if len(self.slots) < self.max_loras:
            slot = min(set(range(self.max_loras)) - set(self.slots.values()))
        else:
            victim = next(v for v in self.slots if v not in keep)
            slot = self.slots.pop(victim)
        self._fill_slot(slot, adapter)
        self.slots[lora_int_id] = slot
        return slot

    def _fill_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        parts: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), w in adapter.weights.items():
            name, part = TARGETS[target]
            linear = self.linears[(layer, name)]
            parts.setdefault((layer, name), {})[part] = _shard(linear, part, w.lora_a, w.lora_b)
        for key, linear in self.linears.items():
            if key in parts:
                linear.lora.set_slot(slot, adapter.rank, adapter.scaling, parts[key])
            else:
                linear.lora.clear_slot(slot)


def _shard(linear: QuantizableLinear, part: int, lora_a: torch.Tensor,
           lora_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (A, B) of a projection, cut as its base layer is: a column-parallel linear's
    output rows (``shard_rows``: split, or a replicated KV head), a row-parallel one's input columns."""
    if hasattr(linear, "shard_rows"):
        start, end = linear.shard_rows(part)
        return lora_a, lora_b[start:end]
    start = linear.tp.rank * linear.in_per_rank
    return lora_a[:, start:start + linear.in_per_rank], lora_b
