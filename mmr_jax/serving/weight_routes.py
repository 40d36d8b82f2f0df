"""The weight-reload and LoRA-adapter routes of `server.OpenAIServer` (on with `weights_dir`
only, as vLLM's dev-mode and runtime-LoRA routes): their bodies as pydantic models with vLLM's
field names, and the paths they take confined to `weights_dir`.

  POST /collective_rpc            {"method", "args", "kwargs"} -> {"results": [one per worker]}
  POST /v1/load_lora_adapter      {"lora_name", "lora_path", "load_inplace"}
  POST /v1/unload_lora_adapter    {"lora_name"}

A body that does not fit its model (a field missing or of the wrong type, an unknown field) is a
400 naming the field, as vLLM's request models answer it. A path outside `weights_dir` is a 400
that says nothing about whether it exists; a load that fails, a 400 naming the path, not the
cause (logged).
"""

from __future__ import annotations

import logging
import os
from typing import Any, TypeVar

import pydantic

from mmr_jax.rollout import vllm_engine
from mmr_jax.serving.openai_format import HTTPError

log = logging.getLogger(__name__)

Body = TypeVar("Body", bound=pydantic.BaseModel)


class _Strict(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", strict=True)


class LoadLoRAAdapter(_Strict):
    """POST /v1/load_lora_adapter."""

    lora_name: str = pydantic.Field(min_length=1)
    lora_path: str = pydantic.Field(min_length=1)
    load_inplace: bool = False  # True: an adapter of that name is replaced


class UnloadLoRAAdapter(_Strict):
    """POST /v1/unload_lora_adapter."""

    lora_name: str


class CollectiveRPC(_Strict):
    """POST /collective_rpc: a method of the workers with its arguments."""

    method: str = pydantic.Field(min_length=1)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


def parse(model: type[Body], body: dict) -> Body:
    """`body` as `model`, or a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or None
        raise HTTPError(400, f"{field}: {first['msg']}", param=field) from None


class WeightRoutes:
    """The routes above over `backend`, for paths inside `weights_dir` (a real path)."""

    def __init__(self, backend, weights_dir: str):
        self.backend, self.weights_dir = backend, weights_dir

    def routes(self) -> dict:
        return {
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/v1/load_lora_adapter"): self._load_lora,
            ("POST", "/v1/unload_lora_adapter"): self._unload_lora,
        }

    def _inside(self, path: Any, param: str) -> str:
        """`path` if it lies inside `weights_dir` (symlinks resolved), else a 400 that says
        nothing about whether it exists."""
        if not isinstance(path, str) or not path:
            raise HTTPError(400, f"{param} must be a path", param=param)
        real = os.path.realpath(path)
        if os.path.commonpath([real, self.weights_dir]) != self.weights_dir:
            raise HTTPError(
                400, f"{param} must lie inside the folder this server loads from", param=param
            )
        return path

    def _load(self, what: str, path: str, param: str, load) -> Any:
        """`load()`, with any failure a 400 that names the path but not the cause (logged)."""
        try:
            return load()
        except Exception:
            log.exception("loading %s from %s failed", what, path)
            raise HTTPError(
                400, f"could not load {what} from {path!r} (see the server log)", param=param
            ) from None

    def _collective_rpc(self, body, conn):
        rpc = parse(CollectiveRPC, body)
        if rpc.method != vllm_engine.RELOAD_METHOD:
            raise HTTPError(400, f"unknown collective_rpc method {rpc.method[:64]!r}")
        if len(rpc.args) > 1 or set(rpc.kwargs) - {"weights_path"} or (rpc.args and rpc.kwargs):
            raise HTTPError(400, "reload takes one argument, weights_path")
        given = rpc.args[0] if rpc.args else rpc.kwargs.get("weights_path")
        path = self._inside(given, "weights_path")
        result = self._load(
            "weights",
            path,
            "weights_path",
            lambda: self.backend.collective_rpc(rpc.method, [], {"weights_path": path}),
        )
        return 200, {"results": [result]}, None

    def _load_lora(self, body, conn):
        req = parse(LoadLoRAAdapter, body)
        name = req.lora_name
        if name in self.backend.adapters() and not req.load_inplace:
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.")
        path = self._inside(req.lora_path, "lora_path")

        def load():
            if name in self.backend.adapters():  # load_inplace: the new weights replace it
                self.backend.unload_adapter(name)
            self.backend.load_adapter(name, path)

        self._load("a LoRA adapter", path, "lora_path", load)
        return 200, None, f"Success: LoRA adapter '{name}' added successfully."

    def _unload_lora(self, body, conn):
        name = parse(UnloadLoRAAdapter, body).lora_name
        if name not in self.backend.adapters():
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
        self.backend.unload_adapter(name)
        return 200, None, f"Success: LoRA adapter '{name}' removed successfully."
