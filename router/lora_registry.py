"""The runtime LoRA registry as a Ray actor (``router.openai.lora_adapters.LoRARegistry``), and an
ingress replica's link to it.

One per served model (named after it in namespace ``pagefleet``), started by the app builder when
``--allow-runtime-lora-updating`` is set, detached as the global scheduler is, so it outlives the
process that built the app (``serve run --non-blocking``, ``serve deploy``) and a redeploy of the
same model keeps its adapters. Ray restarts it if it dies, empty: adapters loaded at runtime are
then loaded again, as after a vLLM server restarts.
"""

from __future__ import annotations

from typing import Any

import ray

from pagefleet.router.openai.lora_adapters import LoRARegistry, RegistryState
from pagefleet.worker.lora.request import LoRAModulePath

REGISTRY_NAMESPACE = "pagefleet"


def registry_name(served_model_name: str) -> str:
    return f"pagefleet-lora-registry:{served_model_name}"


def start_lora_registry(served_model_name: str) -> Any:
    """The model's registry actor, started if it is not running."""
    actor = ray.remote(LoRARegistry).options(
        name=registry_name(served_model_name), namespace=REGISTRY_NAMESPACE, get_if_exists=True,
        lifetime="detached", max_restarts=-1, num_cpus=0).remote()
    ray.get(actor.state.remote(None, -1, 0.0))  # up and answering before the app uses it
    return actor


def stop_lora_registry(served_model_name: str) -> None:
    try:
        ray.kill(ray.get_actor(registry_name(served_model_name), namespace=REGISTRY_NAMESPACE), no_restart=True)
    except ValueError:
        pass


class ActorRegistryLink:
    """``lora_adapters.RegistryLink`` over the actor's handle."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def add(self, module: LoRAModulePath) -> RegistryState:
        return await self.actor.add.remote(module)

    async def remove(self, name: str) -> RegistryState:
        return await self.actor.remove.remote(name)

    async def state(self, epoch: str | None, version: int, wait_s: float) -> RegistryState:
        return await self.actor.state.remote(epoch, version, wait_s)
