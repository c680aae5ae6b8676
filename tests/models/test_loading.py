"""Loading models: directories, sharded safetensors, random init, and clear errors for bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, TrainConfig, Trainer
from slidekit.errors import ModelLoadError, UnknownDriverError
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import save_tiny_model, tiny_config


def _trainer(source, **model) -> Trainer:
    return Trainer(
        TrainConfig(model=ModelConfig(source=str(source), **model), engine=EngineConfig(device="cpu"))
    )


def test_loads_exactly_the_saved_weights(tiny_model):
    from safetensors.torch import load_file

    model_dir = tiny_model("qwen3")
    saved = load_file(str(model_dir / "model.safetensors"))
    with _trainer(model_dir) as t:
        state = t.state_dict()
    for name, value in saved.items():
        assert torch.equal(state[name], value.float()), name


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    single = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with _trainer(single) as a, _trainer(tmp_path) as b:
        assert_states_equal(b.state_dict(), a.state_dict())


def test_random_init_is_reproducible_and_shaped_like_transformers(tmp_path):
    tiny_config("mistral").save_pretrained(tmp_path)  # config only
    with (
        _trainer(tmp_path, random_init=True, init_seed=3) as a,
        _trainer(tmp_path, random_init=True, init_seed=3) as b,
    ):
        sa, sb = a.state_dict(), b.state_dict()
    assert_states_equal(sa, sb)
    assert torch.all(sa["model.norm.weight"] == 1.0)
    std = sa["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.015 < std < 0.025  # initializer_range 0.02
    with _trainer(tmp_path, random_init=True, init_seed=4) as c:
        assert not torch.equal(c.state_dict()["model.embed_tokens.weight"], sa["model.embed_tokens.weight"])


def test_overrides_change_the_architecture(tiny_model):
    with _trainer(tiny_model("llama"), random_init=True, overrides={"num_hidden_layers": 5}) as t:
        assert t.spec.num_layers == 5 and len(t.spec.units) == 7


def test_missing_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        _trainer(tmp_path / "nope")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        _trainer(tmp_path)


def test_directory_without_weights_says_how_to_start_random(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="--random-init"):
        _trainer(tmp_path)


def test_weights_that_do_not_fit_the_config(tmp_path):
    save_tiny_model("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="has shape"):
        _trainer(tmp_path)


def test_unsupported_architecture_lists_the_supported(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(
        UnknownDriverError, match=r"model_type 'gpt2'; supported: llama, mistral, qwen2, qwen3"
    ):
        _trainer(tmp_path, random_init=True)


def test_unknown_override_is_refused(tiny_model):
    with pytest.raises(ModelLoadError, match="no such fields"):
        _trainer(tiny_model("llama"), overrides={"num_layerz": 2})


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"",  # empty
        lambda data: data[: len(data) // 2],  # truncated
        lambda data: b"\xff" * 8 + data[8:],  # a header length far past the end
        lambda data: (5).to_bytes(8, "little") + b"{oops" + data[13:],  # a header that is not JSON
    ],
    ids=["empty", "truncated", "bad-header-length", "bad-header-json"],
)
def test_a_damaged_weights_file_is_named(tmp_path, tiny_model, damage):
    model_dir = _copy_model(tiny_model("llama"), tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ModelLoadError, match=rf"weights file '{weights}' is damaged.*re-download it"):
        _trainer(model_dir)


def _sharded(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny_model("llama")).save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    return sorted(set(index["weight_map"].values()))


def test_a_missing_shard_is_named(tmp_path, tiny_model):
    shards = _sharded(tmp_path, tiny_model)
    assert len(shards) > 1
    (tmp_path / shards[-1]).unlink()
    with pytest.raises(ModelLoadError, match=rf"names shard\(s\) that are missing: \['{shards[-1]}'\]"):
        _trainer(tmp_path)


def test_a_damaged_shard_and_a_damaged_index_are_named(tmp_path, tiny_model):
    shards = _sharded(tmp_path, tiny_model)
    shard = tmp_path / shards[0]
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=rf"weights file '{shard}' is damaged"):
        _trainer(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelLoadError, match=r"shard index '.*model\.safetensors\.index\.json' is damaged"):
        _trainer(tmp_path)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"attention_bias": 1}, r"model\.overrides\.attention_bias must be true or false, like the model's"),
        ({"hidden_act": 3}, r"model\.overrides\.hidden_act must be a string"),
        ({"initializer_range": "big"}, r"model\.overrides\.initializer_range must be a finite number"),
        ({"num_key_value_heads": 3}, r"model\.overrides \{'num_key_value_heads': 3\} make no usable model"),
    ],
)
def test_overrides_that_make_no_model_name_the_override(tiny_model, overrides, match):
    from slidekit.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        _trainer(tiny_model("llama"), random_init=True, overrides=overrides)


def test_planning_for_another_gpu_reads_the_model_as_a_run_does(tiny_model, tmp_path):
    """``slidekit plan --gpu`` (``what_if_setup``) and a run (``resolve``) read the spec one way
    (``resolve_spec``): the same spec, and the same error for a shape the adapter refuses."""
    from slidekit import Plugins
    from slidekit.errors import ConfigError
    from slidekit.identity import architecture
    from slidekit.planning.what_if import what_if_setup
    from slidekit.resolve import resolve

    model = tiny_model("llama")
    config = TrainConfig(model=ModelConfig(source=str(model)), engine=EngineConfig(device="cpu"))
    run = resolve(config, Plugins())
    planned = what_if_setup(dataclasses.replace(config, engine=EngineConfig()), Plugins())
    assert architecture(run.spec) == architecture(planned.spec) and run.model_dir == planned.model_dir
    overridden = TrainConfig(model=ModelConfig(source=str(model), overrides={"num_key_value_heads": 3}))
    refused = tmp_path / "refused"
    refused.mkdir()
    hf = json.loads((model / "config.json").read_text())
    (refused / "config.json").write_text(json.dumps({**hf, "num_key_value_heads": 3}))
    for config, error, match in (
        (overridden, ConfigError, r"model\.overrides \{'num_key_value_heads': 3\} make no usable model: "),
        (
            TrainConfig(model=ModelConfig(source=str(refused))),
            ModelLoadError,
            "the llama adapter refuses this model: ",
        ),
    ):
        messages = []
        for read in (resolve, what_if_setup):  # a run on the CPU; a plan for a CUDA device
            device = "cpu" if read is resolve else "auto"
            with pytest.raises(error, match=match) as err:
                read(dataclasses.replace(config, engine=EngineConfig(device=device)), Plugins())
            messages.append(str(err.value))
        assert messages[0] == messages[1]


def test_masters_on_a_device_are_staged_through_the_host_at_most_two_at_once(monkeypatch):
    """Setup fills every unit's master; one on a device goes through an FP32 host copy of its own size.
    Those copies are what the planner counts as "load staging": the bytes of LOAD_STAGING_UNITS of the
    largest at once (here the device units are layers of one size, so two of them), while units on the
    host still fill in parallel. Here "meta" stands for the device (the copy is a no-op)."""
    import threading
    import time

    from planning_fixtures import tiny_spec

    from slidekit.models import loading

    spec = tiny_spec("llama", num_hidden_layers=12)
    masters = [torch.empty(u.numel, device="meta" if u.index % 2 else "cpu") for u in spec.units]  # odd: "resident"
    lock, live, peak = threading.Lock(), {"staged": 0, "host": 0}, {"staged": 0, "host": 0, "all": 0}
    real = loading.init_unit

    def init(spec_, unit, master, seed):
        kind = "host" if master.data_ptr() == masters[unit.index].data_ptr() else "staged"
        with lock:
            live[kind] += 1
            peak[kind] = max(peak[kind], live[kind])
            peak["all"] = max(peak["all"], live["staged"] + live["host"])
        time.sleep(0.05)
        real(spec_, unit, master, seed)
        with lock:
            live[kind] -= 1

    monkeypatch.setattr(loading, "init_unit", init)
    monkeypatch.setattr(loading.os, "cpu_count", lambda: 8)
    loading.fill_masters(spec, masters, {}, seed=3)
    assert peak["staged"] == loading.LOAD_STAGING_UNITS == 2  # bounded, and reached
    assert peak["all"] > loading.LOAD_STAGING_UNITS  # the host units did not wait for the staged ones
    host = [m for m in masters if m.device.type == "cpu"]
    assert all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in host)


def test_small_device_units_share_the_staging_allowance_of_the_two_largest(monkeypatch):
    """The staged host copies hold at most the bytes of the two largest device units at once (what the
    planner counts), not two copies: with one large unit (the untied head) and small layers, more than two
    layers fill side by side, and the bytes staged never pass the allowance. The masters are the same
    whatever the order (one generator per unit): here against a fill on the host."""
    import threading
    import time

    from planning_fixtures import tiny_spec

    from slidekit.models import loading

    spec = tiny_spec("llama", num_hidden_layers=12, tie_word_embeddings=False, vocab_size=4096)
    sizes = [u.numel for u in spec.units]
    limit = loading.load_staging_bytes(sizes)
    assert 4 * max(sizes) > 4 * sorted(sizes)[-3] * 3  # the head dwarfs a layer: several layers fit beside it
    masters = [torch.empty(n, device="meta") for n in sizes]
    lock, live, peak = threading.Lock(), {"n": 0, "bytes": 0}, {"n": 0, "bytes": 0}
    real = loading.init_unit
    filled: dict[int, torch.Tensor] = {}

    def init(spec_, unit, master, seed):
        with lock:
            live["n"] += 1
            live["bytes"] += 4 * master.numel()
            peak["n"], peak["bytes"] = max(peak["n"], live["n"]), max(peak["bytes"], live["bytes"])
        time.sleep(0.05)
        real(spec_, unit, master, seed)
        filled[unit.index] = master.clone()
        with lock:
            live["n"] -= 1
            live["bytes"] -= 4 * master.numel()

    monkeypatch.setattr(loading, "init_unit", init)
    monkeypatch.setattr(loading.os, "cpu_count", lambda: 8)
    loading.fill_masters(spec, masters, {}, seed=3)
    assert len(filled) == len(spec.units)
    assert peak["bytes"] <= limit  # the planner's count holds
    assert peak["n"] > loading.LOAD_STAGING_UNITS  # small units shared the allowance
    monkeypatch.setattr(loading, "init_unit", real)
    on_host = [torch.empty(n) for n in sizes]
    loading.fill_masters(spec, on_host, {}, seed=3)
    assert all(torch.equal(filled[i], on_host[i]) for i in range(len(sizes)))


def test_staging_bytes_waits_for_room_and_refuses_what_could_never_fit():
    import threading

    from slidekit.models.loading import StagingBytes

    staging = StagingBytes(10)
    with pytest.raises(ValueError, match="staging 11 bytes at once exceeds the allowance of 10"), staging.hold(11):
        pass
    entered = threading.Event()

    def second():
        with staging.hold(6):
            entered.set()

    with staging.hold(6):
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.2)  # 6 + 6 > 10: it waits
    assert entered.wait(5)  # and goes in once the first is released
    t.join()
    with staging.hold(4), staging.hold(6):  # what fits goes in at once
        pass


def test_load_staging_bytes_counts_the_largest_device_units_or_one_whole_unit_per_rank():
    from slidekit.models.loading import load_staging_bytes

    assert load_staging_bytes([]) == 0
    assert load_staging_bytes([5]) == 20
    assert load_staging_bytes([3, 9, 7, 1]) == 4 * (9 + 7)  # the two largest
    assert load_staging_bytes([3, 1], [2, 11, 4]) == 4 * 11  # data-parallel: one whole unit at a time
