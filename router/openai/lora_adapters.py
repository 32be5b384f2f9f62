"""LoRA adapters loaded at runtime: vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

The routes exist only with ``--allow-runtime-lora-updating`` (vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; without it they are a 404, as in vLLM,
whose server does not mount them) and sit behind the API key like every /v1 route.

A Serve handle call reaches one replica, of the ingress as of the workers, so:

- the adapters loaded at runtime live in one ``LoRARegistry`` (a Ray actor per
  app in production) that every ingress replica follows with a long poll
  (``follow_registry``), as each follows the global scheduler's feed: each
  then lists them in /v1/models and takes them as a request's ``model``;
- no worker replica is told: every request for an adapter carries its path
  (``WorkerRequest.lora_path``) and a replica that lacks it registers it
  before the request runs. A replica started later (autoscaling, a
  replacement) needs nothing more, and none is missed by a broadcast. The
  load asks one worker replica to read and check the adapter, so a bad one is
  refused at load, with the engine's reason, and nothing changes.

Unload is vLLM's: the name leaves the registry at once (new requests for it are
a 404), the requests running with it finish; engines keep it registered, its
weights leaving GPU slots and host memory as any idle adapter's do. A name
keeps its path for the registry's life: KV blocks are cached under the name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Awaitable, Callable, NamedTuple, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ValidationError

from pagefleet.router.openai.errors import OpenAIError, bad_request, from_validation_error, unavailable
from pagefleet.router.openai.http_guards import check_content_type, parse_json_object, read_body
from pagefleet.worker.lora.request import LoRAModulePath

logger = logging.getLogger(__name__)

# How long one follow call waits for news before it asks again.
FOLLOW_WAIT_S = 10.0
# A load's body is a name and a path.
MAX_BODY_BYTES = 64 << 10


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name says which adapter


class RegistryState(NamedTuple):
    epoch: str  # the registry's incarnation: one restarted by Ray starts empty, at version 0
    version: int
    adapters: dict[str, LoRAModulePath]


class RegistryLink(Protocol):
    """A ``LoRARegistry``'s calls as an ingress makes them (the object itself in-process, the
    actor's handle through ``router.ingress.ActorRegistryLink``)."""

    async def add(self, module: LoRAModulePath) -> RegistryState: ...

    async def remove(self, name: str) -> RegistryState: ...

    async def state(self, epoch: str | None, version: int, wait_s: float) -> RegistryState: ...


class LoRARegistry:
    """The runtime adapters of one app, by name (an async Ray actor in production: its calls apply
    one at a time, none awaits inside a change). ``add`` raises ValueError (a 400) for a name
    loaded already or once served from another path; ``remove`` KeyError (a 404) for one not loaded."""

    def __init__(self) -> None:
        self.epoch = uuid.uuid4().hex
        self.version = 0
        self.adapters: dict[str, LoRAModulePath] = {}
        self.paths: dict[str, str] = {}  # every name ever loaded, with its path
        self._news = asyncio.Event()

    async def add(self, module: LoRAModulePath) -> RegistryState:
        if module.name in self.adapters:
            raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
        served = self.paths.get(module.name)
        if served is not None and served != module.path:
            raise ValueError(f"The lora adapter '{module.name}' was served from {served}; its name cannot name "
                             f"{module.path} while this server runs (KV blocks are cached under the name)")
        self.adapters[module.name] = module
        self.paths[module.name] = module.path
        return self._changed()

    async def remove(self, name: str) -> RegistryState:
        if name not in self.adapters:
            raise KeyError(name)
        del self.adapters[name]
        return self._changed()

    async def state(self, epoch: str | None, version: int, wait_s: float) -> RegistryState:
        """The adapters once the registry is past (``epoch``, ``version``), or after ``wait_s`` as they are."""
        if (epoch, version) == (self.epoch, self.version):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._news.wait(), wait_s)
        return RegistryState(self.epoch, self.version, dict(self.adapters))

    def _changed(self) -> RegistryState:
        self.version += 1
        self._news.set()
        self._news = asyncio.Event()
        return RegistryState(self.epoch, self.version, dict(self.adapters))


class RuntimeLoRAs:
    """One ingress replica's side: ``adapters`` (the service's ``runtime_loras``) kept as the
    registry has them; ``check`` reads and checks an adapter on one worker replica."""

    def __init__(self, registry: RegistryLink, adapters: dict[str, LoRAModulePath],
                 check: Callable[[LoRAModulePath], Awaitable[None]]) -> None:
        self.registry = registry
        self.adapters = adapters
        self.check = check
        self.epoch: str | None = None
        self.version = 0
        self._follower: asyncio.Task | None = None

    def start(self) -> RuntimeLoRAs:
        """Starts following the registry on the running loop (Serve runs an ingress's constructor
        on its replica's loop; without one, nothing is started)."""
        with contextlib.suppress(RuntimeError):
            self._follower = asyncio.get_running_loop().create_task(self.follow())
        return self

    def _apply(self, state: RegistryState) -> None:
        # A follow call may answer after this replica's own change (an older version); a restarted
        # registry (another epoch) holds what it holds, whatever its version.
        if state.epoch != self.epoch or state.version >= self.version:
            self.epoch, self.version = state.epoch, state.version
            self.adapters.clear()
            self.adapters.update(state.adapters)

    async def follow(self, wait_s: float = FOLLOW_WAIT_S) -> None:
        """Keeps ``adapters`` current for as long as the replica runs (its task is cancelled then)."""
        while True:
            try:
                self._apply(await self.registry.state(self.epoch, self.version, wait_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 — the registry restarts; ask again shortly
                logger.warning("LoRA registry unreachable (%s); asking again", type(exc).__name__)
                await asyncio.sleep(1.0)

    async def load(self, module: LoRAModulePath) -> None:
        try:
            await self.check(module)
        except Exception as exc:  # noqa: BLE001 — what the engine refused is the client's 400
            cause = _cause(exc)
            if isinstance(cause, ValueError):
                raise bad_request(f"Loading lora {module.name} failed: {cause.args[0] if cause.args else cause}",
                                  "lora_path") from None
            logger.warning("LoRA adapter %r: no worker replica checked it: %r", module.name, exc)
            raise unavailable("no worker replica could read the adapter; retry the request") from None
        try:
            self._apply(await self.registry.add(module))
        except ValueError as exc:
            raise bad_request(str(_cause(exc)), "lora_name") from None

    async def unload(self, name: str) -> None:
        try:
            self._apply(await self.registry.remove(name))
        except Exception as exc:
            if isinstance(_cause(exc), KeyError):
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", status_code=404,
                                  param="lora_name") from None
            raise


def add_lora_routes(app: FastAPI, service: Any, loras: RuntimeLoRAs, docs: dict) -> None:
    """The two routes on ``app`` (``service``: the ``OpenAIService`` whose names they check)."""

    @app.post("/v1/load_lora_adapter", **docs)
    async def load_lora_adapter(request: Request) -> Response:
        body = await _parse(request, LoadLoRAAdapterRequest)
        if not body.lora_name or not body.lora_path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        name = body.lora_name
        if service.info.accepts(name):
            raise bad_request(f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
        if service.info.lora_named(name) is not None or name in loras.adapters:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        await loras.load(LoRAModulePath(name, body.lora_path))
        logger.info("loaded LoRA adapter %r from %s", name, body.lora_path)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", **docs)
    async def unload_lora_adapter(request: Request) -> Response:
        name = (await _parse(request, UnloadLoRAAdapterRequest)).lora_name
        if not name:
            raise bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        if service.info.lora_named(name) is not None:
            raise bad_request(f"The lora adapter '{name}' is served from the start (--lora-modules); only "
                              "adapters loaded at runtime can be unloaded", "lora_name")
        await loras.unload(name)
        logger.info("unloaded LoRA adapter %r", name)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    check_content_type(request)
    try:
        return model.model_validate(parse_json_object(await read_body(request, MAX_BODY_BYTES)))
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def _cause(exc: BaseException) -> BaseException:
    """The exception a Ray call raised in the actor or replica (``RayTaskError.cause``), else ``exc``."""
    return getattr(exc, "cause", None) or exc

