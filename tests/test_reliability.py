"""Faults and hygiene: non-finite steps, signals, injected delays everywhere, nothing leaked."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from slidekit import EngineConfig, ModelConfig, OptimConfig, Plugins, TrainConfig, Trainer
from slidekit.errors import NonFiniteError
from slidekit.hookspecs import hookimpl
from slidekit.hostmem import registered_bytes
from slidekit.interfaces import KernelSetDescriptor, TierContext, TierDescriptor
from slidekit.testing.asserts import assert_states_equal
from slidekit.testing.models import random_batches
from slidekit_kernels.torch_ref import TorchRef
from slidekit_tiers.ram import RamTier

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- non-finite steps


class Poison:
    """A kernel set that turns every RMSNorm output into NaN during the steps listed in ``steps``."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.current = 1
        poison = self

        class PoisonedKernels(TorchRef):
            name = "poisoned"

            def rms_norm(self, x, weight, eps):
                out = super().rms_norm(x, weight, eps)
                return out * float("nan") if poison.current in poison.steps else out

        self.kernels = PoisonedKernels

    @hookimpl
    def slidekit_kernel_sets(self) -> Iterator[KernelSetDescriptor]:
        yield KernelSetDescriptor(name="poisoned", factory=self.kernels)

    @hookimpl
    def slidekit_step_end(self, step):
        self.current = step + 1


def _config(tiny_model, **optim) -> TrainConfig:
    return TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(lr=1e-3, **optim),
        engine=EngineConfig(device=DEVICE, compute_dtype="float32", kernels="poisoned"),
    )


def test_nonfinite_step_stops_by_default(tiny_model):
    trainer = Trainer(_config(tiny_model), plugins=Plugins(extra=[("poison", Poison({3}))]))
    with pytest.raises(NonFiniteError, match="step 3"):
        trainer.fit(random_batches(128, steps=5))


@pytest.mark.parametrize("clip", [None, 1.0])
def test_nonfinite_step_is_skipped_as_if_it_never_happened(tiny_model, clip):
    batches = random_batches(128, steps=5, seed=11)
    with Trainer(
        _config(tiny_model, on_nonfinite="skip", max_grad_norm=clip),
        plugins=Plugins(extra=[("poison", Poison({3}))]),
    ) as t:
        with pytest.warns(RuntimeWarning, match="step 3.*skipped"):
            result = t.fit(batches)
        skipped_run = t.state_dict()
    assert torch.isnan(torch.tensor(result.losses[2]))
    # The same run without the poisoned batch: bitwise the same parameters (Adam's count skips too).
    with Trainer(
        _config(tiny_model, on_nonfinite="skip", max_grad_norm=clip),
        plugins=Plugins(extra=[("poison", Poison(set()))]),
    ) as t:
        clean = t.fit(batches[:2] + batches[3:])
        assert_states_equal(skipped_run, t.state_dict())
    assert result.losses[:2] + result.losses[3:] == clean.losses


# --------------------------------------------------------------------------- signals


class Interrupter:
    def __init__(self, after: int, sig: int) -> None:
        self.after, self.sig = after, sig

    @hookimpl
    def slidekit_step_end(self, step):
        if step == self.after:
            os.kill(os.getpid(), self.sig)


_STOP_SIGNALS = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])


@pytest.mark.parametrize("sig", _STOP_SIGNALS)
def test_a_signal_finishes_the_step_and_returns(tiny_model, sig):
    cfg = TrainConfig(model=ModelConfig(source=str(tiny_model("llama"))), engine=EngineConfig(device=DEVICE))
    before = signal.getsignal(sig)
    with Trainer(cfg, plugins=Plugins(extra=[("int", Interrupter(2, sig))])) as t:
        result = t.fit(random_batches(128, steps=6))
        assert result.interrupted == signal.Signals(sig).name
        assert len(result.losses) == 2
        t.state_dict()  # the trainer is still usable: every update of step 2 was applied
    assert signal.getsignal(sig) is before  # handlers restored


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_a_closed_terminal_finishes_the_step_and_writes_the_checkpoint(tiny_model, tmp_path):
    from slidekit import RunConfig
    from slidekit.checkpoint import latest, load_meta

    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device=DEVICE),
        run=RunConfig(dir=str(tmp_path)),
    )
    seen: list[int] = []
    # Were fit not to handle SIGHUP, this records it (and the test fails) instead of ending pytest.
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: seen.append(signum))
    try:
        with Trainer(cfg, plugins=Plugins(extra=[("hup", Interrupter(2, signal.SIGHUP))])) as t:
            result = t.fit(random_batches(128, steps=6))
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert not seen, "SIGHUP reached the handler outside fit"
    assert result.interrupted == "SIGHUP" and len(result.losses) == 2
    path = latest(tmp_path / "checkpoints")
    assert path is not None and load_meta(path)["step"] == 2


# --------------------------------------------------------------------------- soak


class SlowTier(RamTier):
    """The ram tier with a random delay before every read and write completes; refuses to map."""

    name = "slow_ram"
    rng = random.Random(0)

    def __init__(self, ctx: TierContext) -> None:
        super().__init__(ctx)
        self._delayer = ThreadPoolExecutor(2, thread_name_prefix="slidekit-test-delay")

    def map(self, key):
        return None

    def _delayed(self, inner: Future) -> Future:
        delay = self.rng.uniform(0, 0.01)
        return self._delayer.submit(lambda: (time.sleep(delay), inner.result())[1])

    def read(self, key, dst, offset=0):
        return self._delayed(super().read(key, dst, offset))

    def write(self, key, src, offset=0):
        return self._delayed(super().write(key, src, offset))

    def close(self):
        self._delayer.shutdown(wait=True)
        super().close()


class SlowPlugin:
    @hookimpl
    def slidekit_storage_tiers(self) -> Iterator[TierDescriptor]:
        yield TierDescriptor(name="slow_ram", factory=SlowTier)


def _soak_run(model_dir, batches, hook, **engine):
    cfg = TrainConfig(
        model=ModelConfig(source=str(model_dir)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.01),
        engine=EngineConfig(device=DEVICE, **engine),
    )
    with Trainer(cfg, plugins=Plugins(extra=[("slow", SlowPlugin())]), fault_hook=hook) as t:
        result = t.fit(batches)
        return result.losses, t.state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_delays_in_every_thread_and_tier_change_no_bit(tiny_model, seed):
    model_dir = tiny_model("qwen2")  # tied embeddings: the pinned cache unit too
    batches = random_batches(128, steps=12, seed=seed)
    rng = random.Random(seed)
    lock = threading.Lock()

    def jitter(lane: str) -> None:
        with lock:
            delay = rng.uniform(0, 0.004)
        time.sleep(delay)

    base = _soak_run(model_dir, batches, None)
    SlowTier.rng = random.Random(seed)
    slow = _soak_run(model_dir, batches, jitter, activation_tier="slow_ram", state_tier="slow_ram", window=2)
    assert slow[0] == base[0]
    assert_states_equal(slow[1], base[1])


# --------------------------------------------------------------------------- hygiene


def _resources() -> tuple[set[str], int, int]:
    threads = {t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith("slidekit-")}
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    return threads, fds, registered_bytes()


@pytest.mark.parametrize("fail", [False, True])
def test_nothing_is_left_behind(tiny_model, tmp_path, fail):
    threads0, fds0, pinned0 = _resources()
    tiers = [r.name for r in Plugins().drivers("tier") if Plugins().availability("tier", r.name)[0]]
    file_tier = "posix" if "posix" in tiers else "ram"
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        optim=OptimConfig(lr=1e-3),
        engine=EngineConfig(
            device=DEVICE,
            offload_dir=str(tmp_path),
            activation_tier=file_tier,
            state_offload_tier=file_tier,
            state_offload_fraction=0.5,
        ),
    )
    poison = Poison({2} if fail else set())
    trainer = Trainer(
        TrainConfig(
            model=cfg.model,
            optim=cfg.optim,
            engine=EngineConfig(
                device=DEVICE,
                offload_dir=str(tmp_path),
                activation_tier=file_tier,
                kernels="poisoned",
                state_offload_tier=file_tier,
                state_offload_fraction=0.5,
            ),
        ),
        plugins=Plugins(extra=[("poison", poison)]),
    )
    if fail:
        with pytest.raises(NonFiniteError):
            trainer.fit(random_batches(128, steps=3))
    else:
        trainer.fit(random_batches(128, steps=3))
        trainer.close()
    threads, fds, pinned = _resources()
    assert threads <= threads0, f"threads left running: {threads - threads0}"
    assert fds <= fds0, f"{fds - fds0} file descriptors left open"
    assert pinned == pinned0, "page-locked host memory not released"
    assert list(tmp_path.iterdir()) == [], "offload files left behind"


def test_a_seq_len_beyond_the_model_is_reported_as_such_not_as_a_memory_shortfall(tiny_model):
    from slidekit import DataConfig
    from slidekit.errors import ConfigError
    from slidekit.planning import Machine

    small = Machine(device_type="cpu", host_available=8 * 2**30, host_total=8 * 2**30)
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        data=DataConfig(seq_len=1_000_000),
        engine=EngineConfig(device="cpu"),
    )
    with pytest.raises(
        ConfigError, match=r"^data.seq_len 1000000 exceeds the model's max_position_embeddings 64"
    ):
        Trainer(cfg, machine=small)


def test_a_run_directory_that_cannot_be_written_is_named(tiny_model, tmp_path, monkeypatch):
    import errno

    import slidekit.run
    from slidekit import RunConfig
    from slidekit.errors import ConfigError

    def read_only(path, text):
        raise PermissionError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(slidekit.run, "write_text_atomically", read_only)  # root may write anywhere
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(tmp_path)),
    )
    with pytest.raises(
        ConfigError, match=rf"run directory '{tmp_path}' is not writable \(Read-only file system\)"
    ):
        Trainer(cfg)
    assert not [t for t in threading.enumerate() if t.name.startswith("slidekit-") and t.is_alive()]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_run_directory_is_named(tiny_model, tmp_path):
    from slidekit import RunConfig
    from slidekit.errors import ConfigError

    tmp_path.chmod(0o555)
    cfg = TrainConfig(
        model=ModelConfig(source=str(tiny_model("llama"))),
        engine=EngineConfig(device="cpu"),
        run=RunConfig(dir=str(tmp_path)),
    )
    try:
        with pytest.raises(ConfigError, match="is not writable"):
            Trainer(cfg)
    finally:
        tmp_path.chmod(0o755)


def test_sequences_longer_than_the_model_are_refused(tiny_model):
    from slidekit import DataConfig
    from slidekit.errors import ConfigError

    cfg = TrainConfig(model=ModelConfig(source=str(tiny_model("llama"))), data=DataConfig(seq_len=100))
    with (
        Trainer(cfg) as t,
        pytest.raises(ConfigError, match=r"data.seq_len 100 exceeds the model's max_position_embeddings 64"),
    ):
        t.fit()  # the configured data is built when fit needs it
    with (
        Trainer(
            TrainConfig(
                model=ModelConfig(source=str(tiny_model("llama"))),
                data=DataConfig(seq_len=32),
                engine=EngineConfig(device=DEVICE),
            )
        ) as t,
        pytest.raises(ValueError, match="65 tokens"),
    ):
        t.fit(random_batches(128, steps=1, seq_len=65))
