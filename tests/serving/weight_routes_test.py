"""`weight_routes`: bodies checked against their pydantic models (a 400 naming the field, as
vLLM's), paths confined to the weights folder, and vLLM's `load_inplace`."""

import pytest

from mmr_jax.serving import weight_routes
from mmr_jax.serving.openai_format import HTTPError


class _Adapters:
    """A backend that records adapters by name (the only part these routes use)."""

    def __init__(self):
        self.loaded: dict[str, str] = {}

    def adapters(self):
        return dict(self.loaded)

    def load_adapter(self, name, path):
        self.loaded[name] = path

    def unload_adapter(self, name):
        del self.loaded[name]


@pytest.fixture
def routes(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    backend = _Adapters()
    return backend, weight_routes.WeightRoutes(backend, str(tmp_path)).routes(), tmp_path


class TestBodies:
    @pytest.mark.parametrize(
        "route,body,param",
        [
            ("/v1/load_lora_adapter", {"lora_name": "x"}, "lora_path"),  # missing
            ("/v1/load_lora_adapter", {"lora_name": 3, "lora_path": "p"}, "lora_name"),
            ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "p"}, "lora_name"),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "p", "rank": 8}, "rank"),
            ("/v1/unload_lora_adapter", {}, "lora_name"),
            ("/collective_rpc", {"args": []}, "method"),
            ("/collective_rpc", {"method": "reload_weights", "args": "p"}, "args"),
        ],
    )
    def test_a_body_that_does_not_fit_is_a_400_naming_the_field(self, routes, route, body, param):
        _, by_route, _ = routes
        with pytest.raises(HTTPError) as e:
            by_route[("POST", route)](body, None)
        assert e.value.status == 400 and e.value.param == param, e.value.message
        assert e.value.message.startswith(f"{param}: ")


class TestAdapters:
    def test_load_inplace_replaces_and_a_second_load_is_refused(self, routes):
        backend, by_route, root = routes
        load = by_route[("POST", "/v1/load_lora_adapter")]
        assert load({"lora_name": "x", "lora_path": str(root / "a")}, None)[0] == 200
        with pytest.raises(HTTPError, match="already been loaded"):
            load({"lora_name": "x", "lora_path": str(root / "b")}, None)
        assert backend.loaded == {"x": str(root / "a")}
        body = {"lora_name": "x", "lora_path": str(root / "b"), "load_inplace": True}
        assert load(body, None)[0] == 200
        assert backend.loaded == {"x": str(root / "b")}

    def test_outside_the_folder_and_unknown_names(self, routes, tmp_path_factory):
        backend, by_route, _ = routes
        elsewhere = tmp_path_factory.mktemp("elsewhere")
        with pytest.raises(HTTPError, match="must lie inside"):
            by_route[("POST", "/v1/load_lora_adapter")](
                {"lora_name": "x", "lora_path": str(elsewhere)}, None
            )
        with pytest.raises(HTTPError) as e:
            by_route[("POST", "/v1/unload_lora_adapter")]({"lora_name": "nope"}, None)
        assert e.value.status == 404 and backend.loaded == {}
