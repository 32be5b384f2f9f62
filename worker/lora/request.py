"""What names an adapter: a request's ``LoRARequest`` and the ``--lora-modules`` entries, as vLLM's.

Plain values only (no torch): the engine options import this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagefleet.worker.engine_args import EngineArgs


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's ``lora_request``). ``lora_int_id`` is the engine's
    handle for it, >= 1 and unique per adapter; ``lora_name`` is what clients and the prefix cache
    know it by."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name.strip():
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """The engine's LoRA limits, as a runner takes them (``EngineArgs``' options)."""

    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None = None

    @classmethod
    def of(cls, args: EngineArgs) -> LoRAConfig | None:
        """The engine options' LoRA limits (None: LoRA is off)."""
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: an adapter served under ``name`` from ``path``;
    ``base_model_name`` is the parent /v1/models lists (default: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: Any) -> LoRAModulePath:
    """``name=path``, vLLM's JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``
    (as text or, from serve.yaml, a mapping), or a ``LoRAModulePath`` -> a ``LoRAModulePath``."""
    if isinstance(value, LoRAModulePath):
        return value
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"lora module {value!r} is not valid JSON: {exc}") from None
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"name", "path", "base_model_name"})
        if unknown or not {"name", "path"} <= set(value):
            raise ValueError(f"a lora module in JSON form has keys name, path and optionally base_model_name; "
                             f"got {sorted(value)}")
        module = LoRAModulePath(value["name"], value["path"], value.get("base_model_name"))
    elif isinstance(value, str) and "=" in value:
        name, path = value.split("=", 1)
        module = LoRAModulePath(name.strip(), path.strip())
    else:
        raise ValueError(f"a lora module is name=path or JSON with name and path, got {value!r}")
    for field in ("name", "path"):
        if not isinstance(getattr(module, field), str) or not getattr(module, field):
            raise ValueError(f"lora module {value!r}: {field} must be a non-empty string")
    if module.base_model_name is not None and not isinstance(module.base_model_name, str):
        raise ValueError(f"lora module {value!r}: base_model_name must be a string")
    return module


def lora_modules_of(value: Any) -> list[LoRAModulePath] | None:
    """``EngineArgs.lora_modules`` however it came in (one entry or a list of them), checked: names unique."""
    if value is None:
        return None
    items = [value] if isinstance(value, (str, dict, LoRAModulePath)) else list(value)
    modules = [parse_lora_module(item) for item in items]
    names = [m.name for m in modules]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"lora_modules names must be unique, got {duplicates} more than once")
    return modules
