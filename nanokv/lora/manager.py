"""The engine's LoRA adapters: which are loaded, which sit in the max_loras slots, and each
step's rows by slot.

    register(lora_request)   (any thread) read and check the adapter, before its request is
                             queued: a bad adapter is refused with nothing allocated
    set_step(scheduled)      (engine thread) the step's adapters into slots (at most max_loras:
                             the scheduler admits no more distinct adapters at once), then the
                             slices of rows of each slot for every LoRALinear

Adapters read from disk are kept in an LRU of max_cpu_loras (those in a slot stay); one evicted
is read again when a request needs it. An adapter id stays bound to its first name and path for
the engine's life (the prefix cache keys blocks by the id); `remove` frees the name for another
id, and requests already queued under the removed adapter still run with it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from nanokv.lora.adapter import AdapterWeights, load_adapter
from nanokv.lora.layers import LoRALinear, LoRAStep
from nanokv.lora.request import LoRARequest
from nanokv.models.llama import LlamaMLP
from nanokv.scheduler.output import ScheduledRequest


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int | None) -> None:
        """Wraps the model's decoder projections in LoRALinear layers (q/k/v, o, and a dense
        MLP's gate/up, down), each with max_loras zeroed slots of rank max_lora_rank (the
        options checked by EngineConfig)."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras or max_loras
        self.step = LoRAStep()
        self.layers: list[list[LoRALinear]] = []  # per decoder layer, its wrapped projections
        # per layer, projection -> (in, out) features
        self.shapes: list[dict[str, tuple[int, int]]] = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q, kv = attn.q_size, attn.kv_size
            wrapped = {
                ("self_attn", "qkv_proj"): [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                ("self_attn", "o_proj"): [("o_proj", attn.o_proj.out_features)],
            }
            if isinstance(mlp, LlamaMLP):  # a mixture of experts' MLP takes no adapter
                wrapped[("mlp", "gate_up_proj")] = [("gate_proj", mlp.intermediate),
                                                    ("up_proj", mlp.intermediate)]
                wrapped[("mlp", "down_proj")] = [("down_proj", mlp.down_proj.out_features)]
            loras, shapes = [], {}
            for (parent, name), shards in wrapped.items():
                owner = getattr(layer, parent)
                lora = LoRALinear(getattr(owner, name), shards, max_loras, max_lora_rank,
                                  self.step)
                setattr(owner, name, lora)
                loras.append(lora)
                for projection, size in shards:
                    shapes[projection] = (lora.in_features, size)
            self.layers.append(loras)
            self.shapes.append(shapes)
        self._lock = threading.Lock()  # register (server threads) against set_step
        self._bound: dict[int, tuple[str, str]] = {}  # id -> (name, path) of first use
        self._names: dict[str, int] = {}  # the registered (not removed) adapters' ids
        self._adapters: OrderedDict[int, AdapterWeights] = OrderedDict()  # LRU, newest last
        self._slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self._slot_used = [0] * max_loras  # the step that last used each slot
        self._steps = 0

    # ---- adapters ------------------------------------------------------------------------------
    def register(self, lora: LoRARequest) -> None:
        """Check a request's adapter: its id bound to one name and path, its files read and
        checked against the model (ValueError otherwise)."""
        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a nanokv.lora.LoRARequest, got "
                             f"{type(lora).__name__}")
        with self._lock:
            key = (lora.lora_name, lora.lora_path)
            bound = self._bound.get(lora.lora_int_id)
            if bound is not None and bound != key:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already the adapter "
                                 f"{bound[0]!r} at {bound[1]!r}; each adapter needs its own id")
            other = self._names.get(lora.lora_name, lora.lora_int_id)
            if other != lora.lora_int_id:
                raise ValueError(f"lora_name {lora.lora_name!r} is already the adapter of "
                                 f"lora_int_id {other}")
            self._adapter(lora.lora_int_id, lora.lora_path)
            self._bound[lora.lora_int_id] = key
            self._names[lora.lora_name] = lora.lora_int_id

    def remove(self, lora_int_id: int) -> bool:
        """Unregister an adapter (False if it is not registered): its name is free again, its
        weights leave memory unless a slot holds them. Its id stays bound to it."""
        with self._lock:
            bound = self._bound.get(lora_int_id)
            if bound is None or self._names.get(bound[0]) != lora_int_id:
                return False
            del self._names[bound[0]]
            if lora_int_id not in self._slots:
                self._adapters.pop(lora_int_id, None)
            return True

    def _adapter(self, lora_int_id: int, path: str) -> AdapterWeights:
        """The adapter from the LRU, or read from disk (and the LRU trimmed); under the lock."""
        adapter = self._adapters.get(lora_int_id)
        if adapter is None:
            adapter = load_adapter(path, self.shapes, self.max_lora_rank)
            self._adapters[lora_int_id] = adapter
            in_slots = set(self._slots)
            for old in list(self._adapters):
                if len(self._adapters) <= self.max_cpu_loras:
                    break
                if old not in in_slots and old != lora_int_id:
                    del self._adapters[old]
        self._adapters.move_to_end(lora_int_id)
        return adapter

    def list_loras(self) -> list[int]:
        """The ids of the registered adapters (not removed), in order of registration."""
        with self._lock:
            return list(self._names.values())

    # ---- one step ------------------------------------------------------------------------------
    def set_step(self, scheduled: list[ScheduledRequest]) -> None:
        """Put the step's adapters in slots and find its rows' slices by slot (`LoRAStep`)."""
        self._steps += 1
        ids = [s.lora_int_id for s in scheduled]
        wanted = list(dict.fromkeys(i for i in ids if i))
        if not wanted:
            self.step.slices = []
            return
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step holds {len(wanted)} adapters, max_loras is "
                               f"{self.max_loras}")
        slot_of = {}
        for lora_int_id in wanted:
            slot = self._slot_for(lora_int_id, wanted)
            self._slot_used[slot] = self._steps
            slot_of[lora_int_id] = slot
        # the scheduler puts an adapter's requests side by side: one slice per run of them
        slices, start = [], 0
        for s in scheduled:
            end = start + s.num_tokens
            if s.lora_int_id:
                slot = slot_of[s.lora_int_id]
                if slices and slices[-1][0] == slot and slices[-1][2] == start:
                    slices[-1] = (slot, slices[-1][1], end)
                else:
                    slices.append((slot, start, end))
            start = end
        self.step.slices = slices

    def _slot_for(self, lora_int_id: int, wanted: list[int]) -> int:
        """The slot holding the adapter, else one that is free or was used longest ago by an
        adapter this step does not need, loaded with it."""
        if lora_int_id in self._slots:
            return self._slots.index(lora_int_id)
        candidates = [s for s, held in enumerate(self._slots) if held not in wanted]
        slot = min(candidates, key=lambda s: (self._slots[s] is not None, self._slot_used[s]))
        with self._lock:
            adapter = self._adapter(lora_int_id, self._bound[lora_int_id][1])
            self._slots[slot] = lora_int_id
        for index, loras in enumerate(self.layers):
            for lora in loras:
                lora.set_slot(slot, {name: adapter[(index, name)] for name in lora.shard_names
                                     if (index, name) in adapter})
        return slot
